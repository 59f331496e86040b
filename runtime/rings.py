"""Sequence rings in the runtime: ring attention, zigzag and TASP run on real ranks.

A sequence-ring program (``Program.rings`` set; ``compiler/lower_rings.py``
builds it, ``compiler/checks/rings.py`` proves it) cuts a sequence into chunks
held by the ranks and moves keys and values round rings of ranks so that
every query chunk meets every key piece its mask shows it. This module runs
one rank's list on the current default process group (gloo on the CPU, NCCL
on GPUs: the same logic, the waits differ as ``runtime/comm`` says), mirroring
the checker's semantics op for op.

The state and op semantics (bundles, partials, AF, AB, EXCHANGE, its wait)
are ``_RingRank``'s docstring. Each attention call's list runs through the
one interpreter loop (``runtime/family.run_instructions``) with the table of
its ``RingContext`` (``HANDLERS``, plus a fault ``--inject`` planted).

The posting and the waiting are ``runtime/exchange.py``'s, shared with weight
passing; this module gives it what each part means (``PART_POSTERS``).

At the end rank r's partials of its own bundles are the whole dK, dV of its
chunks. Anything a checked program never does (a block whose bundle this rank
does not hold, an exchange never waited, a partial left away from home, an op
this family does not have) is a ``RuntimeFault`` naming the rank and the
instruction; a wait past the deadline is one too, never a hang.
"""
from __future__ import annotations

from time import perf_counter
from typing import Callable, Mapping, NamedTuple

import torch
import torch.distributed as dist

from pipec.compiler import ops, ring_halves
from pipec.compiler.ir import Action, Program, RingPlan
from pipec.errors import RuntimeFault, UsageError
from pipec.runtime import comm
from pipec.runtime.family import run_instructions
from pipec.runtime.exchange import Exchange, PartHandler, check_all_waited, post_exchange, wait_exchange
from pipec.runtime.attention import (accumulating_dtype, block_backward_at, block_forward_at, empty_result,
                                     merge_rows)

# gloo matches point-to-point messages FIFO per (pair, tag): KV and dKV each keep their own channel.
_TAGS = {ops.SEND_KV: 1, ops.RECV_KV: 1, ops.SEND_DKV: 2, ops.RECV_DKV: 2}
_KV_PARTS = (ops.SEND_KV, ops.RECV_KV)
_DKV_PARTS = (ops.SEND_DKV, ops.RECV_DKV)
_ALLTOALL_KIND = {ops.ALLTOALL_KV: _KV_PARTS, ops.ALLTOALL_DKV: _DKV_PARTS}


class RingResult(NamedTuple):
    """One rank's share of a ring attention's result, per chunk it holds (accumulating dtype).

    Attributes:
        chunks: the chunks this rank holds, ascending.
        out: chunk -> (B, H, chunk length, D) attention output of its queries.
        lse: chunk -> (B, H, chunk length) the log-sum-exp of its rows.
        dq: chunk -> the gradient of its queries.
        dk, dv: chunk -> the whole gradient of its keys and values (every rank's contributions).
    """

    chunks: tuple[int, ...]
    out: dict
    lse: dict
    dq: dict
    dk: dict
    dv: dict

    def local(self, name: str) -> torch.Tensor:
        """One field over this rank's chunks, concatenated along the sequence in ascending chunk order."""
        parts = getattr(self, name)
        return torch.cat([parts[c] for c in self.chunks], dim=-2 if name != "lse" else -1)


def chunk_length(plan: RingPlan, seq: int) -> int:
    """The tokens of one chunk of a sequence of ``seq``; raises UsageError unless chunks and pieces cut it evenly."""
    cut = plan.chunks * plan.pieces
    if seq <= 0 or seq % cut:
        cutting = f"{plan.chunks} equal chunks" + (f" of {plan.pieces} equal pieces" if plan.pieces > 1 else "")
        raise UsageError(f"a sequence of {seq} tokens cannot be cut into {cutting}: its length must be a multiple "
                         f"of {cut}")
    return seq // plan.chunks


def token_positions(plan: RingPlan, rank: int, seq_len: int) -> torch.Tensor:
    """The global positions of ring rank ``rank``'s tokens of a sequence of ``seq_len``, its chunks in ascending
    order (LongTensor); ``chunk_length``'s UsageError when the plan does not cut it evenly."""
    size = chunk_length(plan, seq_len)
    return torch.cat([torch.arange(c * size, (c + 1) * size) for c in plan.chunks_of(rank)])


def own_chunks(plan: RingPlan, rank: int, whole: torch.Tensor) -> dict[int, torch.Tensor]:
    """The chunks ``rank`` holds of a whole-sequence tensor (B, H, S, D), chunk -> view."""
    size = chunk_length(plan, whole.shape[-2])
    return {c: whole[..., c * size:(c + 1) * size, :] for c in plan.chunks_of(rank)}


def run_ring_attention(program: Program, rank: int, q, k, v, grad_out, *, timeout: float,
                       scale: float | None = None) -> RingResult:
    """Run rank ``rank``'s list of a sequence-ring program: one forward and backward of attention.

    Collective: every rank of the default process group calls it with the same
    program (the group's size is the program's rank count). A program without
    exchanges (one rank) needs no group. The whole list runs in one pass;
    ``RingAttention`` runs the same list as a forward half and a backward half.

    Args:
        program: a sequence-ring program (``Program.rings`` set).
        rank: this rank.
        q, k, v, grad_out: this rank's chunks of the queries, keys, values and
            the output's gradient, (B, H, length, D): a mapping chunk ->
            tensor, or one tensor of its chunks concatenated in ascending chunk
            order (``own_chunks`` cuts them from a whole sequence).
        timeout: the longest wait of one instruction, seconds.
        scale: the softmax scale; 1/sqrt(D) when None.
    Returns:
        this rank's ``RingResult``.
    Raises:
        UsageError: not a ring program, or inputs that do not fit it.
        RuntimeFault: a wait past ``timeout``, a failed peer, or a list the runtime cannot run.
    """
    run = _RingRank(RingContext(program, rank, timeout=timeout, scale=scale))
    run.load(q, k, v)
    run.load_grad(grad_out)
    run.run_range(0, len(run.row))
    return run.finish()


class RingAttention:
    """One attention call of a sequence-ring program on one rank, run as a forward and a backward half.

    ``forward(q, k, v)`` runs the rank's list up to the backward's first
    instruction (``forward_end``): every AF, and every forward exchange posted
    and waited, so nothing of this call is in flight when it returns and the
    next call's messages cannot meet this one's. ``backward(grad_out)`` runs
    the rest (the AB blocks, the backward's KV and the dK, dV partials) and
    returns this rank's gradients. Between the two, the object keeps what
    the backward needs (the chunks' output and log-sum-exp, the inputs, and
    under ``kv kept`` every bundle forward brought). A call is used once:
    ``torch.autograd.Function`` (``runtime/sequence.py``) makes one per
    attention of every layer.

    Collective as ``run_ring_attention``: every rank runs its halves in the same
    order of calls, so that the programs' messages line up.

    Args:
        program: a sequence-ring program (``Program.rings`` set).
        rank: this rank.
        timeout: the longest wait of one instruction, seconds.
        scale: the softmax scale; 1/sqrt(D) when None.
        iteration: the training step a fault message names (None: it names none).
        label: which call this is (``attention 3``), for fault messages: an
            instruction's text is followed by ``, in LABEL's forward`` (or backward).
    Raises:
        UsageError: not a ring program, a rank outside it, a bad timeout, or a
            process group of another size.
    """

    def __init__(self, program: Program, rank: int, *, timeout: float, scale: float | None = None,
                 iteration: int | None = None, label: str | None = None):
        self._start(RingContext(program, rank, timeout=timeout, scale=scale), iteration, label)

    @classmethod
    def in_context(cls, context: "RingContext", *, iteration: int | None = None,
                   label: str | None = None) -> "RingAttention":
        """A call run with ``context``'s list and table (a training run's: ``--inject`` and ``--trace``)."""
        call = cls.__new__(cls)
        call._start(context, iteration, label)
        return call

    def _start(self, context: "RingContext", iteration: int | None, label: str | None) -> None:
        self._run = _RingRank(context, iteration)
        self._label = label
        self._stage = "new"

    def forward(self, q, k, v) -> torch.Tensor:
        """Run the forward half on this rank's chunks of q, k, v (B, H, S_local, D) (or mappings chunk -> tensor).

        Returns:
            the attention output of this rank's queries, (B, H, S_local, D), its chunks
            in ascending order, in the inputs' dtype.
        Raises:
            UsageError: called twice, or inputs that do not fit the program.
            RuntimeFault: a wait past the timeout, a failed peer, or a list whose forward
                cannot be run apart from its backward.
        """
        if self._stage != "new":
            raise UsageError("RingAttention.forward runs once per call; make a new RingAttention for another")
        run = self._run
        run.label = f"{self._label}'s forward" if self._label else None
        run.load(q, k, v)
        end = forward_end(run)
        run.run_range(0, end)
        run.settle()
        self._stage = "forward"
        return torch.cat([run.output(c, end)[0] for c in run.mine], dim=-2).to(run.dtype)

    def backward(self, grad_out) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Run the backward half with the output's gradient of this rank's queries (forward's layout).

        Returns:
            (dq, dk, dv) of this rank's chunks, each (B, H, S_local, D) in the inputs' dtype;
            dk, dv hold every rank's contributions.
        Raises:
            UsageError: called before forward or twice, or a gradient that does not fit.
            RuntimeFault: as ``forward``, and a partial the list leaves away from home.
        """
        if self._stage != "forward":
            raise UsageError("RingAttention.backward runs once, after forward")
        run = self._run
        run.label = f"{self._label}'s backward" if self._label else None
        run.load_grad(grad_out)
        self._stage = "done"
        run.run_range(forward_end(run), len(run.row))
        result = self.result = run.finish()
        return tuple(result.local(name).to(run.dtype) for name in ("dq", "dk", "dv"))


def forward_end(run) -> int:
    """Where rank ``run.rank``'s list stops being forward: the index of its backward's first instruction
    (``compiler/ring_halves.py``, which the prover proved the list has).

    ``run`` is a ``RingContext`` or one call's state: what has the list (``row``), keeps the answer
    (``split``) and makes faults (``fault``).

    Raises:
        RuntimeFault: an exchange never waited, or an AF at or after the backward's start.
    """
    if run.split is not None:
        return run.split
    halves = ring_halves.forward_end(run.row)
    if halves.problem is not None:
        raise run.fault(*halves.problem)
    run.split = halves.end
    return halves.end


def wait_within(works, timeout: float, site: comm.Site, wait=comm.await_blocking, *,
                training: bool = False) -> None:
    """Wait for ``works`` within ``timeout`` seconds (``comm``'s rules); a ``RuntimeFault`` past it.

    A ring run outside training runs one forward and backward, not training
    steps: the fault's message leaves out ``comm``'s training step unless
    ``training`` (sequence-parallel training, ``runtime/sequence.py``).
    """
    try:
        wait(works, timeout, site)
    except RuntimeFault as fault:
        if training:
            raise
        message = fault.message.removesuffix(f"; training step {site.iteration}")
        raise RuntimeFault(message, fault.rank, fault.step, fault.instruction, fault.peer) from None


# ------------------------------------------------------------------ state


class RingContext:
    """What one rank keeps across a run's attention calls: its list, its table, the process group's rules.

    The ring is the whole world (a sequence-ring program: ring rank r is global rank r) or a group of
    it (``members``: a context-parallel stage's group, ``runtime/placed.py``): ring rank i is global rank
    ``members[i]``, a point-to-point part's peer (a ring rank) goes to its global rank, and TASP's
    all_to_all runs over ``group``, whose members in group order are the ring ranks in order.

    Args:
        program: a sequence-ring program (``Program.rings`` set).
        rank: this rank's ring rank.
        timeout: the longest wait of one instruction, seconds.
        scale: the softmax scale; 1/sqrt(D) when None.
        members: the global ranks of ring ranks 0, 1, ... (None: the world, in order).
        group: the process group of ``members`` (None: the default group, for a ring that is the world).
    Attributes:
        where: this rank's global rank, the one faults and waits name.
        row: this rank's list (a copy: ``--inject`` plants a fault in it).
        handlers: op -> handler, ``HANDLERS`` plus anything planted.
        events: None, or the trace's records so far: (index, start, end, waited, call) per instruction.
        synchronize: called after every instruction when the trace must show device time, else None.
    Raises:
        UsageError: not a ring program, a rank outside it, a bad timeout, or a process group of another size.
        RuntimeFault: an instruction the ring runtime has no handler for.
    """

    def __init__(self, program: Program, rank: int, *, timeout: float, scale: float | None = None,
                 members: tuple[int, ...] | None = None, group=None):
        plan = program.rings
        if plan is None:
            raise UsageError(f"{program.name or 'the program'} is not a sequence-ring program (no rings): "
                             "run_ring_attention runs ring, zigzag and TASP attention schedules")
        if not 0 <= rank < program.num_ranks:
            raise UsageError(f"rank {rank} is not one of the program's {program.num_ranks} ranks")
        if not timeout > 0:
            raise UsageError(f"the timeout must be a positive number of seconds, got {timeout}")
        self.program, self.plan, self.rank = program, plan, rank
        self.members = tuple(range(program.num_ranks)) if members is None else tuple(members)
        if len(self.members) != program.num_ranks:
            raise UsageError(f"{program.name or 'the ring'} runs on {program.num_ranks} ranks, but its group has "
                             f"{len(self.members)}: {list(self.members)}")
        self.where, self.group = self.members[rank], group
        self.row = list(program.ranks[rank])
        self.handlers: dict[str, Callable] = dict(HANDLERS)
        self.timeout, self.scale = timeout, scale
        self.split: int | None = None
        self.events: list | None = None
        self.synchronize: Callable[[], None] | None = None
        _check_row(self)
        # A program without exchanges (one rank) runs without a process group.
        self.backend = dist.get_backend() if dist.is_available() and dist.is_initialized() else None
        if members is not None:
            if self.backend is not None and dist.get_rank() != self.where:
                raise UsageError(f"this is rank {dist.get_rank()}, but it was asked to run ring rank {rank}, "
                                 f"global rank {self.where}")
        elif self.backend is not None and (dist.get_world_size(), dist.get_rank()) != (program.num_ranks, rank):
            raise UsageError(f"the process group has {dist.get_world_size()} ranks and this is rank "
                             f"{dist.get_rank()}, but the program has {program.num_ranks} ranks and was asked to run "
                             f"rank {rank}'s list")
        self.wait_fn, self.blocking = comm.wait_rule(self.backend or "gloo")

    def fault(self, index: int, message: str, peer: int | None = None) -> RuntimeFault:
        text = self.row[index].text() if 0 <= index < len(self.row) else "the end of the list"
        return RuntimeFault(message, self.where, index, text, peer)

    def global_rank(self, ring_rank: int) -> int:
        """The global rank of ring rank ``ring_rank``."""
        return self.members[ring_rank]


def _check_row(context: RingContext) -> None:
    """Every instruction of the list has a handler in the ring's table; the first that has none is a fault."""
    for index, action in enumerate(context.row):
        if action.op in context.handlers:
            continue
        if action.op in ops.RING_PART_OPS:
            raise context.fault(index, f"{action.op} stands outside an exchange; a sequence ring posts it inside "
                                       "an EXCHANGE")
        raise context.fault(index, f"the sequence-ring runtime has no instruction {action.op!r} (it runs AF, AB, "
                                   "EXCHANGE and EXCHANGE_WAIT)")


class _RingRank:
    """One rank's state during one attention call (``load`` the inputs first, ``load_grad`` before the backward).

    * A **bundle** (s, p) is piece p of the keys and values of every chunk rank s
      holds, ascending, concatenated along the sequence: one tensor
      ``(2, B, H, len(chunks_of(s)) * piece, D)`` (keys, then values) in the
      inputs' dtype. Rank r starts with its own bundles (r, p). Under ``kv
      again`` a delivered bundle replaces the one this rank received before for
      that piece; under ``kv kept`` every delivered bundle stays.
    * ``AF`` (stage q, block) computes the block of chunk q's queries against
      the key piece, by global positions (``attention.block_forward_at``), and
      folds it into chunk q's running (out, lse) in fp32 (fp64 for fp64 inputs).
    * ``AB`` takes chunk q's final out and lse, keeps the block's dq on the rank
      and adds its dk, dv into this rank's **partial** of the bundle (holder of
      the kv chunk, piece), at that chunk's slice; a partial has the bundle's
      shape in the accumulating dtype.
    * ``EXCHANGE`` posts its parts in list order: the collectives (``ALLTOALL_KV``,
      ``ALLTOALL_DKV``: one ``all_to_all_single`` of every rank, each peer's
      items flattened and concatenated in part order, an empty share for a peer
      with nothing) when met, the point-to-point parts together at the end as one
      ``batch_isend_irecv`` (a tag per kind, so that gloo keeps KV and dKV on
      their own channels; NCCL matches by posting order, which the checks prove).
      A received bundle or partial always lands in a new buffer. ``SEND_DKV``
      sends this rank's partial and forgets it (zeros when it has none).
    * ``EXCHANGE_WAIT`` waits for every part of the exchange within ``timeout``
      (``comm.await_blocking`` on gloo; on NCCL the stream waits and the deadline
      is checked when the list ends, ``comm.settle``); then received bundles
      become usable and received partials are added to this rank's.
    """

    def __init__(self, context: RingContext, iteration: int | None = None):
        plan = context.plan
        self.context = context
        self.program, self.plan, self.row = context.program, plan, context.row
        self.ring_rank, self.rank = context.rank, context.where  # the plan's rank; the global one faults name
        self.timeout, self.scale, self.iteration = context.timeout, context.scale, iteration
        self.backend, self.wait_fn, self.blocking = context.backend, context.wait_fn, context.blocking
        self.label: str | None = None  # where in training this call runs, for fault messages and the trace
        self.waited = 0.0  # seconds spent waiting so far (the trace's wait of each instruction)
        self.mine = plan.chunks_of(context.rank)
        self.grad_out = None
        # bundles: own per piece; received (kv again: per piece, (bundle, tensor)) or kept (bundle -> tensor)
        self.received: dict[int, tuple[tuple[int, int], torch.Tensor]] = {}
        self.kept: dict[tuple[int, int], torch.Tensor] = {}
        self.out: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.dq: dict[int, torch.Tensor] = {}
        self.partials: dict[tuple[int, int], torch.Tensor] = {}
        self.incoming: dict[tuple[int, int], int] = {}
        self.open: dict[int, Exchange] = {}
        self.streamed: list = []

    @property
    def split(self) -> int | None:
        return self.context.split

    @split.setter
    def split(self, value: int) -> None:
        self.context.split = value

    def load(self, q, k, v) -> None:
        """Take this rank's chunks of the queries, keys and values, and make its own bundles."""
        plan, rank = self.plan, self.ring_rank
        self.q = self._chunks(q, "q")
        self.k = self._chunks(k, "k")
        self.v = self._chunks(v, "v")
        first = self.q[self.mine[0]] if self.mine else None
        if first is None:
            raise UsageError(f"rank {rank} holds no chunk of the sequence; every rank of a ring holds one")
        self.dtype, self.device = first.dtype, first.device
        self.wide = accumulating_dtype(self.dtype)
        self.batch, self.heads, self.chunk, self.dim = first.shape
        if self.chunk % plan.pieces:
            raise UsageError(f"a chunk of {self.chunk} tokens cannot be cut into {plan.pieces} equal pieces")
        self.piece = self.chunk // plan.pieces
        for name, chunks in (("q", self.q), ("k", self.k), ("v", self.v)):
            self._check_shapes(name, chunks)
        self.own = {p: self._bundle_of_own(p) for p in range(plan.pieces)}

    def load_grad(self, grad_out) -> None:
        """Take this rank's chunks of the output's gradient (None: a backward block will say it has none)."""
        if grad_out is None:
            return
        self.grad_out = self._chunks(grad_out, "grad_out")
        self._check_shapes("grad_out", self.grad_out)

    def _check_shapes(self, name: str, chunks: dict[int, torch.Tensor]) -> None:
        for c, tensor in chunks.items():
            if tuple(tensor.shape) != (self.batch, self.heads, self.chunk, self.dim) or tensor.dtype != self.dtype:
                raise UsageError(f"{name} of chunk {c} is {tuple(tensor.shape)} {tensor.dtype}; every chunk must "
                                 f"be {(self.batch, self.heads, self.chunk, self.dim)} {self.dtype}")

    def run_range(self, start: int, stop: int) -> None:
        """Run instructions ``start`` .. ``stop - 1`` of the list through the one loop and the context's table;
        with a trace, each is recorded with the call's label (``attention 3's forward``)."""
        events = self.context.events
        record = None
        if events is not None:
            call = self.label or ""
            record = lambda event: events.append((*event, call))  # noqa: E731
        run_instructions(self, self.row, self.context.handlers, start, stop, record, self.context.synchronize,
                         lambda index: self._labelled(self.row[index].text()))

    def _chunks(self, given, name: str) -> dict[int, torch.Tensor]:
        if isinstance(given, Mapping):
            missing = [c for c in self.mine if c not in given]
            if missing:
                raise UsageError(f"{name} lacks chunk {missing[0]}, which rank {self.ring_rank} holds")
            return {c: given[c] for c in self.mine}
        if not isinstance(given, torch.Tensor) or given.dim() != 4:
            raise UsageError(f"{name} must be a (batch, heads, length, head dim) tensor or a mapping chunk -> tensor")
        if given.shape[-2] % len(self.mine):
            raise UsageError(f"{name} holds {given.shape[-2]} tokens, not {len(self.mine)} equal chunks")
        size = given.shape[-2] // len(self.mine)
        return {c: given[..., i * size:(i + 1) * size, :] for i, c in enumerate(self.mine)}

    def _bundle_of_own(self, piece: int) -> torch.Tensor:
        cut = slice(piece * self.piece, (piece + 1) * self.piece)
        keys = torch.cat([self.k[c][..., cut, :] for c in self.mine], dim=-2)
        values = torch.cat([self.v[c][..., cut, :] for c in self.mine], dim=-2)
        return torch.stack((keys, values)).contiguous()

    def bundle_shape(self, holder: int) -> tuple[int, ...]:
        return (2, self.batch, self.heads, len(self.plan.chunks_of(holder)) * self.piece, self.dim)

    # -- faults ------------------------------------------------------------------

    def fault(self, index: int, message: str, peer: int | None = None) -> RuntimeFault:
        text = self.row[index].text() if 0 <= index < len(self.row) else "the end of the list"
        return RuntimeFault(message, self.rank, index, self._labelled(text), peer)

    def site(self, index: int, text: str, peers: tuple[int, ...]) -> comm.Site:
        return comm.Site(self.rank, index, self._labelled(text), peers, self.iteration or 1)

    def wait_works(self, ex: Exchange, site: comm.Site) -> None:
        """Wait for an exchange's works within the timeout, the backend's way (``wait_within``)."""
        start = perf_counter()
        wait_within(ex.works, self.timeout, site, self.wait_fn, training=self.iteration is not None)
        self.waited += perf_counter() - start
        if not self.blocking:  # NCCL: the stream waits; the buffers live until the deadline is checked
            self.streamed.append((ex.works, site, ex.keep))

    def _labelled(self, text: str) -> str:
        return f"{text}, in {self.label}" if self.label else text

    # -- bundles and partials ----------------------------------------------------------

    def held(self, bundle: tuple[int, int]) -> torch.Tensor | None:
        """This rank's usable copy of ``bundle``, or None."""
        holder, piece = bundle
        if holder == self.ring_rank:
            return self.own.get(piece)
        if self.plan.kv == "kept":
            return self.kept.get(bundle)
        slot = self.received.get(piece)
        return slot[1] if slot is not None and slot[0] == bundle else None

    def deliver(self, bundle: tuple[int, int], tensor: torch.Tensor) -> None:
        if bundle[0] == self.ring_rank:
            return  # its own bundle came back round: this rank keeps its own copy
        if self.plan.kv == "kept":
            self.kept[bundle] = tensor
        else:
            self.received[bundle[1]] = (bundle, tensor)

    def add_partial(self, bundle: tuple[int, int], partial: torch.Tensor) -> None:
        have = self.partials.get(bundle)
        if have is None:
            self.partials[bundle] = partial
        else:
            have.add_(partial)

    def take_partial(self, bundle: tuple[int, int], index: int) -> torch.Tensor:
        if self.incoming.get(bundle):
            raise self.fault(index, f"it sends this rank's dK, dV partial of rank {bundle[0]}'s bundle of piece "
                                    f"{bundle[1]} while another partial of it is still arriving")
        partial = self.partials.pop(bundle, None)
        if partial is None:
            partial = torch.zeros(self.bundle_shape(bundle[0]), dtype=self.wide, device=self.device)
        return partial

    # -- the end -----------------------------------------------------------------

    def settle(self) -> None:
        """NCCL: check the deadline of every stream wait so far (gloo waited at each EXCHANGE_WAIT)."""
        for works, site, _ in self.streamed:
            wait_within(works, self.timeout, site, comm.settle, training=self.iteration is not None)
        self.streamed.clear()

    def output(self, chunk: int, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Chunk ``chunk``'s (out, lse); a fault at ``index`` when no forward block of it was computed."""
        if chunk not in self.out:
            raise self.fault(index, f"no block of chunk {chunk}'s queries was computed forward: it has no output")
        return self.out[chunk]

    def finish(self) -> RingResult:
        end = len(self.row)
        check_all_waited(self.open, self.fault)
        self.settle()
        away = sorted(b for b in self.partials if b[0] != self.ring_rank)
        if away:
            holder, piece = away[0]
            raise self.fault(end, f"a dK, dV partial of rank {holder}'s bundle of piece {piece} is left on this "
                                  "rank: it never went home")
        out, lse, dq, dk, dv = {}, {}, {}, {}, {}
        for c in self.mine:
            out[c], lse[c] = self.output(c, end)
            dq[c] = self.dq.get(c)
            if dq[c] is None:
                dq[c] = torch.zeros(self.q[c].shape, dtype=self.wide, device=self.device)
        for c in self.mine:
            index = self.mine.index(c)
            cut = slice(index * self.piece, (index + 1) * self.piece)
            keys, values = [], []
            for p in range(self.plan.pieces):
                partial = self.partials.get((self.ring_rank, p))
                if partial is None:
                    partial = torch.zeros(self.bundle_shape(self.ring_rank), dtype=self.wide, device=self.device)
                keys.append(partial[0, ..., cut, :])
                values.append(partial[1, ..., cut, :])
            dk[c] = torch.cat(keys, dim=-2)
            dv[c] = torch.cat(values, dim=-2)
        return RingResult(self.mine, out, lse, dq, dk, dv)


# ------------------------------------------------------------------ blocks


def _block(run: _RingRank, action: Action, index: int):
    """(query chunk, kv chunk, piece, bundle, its keys, its values) of a block instruction."""
    plan = run.plan
    q = action.stage
    if q not in run.q:
        raise run.fault(index, f"the queries of chunk {q} are not on this rank (chunk {q} lives on rank "
                               f"{plan.holders[q] if 0 <= q < plan.chunks else '?'})")
    if not 0 <= action.mb < plan.chunks * plan.pieces:
        raise run.fault(index, f"block {action.mb} is not one of {plan.chunks} chunks x {plan.pieces} pieces")
    kv, piece = plan.unblock(action.mb)
    bundle = (plan.holders[kv], piece)
    tensor = run.held(bundle)
    if tensor is None:
        raise run.fault(index, f"it needs rank {bundle[0]}'s KV bundle of piece {piece}, which this rank does not "
                               "hold now")
    offset = plan.chunks_of(bundle[0]).index(kv) * run.piece
    cut = slice(offset, offset + run.piece)
    return q, kv, piece, bundle, tensor[0, ..., cut, :], tensor[1, ..., cut, :], cut


def _positions(run: _RingRank, q: int, kv: int, piece: int) -> tuple[int, int]:
    return q * run.chunk, kv * run.chunk + piece * run.piece


def attention_forward(run: _RingRank, action: Action, index: int) -> None:
    """AF: the block's (out, lse) folded into its query chunk's running result."""
    q, kv, piece, _, keys, values, _ = _block(run, action, index)
    q_start, k_start = _positions(run, q, kv, piece)
    block = block_forward_at(run.q[q], keys, values, q_start, k_start, run.plan.causal, run.scale)
    if block is None:
        return  # fully masked: nothing to fold (a checked program never computes it)
    if q not in run.out:
        run.out[q] = empty_result(run.q[q])
    merge_rows(*run.out[q], block)


def attention_backward(run: _RingRank, action: Action, index: int) -> None:
    """AB: the block's dq kept, its dk and dv added to this rank's partial of the bundle."""
    q, kv, piece, bundle, keys, values, cut = _block(run, action, index)
    if run.grad_out is None:
        raise run.fault(index, "a backward block needs the output's gradient, and none was given")
    if q not in run.out:
        raise run.fault(index, f"chunk {q}'s queries have no forward output yet; a backward block needs it")
    out, lse = run.out[q]
    q_start, k_start = _positions(run, q, kv, piece)
    dq, dk, dv = block_backward_at(run.grad_out[q], run.q[q], keys, values, out, lse, q_start, k_start,
                                   run.plan.causal, run.scale)
    if q in run.dq:
        run.dq[q].add_(dq)
    else:
        run.dq[q] = dq
    partial = run.partials.get(bundle)
    if partial is None:
        partial = run.partials[bundle] = torch.zeros(run.bundle_shape(bundle[0]), dtype=run.wide, device=run.device)
    partial[0, ..., cut, :].add_(dk)
    partial[1, ..., cut, :].add_(dv)


# ------------------------------------------------------------------ exchanges


def _bundle_of(run: _RingRank, part: Action, ex: Exchange) -> tuple[int, int]:
    plan = run.plan
    if not (0 <= part.stage < run.program.num_ranks and 0 <= part.mb < plan.pieces
            and 0 <= part.peer < run.program.num_ranks) or part.peer == run.ring_rank:
        raise run.fault(ex.index, f"{part.text()} names no bundle of this program or no other rank (peer {part.peer})")
    return part.stage, part.mb


def _kv_to_send(run: _RingRank, part: Action, ex: Exchange) -> torch.Tensor:
    bundle = _bundle_of(run, part, ex)
    tensor = run.held(bundle)
    if tensor is None:
        raise run.fault(ex.index, f"{part.text()} sends rank {bundle[0]}'s KV bundle of piece {bundle[1]}, which "
                                  "this rank does not hold now", run.context.global_rank(part.peer))
    ex.keep.append(tensor)
    return tensor


def _dkv_to_send(run: _RingRank, part: Action, ex: Exchange) -> torch.Tensor:
    tensor = run.take_partial(_bundle_of(run, part, ex), ex.index)
    ex.keep.append(tensor)
    return tensor


def _arrive_kv(run: _RingRank, bundle: tuple[int, int], buffer: torch.Tensor) -> Callable[[], None]:
    return lambda: run.deliver(bundle, buffer)


def _arrive_dkv(run: _RingRank, bundle: tuple[int, int], buffer: torch.Tensor) -> Callable[[], None]:
    run.incoming[bundle] = run.incoming.get(bundle, 0) + 1

    def arrive() -> None:
        run.incoming[bundle] -= 1
        run.add_partial(bundle, buffer)
    return arrive


def _send_kv(run: _RingRank, part: Action, ex: Exchange) -> None:
    """SEND_KV: the bundle this rank holds now, to the part's peer on the KV channel."""
    ex.send(_kv_to_send(run, part, ex), run.context.global_rank(part.peer), _TAGS[part.op])


def _send_dkv(run: _RingRank, part: Action, ex: Exchange) -> None:
    """SEND_DKV: this rank's partial of the bundle (taken from it; zeros when it has none), to the peer."""
    ex.send(_dkv_to_send(run, part, ex), run.context.global_rank(part.peer), _TAGS[part.op])


def _recv_kv(run: _RingRank, part: Action, ex: Exchange) -> None:
    """RECV_KV: the bundle into a new buffer, usable (delivered) once waited."""
    bundle, buffer = _receive(run, part, ex, run.dtype)
    ex.arrivals.append(_arrive_kv(run, bundle, buffer))


def _recv_dkv(run: _RingRank, part: Action, ex: Exchange) -> None:
    """RECV_DKV: a partial of the bundle into a new buffer, added to this rank's once waited."""
    bundle, buffer = _receive(run, part, ex, run.wide)
    ex.arrivals.append(_arrive_dkv(run, bundle, buffer))


def _receive(run: _RingRank, part: Action, ex: Exchange, dtype: torch.dtype) -> tuple[tuple[int, int], torch.Tensor]:
    """(the bundle, a new buffer of its shape in ``dtype``) received from the part's peer."""
    bundle = _bundle_of(run, part, ex)
    buffer = torch.empty(run.bundle_shape(bundle[0]), dtype=dtype, device=run.device)
    ex.keep.append(buffer)
    ex.receive(buffer, run.context.global_rank(part.peer), _TAGS[part.op])
    return bundle, buffer


def _post_all_to_all(run: _RingRank, part: Action, ex: Exchange) -> None:
    """ALLTOALL_KV / ALLTOALL_DKV: its sends and receives moved by one all_to_all of every rank of the ring."""
    kinds = _ALLTOALL_KIND[part.op]
    communicator = run.program.communicator_on(part, run.ring_rank)
    if communicator is not None and tuple(communicator.ranks) != tuple(range(run.program.num_ranks)):
        raise run.fault(ex.index, f"{part.text()} meets on ranks {list(communicator.ranks)}; the runtime moves an "
                                  "all_to_all over every rank")
    world = run.program.num_ranks
    wide = part.op == ops.ALLTOALL_DKV
    dtype = run.wide if wide else run.dtype
    sends: list[list[torch.Tensor]] = [[] for _ in range(world)]
    takes: list[list[tuple[tuple[int, int], tuple[int, ...]]]] = [[] for _ in range(world)]
    for inner in part.parts:
        if inner.op not in kinds:
            raise run.fault(ex.index, f"{part.op} holds {inner.text()}, which it does not move")
        if inner.op in (ops.SEND_KV, ops.SEND_DKV):
            tensor = (_kv_to_send if inner.op == ops.SEND_KV else _dkv_to_send)(run, inner, ex)  # checks the peer
            sends[inner.peer].append(tensor.reshape(-1))
        else:
            bundle = _bundle_of(run, inner, ex)
            takes[inner.peer].append((bundle, run.bundle_shape(bundle[0])))
    empty = torch.zeros(0, dtype=dtype, device=run.device)
    send_splits = [sum(t.numel() for t in items) for items in sends]
    take_splits = [sum(_numel(shape) for _, shape in items) for items in takes]
    flat_in = torch.cat([t for items in sends for t in items]) if any(send_splits) else empty
    flat_out = torch.empty(sum(take_splits), dtype=dtype, device=run.device)
    ex.keep += [flat_in, flat_out]
    ex.works.append(dist.all_to_all_single(flat_out, flat_in, take_splits, send_splits, group=run.context.group,
                                           async_op=True))
    ex.peers.update(run.context.global_rank(r) for r in range(world) if r != run.ring_rank)
    offset = 0
    for items in takes:
        for bundle, shape in items:
            buffer = flat_out[offset:offset + _numel(shape)].view(shape)
            offset += _numel(shape)
            ex.arrivals.append((_arrive_dkv if wide else _arrive_kv)(run, bundle, buffer))


def _numel(shape: tuple[int, ...]) -> int:
    count = 1
    for size in shape:
        count *= size
    return count


def exchange(run: _RingRank, action: Action, index: int) -> None:
    """EXCHANGE: post every part in list order; the point-to-point parts go out together as one batch."""
    if run.backend is None:
        raise run.fault(index, "an exchange needs the process group, and none is joined (torch.distributed."
                               "init_process_group)")
    post_exchange(run, action, index, run.open, PART_POSTERS, fault=run.fault,
                  refusal="a sequence ring's exchange cannot hold")


def exchange_wait(run: _RingRank, action: Action, index: int) -> None:
    """EXCHANGE_WAIT: wait for every part of exchange ``mb``, then take what arrived."""
    wait_exchange(action, index, run.open, run.row, fault=run.fault, site=run.site, wait=run.wait_works)


# part op -> its poster (run, part, exchange) -> None; every point-to-point part on the default group
PART_POSTERS: dict[str, PartHandler] = {
    ops.SEND_KV: _send_kv,
    ops.RECV_KV: _recv_kv,
    ops.SEND_DKV: _send_dkv,
    ops.RECV_DKV: _recv_dkv,
    ops.ALLTOALL_KV: _post_all_to_all,
    ops.ALLTOALL_DKV: _post_all_to_all,
}
HANDLERS: dict[str, Callable[[_RingRank, Action, int], None]] = {
    ops.AF: attention_forward,
    ops.AB: attention_backward,
    ops.EXCHANGE: exchange,
    ops.EXCHANGE_WAIT: exchange_wait,
}


__all__ = ["HANDLERS", "PART_POSTERS", "RingAttention", "RingContext", "RingResult", "chunk_length", "forward_end",
           "own_chunks", "run_ring_attention", "token_positions", "wait_within"]
