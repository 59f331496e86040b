"""Where a training step's rows come from: the one object every training path draws its batches through.

A model spec has exactly one data source (``ModelSpec.data_source``):

* ``synthetic_batch(config, step, N, seed) -> (inputs, targets)``: the whole
  batch of a step, N equal blocks of rows. Every rank draws it whole (a
  function of the step, cheap) and keeps the microbatches it needs.
* ``microbatch(config, step, m, N, seed) -> (inputs, targets)``: the rows of
  microbatch m alone. Called only for the microbatches this rank needs.
* ``dataset(config, seed) -> torch.utils.data.Dataset``: item i is one row
  ``(inputs, targets)`` of tensors. The rows form one endless stream: epoch e
  is the dataset in the order of the runtime's seeded shuffle
  (``torch.randperm`` from ``stream_seed(seed, SHUFFLE_DOMAIN + e)``), or of
  the spec's ``sampler(config, dataset, seed)``; stream position p is row
  ``p mod L`` of epoch ``p div L`` (L rows an epoch), so the stream wraps from
  one epoch into the next. Microbatch m of a step is ``R =
  microbatch_rows(config)`` consecutive positions (default
  ``config.microbatch_size``), stacked row by row (``torch.stack``). Only a
  rank that needs rows builds the dataset and reads items, and only the items
  of the microbatches it needs.

What a rank needs comes from its program (``data_needs``): the inputs of the
microbatches its first stages run forward, the targets of those its last
stages run forward. ``BatchSource.batch(step)`` leaves every other entry None.
``BatchSource``'s docstring says why every rank draws the same rows without
communicating, and how a checkpoint saves and restores the data position.

A rank of a stage placed on a group of k ranks (``mesh_placement.place_on_mesh``) is
given its ``share`` (i, k): it keeps rows [i*b/k, (i+1)*b/k) of each
microbatch of b rows, so that the group runs every microbatch whole and one
process with the same N stays the reference (``rows_share``). A member of a
context-parallel group (PP x CP) keeps every row instead, and of each sequence
(dimension 1) the tokens of its ring rank's chunks (``TokenShare``, ``tokens_share``).
"""
from __future__ import annotations

import operator
from typing import Any, NamedTuple

import torch
from torch.utils.data import IterableDataset

from pipec.compiler import ops
from pipec.compiler.ir import Program, stage_tables
from pipec.errors import UsageError
from pipec.runtime.family import runtime_family
from pipec.runtime.model import ModelSpec, call_spec_function, spec_label, split_microbatches, stream_seed

# Streams of the data order, apart from the parameters' and the synthetic
# task's (model.py's owners and domains lie below 2**42): the runtime's
# shuffle of epoch e, and torch's global generator while a user's sampler
# draws epoch e (so a sampler that draws from it, as RandomSampler does, gives
# every rank the same order).
SHUFFLE_DOMAIN = 1 << 42
SAMPLER_DOMAIN = 1 << 43
# The compute ops that run a stage forward: those that make its activation
# (F; a recomputing forward such as a checkpointed one too).
_FORWARDS = frozenset(ops.producers("act"))


class TokenShare(NamedTuple):
    """A context-parallel member's share of each sequence (``rings.token_positions``).

    Attributes:
        positions: the global positions of its tokens along dimension 1 (LongTensor, CPU), its ring rank's
            chunks in ascending order.
        seq_len: the length every sequence has (the model's ``ring_model(config).seq_len``).
    """

    positions: torch.Tensor
    seq_len: int


class Needs(NamedTuple):
    """The microbatches whose inputs and whose targets a rank reads in a step.

    Attributes:
        inputs: microbatches a first stage of this rank runs forward.
        targets: microbatches a last stage of this rank runs forward (the loss).
    """

    inputs: frozenset[int]
    targets: frozenset[int]


def batch_microbatches(program: Program) -> int:
    """The microbatch count N of the batches ``program`` trains on: its own, or 1 for a sequence ring
    (one whole batch a step, cut along the sequence instead)."""
    return 1 if runtime_family(program).reads_whole_batch else program.num_microbatches


def data_needs(program: Program, rank: int) -> Needs:
    """What ``rank`` reads of each step's batch when it runs ``program``.

    A forward (a compute op whose rule makes the stage's activation,
    ``ops.producers("act")``) of a stage with no previous stage reads its
    microbatch's inputs; of a stage with no next stage, its targets (the
    loss). Activation and weight passing alike; a sequence ring's every rank
    reads the whole batch (microbatch 0 of 1).

    Args:
        program: the compiled program.
        rank: a rank of it.
    Returns:
        ``Needs(inputs, targets)``, sets of microbatch indices.
    """
    if runtime_family(program).reads_whole_batch:
        whole = frozenset({0})
        return Needs(whole, whole)
    tables = stage_tables(program)
    inputs: set[int] = set()
    targets: set[int] = set()
    for action in program.ranks[rank]:
        if action.op in _FORWARDS:
            if tables.prev[action.stage] < 0:
                inputs.add(action.mb)
            if tables.next[action.stage] < 0:
                targets.add(action.mb)
    return Needs(frozenset(inputs), frozenset(targets))


class BatchSource:
    """The batches of a training run, drawn from a model spec's data source (see the module docstring).

    Determinism and the data position. Every rank computes the same rows for the
    same step without communicating: the rows of step k are a pure function of k
    and of the position the source started from, ``(step s0, stream row r0)``
    (``(0, 0)`` for a new run): for a dataset, step k's first stream position is
    ``r0 + (k - s0) * N * R``; the function sources depend on k alone.
    ``state_after(k)`` says where the stream stands after k steps and
    ``restore(state)`` makes a new source continue from there exactly, which is
    what a checkpoint saves and a resume loads.

    Args:
        spec: the model spec.
        config: its config, overrides applied.
        seed: the run's seed.
        num_microbatches: N, the microbatches of one step (``batch_microbatches``).
        needs: what this rank reads (``data_needs``); None: everything (the
            one-process reference).
        device: where the tensors go (``.to(device)``); None: where the source made them.
        name: how messages name the spec (``--model``'s text).
        share: (i, k): keep share i of k of each microbatch's rows (``rows_share``); None: every row.
        tokens: keep these tokens of every sequence (``tokens_share``); None: every token.
    Raises:
        UsageError: a dataset source's ``microbatch_rows(config)`` that fails
            or is not a positive int (it is asked at once, on every rank: the
            data position counts rows).
        ValueError: N < 1, or a need outside 0 .. N - 1 (a caller's bug).
    """

    def __init__(self, spec: ModelSpec, config: Any, seed: int, num_microbatches: int,
                 needs: tuple[frozenset[int], frozenset[int]] | None = None, *,
                 device: torch.device | str | None = None, name: str = "", share: tuple[int, int] | None = None,
                 tokens: TokenShare | None = None):
        if num_microbatches < 1:
            raise ValueError(f"num_microbatches must be at least 1, got {num_microbatches}")
        every = frozenset(range(num_microbatches))
        self.needs = Needs(every, every) if needs is None else Needs(frozenset(needs[0]), frozenset(needs[1]))
        if not self.needs.inputs <= every or not self.needs.targets <= every:
            raise ValueError(f"needs {self.needs} name microbatches outside 0 .. {num_microbatches - 1}")
        self.spec, self.config, self.seed, self.num_microbatches = spec, config, seed, num_microbatches
        self.source = spec.data_source
        self.device = device
        self.name = name
        self.share, self.tokens = share, tokens
        self.rows_per_microbatch = self._microbatch_rows() if self.source == "dataset" else None
        self._origin = (0, 0)  # (step, stream row) the source continues from
        self._stream: _RowStream | None = None  # built at the first read

    # -- the batches ---------------------------------------------------------

    def batch(self, step: int) -> tuple[list[torch.Tensor | None], list[torch.Tensor | None]]:
        """The rows of 0-based global training step ``step``, cut into microbatches.

        Args:
            step: the step, counted from 0 over the whole training (not from a
                resume); at least the step ``restore`` continued from.
        Returns:
            (inputs, targets): two lists of N entries; entry m is microbatch
            m's tensor where this rank needs it (``needs``), else None.
        Raises:
            UsageError: the data source fails or returns data of the wrong
                form (``model spec NAME: ... (the batch of training step K)``,
                K = step + 1 as the loss lines count).
            ValueError: ``step`` is not an int at or after the restored step.
        """
        self._check_step(step)
        count = self.num_microbatches
        inputs: list[torch.Tensor | None] = [None] * count
        targets: list[torch.Tensor | None] = [None] * count
        wanted = sorted(self.needs.inputs | self.needs.targets)
        try:
            if self.source == "synthetic_batch":
                pieces = self._synthetic(step)
                rows = {m: pieces[m] for m in wanted}
            elif self.source == "microbatch":
                rows = {m: self._microbatch(step, m) for m in wanted}
            else:
                rows = self._dataset_rows(step, wanted)
        except UsageError as error:  # say when: a bad row may lie deep in a long run
            raise UsageError(f"{error} (the batch of training step {step + 1})") from None
        for m, (x, y) in rows.items():
            if self.share is not None:
                x, y = (rows_share(t, self.share, f"{label} of microbatch {m} of step {step + 1}", self.name)
                        for t, label in ((x, "the inputs"), (y, "the targets")))
            if self.tokens is not None:
                x, y = (tokens_share(t, self.tokens, f"{label} of microbatch {m} of step {step + 1}", self.name)
                        for t, label in ((x, "the inputs"), (y, "the targets")))
            if m in self.needs.inputs:
                inputs[m] = x if self.device is None else x.to(self.device)
            if m in self.needs.targets:
                targets[m] = y if self.device is None else y.to(self.device)
        return inputs, targets

    def _synthetic(self, step: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The whole batch from ``synthetic_batch``, cut into its N equal row blocks."""
        count = self.num_microbatches
        what = f"synthetic_batch(config, {step}, {count}, seed)"
        whole = _pair(call_spec_function(self.name, what, self.spec.synthetic_batch,
                                         self.config, step, count, self.seed), what, self.name)
        for label, tensor in zip(("inputs", "targets"), whole):
            rows = tensor.shape[0] if tensor.dim() else 0
            if rows == 0 or rows % count:
                raise UsageError(f"{spec_label(self.name)}: {what} returned {label} of {rows} rows, which do not "
                                 f"cut into {count} equal microbatches")
        return split_microbatches(whole, count)

    def _microbatch(self, step: int, m: int) -> tuple[torch.Tensor, torch.Tensor]:
        what = f"microbatch(config, {step}, {m}, {self.num_microbatches}, seed)"
        return _pair(call_spec_function(self.name, what, self.spec.microbatch, self.config, step, m,
                                        self.num_microbatches, self.seed), what, self.name)

    def _dataset_rows(self, step: int, wanted: list[int]) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
        """Microbatch m (for m in ``wanted``): its R stream positions' items, stacked."""
        if not wanted:
            return {}
        if self._stream is None:
            self._stream = _RowStream(self.spec, self.config, self.seed, self.name)
        rows = self.rows_per_microbatch
        first = self._row_of(step)
        self._stream.forget_before(first + wanted[0] * rows)
        out = {}
        for m in wanted:
            items = [self._stream.item(first + m * rows + j) for j in range(rows)]
            out[m] = tuple(self._stack([item[part] for item in items], [item[0] for item in items], step, m, label)
                           for part, label in ((1, "inputs"), (2, "targets")))
        return out

    def _stack(self, tensors: list[torch.Tensor], indices: list[int], step: int, m: int, label: str) -> torch.Tensor:
        try:
            return torch.stack(tensors)
        except RuntimeError as error:  # rows of different shapes or dtypes
            shown = ", ".join(map(str, indices[:8])) + (", ..." if len(indices) > 8 else "")
            raise UsageError(f"{spec_label(self.name)}: the {label} of microbatch {m} of step {step} (dataset "
                             f"items {shown}) do not stack into one tensor: {error}") from None

    def _microbatch_rows(self) -> int:
        if self.spec.microbatch_rows is not None:
            rows = call_spec_function(self.name, "microbatch_rows(config)", self.spec.microbatch_rows, self.config)
            what = "microbatch_rows(config)"
        else:
            rows = getattr(self.config, "microbatch_size", None)
            what = "config.microbatch_size"
            if rows is None:
                raise UsageError(f"{spec_label(self.name)}: its dataset needs the rows of a microbatch: give the "
                                 "spec microbatch_rows(config), or its config a microbatch_size")
        if isinstance(rows, bool) or not isinstance(rows, int) or rows < 1:
            raise UsageError(f"{spec_label(self.name)}: {what} is {rows!r}; rows per microbatch must be an int >= 1")
        return rows

    # -- the data position ----------------------------------------------------

    def state_after(self, steps_done: int) -> dict[str, Any]:
        """Where the data stand once steps ``0 .. steps_done - 1`` are done: what a checkpoint saves.

        Args:
            steps_done: steps finished, counted from 0 over the whole training;
                at least the step ``restore`` continued from.
        Returns:
            a JSON-able dict: ``{"source": NAME, "steps": steps_done}`` with
            NAME the data source (``synthetic_batch``, ``microbatch`` or
            ``dataset``); for a dataset also ``"rows"``: the stream positions
            consumed, i.e. the position step ``steps_done`` starts at. The same
            on every rank, whatever it needs (nothing is read to make it).
        Raises:
            ValueError: ``steps_done`` is not an int at or after the restored step.
        """
        self._check_step(steps_done)
        state: dict[str, Any] = {"source": self.source, "steps": steps_done}
        if self.source == "dataset":
            state["rows"] = self._row_of(steps_done)
        return state

    def restore(self, state: dict[str, Any]) -> None:
        """Continue from a position ``state_after`` gave: what a resume loads.

        After ``restore(source.state_after(k))`` on a new source of the same
        spec, config and seed, ``batch(j)`` for every ``j >= k`` returns what
        ``batch(j)`` of the uninterrupted run returns. For a dataset that holds
        with another N or microbatch size too: step k starts at the saved row
        and later steps follow on in the stream. A user's sampler is then
        made again and its epochs drawn in order up to the saved one, so a
        sampler that keeps state between epochs continues exactly as well.

        Args:
            state: ``state_after``'s dict (as loaded from JSON).
        Raises:
            UsageError: not such a dict (keys other than ``source``, ``steps``
                and, for a dataset, ``rows``; counts that are not ints >= 0),
                or a position saved from another kind of data source.
        """
        label = spec_label(self.name)
        expected = {"source", "steps"} | ({"rows"} if self.source == "dataset" else set())
        if not isinstance(state, dict) or set(state) != expected:
            found = sorted(map(str, state)) if isinstance(state, dict) else type(state).__name__
            raise UsageError(f"{label}: a data position of a {self.source} source holds "
                             f"{', '.join(sorted(expected))}; got {found}")
        if state["source"] != self.source:
            raise UsageError(f"{label}: the data position was saved from a {state['source']!r} data source, "
                             f"and this spec's data come from {self.source}")
        counts = {key: state[key] for key in sorted(expected - {"source"})}
        for key, value in counts.items():
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise UsageError(f"{label}: the data position's {key} is {value!r}, not an int >= 0")
        self._origin = (counts["steps"], counts.get("rows", 0))
        if self._stream is not None:
            self._stream.restart()

    def _row_of(self, step: int) -> int:
        """The stream position step ``step`` starts at (a dataset source)."""
        origin_step, origin_row = self._origin
        return origin_row + (step - origin_step) * self.num_microbatches * self.rows_per_microbatch

    def _check_step(self, step: int) -> None:
        if isinstance(step, bool) or not isinstance(step, int) or step < self._origin[0]:
            raise ValueError(f"step must be an int >= {self._origin[0]} (the step the data continue from), "
                             f"got {step!r}")


def rows_share(tensor: torch.Tensor, share: tuple[int, int], what: str, name: str) -> torch.Tensor:
    """Share i of k of ``tensor``'s rows: rows [i*b/k, (i+1)*b/k) of its b.

    Raises:
        UsageError: b does not divide by k (every member must run an equal share, or the group's summed
            gradient would weigh the members' rows unequally).
    """
    member, members = share
    rows = tensor.shape[0] if tensor.dim() else 0
    if rows == 0 or rows % members:
        raise UsageError(f"{spec_label(name)}: {what} has {rows} rows, which do not split into the {members} "
                         f"equal shares of a stage's group of {members} ranks (give a microbatch a multiple of "
                         f"{members} rows: --config microbatch_size=... where the model's config has it, as the "
                         "built-in model's does)")
    piece = rows // members
    return tensor[member * piece:(member + 1) * piece]


def tokens_share(tensor: torch.Tensor, tokens: TokenShare, what: str, name: str) -> torch.Tensor:
    """The member's tokens of every sequence of ``tensor`` (dimension 1, ``tokens.seq_len`` long).

    Raises:
        UsageError: dimension 1 is not a sequence of ``seq_len`` (the tokens would not be the ones the ring
            and the positions the model is given name).
    """
    if tensor.dim() < 2 or tensor.shape[1] != tokens.seq_len:
        raise UsageError(f"{spec_label(name)}: {what} is {tuple(tensor.shape)}; a context-parallel stage cuts each "
                         f"sequence along dimension 1, which must be the model's seq_len {tokens.seq_len} "
                         "(ring_model(config))")
    return tensor[:, tokens.positions.to(tensor.device)]


def _pair(value: Any, what: str, name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``value`` as (inputs, targets), two tensors, or a usage error naming ``what`` returned it."""
    if isinstance(value, (tuple, list)) and len(value) == 2 and all(isinstance(v, torch.Tensor) for v in value):
        return value[0], value[1]
    kinds = (", ".join(type(v).__name__ for v in value) if isinstance(value, (tuple, list))
             else type(value).__name__)
    raise UsageError(f"{spec_label(name)}: {what} returned ({kinds}), not (inputs, targets): two tensors")


class _RowStream:
    """A dataset's rows as one endless stream: position p is item ``order(p // L)[p % L]``.

    The order of an epoch is the runtime's shuffle (a pure function of the
    seed and the epoch), or a user's sampler's indices. A sampler is drawn
    epoch after epoch from epoch 0, whichever positions a rank reads, so
    every rank draws it identically, a sampler that keeps state included;
    only the orders of the epochs still ahead are kept.
    """

    def __init__(self, spec: ModelSpec, config: Any, seed: int, name: str):
        self.spec, self.config, self.seed, self.name = spec, config, seed, name
        self.label = spec_label(name)
        self.dataset = call_spec_function(name, "dataset(config, seed)", spec.dataset, config, seed)
        if isinstance(self.dataset, IterableDataset) or not (
                hasattr(self.dataset, "__getitem__") and hasattr(self.dataset, "__len__")):
            raise UsageError(f"{self.label}: dataset(config, seed) returned a {type(self.dataset).__name__}, not a "
                             "map-style dataset (len(d) and d[i]): rows are read by their position")
        self.size = self._count(call_spec_function(name, "len(dataset)", len, self.dataset), "len(dataset)")
        self.orders: dict[int, Any] = {}
        self.floor = 0  # the earliest epoch still read: orders before it are dropped
        self.sampler = None
        self.next_epoch = 0  # a sampler's next epoch to draw
        if spec.sampler is not None:
            self.restart()
        self.length = self.size if self.sampler is None else len(self.order(0))

    def restart(self) -> None:
        """Forget every order; a user's sampler is made again, to be drawn from epoch 0."""
        self.orders.clear()
        self.next_epoch = 0
        if self.spec.sampler is not None:
            self.sampler = call_spec_function(self.name, "sampler(config, dataset, seed)", self.spec.sampler,
                                              self.config, self.dataset, self.seed)
            if not hasattr(self.sampler, "__iter__"):
                raise UsageError(f"{self.label}: sampler(config, dataset, seed) returned a "
                                 f"{type(self.sampler).__name__}, which cannot be iterated")

    def forget_before(self, position: int) -> None:
        """Reads go on from ``position``: drop the orders of the epochs before its own."""
        self.floor = position // self.length
        for old in [e for e in self.orders if e < self.floor]:
            del self.orders[old]

    def item(self, position: int) -> tuple[int, torch.Tensor, torch.Tensor]:
        """(dataset index, inputs, targets) at stream position ``position``."""
        epoch, offset = divmod(position, self.length)
        index = int(self.order(epoch)[offset])
        what = f"dataset[{index}]"
        row = call_spec_function(self.name, what, self.dataset.__getitem__, index)
        return (index, *_pair(row, what, self.name))

    def order(self, epoch: int):
        """The dataset indices of ``epoch``, in stream order (a tensor or a list)."""
        if epoch in self.orders:
            return self.orders[epoch]
        self.floor = min(self.floor, epoch)
        if self.sampler is None:  # random access: the shuffle is a pure function of (seed, epoch)
            generator = torch.Generator().manual_seed(stream_seed(self.seed, SHUFFLE_DOMAIN + epoch))
            self.orders[epoch] = torch.randperm(self.size, generator=generator)
            return self.orders[epoch]
        if epoch < self.next_epoch:  # drawn and dropped: draw again from epoch 0
            self.restart()
        while self.next_epoch <= epoch:  # every epoch in turn: a sampler may keep state between them
            drawn = self._sample(self.next_epoch)
            if self.next_epoch >= self.floor:
                self.orders[self.next_epoch] = drawn
            self.next_epoch += 1
        return self.orders[epoch]

    def _sample(self, epoch: int) -> list[int]:
        """The sampler's indices of ``epoch``: ``set_epoch(epoch)`` when it has one, then one pass, with torch's
        global generator seeded for the epoch (and restored after)."""
        sampler = self.sampler
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(stream_seed(self.seed, SAMPLER_DOMAIN + epoch))
            if callable(getattr(sampler, "set_epoch", None)):
                call_spec_function(self.name, f"sampler.set_epoch({epoch})", sampler.set_epoch, epoch)
            drawn = call_spec_function(self.name, f"iterating the sampler (epoch {epoch})", list, sampler)
        indices = []
        for value in drawn:
            try:
                index = operator.index(value)
            except TypeError:
                raise UsageError(f"{self.label}: the sampler yielded a {type(value).__name__} in epoch {epoch}, not "
                                 "an index (a batch sampler yields lists: give a sampler of single indices)") from None
            if not 0 <= index < self.size:
                raise UsageError(f"{self.label}: the sampler yielded index {index} in epoch {epoch}, outside the "
                                 f"dataset's {self.size} rows")
            indices.append(index)
        if not indices:
            raise UsageError(f"{self.label}: the sampler yielded no index in epoch {epoch}")
        if epoch > 0 and len(indices) != self.length:
            raise UsageError(f"{self.label}: the sampler yielded {len(indices)} indices in epoch {epoch} and "
                             f"{self.length} in epoch 0; every epoch must have as many (the stream is read by "
                             "position)")
        return indices

    def _count(self, value: Any, what: str) -> int:
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise UsageError(f"{self.label}: {what} is {value!r}; a dataset needs at least one row")
        return value


__all__ = ["SAMPLER_DOMAIN", "SHUFFLE_DOMAIN", "BatchSource", "Needs", "TokenShare", "batch_microbatches", "data_needs",
           "rows_share", "tokens_share"]
