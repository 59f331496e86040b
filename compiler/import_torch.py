"""Read a torch.distributed.pipelining schedule CSV into a ``Program``.

``read_torch_csv`` parses torch's CSV (one row per rank, one action token
``<stage><type><microbatch>`` per cell, with or without communication) into a
program exactly as written; ``prepare_imported`` completes and proves it;
``import_and_check`` does both on a file and simulates the result (``pipec
import-torch``). A compute-only CSV gets pipec's communication
(``insert_communication``) and is checked under rendezvous semantics, the
strictest; a CSV with communication is checked as written, under torch's own
runtime semantics ("async": sends and receives posted in order, a receive
waited at first use).

The file is untrusted input: it is read through the guarded reader
(``guarded_read.TORCH_CSV``), tokens must match whole, and every index is
bounded by the CSV itself before anything is sized by it, so a bad file is a
located ``ImportError_`` (``rank R, step S`` with the grid), never a
traceback or a huge allocation. How each token is read (computes, messages,
``OVERLAP_F_B``, the skipped FSDP tokens, stages and microbatches) is
described in docs/formats.md, "Reading one".
"""
from __future__ import annotations

import csv
import io
import os
import re
from collections import Counter

from pipec.compiler.checks import check_all
from pipec.compiler.costs import CostModel
from pipec.compiler import ops
from pipec.compiler.ir import NO_PEER, Action, Program, build_program, single_pipeline
from pipec.compiler.lower_comms import insert_communication
# The cyclic GC rescans every object built so far each time allocations trigger
# it; reading builds hundreds of thousands of acyclic ones.
from pipec.compiler.gc_pause import paused_gc
from pipec.compiler.guarded_read import TORCH_CSV, plain_int, quote, read_text
from pipec.dsl.limits import MAX_RANKS
from pipec.compiler.simulate import SimResult, simulate
from pipec.errors import ImportError_, WellFormedError

# What each torch action type becomes: pipec's compute and point-to-point ops
# (the rule table's), and torch's FSDP / data-parallel tokens, skipped.
_COMPUTE, _COMM, _SKIP = "compute", "comm", "skip"
_KIND = {
    # the computes torch's CSV writes by their own name (not FC, written as F, nor R, never written)
    **{op: _COMPUTE for op in ops.COMPUTE_OPS if ops.RULES[op].torch[0] == ops.KEEP and not ops.RULES[op].torch_token},
    **{op: _COMM for op in ops.COMM_OPS},
    "UNSHARD": _SKIP,
    "RESHARD": _SKIP,
    "REDUCE_GRAD": _SKIP,
}
# The forwards: every stage runs each microbatch's once (a backward may be B for some microbatches and I, W
# for others, as torch's ZBV writes it), so their counts say N.
_FORWARD_OPS = frozenset(op for op in ops.FORWARD_COMPUTE_OPS if _KIND.get(op) is _COMPUTE)
# torch's action token (schedules.py's _action_regex: F, I, B, W, UNSHARD,
# RESHARD, REDUCE_GRAD, SEND_F, RECV_F, SEND_B, RECV_B), matched whole.
# ASCII digits only: Python's \d (and int()) would also take '٣' or '³'.
_TOKEN = re.compile(r"([0-9]+)(" + "|".join(map(re.escape, _KIND)) + r")([0-9]*)")
# The longest cell the common path reads with int() directly (indices of at most
# 9 digits); a longer one goes through plain_int, which bounds its digits.
_FAST_CELL = 20
# torch's sub-action form: (a;b;...)TYPE
_GROUP = re.compile(r"\(([^()]*)\)([A-Z_]+)")
# Action._make skips NamedTuple's keyword handling: about 3x cheaper per instruction.
_make_action = Action._make
# Sub-action containers read as their parts in order. torch writes only
# OVERLAP_F_B (a forward and a backward of two stages run together).
_GROUPS = {"OVERLAP_F_B"}
# The stage at the other end of a message, relative to the token's stage: a send
# names its producer and goes to the neighbour that reads its value
# (ops.READER_OF), a receive names its consumer and comes from the neighbour
# whose value it carries (its rule's ``where``); torch's convention and pipec's.
# Stages form one chain, so the previous stage is s - 1 and the next s + 1.
_STEP = {ops.PREV: -1, ops.NEXT: +1}
_NEIGHBOUR = {op: _STEP[ops.READER_OF[rule.kind] if rule.is_send else rule.where]
              for op, rule in ops.PART_RULES.items()}


class _BadToken(Exception):
    """Internal: why one cell cannot be read; located by the caller."""


def read_torch_csv(text: str, source: str = "<csv>") -> tuple[Program, bool]:
    """Parse torch's schedule CSV.

    Args:
        text: the CSV, one row per rank.
        source: where it came from, for messages and ``Program.source``.
    Returns:
        (program, had_comms): the program exactly as written (no communication
        added, nothing checked beyond what reading needs) and whether the CSV
        held send/recv tokens.
    Raises:
        ImportError_: a token that is not torch's, a microbatch-less compute or
            communication token, a stage that never computes, a message whose
            stage is not on its rank or has no neighbour; located at
            ``rank R, step S`` (S = the CSV column) with the grid.
        WellFormedError: a stage whose compute appears on two ranks.
    """
    rows = csv.reader(io.StringIO(text))
    grid: list[list[str]] = []
    ranks_seen = 0  # rows up to the last that is not blank: trailing blank lines are not ranks
    try:
        for row in rows:
            grid.append([cell.strip() for cell in row])
            if any(grid[-1]):
                ranks_seen = len(grid)
                if ranks_seen > MAX_RANKS:  # refused before the work, which grows as ranks^2 (per-pair tables)
                    raise ImportError_(f"{source}:{rows.line_num}: the schedule CSV has more than {MAX_RANKS:,} "
                                       f"rows (ranks); pipec's limit is {MAX_RANKS:,} ranks (a program keeps "
                                       "per-rank lists and per-pair tables: P^2 entries)")
    except csv.Error as error:  # a field past csv.field_size_limit(), a NUL, a bad quote
        raise ImportError_(f"{source}:{rows.line_num}: cannot read the CSV: {error}") from None
    del grid[ranks_seen:]
    if not grid:
        raise ImportError_(f"{source}: empty schedule CSV")
    reader = _Reader(grid)
    with paused_gc():
        for rank, row in enumerate(grid):
            reader.read_row(rank, row)
        ranks, home, num_microbatches, had_comms = reader.finish()
    stages, pipelines, mb_pipeline = single_pipeline(home, num_microbatches)
    program = build_program(_name_of(source), len(grid), num_microbatches, stages, pipelines, mb_pipeline, ranks,
                            source=source)
    return program, had_comms


class _Reader:
    """One pass over the cells, then one over the messages (whose peers need every stage's home)."""

    def __init__(self, grid: list[list[str]]):
        self.grid = grid
        self.ranks: list[list[Action | None]] = []
        self.first_seen: dict[int, tuple[int, int]] = {}  # stage -> (rank, column) of its first compute
        self.messages: list[tuple[int, int, int, int, str, int]] = []  # (rank, index, column, stage, op, mb)
        self.max_mb = -1
        self.max_mb_at = (0, 0)  # (rank, column) of the largest microbatch index
        self.computes = 0  # compute actions: the bound of every stage and microbatch index

    def read_row(self, rank: int, row: list[str]) -> None:
        self.actions: list[Action | None] = []
        self.ranks.append(self.actions)
        add, token = self._add, _TOKEN.fullmatch
        for column, cell in enumerate(row):
            if not cell:
                continue
            match = token(cell) if len(cell) <= _FAST_CELL else None
            if match is not None and match[3]:
                add(rank, column, int(match[1]), match[2], int(match[3]))  # the common case
                continue
            try:
                leaves = _parse_cell(cell)
            except _BadToken as bad:
                raise ImportError_(str(bad), rank=rank, step=column, grid=_shown(self.grid)) from None
            for stage, op, mb in leaves:
                add(rank, column, stage, op, mb)

    def _add(self, rank: int, column: int, stage: int, op: str, mb: int) -> None:
        kind = _KIND[op]
        if kind is _COMPUTE:
            self.actions.append(_make_action((stage, op, mb, NO_PEER, ())))
            self.computes += 1
            if mb > self.max_mb:
                self.max_mb, self.max_mb_at = mb, (rank, column)
            seen = self.first_seen.get(stage)
            if seen is None:
                self.first_seen[stage] = (rank, column)
            elif seen[0] != rank:
                raise WellFormedError(
                    f"stage {stage} computes on rank {seen[0]} (step {seen[1]}) and on rank {rank}; "
                    "a stage has exactly one home rank",
                    rank=rank, step=column, grid=_shown(self.grid), marks=[seen],
                )
        elif kind is _COMM:
            # its peer is known only once every stage's home is: filled in by finish()
            self.messages.append((rank, len(self.actions), column, stage, op, mb))
            self.actions.append(None)

    def finish(self) -> tuple[list[list[Action]], list[int], int, bool]:
        """(ranks, stage homes, N, had_comms), with every message's peer resolved."""
        first_seen = self.first_seen
        if not first_seen:
            raise ImportError_("the schedule CSV has no compute action (F, B, I or W)")
        num_stages = 1 + max(first_seen)
        self._bound_index("stage", num_stages - 1, first_seen[num_stages - 1])
        self._bound_index("microbatch", self.max_mb, self.max_mb_at)
        missing = [s for s in range(num_stages) if s not in first_seen]
        if missing:
            listed = ", ".join(map(str, missing[:10])) + (f", ... ({len(missing)} in all)" if len(missing) > 10 else "")
            raise ImportError_(
                f"stage(s) {listed} never compute, but stage {num_stages - 1} does; "
                "torch's stages form one chain 0..S-1"
            )
        home = [first_seen[s][0] for s in range(num_stages)]
        num_microbatches = self._agreed_microbatches()
        for rank, index, column, stage, op, mb in self.messages:
            try:
                peer = _message_peer(rank, stage, op, mb, home, num_microbatches)
            except _BadToken as bad:
                raise ImportError_(str(bad), rank=rank, step=column, grid=_shown(self.grid)) from None
            self.ranks[rank][index] = _make_action((stage, op, mb, peer, ()))
        return self.ranks, home, num_microbatches, bool(self.messages)

    def _agreed_microbatches(self) -> int:
        """N: the number of forwards most stages run (each runs every microbatch's once); on a tie, the count
        that more stages run as exactly microbatches 0..count-1, then the larger. A compute past it is a
        stray on its rank, refused naming that rank's task and what the rank lacks, instead of a larger N
        that would blame every other rank for a missing task."""
        counts = Counter((action[0], action[1]) for row in self.ranks for action in row
                         if action is not None and action[1] in _FORWARD_OPS)
        tally = Counter(counts.values())
        if not tally:  # no forward at all: the well-formed check names what is missing
            return self.max_mb + 1
        most = max(tally.values())
        tied = [count for count, pairs in tally.items() if pairs == most]
        agreed = max(tied, key=lambda count: (self._whole_pairs(counts, count), count)) if len(tied) > 1 \
            else tied[0]
        if agreed > self.max_mb:
            return self.max_mb + 1
        rank, column, stage, op, mb = next(found for found in self._computes_at() if found[4] >= agreed)
        held = {action[2] for action in self.ranks[rank] if action is not None and action[:2] == (stage, op)}
        lacking = [f"{stage}{op}{m}" for m in range(agreed) if m not in held]
        lacks = f"; rank {rank} lacks {', '.join(lacking[:5])}" + (", ..." if len(lacking) > 5 else "") \
            if lacking else ""
        raise ImportError_(
            f"{stage}{op}{mb} is a stray: the stages' forwards say N = {agreed} (microbatches "
            f"0..{agreed - 1}){lacks}", rank=rank, step=column, grid=_shown(self.grid))

    def _whole_pairs(self, counts: Counter, count: int) -> int:
        """How many (stage, forward op) pairs run exactly microbatches 0..count-1 (a tie's witness)."""
        held: dict[tuple[int, str], set[int]] = {}
        for row in self.ranks:
            for action in row:
                if action is not None and counts.get((action[0], action[1])) == count:
                    held.setdefault((action[0], action[1]), set()).add(action[2])
        return sum(1 for mbs in held.values() if mbs == set(range(count)))

    def _computes_at(self):
        """Every compute of the grid as (rank, column, stage, op, mb), in row order (the error path reads it)."""
        for rank, row in enumerate(self.grid):
            for column, cell in enumerate(row):
                for stage, op, mb in (_parse_cell(cell) if cell else ()):
                    if _KIND[op] is _COMPUTE:
                        yield rank, column, stage, op, mb

    def _bound_index(self, what: str, index: int, at: tuple[int, int]) -> None:
        """Refuse a stage or microbatch ``index`` no schedule in this CSV can have (docs/formats.md, "Reading one")."""
        if index >= self.computes:
            raise ImportError_(
                f"{what} {index} is past what this CSV can hold: it has {self.computes} compute action(s), and every "
                f"{what} 0..{index} would compute at least once", rank=at[0], step=at[1], grid=_shown(self.grid))


def _shown(grid: list[list[str]]) -> list[list[str]]:
    """The grid as an error shows it: a cell with a non-printable character, or a long one, quoted and cut."""
    return [[cell if cell.isprintable() and len(cell) <= 40 else quote(cell, 40) for cell in row] for row in grid]


def _parse_cell(cell: str) -> list[tuple[int, str, int]]:
    """One CSV cell as (stage, op, mb) actions; a sub-action group as its parts in order."""
    group = _GROUP.fullmatch(cell)
    if group is not None:
        inner, kind = group.groups()
        if kind not in _GROUPS:
            raise _BadToken(f"unknown sub-action group type {quote(kind)} in {quote(cell)}; "
                            f"torch writes {', '.join(sorted(_GROUPS))}")
        parts = [p.strip() for p in inner.split(";") if p.strip()]
        if not parts:
            raise _BadToken(f"empty sub-action group {quote(cell)}")
        return [_parse_token(p) for p in parts]
    return [_parse_token(cell)]


def _parse_token(token: str) -> tuple[int, str, int]:
    match = _TOKEN.fullmatch(token)
    if match is None:
        raise _BadToken(
            f"{quote(token)} is not a torch.distributed.pipelining action "
            "(expected <stage><type><microbatch>, e.g. 2F0, 1SEND_B3, or (a;b)OVERLAP_F_B)"
        )
    stage, op, mb = match.groups()
    if not mb:
        if _KIND[op] != _SKIP:
            raise _BadToken(f"{quote(token)}: a {op} action needs a microbatch index, e.g. {quote(token + '0')}")
        return _index(stage, token), op, -1
    return _index(stage, token), op, _index(mb, token)


def _index(digits: str, token: str) -> int:
    """A stage or microbatch index of ``token``: ASCII digits, at most ``MAX_INT_DIGITS`` (``plain_int``)."""
    return plain_int(digits, f"{quote(token, 40)}: index", _BadToken)


def _message_peer(rank: int, stage: int, op: str, mb: int, home: list[int], num_microbatches: int) -> int:
    """The rank at the other end of a send/recv token on ``rank``."""
    neighbour = stage + _NEIGHBOUR[op]
    if stage < len(home) and home[stage] == rank and mb < num_microbatches and 0 <= neighbour < len(home) \
            and home[neighbour] != rank:
        return home[neighbour]  # the common, valid case; the messages below say what is wrong otherwise
    token = f"{stage}{op}{mb}"
    if stage >= len(home):
        raise _BadToken(f"{token}: stage {stage} never computes (stages are 0..{len(home) - 1})")
    if home[stage] != rank:
        raise _BadToken(f"{token}: stage {stage} runs on rank {home[stage]}, so rank {rank} cannot {op.lower()} for it")
    if mb >= num_microbatches:
        raise _BadToken(f"{token}: microbatch {mb} never computes (microbatches are 0..{num_microbatches - 1})")
    if not 0 <= neighbour < len(home):
        raise _BadToken(f"{token}: stage {stage} has no stage {neighbour} to exchange with")
    raise _BadToken(f"{token}: stages {stage} and {neighbour} are both on rank {rank}; their hand-off is local, not a message")


def _name_of(source: str) -> str:
    if source.startswith("<"):
        return "torch-csv"
    return os.path.splitext(os.path.basename(source))[0] or "torch-csv"


# ---------------------------------------------------------- import, lower, check


def complete_imported(program: Program, had_comms: bool) -> tuple[Program, str]:
    """An imported program made complete, unchecked, and the semantics it is proved under.

    Args:
        program, had_comms: what ``read_torch_csv`` returned.
    Returns:
        (the program, with pipec's communication added when the CSV had none; "async" for a CSV with
        communication, as torch's runtime runs it, else "rendezvous").
    """
    return (program, "async") if had_comms else (insert_communication(program), "rendezvous")


def prepare_imported(program: Program, had_comms: bool, **check_options) -> Program:
    """Make an imported program complete (``complete_imported``) and prove it safe.

    Args:
        program, had_comms: what ``read_torch_csv`` returned.
        check_options: passed on to ``check_all`` (budgets, sizes).
    Returns:
        the completed program.
    Raises:
        ProgramError: a check fails.
    """
    program, semantics = complete_imported(program, had_comms)
    check_all(program, semantics=semantics, **check_options)
    return program


def import_and_check(path: str, costs: CostModel | None = None) -> tuple[Program, SimResult]:
    """Read, complete, check and simulate a torch schedule CSV file.

    Args:
        path: the CSV file.
        costs: optional cost model for ``simulate`` (unit costs when None).
    Returns:
        (program, SimResult).
    Raises:
        UsageError: the file cannot be read (``guarded_read.read_text``: not a
            regular file, over ``TORCH_CSV``'s limit, not UTF-8).
        ProgramError: the CSV is not a schedule, or a check fails.
    """
    text = read_text(path, TORCH_CSV)  # the one guarded reader: a regular file, bounded, UTF-8
    program, had_comms = read_torch_csv(text, source=path)
    program = prepare_imported(program, had_comms)
    return program, simulate(program, costs)
