"""The prover and the runtime agree on every program: a property over mutants of compiled programs (issue 26).

What ``check_all`` accepts runs, and trains exactly; what the runtime faults on, ``check_all`` rejects. From
a small compiled program of each family (``BASES``), ``family_mutants`` derives seeded mutants, each made of
one or more edits (``EDITS``: swap two adjacent instructions of a rank, move one a few places, drop one,
duplicate one, change a message's peer, swap two parts of a batch or exchange; ``ROLE_EDITS``, on a
composition: exchange a member between two groups of one kind, swap two members' shares or shards, give a
stage another saver, permute the mesh's axes). ``verdict`` checks each: a
rejection must be a ``ProgramError``, never another exception. ``run_programs`` then trains, on gloo, the
unmutated programs, every distinct accepted mutant and a sample of the rejected ones, from the program
file the runtime reads, without rank 0's check (``runtime_util.launch_isolated``: each job in processes of
its own, so that a rejected mutant's fault or hang ends that job only). The property (``disagreements``):
every accepted mutant's run ends on every rank and saves the unmutated program's parameters within 1e-5
(those are one process's, ``reference_run``); a rejected mutant may do anything (a fault, a wait past its
``--timeout``, wrong parameters, or even train exactly: the checks may refuse what happens to work), which
is counted, not judged.

Run as a script, it checks ``--per-base`` mutants (1,000 by default) of each base program (the family's
bases take turns) and runs every distinct accepted one, then prints a row per base; ``--per-family`` sets
a family's count instead. ``tests/test_prover_runtime_agree.py`` runs a seeded subset:

    OMP_NUM_THREADS=1 .venv/bin/python tests/mutants.py [--per-base 1000] [--rejected-runs 10] [--seed 0]
"""
from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable, NamedTuple

import torch

from pipec.compiler.checks import check_all
from pipec.compiler.driver import compile_target
from pipec.compiler.emit.json_program import program_to_json
from pipec.compiler.ir import Action, Program
from pipec.errors import ProgramError
from pipec.runtime.model import ModelConfig
from pipec.runtime.reference import reference_run

_HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(_HERE))  # run as a script: runtime_util beside it
from runtime_util import TOLERANCE, launch_isolated  # noqa: E402


class Base(NamedTuple):
    """An unmutated program: its family (for the counts), the schedule (a shipped name or a file beside this
    one) and its parameters, its world size, and the built-in model's config fields it trains with."""

    family: str
    target: str
    params: tuple[tuple[str, str], ...]
    world: int
    config: tuple[tuple[str, int], ...] = ()

    @property
    def label(self) -> str:
        return os.path.basename(self.target) + "".join(f" {k}={v}" for k, v in self.params)

    @property
    def model_config(self) -> ModelConfig:
        return ModelConfig(**dict(self.config))

    @property
    def microbatches(self) -> int:
        """N of the one-process run it trains like (a sequence ring trains one batch a step: 1)."""
        return int(dict(self.params).get("N", 1))


# The smallest programs of each family that still hold its kinds of instruction.
BASES: tuple[Base, ...] = (
    Base("activation passing", "1f1b", (("P", "2"), ("N", "2")), 2),
    Base("activation passing", "zbv", (("P", "2"), ("N", "2")), 2),
    Base("weight passing", "weipipe", (("P", "2"), ("N", "2")), 2),
    Base("weight passing", "tawpipe", (("P", "2"), ("N", "2")), 2),
    Base("sequence ring", "zigzag_ring", (("P", "2"),), 2),
    Base("composition", "1f1b_dp", (("P", "2"), ("N", "2")), 4),
    Base("composition", "zbv_dp", (("P", "2"), ("N", "2")), 4),
    Base("composition", "1f1b_fsdp", (("P", "2"), ("N", "2")), 4),
    Base("composition", "1f1b_zero2", (("P", "2"), ("N", "2")), 4),
    # HSDP at P = 1 on 4 ranks (2 shard groups x 2 replicas): a microbatch's rows split over 4 members
    Base("composition", "1f1b_hsdp", (("P", "1"), ("N", "2")), 4, (("microbatch_size", 4),)),
    Base("composition", "1f1b_cp", (("P", "2"), ("N", "2")), 4),
    Base("composition", str(_HERE / "ring_attention_cp.pipe"), (("N", "2"),), 4),
    Base("composition", str(_HERE / "tasp_cp.pipe"), (("N", "2"),), 4),
    Base("composition", "tawpipe_dp", (("P", "2"), ("N", "2")), 4),
)
FAMILIES: tuple[str, ...] = tuple(dict.fromkeys(base.family for base in BASES))

# Training of each run: a few steps from one seed; a rejected mutant's waits give up after REJECTED_TIMEOUT_S.
STEPS, SEED = 2, 7
ACCEPTED_TIMEOUT_S, REJECTED_TIMEOUT_S = 60, 3


# ---------------------------------------------------------------------------- edits
#
# An edit changes a copy of the program's rows in place and says what it did, or returns None where the
# program holds nothing it applies to (a peer change in a program without messages).

Rows = list[list[Action]]


def _pick(rows: Rows, rng: random.Random, least: int = 1) -> tuple[int, int] | None:
    """A (rank, index) of an instruction with at least ``least - 1`` after it, or None."""
    places = [(rank, i) for rank, row in enumerate(rows) for i in range(len(row) - least + 1)]
    return rng.choice(places) if places else None


def swap_adjacent(rows: Rows, rng: random.Random, num_ranks: int) -> str | None:
    place = _pick(rows, rng, 2)
    if place is None:
        return None
    rank, i = place
    row = rows[rank]
    row[i], row[i + 1] = row[i + 1], row[i]
    return f"rank {rank}: swap {i} and {i + 1} ({row[i + 1].text()}, {row[i].text()})"


def move(rows: Rows, rng: random.Random, num_ranks: int) -> str | None:
    place = _pick(rows, rng)
    if place is None:
        return None
    rank, i = place
    row = rows[rank]
    to = min(max(i + rng.choice((-4, -3, -2, 2, 3, 4)), 0), len(row) - 1)
    action = row.pop(i)
    row.insert(to, action)
    return f"rank {rank}: move {i} ({action.text()}) to {to}"


def drop(rows: Rows, rng: random.Random, num_ranks: int) -> str | None:
    place = _pick(rows, rng)
    if place is None:
        return None
    rank, i = place
    return f"rank {rank}: drop {i} ({rows[rank].pop(i).text()})"


def duplicate(rows: Rows, rng: random.Random, num_ranks: int) -> str | None:
    place = _pick(rows, rng)
    if place is None:
        return None
    rank, i = place
    rows[rank].insert(i + 1, rows[rank][i])
    return f"rank {rank}: duplicate {i} ({rows[rank][i].text()})"


def _with_parts(action: Action, path: tuple[int, ...], change: Callable[[Action], Action]) -> Action:
    """``action`` with its part at ``path`` (indexes into nested ``parts``; () for itself) changed."""
    if not path:
        return change(action)
    parts = list(action.parts)
    parts[path[0]] = _with_parts(parts[path[0]], path[1:], change)
    return action._replace(parts=tuple(parts))


def _nested(action: Action, path: tuple[int, ...] = ()):
    """(path, action) for ``action`` and every part inside it, at any depth."""
    yield path, action
    for k, part in enumerate(action.parts):
        yield from _nested(part, path + (k,))


def change_peer(rows: Rows, rng: random.Random, num_ranks: int) -> str | None:
    found = [(rank, i, path, a) for rank, row in enumerate(rows) for i, top in enumerate(row)
             for path, a in _nested(top) if a.peer >= 0]
    if not found:
        return None
    rank, i, path, action = rng.choice(found)
    peer = rng.choice([r for r in range(num_ranks) if r != action.peer])
    rows[rank][i] = _with_parts(rows[rank][i], path, lambda a: a._replace(peer=peer))
    return f"rank {rank}: {i} ({action.text()}) to peer {peer}"


def swap_parts(rows: Rows, rng: random.Random, num_ranks: int) -> str | None:
    found = [(rank, i, path, a) for rank, row in enumerate(rows) for i, top in enumerate(row)
             for path, a in _nested(top) if len(a.parts) >= 2]
    if not found:
        return None
    rank, i, path, action = rng.choice(found)
    k = rng.randrange(len(action.parts) - 1)

    def swapped(a: Action) -> Action:
        parts = list(a.parts)
        parts[k], parts[k + 1] = parts[k + 1], parts[k]
        return a._replace(parts=tuple(parts))

    rows[rank][i] = _with_parts(rows[rank][i], path, swapped)
    return f"rank {rank}: {i} ({action.text()}) swap parts {k} and {k + 1}"


EDITS: tuple[Callable[[Rows, random.Random, int], str | None], ...] = (
    swap_adjacent, move, drop, duplicate, change_peer, swap_parts)


# Role edits change what the program states of its ranks (``Placement``'s roles, its communicators, its mesh):
# (program, rng) -> (the changed program, what was done), or None where the program has nothing to change.

def _placed(program: Program, rng: random.Random, usable=lambda placement: True):
    found = [info for info in program.stages if info.placement is not None and usable(info.placement)]
    return rng.choice(found) if found else None


def _with_placement(program: Program, info, **change) -> Program:
    stages = list(program.stages)
    stages[info.id] = dataclasses.replace(info, placement=dataclasses.replace(info.placement, **change))
    return dataclasses.replace(program, stages=stages)


def _swapped(values: tuple[int, ...], rng: random.Random) -> tuple[tuple[int, ...], int, int]:
    i, j = rng.sample(range(len(values)), 2)
    out = list(values)
    out[i], out[j] = out[j], out[i]
    return tuple(out), i, j


def exchange_members(program: Program, rng: random.Random):
    pairs = [(a, b) for a in program.communicators for b in program.communicators if a.id < b.id
             and a.purpose == b.purpose and len(a.ranks) == len(b.ranks) > 1 and not set(a.ranks) & set(b.ranks)]
    if not pairs:
        return None
    a, b = rng.choice(pairs)
    x, y = rng.choice(a.ranks), rng.choice(b.ranks)
    groups = list(program.communicators)
    groups[a.id] = dataclasses.replace(a, ranks=tuple(sorted({*a.ranks} - {x} | {y})))
    groups[b.id] = dataclasses.replace(b, ranks=tuple(sorted({*b.ranks} - {y} | {x})))
    return (dataclasses.replace(program, communicators=groups),
            f"communicators {a.id} and {b.id} exchange ranks {x} and {y}")


def swap_shares(program: Program, rng: random.Random):
    info = _placed(program, rng)
    if info is None:
        return None
    shares, i, j = _swapped(info.placement.shares, rng)
    return _with_placement(program, info, shares=shares), f"stage {info.id}: members {i} and {j} swap shares"


def swap_shards(program: Program, rng: random.Random):
    info = _placed(program, rng, lambda placement: len(placement.shards) > 1)
    if info is None:
        return None
    shards, i, j = _swapped(info.placement.shards, rng)
    return _with_placement(program, info, shards=shards), f"stage {info.id}: members {i} and {j} swap shards"


def change_saver(program: Program, rng: random.Random):
    info = _placed(program, rng)
    if info is None:
        return None
    saver = rng.choice([r for r in range(program.num_ranks) if r != info.placement.saver])
    return _with_placement(program, info, saver=saver), f"stage {info.id}: saved by rank {saver}"


def permute_mesh(program: Program, rng: random.Random):
    if program.mesh is None or len(program.mesh.axes) < 2:
        return None
    axes = list(program.mesh.axes)
    while axes == list(program.mesh.axes):
        rng.shuffle(axes)
    return (dataclasses.replace(program, mesh=dataclasses.replace(program.mesh, axes=tuple(axes))),
            f"mesh {' x '.join(f'{name} {size}' for name, size in axes)}")


ROLE_EDITS: tuple[Callable[[Program, random.Random], tuple[Program, str] | None], ...] = (
    exchange_members, swap_shares, swap_shards, change_saver, permute_mesh)


# -------------------------------------------------------------------------- mutants

@dataclasses.dataclass
class Mutant:
    """A program derived from ``base``'s by ``edits``; ``error`` is the checks' rejection, None when accepted."""

    base: Base
    edits: tuple[str, ...]
    program: Program
    error: ProgramError | None = None

    @property
    def text(self) -> str:
        """The program's instructions, one line per rank, and what it states of its ranks: what tells two
        mutants apart."""
        return program_text(self.program) + "\n" + repr((self.program.stages, self.program.communicators,
                                                         self.program.mesh))

    def describe(self) -> str:
        return f"{self.base.label}: " + "; ".join(self.edits)


def program_text(program: Program) -> str:
    return "\n".join(" ".join(action.text() for action in row) for row in program.ranks)


_compiled: dict[Base, Program] = {}


def base_program(base: Base) -> Program:
    """The unmutated program (compiled once per process)."""
    if base not in _compiled:
        _compiled[base] = compile_target(base.target, dict(base.params)).program
    return _compiled[base]


def mutate(base: Base, rng: random.Random, num_edits: int) -> Mutant | None:
    """A mutant of ``base``'s program by ``num_edits`` edits drawn from ``rng``, or None where one did not apply."""
    program = base_program(base)
    rows = [list(row) for row in program.ranks]
    edits = []
    for _ in range(num_edits):
        edit = rng.choice(EDITS + (ROLE_EDITS if program.placed_on_groups else ()))
        if edit in ROLE_EDITS:
            changed = edit(program, rng)
            if changed is None:
                return None
            program, said = changed
        else:
            said = edit(rows, rng, program.num_ranks)
        if said is None:
            return None
        edits.append(said)
    return Mutant(base, tuple(edits), dataclasses.replace(program, ranks=rows))


def family_mutants(family: str, count: int, seed: int, max_edits: int = 1) -> list[Mutant]:
    """``count`` distinct mutants of the family's bases, each differing from its base (taken in turn), of
    1 to ``max_edits`` edits; the same for the same arguments. Fewer when the bases hold fewer."""
    bases = [base for base in BASES if base.family == family]
    rng = random.Random(f"{family}/{seed}")
    seen = {(base, Mutant(base, (), base_program(base)).text) for base in bases}
    out: list[Mutant] = []
    tries = 0
    while len(out) < count and tries < 50 * count:
        tries += 1
        mutant = mutate(bases[len(out) % len(bases)], rng, rng.randint(1, max_edits))
        if mutant is not None and (mutant.base, mutant.text) not in seen:
            seen.add((mutant.base, mutant.text))
            out.append(mutant)
    return out


def verdict(mutant: Mutant) -> Mutant:
    """Check ``mutant`` (``check_all``), recording its rejection. Any exception but a ``ProgramError``
    propagates: the checks must reject a bad program with a pipec error, never a traceback."""
    try:
        check_all(mutant.program)
    except ProgramError as error:
        mutant.error = error
    return mutant


# ----------------------------------------------------------------------------- runs

class Outcome(NamedTuple):
    """How one program trained: ``kind`` is exact, wrong (trained, other parameters or none saved), fault (a
    rank stopped with an error), internal (a rank stopped with a traceback), hang (killed at its deadline) or
    lost (a rank's process ended before the job did: the batch broke)."""

    kind: str
    detail: str


def run_programs(chosen: dict[Base, list[Mutant]], folder: Path) -> dict[Base, tuple[Outcome, list[Outcome]]]:
    """Train each base's program and then its mutants in ``chosen``, from their program files: one
    ``launch_isolated`` per world size, every job in processes of its own.

    Returns:
        base -> (the unmutated program's outcome, measured against one process's run; each of its mutants',
        against the unmutated run's parameters).
    """
    folder.mkdir(parents=True, exist_ok=True)
    out = {}
    for world in sorted({base.world for base in chosen}):
        bases = [base for base in chosen if base.world == world]
        jobs, owners = [], []  # owners: the base of each job
        for base in bases:
            for mutant in [None] + chosen[base]:
                index = len(jobs)
                path = folder / f"program-{index}-{world}.json"
                path.write_text(json.dumps(program_to_json(base_program(base) if mutant is None else mutant.program)))
                timeout = ACCEPTED_TIMEOUT_S if mutant is None or mutant.error is None else REJECTED_TIMEOUT_S
                jobs.append([base.target, "--program", str(path), "--steps", str(STEPS), "--seed", str(SEED),
                             "--timeout", str(timeout), "--save", str(folder / f"state-{index}-{world}.pt"),
                             *[arg for key, value in base.config for arg in ("--config", f"{key}={value}")]])
                owners.append(base)
        stores = folder / f"stores-{world}"
        stores.mkdir()
        ends, _run = launch_isolated(jobs, world, stores)
        want = {}
        for index, (base, end) in enumerate(zip(owners, ends)):
            saved = folder / f"state-{index}-{world}.pt"
            if end.timed_out:
                outcome = Outcome("hang", _said(end.stderr))
            elif not end.ok:
                said = _said(end.stderr)
                outcome = Outcome("lost" if None in end.returncodes else "internal" if "internal error" in said
                                  else "fault", said)
            elif not saved.exists():
                outcome = Outcome("wrong", "saved nothing")
            else:
                got = torch.load(saved)
                if base not in want:  # a base's first job is its unmutated program: it trains like one process
                    want[base] = got
                    got = reference_run(base.model_config, STEPS, base.microbatches, SEED).state_dict
                outcome = _compare(got, want[base])
            if base not in out:
                out[base] = (outcome, [])
            else:
                out[base][1].append(outcome)
    return out


def _said(stderr: list[str]) -> str:
    """What each rank said: a fault's first line, or a traceback's last."""
    said = []
    for rank, text in enumerate(stderr):
        lines = [line for line in text.splitlines() if line.strip()]
        if lines:
            said.append(f"[rank {rank}] " + (lines[-1] if "internal error" in text else lines[0]))
    return " ".join(said) or "no message"


def _compare(got: dict, want: dict | None) -> Outcome:
    if want is None:
        return Outcome("wrong", "the unmutated program saved nothing to compare with")
    if sorted(got) != sorted(want):
        return Outcome("wrong", "saved other keys")
    diff = max((got[k] - want[k]).abs().max().item() for k in want)
    return Outcome("exact" if diff <= TOLERANCE else "wrong", f"max difference {diff:.3g}")


def disagreements(mutants: list[Mutant], outcomes: list[Outcome]) -> list[str]:
    """The property's failures: an accepted mutant that did not train exactly like its base."""
    return [f"{m.describe()}: accepted, but {o.kind}: {o.detail}"
            for m, o in zip(mutants, outcomes) if m.error is None and o.kind != "exact"]


def runs_for(mutants: list[Mutant], rejected_runs: int, seed: int) -> dict[Base, list[Mutant]]:
    """Base -> what to run: ``rejected_runs`` rejected mutants (a seeded sample), then every accepted one: a
    rejected one's fault must end its job only, and the accepted ones after it show that it did."""
    rng = random.Random(f"rejected/{seed}")
    out: dict[Base, list[Mutant]] = {}
    for base in dict.fromkeys(m.base for m in mutants):
        mine = [m for m in mutants if m.base == base]
        rejected = [m for m in mine if m.error is not None]
        out[base] = rng.sample(rejected, min(rejected_runs, len(rejected))) + [m for m in mine if m.error is None]
    return out


# --------------------------------------------------------------------------- script

def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--per-base", type=int, default=1000, help="mutants checked per base program")
    parser.add_argument("--per-family", type=int, help="mutants checked per family (instead of --per-base)")
    parser.add_argument("--max-edits", type=int, default=3, help="edits per mutant, at most")
    parser.add_argument("--rejected-runs", type=int, default=10, help="rejected mutants run per base program")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    start = time.monotonic()
    mutants = []
    for family in FAMILIES:
        count = args.per_family or args.per_base * sum(base.family == family for base in BASES)
        mine = [verdict(m) for m in family_mutants(family, count, args.seed, args.max_edits)]
        errors = collections.Counter(type(m.error).__name__ for m in mine if m.error is not None)
        print(f"{family}: {len(mine)} distinct mutants checked, {sum(m.error is None for m in mine)} accepted, "
              f"{sum(errors.values())} rejected ({', '.join(f'{k} {v}' for k, v in errors.most_common())})",
              flush=True)
        mutants += mine
    print(f"checked in {time.monotonic() - start:.1f} s", flush=True)
    failures = []
    kinds: dict[tuple[str, bool], collections.Counter] = collections.defaultdict(collections.Counter)
    rejected_exact = []
    chosen = runs_for(mutants, args.rejected_runs, args.seed)
    print(f"running {sum(map(len, chosen.values()))} mutants and {len(chosen)} unmutated programs", flush=True)
    with tempfile.TemporaryDirectory() as folder:
        ran = run_programs(chosen, Path(folder))
    for base, (base_outcome, outcomes) in ran.items():
        if base_outcome.kind != "exact":
            failures.append(f"{base.label}: the unmutated program did not train: {base_outcome.detail}")
        failures += disagreements(chosen[base], outcomes)
        for m, o in zip(chosen[base], outcomes):
            kinds[base.family, m.error is None][o.kind] += 1
            if m.error is not None and o.kind == "exact":
                rejected_exact.append(f"{m.describe()} ({type(m.error).__name__}: {m.error.message})")
    for family in FAMILIES:
        for accepted in (True, False):
            counts = kinds[family, accepted]
            print(f"{family}, {'accepted' if accepted else 'rejected'} runs: "
                  + (", ".join(f"{k} {v}" for k, v in counts.most_common()) or "none"))
    print("base | checked | accepted | rejected | accepted runs | rejected runs")
    for base in BASES:
        mine = [m for m in mutants if m.base == base]
        pairs = list(zip(chosen.get(base, []), ran[base][1] if base in ran else []))
        ends = {accepted: collections.Counter(o.kind for m, o in pairs if (m.error is None) == accepted)
                for accepted in (True, False)}
        print(f"{base.label} | {len(mine)} | {sum(m.error is None for m in mine)} | "
              f"{sum(m.error is not None for m in mine)} | "
              + " | ".join(", ".join(f"{k} {v}" for k, v in ends[accepted].most_common()) or "none"
                           for accepted in (True, False)))
    for line in rejected_exact:
        print(f"rejected, yet trained exactly: {line}")
    for line in failures:
        print(f"DISAGREEMENT: {line}")
    print(f"{len(failures)} disagreements; {time.monotonic() - start:.0f} s in all")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
