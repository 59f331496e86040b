"""The ranks of a run agree on what they train, or all of them stop with one line.

Every node of a run compiles (or loads) its program itself: ``pipec run`` on
each machine, or each torchrun worker. A node started with other ``-D``
values, another cost file, other ``--steps`` or another pipec would train
something else, or wait on messages no rank sends. So right after joining the
group each worker calls ``check_same_training``: the ranks gather what each
one runs (``what_runs``), and when they differ every rank prints the same line
(``mismatch``) and exits 1, before the first step. The same gather carries
rank 0's check of a ``--program`` file (``worker.program_refusal``): once the
ranks agree that they hold one program, a program rank 0's check rejected is
refused on every rank, with the check's message.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import socket
import sys

from pipec.compiler.defines import value_text
from pipec.errors import printable

# The first words of the line every rank prints when the ranks were not started
# for the same training; ``pipec run`` reports that line once, as it does a fault message.
MISMATCH_PREFIX = "the ranks were not started for the same training: "
# What every node must be started with alike, for the line's advice.
_SAME = ("TARGET, -D, --costs, --steps, --seed, --model, --config, --partition (the same cut), --backend, --dtype, "
         "--clip-grad-norm, --save, --save-every, --trace, --resume (the same checkpoint) and pipec version")


def check_same_training(plan, world: int, refusal: str | None = None) -> None:
    """Stop this worker, with ``mismatch``'s line on stderr and status 1, unless every rank runs the same
    training, a program rank 0's check accepted.

    Collective: every rank calls it once, right after joining the default
    group, before any other collective. One ``all_gather_object`` of a short
    JSON text per rank.

    Args:
        plan: the worker's ``runtime.worker.Plan``: the program, the model's config, the run's
            configuration (``plan.run``, a ``runtime.config.RunConfig``).
        world: the world size.
        refusal: on rank 0, ``worker.program_refusal``'s verdict on the program (None: accepted, or
            compiled and proved here); the other ranks' is not read.
    Returns:
        None, when every rank runs the same training and rank 0 did not
        refuse it; otherwise it does not return (``runtime.worker.end_process``):
        ranks holding different programs print ``mismatch``'s line, naming
        them, and a program rank 0 refused prints ``refusal`` on every rank.
    """
    import torch.distributed as dist

    from pipec.runtime.worker import end_process

    # torchrun's node rank (GROUP_RANK; none when the workers were started by hand) and the machine
    where = {"node": os.environ.get("GROUP_RANK"), "host": socket.gethostname()}
    texts = [None] * world
    dist.all_gather_object(texts, json.dumps([what_runs(plan), where, refusal]))
    gathered = [json.loads(text) for text in texts]
    line = mismatch([runs for runs, _, _ in gathered], [where for _, where, _ in gathered])
    if line is None:  # one program on every rank: rank 0's proof of it holds for all
        line = gathered[0][2]
    if line is not None:
        sys.stderr.write(line + "\n")
        end_process(1)


def what_runs(plan) -> dict[str, str]:
    """What this rank trains, as the ranks compare it: field -> value, all text.

    Args:
        plan: the worker's ``Plan``, with its run configuration (``plan.run``).
    Returns:
        ``program`` (its name, parameters and a hash of the compact JSON
        ``pipec compile --format json`` writes, without ``source``: a path
        that depends on the folder a node started in), ``pipec`` (the
        version), ``steps``, ``seed``, ``model``, ``config`` (the config
        after ``--config``), ``backend``, and whether ``--save`` and
        ``--trace`` were given (every rank takes part in writing them; only
        rank 0 writes, so their paths need not agree); ``dtype``,
        ``--clip-grad-norm``, ``--save-every``, the step a ``--resume``
        goes on from, and the cut a ``--partition`` file gave the model's
        layers (its path may differ from node to node).
    """
    from pipec import __version__
    from pipec.runtime.layered import partition_cut

    program = plan.program
    params = "".join(f" {name}={value_text(value)}" for name, value in program.params.items())
    config, run = plan.config, plan.run
    return {
        "program": f"{program.name}{params} #{program_digest(program)[:12]}",
        "pipec": __version__,
        "steps": str(run.steps),
        "seed": str(run.seed),
        "model": str(run.model),
        # a dataclass's repr is its values; another object's may hold its address
        "config": repr(config) if dataclasses.is_dataclass(config) else repr(list(run.config_overrides)),
        "backend": str(run.backend),
        "--save": "given" if run.save else "not given",
        "--trace": "given" if run.trace else "not given",
        "dtype": str(run.dtype),
        "--clip-grad-norm": str(run.clip_grad_norm),
        "--save-every": str(run.save_every),
        # the checkpoint's path may differ from node to node; the step it goes on from may not
        "--resume": f"from step {plan.checkpoint.step}" if plan.checkpoint is not None else "not given",
        "--partition": _cut_text(partition_cut(plan.spec)),
    }


def _cut_text(cut) -> str:
    """A partition's cut as the ranks compare it: ``layers 0-1, 1-3, ...`` (stop exclusive), or ``not given``."""
    return "layers " + ", ".join(f"{first}-{stop}" for first, stop in cut) if cut else "not given"


def program_digest(program) -> str:
    """The SHA-256 (hex) of ``program``'s compact JSON (``write_program_json``) with ``source`` left out.

    Streamed into the hash: the document is never held whole.
    """
    from pipec.compiler.emit.json_program import write_program_json

    digest = hashlib.sha256()

    class _Hashing:
        @staticmethod
        def write(text: str) -> None:
            digest.update(text.encode())

    write_program_json(dataclasses.replace(program, source=""), _Hashing())
    return digest.hexdigest()


def mismatch(runs: list[dict[str, str]], where: list[dict]) -> str | None:
    """The line that stops a run whose ranks differ, or None when every rank runs the same training.

    Args:
        runs: per rank, its ``what_runs``.
        where: per rank, ``{"node": GROUP_RANK or None, "host": its machine}``.
    Returns:
        ``MISMATCH_PREFIX``, then each group of ranks that agree, with its
        nodes (and machines, when they are not all one) and its values of the
        fields that differ, then which arguments must agree; escaped for a
        terminal. The same line on every rank.
    """
    groups: dict[str, list[int]] = {}
    for rank, theirs in enumerate(runs):
        groups.setdefault(json.dumps(theirs, sort_keys=True), []).append(rank)
    if len(groups) < 2:
        return None
    firsts = [runs[ranks[0]] for ranks in groups.values()]
    differ = [name for name in firsts[0] if len({str(first.get(name)) for first in firsts}) > 1]
    several_hosts = len({place["host"] for place in where}) > 1
    parts = []
    for ranks, first in zip(groups.values(), firsts):
        values = ", ".join(f"{name} {first.get(name)}" for name in differ)
        parts.append(f"{_ranks_label(ranks, where, several_hosts)}: {values}")
    return printable(MISMATCH_PREFIX + "; ".join(parts) + f"; start every node with the same {_SAME}")


def _ranks_label(ranks: list[int], where: list[dict], hosts: bool) -> str:
    """``ranks 0-1 (node 0)``: the ranks, and the nodes (and the machines, when ``hosts``) they run on."""
    nodes = sorted({int(where[r]["node"]) for r in ranks if str(where[r]["node"]).isdigit()})
    machines = sorted({where[r]["host"] for r in ranks}) if hosts else []
    places = [f"{_plural('node', nodes)} {', '.join(map(str, nodes))}"] if nodes else []
    places += [f"{_plural('host', machines)} {', '.join(machines)}"] if machines else []
    return f"{_plural('rank', ranks)} {_spans(ranks)}" + (f" ({', '.join(places)})" if places else "")


def _plural(word: str, items: list) -> str:
    return word + "s" * (len(items) > 1)


def _spans(ranks: list[int]) -> str:
    """Ascending ranks as spans: ``[0, 1, 2, 5]`` is ``0-2, 5``."""
    spans: list[list[int]] = []
    for rank in ranks:
        if spans and rank == spans[-1][1] + 1:
            spans[-1][1] = rank
        else:
            spans.append([rank, rank])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in spans)
