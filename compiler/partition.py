"""PipeDream's partitioner: cut a model's layers into pipeline stages, replicating the slow ones, so that
the slowest stage is as fast as it can be; and the partition file that records the cut, which
``pipec run --partition FILE`` cuts a model given by its layers by (``runtime/layered.py``).

Contract: ``partition(layers, ranks, costs, memory_limit, replicate)`` reads, per layer (a cost
file's ``layers``, ``costs.LayerCost``), its compute time F + B and the bytes of its output and of
its parameters, and from the rest of the cost file the links and the all-reduce link (all free when
the file does not give them). It returns the ``Partition`` of L layers over P ranks: stages in
pipeline order, each a non-empty range of consecutive layers, together every layer once; stage k on
r_k >= 1 contiguous ranks (its replicas, data parallel inside the pipeline), every rank used. It is
the fastest (least slowest-stage time, ``stage_time``) whose every rank fits the memory limit
(``stage_memory``, ``in_flight``); among equally fast ones, the one with fewest stages, then
earliest cuts, then fewest replicas in the earlier stages. The search is a dynamic program over
suffixes (``_Search``); a problem over ``MAX_MOVES`` is refused rather than left running.
docs/costs.md, "Partition it", states the cost and memory model and the file format.

The partition file: ``partition_to_json`` writes it, ``load_partition`` is the one reader of it
(the runtime's too), through the guarded reader, every field checked and every mistake an error
that names the file and the key (``part.json: stages[2].layers: ...``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, NamedTuple, Sequence

from pipec.compiler.costs import CostModel, FieldReader, LayerCost, Number, exact_ratio, ring_allreduce_time
from pipec.compiler.guarded_read import PARTITION, checked_total, json_type, quote, read_json
from pipec.errors import UsageError

# The partition file: {"format": FORMAT, "version": VERSION, ...} (``partition_to_json``).
FORMAT = "pipec partition"
VERSION = 1
_FILE_KEYS = ("format", "version", "layers", "ranks", "names", "stages", "time_per_microbatch")
_STAGE_KEYS = ("layers", "replicas", "ranks", "time", "memory")

# Copies of a stage's parameters each of its ranks holds: the weights and their gradients.
WEIGHT_COPIES = 2

# The most moves one pass of the dynamic program may make (about 1.3 microseconds each in CPython: some
# seconds a pass, and there are two or three): a bigger problem is refused before it starts rather than
# left running.
MAX_MOVES = 10_000_000


@dataclass(frozen=True)
class PartitionStage:
    """One stage of a partition.

    Attributes:
        first: its first layer.
        stop: one past its last layer.
        replicas: how many ranks run it (round robin over the microbatches).
        ranks: those ranks, consecutive.
        time: its time per microbatch (time_k: ``stage_time``).
        memory: the bytes each of its ranks holds (memory_k: ``stage_memory``).
    """

    first: int
    stop: int
    replicas: int
    ranks: tuple[int, ...]
    time: Number
    memory: Number


@dataclass(frozen=True)
class Partition:
    """A cut of a model's layers into stages over ranks (``partition``, ``load_partition``).

    Attributes:
        layers: the model's layer count L.
        ranks: the rank count P (the sum of the stages' replicas).
        names: the layers' names, in order.
        stages: the stages in pipeline order, covering layers 0 .. L - 1.
        time_per_microbatch: the predicted steady-state time per microbatch, the slowest stage's time.
    """

    layers: int
    ranks: int
    names: tuple[str, ...]
    stages: tuple[PartitionStage, ...]
    time_per_microbatch: Number

    @property
    def cut(self) -> tuple[tuple[int, int], ...]:
        """Per stage (chunk), its layers as (first, stop): what ``costs.roll_up`` and ``runtime/layered.py`` take."""
        return tuple((stage.first, stage.stop) for stage in self.stages)

    @property
    def replicas(self) -> tuple[int, ...]:
        """Each stage's replica count."""
        return tuple(stage.replicas for stage in self.stages)


# ------------------------------------------------------------------ the cost model


def in_flight(replicas: Sequence[int]) -> tuple[int, ...]:
    """How many microbatches one replica of each stage keeps at once (i_k of memory_k).

    That is what the schedule ``partition_schedule`` writes lets a rank keep, and what its steady
    state needs to run at the slowest stage's rate whatever the stages cost.

    Args:
        replicas: each stage's replica count, in pipeline order.
    Returns:
        i_k per stage: 1 for the last; 1 + ceil(r_{k+1} i_{k+1} / r_k) before it
        (1F1B's S - k when no stage is replicated).
    """
    counts: list[int] = []
    downstream = 0  # microbatches in flight after the stage, over all the next stage's replicas
    for count_of_replicas in reversed(replicas):
        counts.append(_kept(downstream, count_of_replicas))
        downstream = count_of_replicas * counts[-1]
    return tuple(reversed(counts))


def _kept(downstream: int, replicas: int) -> int:
    """i_k from r_{k+1} i_{k+1} (``downstream``; 0 after the last stage) and r_k: one more than a replica's share."""
    return 1 + -(-downstream // replicas)


def stage_time(compute: Number, parameters: Number, boundary: Number | None, replicas: int, last_rank: int,
               costs: CostModel) -> Number:
    """A stage's time per microbatch: max(compute / r, allreduce(parameters, r), 2 link(boundary)).

    PipeDream's model (the review's T(i -> j, m) and the cut term of its dynamic program):
    each replica runs every r-th microbatch (round robin); the replicas' gradient all-reduce is a
    ring over the ``allreduce`` link (``costs.ring_allreduce_time``); the cut after the stage's last
    layer carries its activation forward and its gradient back, both over the link between the
    stage's last rank and the next stage's first (``CostModel.link_between``). Communication
    overlaps computation, the link being a resource of the pipeline like a stage, so the cut
    enters the maximum (PipeDream's 2 C_j), counted against the stage that sends the activation,
    and replication does not divide it. docs/costs.md, "Partition it", states it for users.

    Args:
        compute: the sum of its layers' F + B.
        parameters: the sum of its layers' parameter bytes.
        boundary: the activation bytes of its last layer's output, or None for the last stage.
        replicas: its replica count r.
        last_rank: its last rank; the next stage starts at the one after.
        costs: the links and the all-reduce link.
    Returns:
        time_k, the stage's time per microbatch.
    """
    time = max(exact_ratio(compute, replicas), ring_allreduce_time(costs.allreduce_link, replicas, parameters))
    if boundary is not None:
        # the activation forward and its gradient back, each over the same (symmetric) link
        time = max(time, 2 * costs.link_between(last_rank, last_rank + 1).time(boundary))
    return time


def stage_memory(parameters: Number, activations: Number, microbatches: int) -> Number:
    """The bytes a rank of a stage holds: ``WEIGHT_COPIES`` of its parameters and ``microbatches``
    microbatches' activations (the sum of its layers' outputs for one)."""
    return WEIGHT_COPIES * parameters + microbatches * activations


# ------------------------------------------------------------------ the search


class _Head(NamedTuple):
    """A suffix's first stage, as the dynamic program tries it."""

    stop: int
    replicas: int
    time: Number
    memory: Number | None  # None when no memory limit is tracked
    downstream: int  # replicas x in-flight microbatches: what decides the previous stage's i


# How a pass scores a suffix: (score of the empty suffix, join(head, score of the rest)); lower is better.
_Scoring = tuple[Any, Callable[[_Head, Any], Any]]
_FASTEST: _Scoring = (0, lambda head, rest: max(head.time, rest))
_SMALLEST: _Scoring = (0, lambda head, rest: max(head.memory, rest))
# fewest stages, then the list of (stop, replicas) smallest: the head's own comes first
_SHORTEST: _Scoring = ((0, ()), lambda head, rest: (rest[0] + 1, ((head.stop, head.replicas),) + rest[1]))


class _Search:
    """The dynamic program over suffixes, one pass per ``best`` call.

    State (j, m) is "layers j .. L-1 on the last m ranks" (whose first rank is P - m, so the
    links of each cut are known), and a move picks the suffix's first stage, layers j .. i-1 on r
    of the m ranks. ``partition`` runs three passes of the same recursion, each O(L^2 P^2) moves
    (O(L^2 P) without replication): the least slowest-stage time, the fewest-stages-earliest-cuts
    partition among those that reach it, and, when no partition fits the memory limit, the least
    memory that would. A memory limit adds the first stage's downstream in-flight count r_k i_k
    to the state (it decides i of the stage before), at most 2P values, so the moves grow by that
    factor.
    """

    def __init__(self, layers: Sequence[LayerCost], ranks: int, costs: CostModel, replicate: bool,
                 track_memory: bool):
        self.layers, self.ranks, self.costs = layers, ranks, costs
        self.replicate, self.track_memory = replicate, track_memory

    def replica_choices(self, ranks_left: int, stop: int) -> Sequence[int]:
        """The replica counts a suffix's first stage may take: all the ranks when it ends the model,
        else at least one rank left for the rest; always 1 without replication."""
        if stop == len(self.layers):
            return (ranks_left,) if self.replicate or ranks_left == 1 else ()
        if not self.replicate:
            return (1,) if ranks_left > 1 else ()
        return range(1, ranks_left)

    def moves(self) -> int:
        """How many moves one pass makes, at most."""
        layers, ranks = len(self.layers), self.ranks
        per_state = ranks if self.replicate else 1
        keys = 2 * ranks if self.track_memory and self.replicate else 1
        return layers * (layers + 1) // 2 * ranks * per_state * keys

    def best(self, scoring: _Scoring, admit: Callable[[_Head], bool]) -> Any:
        """The least score of a whole partition whose every stage ``admit`` accepts, or None when none is."""
        layers, ranks = self.layers, self.ranks
        count = len(layers)
        empty, join = scoring
        # table[j][m]: downstream count of the first stage (0 when memory is not tracked) -> best score of a
        # partition of layers j .. count-1 over the last m ranks
        table: list[list[dict[int, Any]]] = [[{} for _ in range(ranks + 1)] for _ in range(count + 1)]
        table[count][0] = {0: empty}
        for first in range(count - 1, -1, -1):
            for ranks_left in range(1, ranks + 1):
                row = table[first][ranks_left]
                start = ranks - ranks_left
                compute = parameters = activations = 0
                for stop in range(first + 1, count + 1):
                    layer = layers[stop - 1]
                    # summed from the left as sum() does, so the partition's times are these, bit for bit
                    compute += layer.time
                    parameters += layer.parameters
                    activations += layer.activation
                    boundary = layer.activation if stop < count else None
                    for replicas in self.replica_choices(ranks_left, stop):
                        rest = table[stop][ranks_left - replicas]
                        if not rest:
                            continue
                        time = stage_time(compute, parameters, boundary, replicas, start + replicas - 1, self.costs)
                        for downstream, rest_score in rest.items():
                            keep = _kept(downstream, replicas)
                            memory = stage_memory(parameters, activations, keep) if self.track_memory else None
                            head = _Head(stop, replicas, time, memory, replicas * keep if self.track_memory else 0)
                            if not admit(head):
                                continue
                            score = join(head, rest_score)
                            if head.downstream not in row or score < row[head.downstream]:
                                row[head.downstream] = score
        scores = table[0][ranks].values()
        return min(scores) if scores else None

    def assemble(self, cuts: Sequence[tuple[int, int]], names: tuple[str, ...]) -> Partition:
        """The partition whose stages end at and are replicated as ``cuts``: (stop, replicas) per stage."""
        layers = self.layers
        keeps = in_flight([replicas for _, replicas in cuts])
        stages, first, rank = [], 0, 0
        for (stop, replicas), keep in zip(cuts, keeps):
            span = layers[first:stop]
            boundary = layers[stop - 1].activation if stop < len(layers) else None
            parameters = sum(layer.parameters for layer in span)
            time = stage_time(sum(layer.time for layer in span), parameters, boundary, replicas,
                              rank + replicas - 1, self.costs)
            memory = stage_memory(parameters, sum(layer.activation for layer in span), keep)
            # the partition file holds them: a total that overflowed (or an int past 2^63) is named, never written
            what = f"stage {len(stages)} (layers {first}..{stop - 1})"
            checked_total(time, f"{what}'s time per microbatch", self.costs.source)
            checked_total(memory, f"{what}'s memory per rank", self.costs.source)
            stages.append(PartitionStage(first, stop, replicas, tuple(range(rank, rank + replicas)), time, memory))
            first, rank = stop, rank + replicas
        return Partition(len(layers), self.ranks, names, tuple(stages), max(stage.time for stage in stages))


def partition(layers: Sequence[LayerCost], ranks: int, costs: CostModel | None = None, *,
              memory_limit: Number | None = None, replicate: bool = False) -> Partition:
    """Cut ``layers`` into stages over ``ranks`` ranks, the slowest stage as fast as it can be.

    Args:
        layers: the model's layers in order (a cost file's ``layers``).
        ranks: P, the ranks to use, every one.
        costs: the links and the all-reduce link (the rest of the cost file); None: all free.
        memory_limit: the most bytes a rank may hold (``stage_memory``); None: no limit.
        replicate: whether a stage may run on several ranks.
    Returns:
        the partition the module docstring describes: the fastest that fits, ties broken by
        fewest stages, then earliest cuts, then fewest replicas early.
    Raises:
        UsageError: no layers, fewer than one rank, more ranks than layers without
            replication, a problem too large to search (``MAX_MOVES``), or a memory limit no
            partition fits (naming the smallest that would).
        NumberLimitError: a stage's time or memory past what a partition file holds (a float not
            finite, an integer past 2^63), naming the cost file (``guarded_read.checked_total``).
    """
    costs = CostModel.unit() if costs is None else costs
    if not layers:
        raise UsageError("there are no layers to partition")
    if ranks < 1:
        raise UsageError(f"a partition needs at least one rank, got {ranks}")
    if not replicate and ranks > len(layers):
        raise UsageError(f"{ranks} ranks need at least {ranks} layers without replication, and the model has "
                         f"{len(layers)}: use fewer ranks, or let stages be replicated (--replicate)")
    search = _Search(layers, ranks, costs, replicate, track_memory=memory_limit is not None)
    if search.moves() > MAX_MOVES:
        raise UsageError(f"partitioning {len(layers)} layers over {ranks} ranks takes about {search.moves():,} steps, "
                         f"more than the {MAX_MOVES:,} pipec takes on: use fewer layers (merge some) or ranks")

    def fits(head: _Head) -> bool:
        return memory_limit is None or head.memory <= memory_limit

    fastest = search.best(_FASTEST, fits)
    if fastest is None:  # only a memory limit makes every partition infeasible
        smallest = search.best(_SMALLEST, lambda head: True)
        replication = "with" if replicate else "without"
        raise UsageError(f"no partition of {len(layers)} layers over {ranks} ranks ({replication} replication) fits "
                         f"a memory limit of {memory_limit} bytes per rank: the smallest limit that fits is "
                         f"{smallest} bytes")
    _, cuts = search.best(_SHORTEST, lambda head: head.time <= fastest and fits(head))
    return search.assemble(cuts, tuple(layer.name for layer in layers))


# ------------------------------------------------------------------ the partition file


def partition_to_json(part: Partition) -> dict[str, Any]:
    """The partition file's JSON value (``load_partition`` reads it back)::

        {"format": "pipec partition", "version": 1, "layers": L, "ranks": P,
         "names": [...], "stages": [{"layers": [first, stop], "replicas": r,
         "ranks": [...], "time": t, "memory": bytes}, ...], "time_per_microbatch": T}
    """
    return {
        "format": FORMAT,
        "version": VERSION,
        "layers": part.layers,
        "ranks": part.ranks,
        "names": list(part.names),
        "stages": [{"layers": [stage.first, stage.stop], "replicas": stage.replicas, "ranks": list(stage.ranks),
                    "time": stage.time, "memory": stage.memory} for stage in part.stages],
        "time_per_microbatch": part.time_per_microbatch,
    }


def partition_from_json(data: Any, path: str = "<partition>") -> Partition:
    """A partition from its file's JSON value, every field checked.

    Args:
        data: the parsed file (``partition_to_json``'s form).
        path: the file's name, for messages.
    Returns:
        the ``Partition``.
    Raises:
        UsageError: ``FILE: KEY: problem`` for an unknown or missing key, another format or
            version, a value of the wrong type or range, names that are not one per layer,
            stages that are not consecutive or do not cover the layers, ranks that are not
            the next ``replicas`` ones, replicas that do not add up to the ranks, or a time per
            microbatch that is not the slowest stage's.
    """
    reader = FieldReader(path, UsageError)
    top = reader.fields(data, "top level", _FILE_KEYS)
    if top["format"] != FORMAT:
        raise reader.fail("format", f"expected {quote(FORMAT)} (a file `pipec partition -o` writes), "
                                    f"got {json_type(top['format'])}")
    version = reader.integer(top["version"], "version", low=1)
    if version != VERSION:
        raise reader.fail("version", f"this pipec reads version {VERSION}, got {version}")
    layer_count = reader.integer(top["layers"], "layers", low=1)
    rank_count = reader.integer(top["ranks"], "ranks", low=1)
    names = reader.array(top["names"], "names")
    if len(names) != layer_count:
        raise reader.fail("names", f"expected one name per layer, {layer_count}, got {len(names)}")
    names = tuple(reader.name(name, f"names[{index}]") for index, name in enumerate(names))
    stages, layer, rank = [], 0, 0
    for index, entry in enumerate(reader.array(top["stages"], "stages")):
        stages.append(_stage(reader, entry, f"stages[{index}]", layer, rank, layer_count, rank_count))
        layer, rank = stages[-1].stop, rank + stages[-1].replicas
    if layer != layer_count:
        raise reader.fail(f"stages[{len(stages) - 1}].layers",
                          f"the last stage stops at layer {layer}, but the model has {layer_count} layers: the stages "
                          "must hold every layer")
    if rank != rank_count:
        raise reader.fail("stages", f"the stages' replicas add up to {rank} ranks, and the partition is for "
                                    f"{rank_count}: every rank holds a stage")
    time_per_microbatch = reader.number(top["time_per_microbatch"], "time_per_microbatch", limited=False)
    slowest = max(stage.time for stage in stages)
    if time_per_microbatch != slowest:
        raise reader.fail("time_per_microbatch", f"{time_per_microbatch} is not the slowest stage's time, {slowest}")
    return Partition(layer_count, rank_count, names, tuple(stages), time_per_microbatch)


def _stage(reader: FieldReader, value: Any, key: str, first: int, rank: int, layer_count: int,
           rank_count: int) -> PartitionStage:
    """Stage ``key`` of a partition file, which must start at layer ``first`` and rank ``rank``."""
    given = reader.fields(value, key, _STAGE_KEYS)
    bounds = reader.array(given["layers"], f"{key}.layers")
    if len(bounds) != 2:
        raise reader.fail(f"{key}.layers", f"expected [first, stop], got {len(bounds)} values")
    start = reader.integer(bounds[0], f"{key}.layers[0]")
    stop = reader.integer(bounds[1], f"{key}.layers[1]")
    if start != first:
        where = "the first stage must start at layer 0" if first == 0 else \
            f"the stage before stops at layer {first}, so this one must start there"
        raise reader.fail(f"{key}.layers", f"starts at layer {start}, but {where} (stages hold consecutive "
                                           "layers, in pipeline order)")
    if not start < stop <= layer_count:
        raise reader.fail(f"{key}.layers", f"expected [first, stop] with {start} < stop <= {layer_count} (stop is "
                                           f"exclusive; a stage holds at least one layer), got [{start}, {stop}]")
    replicas = reader.integer(given["replicas"], f"{key}.replicas", low=1, high=rank_count)
    held = [reader.integer(on, f"{key}.ranks[{at}]", high=rank_count - 1)
            for at, on in enumerate(reader.array(given["ranks"], f"{key}.ranks"))]
    if len(held) != replicas:
        raise reader.fail(f"{key}.ranks", f"expected one rank per replica, {replicas}, got {len(held)}: {held}")
    expected = list(range(rank, rank + replicas))
    if held != expected:
        raise reader.fail(f"{key}.ranks", f"expected the next {replicas} ranks, {expected}, got {held}: the stages "
                                          "run on consecutive ranks, in pipeline order")
    return PartitionStage(start, stop, replicas, tuple(held), reader.number(given["time"], f"{key}.time", limited=False),
                          reader.number(given["memory"], f"{key}.memory", limited=False))


def load_partition(path: str) -> Partition:
    """Read and check a partition file (``pipec partition -o``): the one reader of the format.

    Raises:
        UsageError: not a regular file, over ``guarded_read.PARTITION``'s limit, not JSON, or
            any mistake ``partition_from_json`` names.
    """
    return partition_from_json(read_json(path, PARTITION), path)


__all__ = [
    "FORMAT", "MAX_MOVES", "Partition", "PartitionStage", "VERSION", "WEIGHT_COPIES", "in_flight", "load_partition",
    "partition", "partition_from_json", "partition_to_json", "stage_memory", "stage_time",
]
