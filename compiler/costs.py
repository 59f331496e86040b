"""The cost model the simulator prices a program with, and the reader of its JSON file.

A ``CostModel`` answers three questions: how long a compute task of a model
chunk takes (``compute``), how long a message takes between two ranks
(``transfer``, over ``link_between``) and how long a gradient all-reduce among
replicas takes (``allreduce``); it also carries the bytes of one value of each
size class (``sizes``), which memory is counted in. ``CostModel.unit()`` is the
model the design's facts are stated in: F = 1, B = 2, I = W = 1, every
communication free, all integers (so that bubble ratios come out as exact
fractions). ``load_costs`` and ``costs_from_json`` read a cost file into one;
``roll_up`` and ``rolled_up`` turn its per-layer costs (``layers``, which
``pipec profile`` measures) into per-chunk ones for a cut (``compiler.partition``).

The file format, every key with its defaults, is docs/costs.md ("Cost
files"). Every key is optional and an unknown key is an error, so that a typo
never silently falls back to a default; ``FieldReader`` names each mistake at
its key. Ranks here are devices (the ranks torchrun starts): the simulator maps
a program's ranks through ``Program.devices`` before it asks for a link.
Integers stay integers where the arithmetic allows it (``exact_ratio``), so an
all-integer file keeps exact results.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Mapping, NamedTuple, Sequence, Union

from pipec.compiler import ops as rules
from pipec.compiler.guarded_read import (
    COST_LIMIT, COST_LIMIT_TEXT, COSTS, INT_LIMIT, INT_LIMIT_TEXT, LIMITS_DOC, cost_number_problem, plain_int, quote,
    read_json,
)
from pipec.compiler.guarded_read import json_type as _json_type
from pipec.errors import CostFileError, NumberLimitError, PipecError, UsageError

Number = Union[int, float]
# A chunk or rank written as a JSON key: ASCII digits only.
_ASCII_DIGITS = re.compile(r"[0-9]+")

# The unit cost of every compute op (the design's facts are stated in these), from the rule table.
UNIT_COMPUTE: dict[str, Number] = dict(rules.UNIT_COSTS)
# The message kinds a link prices (``links.bytes``): the values that cross stages.
MESSAGE_KINDS = rules.MESSAGE_KINDS


# The keys of a ``layers`` entry, every one required, in LayerCost's field order.
LAYER_KEYS = ("name", "F", "B", "activation", "parameters")
# The most layers a cost file lists: the partitioner's work grows with the square of their number.
MAX_LAYERS = 4096
# The longest name of a layer (it is printed in tables and written into .pipe comments).
NAME_CHARS = 200

# whole op -> the ops it splits into (B -> (I, W)); a cost file that gives the
# whole but not a part prices the part at half the whole, and a measured run
# with the parts prices the whole as their sum.
SPLITS = rules.SPLITS

# compute op -> the op whose time it takes on a chunk when a cost file does not
# price it (FC and R: F, on the same chunk; ``ops.OpRule.priced_like``).
PRICED_LIKE: dict[str, str] = {op: rules.RULES[op].priced_like for op in UNIT_COMPUTE if rules.RULES[op].priced_like}

# The unit costs a model holds: every op's but those priced like another (the unit model prices FC and R
# at F's 1 through ``CostModel.compute``, so a file that gives F prices them too).
_PRICED_UNITS: dict[str, Number] = {op: cost for op, cost in UNIT_COMPUTE.items() if op not in PRICED_LIKE}

# What prices each op's category: the compute table (``UNIT_COMPUTE`` and the
# file's ``compute``), the links (messages; a batch per part), the all-reduce
# section, or nothing (a free, a wait for a collective).
_PRICED_BY = {
    rules.COMPUTE: "compute",
    rules.SEND: "links",
    rules.RECV: "links",
    rules.BATCH_OF: "links",
    rules.COLLECTIVE: "allreduce",
    rules.COLLECTIVE_WAIT: "free",
    rules.FREE: "free",
    # weight passing: an exchange's parts by the links (collectives as ring
    # steps over them), a wait, a fill (a local copy) and a drop cost nothing
    rules.EXCHANGE_OF: "links",
    rules.EXCHANGE_WAIT_OF: "free",
    rules.PART_SEND: "links",
    rules.PART_RECV: "links",
    rules.PART_COLLECTIVE: "links",
    rules.PART_LOCAL: "free",
    rules.DROP_COPY: "free",
}
rules.declare_pass("cost model", [
    op for op, rule in rules.RULES.items()
    if rule.category in _PRICED_BY and (rule.category != rules.COMPUTE or op in UNIT_COMPUTE)])


def exact_ratio(numerator: Number, denominator: Number) -> Number:
    """numerator / denominator, kept an int when both are ints and it divides."""
    if isinstance(numerator, int) and isinstance(denominator, int) and numerator % denominator == 0:
        return numerator // denominator
    return numerator / denominator


@dataclass(frozen=True)
class Link:
    """A point-to-point link.

    Attributes:
        latency: fixed time per message.
        bandwidth: bytes per time unit; None means infinite.
    """

    latency: Number = 0
    bandwidth: Number | None = None

    def time(self, nbytes: Number) -> Number:
        """Time to move ``nbytes`` over this link: latency + nbytes / bandwidth."""
        if self.bandwidth is None or not nbytes:
            return self.latency
        return self.latency + exact_ratio(nbytes, self.bandwidth)

    def overridden(self, latency: Number | None, bandwidth: Number | None) -> "Link":
        """This link with the given fields replaced (None keeps a field)."""
        return Link(self.latency if latency is None else latency, self.bandwidth if bandwidth is None else bandwidth)


def ring_allreduce_time(link: Link, members: int, nbytes: Number) -> Number:
    """Time of a ring all-reduce of ``nbytes`` among ``members`` over ``link``.

    Args:
        link: the link every step of the ring takes.
        members: how many take part; one (or none) costs nothing.
        nbytes: the bytes each member reduces.
    Returns:
        ``2 (n-1) latency + 2 (n-1)/n nbytes / bandwidth`` (no bandwidth: the latency term only).
    """
    if members <= 1:
        return 0
    steps = 2 * (members - 1)
    time = steps * link.latency
    if link.bandwidth is not None and nbytes:
        time += exact_ratio(steps * nbytes, members * link.bandwidth)
    return time


@dataclass(frozen=True)
class LayerCost:
    """One layer of a model, as a cost file's ``layers`` gives it (``pipec profile`` measures it).

    Attributes:
        name: the layer's name, unique among the model's layers.
        F: time of its forward on one microbatch.
        B: time of its backward on one microbatch.
        activation: bytes of its output for one microbatch.
        parameters: bytes of its parameters.
    """

    name: str
    F: Number
    B: Number
    activation: Number
    parameters: Number

    def __post_init__(self) -> None:
        for name in LAYER_KEYS[1:]:
            _within_limits(getattr(self, name), f"layer {quote(self.name)}: {name}")

    @property
    def time(self) -> Number:
        """Its forward and backward: PipeDream's T_l."""
        return self.F + self.B


class RolledUp(NamedTuple):
    """Per-layer costs summed over the chunks of a cut (``roll_up``).

    Attributes:
        per_chunk: (F, B) of each chunk: the sums of its layers' times.
        boundaries: for each chunk but the last, the bytes of its last layer's
            output for one microbatch: what crosses the cut after it (and its gradient, back).
    """

    per_chunk: tuple[tuple[Number, Number], ...]
    boundaries: tuple[Number, ...]


def roll_up(layers: Sequence[LayerCost], ranges: Sequence[tuple[int, int]]) -> RolledUp:
    """Sum per-layer costs into per-chunk ones.

    Args:
        layers: the model's layers in order (``CostModel.layers``).
        ranges: chunk c -> its layers ``(first, stop)``, stop exclusive; the
            chunks in order, each non-empty, together every layer once.
    Returns:
        the chunks' F and B and the activation bytes of each boundary.
    Raises:
        UsageError: ranges that are not a contiguous cover of the layers.
    """
    if not ranges:
        raise UsageError("a cut of the layers needs at least one chunk")
    expected = 0
    for chunk, (first, stop) in enumerate(ranges):
        if first != expected or stop <= first:
            raise UsageError(f"chunk {chunk} holds layers {first}..{stop}: a cut's chunks hold consecutive layers, "
                             f"in order, at least one each (expected it to start at {expected})")
        expected = stop
    if expected != len(layers):
        raise UsageError(f"the chunks hold layers 0..{expected}, and the model has {len(layers)}")
    per_chunk = tuple((sum(layer.F for layer in layers[first:stop]), sum(layer.B for layer in layers[first:stop]))
                      for first, stop in ranges)
    return RolledUp(per_chunk, tuple(layers[stop - 1].activation for _, stop in ranges[:-1]))


@dataclass(frozen=True)
class CostModel:
    """Prices of compute tasks, messages and all-reduces.

    Attributes:
        ops: default time per compute op, as sorted (op, time) pairs; an op
            priced like another (``PRICED_LIKE``) may be absent (``compute``).
        per_chunk: overrides as sorted (chunk, op, time) triples.
        link: the default link between two ranks.
        message_bytes: (kind, bytes) for kinds "act" and "grad".
        node_size: ranks per node; 0 means one node holds every rank.
        inter_node: the link between ranks of different nodes (None: ``link``).
        pairs: per-pair links as sorted (low rank, high rank, Link) triples.
        contention: transfers that share a link share its bandwidth (``compiler.network``).
        nic: the network interface every device of a node shares for its inter-node transfers
            (``compiler.network``), or None for none.
        port: a device's switch port, shared by all its transfers out and all in
            (``compiler.network``), or None for none.
        rails: a device's own rail NIC, shared by all its transfers to and from other nodes
            (rail-optimised nodes: device i of every node on rail i; ``compiler.network``), or None.
        allreduce_link: the link a ring all-reduce runs over.
        allreduce_bytes: the gradient bytes of one model chunk.
        post: the time a rank spends posting one message.
        value_bytes: the bytes of one value of a size class, as sorted
            (size class, bytes) pairs; ``sizes`` gives them as a dict.
        layers: the model's layers in order (the file's ``layers``); empty when it has none.
        source: the cost file the model was read from, which messages about its totals name ("": none).

    Every number is within the guarded reader's limits (``guarded_read.cost_number_problem``: at most
    ``COST_LIMIT``, a bandwidth at least ``MIN_BANDWIDTH``), so that no sum of a program's size overflows:
    ``FieldReader`` names a file's number past them at its key, and a model built in Python is held to the
    same when it is made (``NumberLimitError``). Fields are tuples so that the model is hashable; lookup tables are built
    once in ``__post_init__``.
    """

    ops: tuple[tuple[str, Number], ...] = tuple(sorted(_PRICED_UNITS.items()))
    per_chunk: tuple[tuple[int, str, Number], ...] = ()
    link: Link = Link()
    message_bytes: tuple[tuple[str, Number], ...] = (("act", 0), ("grad", 0))
    node_size: int = 0
    inter_node: Link | None = None
    pairs: tuple[tuple[int, int, Link], ...] = ()
    contention: bool = False
    nic: Link | None = None
    port: Link | None = None
    rails: Link | None = None
    allreduce_link: Link = Link()
    allreduce_bytes: Number = 0
    post: Number = 0
    value_bytes: tuple[tuple[str, Number], ...] = ()
    layers: tuple[LayerCost, ...] = ()
    source: str = field(default="", compare=False)  # the cost file it was read from, for messages ("" if none)
    _compute_table: dict = field(init=False, repr=False, compare=False, hash=False)
    _pair_table: dict = field(init=False, repr=False, compare=False, hash=False)
    _bytes_table: dict = field(init=False, repr=False, compare=False, hash=False)

    def __post_init__(self) -> None:
        self._check_limits()
        compute = {(None, op): cost for op, cost in self.ops}
        compute.update({(chunk, op): cost for chunk, op, cost in self.per_chunk})
        # frozen: the caches are set once, here, and never change afterwards
        object.__setattr__(self, "_compute_table", compute)
        object.__setattr__(self, "_pair_table", {(a, b): link for a, b, link in self.pairs})
        object.__setattr__(self, "_bytes_table", dict(self.message_bytes))

    def _check_limits(self) -> None:
        """Raise ``NumberLimitError`` at the first number past the guarded reader's limits."""
        numbers = [(f"compute.{op}", cost) for op, cost in self.ops]
        numbers += [(f"compute.per_chunk.{chunk}.{op}", cost) for chunk, op, cost in self.per_chunk]
        numbers += [(f"links.bytes.{kind}", size) for kind, size in self.message_bytes]
        numbers += [("allreduce.bytes", self.allreduce_bytes), ("links.post", self.post)]
        numbers += [(f"sizes.{size_class}", size) for size_class, size in self.value_bytes]
        links = [("links", self.link), ("links.inter_node", self.inter_node), ("links.nic", self.nic),
                 ("links.port", self.port), ("links.rails", self.rails), ("allreduce", self.allreduce_link)]
        links += [(f"links.pairs.{low}-{high}", link) for low, high, link in self.pairs]
        for key, link in links:
            if link is not None:
                if link.latency is not None:
                    numbers.append((f"{key}.latency", link.latency))
                if link.bandwidth is not None:
                    _within_limits(link.bandwidth, f"{key}.bandwidth", self.source, bandwidth=True)
        for key, value in numbers:
            _within_limits(value, key, self.source)

    @property
    def sizes(self) -> dict[str, Number]:
        """Size class -> bytes of one value of it, in ``ops.SIZE_CLASSES`` order; empty when none is given."""
        given = dict(self.value_bytes)
        return {size_class: given[size_class] for size_class in rules.SIZE_CLASSES if size_class in given}

    @staticmethod
    def unit() -> "CostModel":
        """F = 1, B = 2, I = W = 1, communication free; every value an int."""
        return CostModel()

    def compute(self, op: str, chunk: int) -> Number:
        """Time of one ``op`` task of one microbatch on model chunk ``chunk``.

        An op the model does not price that the rule table prices like
        another (``ops.OpRule.priced_like``: FC and R like F) costs what that
        one costs on the chunk; one that is free under unit costs (U, the
        optimizer update inside an order) costs nothing.

        Raises:
            KeyError: for an op the model does not price.
        """
        table = self._compute_table
        cost = table.get((chunk, op))
        if cost is None:
            cost = table.get((None, op))
        if cost is None:
            like = PRICED_LIKE.get(op)
            if like is None:
                if UNIT_COMPUTE.get(op) == 0:
                    return 0
                raise KeyError((None, op))
            return self.compute(like, chunk)
        return cost

    def link_between(self, src: int, dst: int) -> Link:
        """The link a message from ``src`` to ``dst`` uses (pairs, then nodes, then the default)."""
        base = self.link
        if self.node_size and src // self.node_size != dst // self.node_size and self.inter_node is not None:
            base = self.inter_node
        pair = self._pair_table.get((min(src, dst), max(src, dst)))
        if pair is None:
            return base
        return base.overridden(pair.latency, pair.bandwidth)

    def transfer(self, src_rank: int, dst_rank: int, kind: str) -> Number:
        """Time for one message of ``kind`` ("act" or "grad") from ``src_rank`` to ``dst_rank``.

        Returns:
            0 for a rank to itself (a local hand-off), else latency + bytes / bandwidth.
        """
        if src_rank == dst_rank:
            return 0
        return self.link_between(src_rank, dst_rank).time(self._bytes_table[kind])

    def message_bytes_of(self, kind: str) -> Number:
        """The bytes of one message of ``kind`` ("act" or "grad"; ``links.bytes``)."""
        return self._bytes_table[kind]

    def allreduce(self, members: int, chunk: int) -> Number:
        """Time of a ring all-reduce of one chunk's gradients among ``members`` replicas.

        ``chunk`` is accepted so that per-chunk sizes can be added without
        changing callers; today every chunk has ``allreduce_bytes``.
        """
        return ring_allreduce_time(self.allreduce_link, members, self.allreduce_bytes)


# ------------------------------------------------------------------ file loading


class FieldReader:
    """Validates one JSON file's value (a cost file's, or another of pipec's formats: ``partition``),
    naming the file and key of every mistake: ``FILE: KEY: problem``.

    Args:
        path: the file, as messages name it.
        error: the ``PipecError`` subclass every mistake raises.
    """

    def __init__(self, path: str, error: type[PipecError] = CostFileError):
        self.path = path
        self.error = error

    def fail(self, key: str, problem: str) -> PipecError:
        # a key is the file's text: quoted (escaped, shortened) unless plain
        shown = key if key.isprintable() and len(key) <= 120 else quote(key)
        return self.error(f"{self.path}: {shown}: {problem}")

    def fields(self, value: Any, key: str, names: tuple[str, ...]) -> Mapping[str, Any]:
        """``value`` as a JSON object with exactly the keys ``names``: none unknown, none missing."""
        given = self.table(value, key, names)
        missing = [name for name in names if name not in given]
        if missing:
            raise self.fail(key, f"missing {', '.join(missing)}")
        return given

    def array(self, value: Any, key: str) -> list:
        """``value`` as a non-empty JSON array."""
        if not isinstance(value, list):
            raise self.fail(key, f"expected an array, got {_json_type(value)}")
        if not value:
            raise self.fail(key, "expected at least one entry, got an empty array")
        return value

    def integer(self, value: Any, key: str, low: int = 0, high: int | None = None) -> int:
        """``value`` as a JSON integer in ``low .. high`` (no ``high``: at least ``low``)."""
        if isinstance(value, bool) or not isinstance(value, int):
            raise self.fail(key, f"expected an integer, got {_json_type(value)}")
        if value < low or (high is not None and value > high):
            bounds = f"at least {low}" if high is None else f"in {low} .. {high}"
            raise self.fail(key, f"expected an integer {bounds}, got {value}")
        return value

    def name(self, value: Any, key: str) -> str:
        """``value`` as a name: a non-empty string of printable characters, at most ``NAME_CHARS`` of them."""
        if not isinstance(value, str) or not value or not value.isprintable() or len(value) > NAME_CHARS:
            raise self.fail(key, f"expected a name (1 to {NAME_CHARS} printable characters), got "
                                 f"{_json_type(value) if not isinstance(value, str) else quote(value)}")
        return value

    def table(self, value: Any, key: str, allowed: tuple[str, ...] | None) -> Mapping[str, Any]:
        """``value`` as a JSON object whose keys are all in ``allowed`` (None: any key)."""
        if not isinstance(value, dict):
            raise self.fail(key, f"expected an object, got {_json_type(value)}")
        if allowed is not None:
            for name in value:
                if name not in allowed:
                    raise self.fail(_join(key, name), f"unknown key (expected one of {', '.join(allowed)})")
        return value

    def number(self, value: Any, key: str, positive: bool = False, *, limited: bool = True,
               bandwidth: bool = False) -> Number:
        """``value`` as a non-negative (or, with ``positive``, strictly positive) finite number; with ``limited``
        (a cost file's number) at most ``guarded_read.COST_LIMIT``, a ``bandwidth`` at least ``MIN_BANDWIDTH``."""
        # bool is an int subclass in Python, but `true` is not a cost
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise self.fail(key, f"expected a number, got {_json_type(value)}")
        if value != value or value in (float("inf"), float("-inf")):
            raise self.fail(key, f"expected a finite number, got {value}")
        if isinstance(value, int) and not -INT_LIMIT < value < INT_LIMIT:  # data not read by guarded_read
            raise self.fail(key, f"the integer is outside pipec's range (-{INT_LIMIT_TEXT} < n < {INT_LIMIT_TEXT})")
        if positive and value <= 0:
            raise self.fail(key, f"expected a positive number, got {value}")
        if value < 0:
            raise self.fail(key, f"expected a non-negative number, got {value}")
        problem = cost_number_problem(value, bandwidth=bandwidth) if limited else None
        if problem is not None:
            raise self.fail(key, problem)
        return value

    def index(self, text: str, key: str) -> int:
        """A non-negative integer written as a JSON key."""
        if not _ASCII_DIGITS.fullmatch(text):  # str.isdigit and int() also take '٣', '³', '1_000'
            raise self.fail(key, f"expected a non-negative integer in ASCII digits, got {quote(text)}")
        return plain_int(text, f"{self.path}: {key}", CostFileError)

    def op_costs(self, value: Any, key: str, fallback: Mapping[str, Number], extra: tuple[str, ...] = ()) -> dict[str, Number]:
        """Compute costs completed from ``fallback`` (I and W default to B / 2 when B is given). An op priced
        like another (``PRICED_LIKE``: FC, R) that neither this object nor ``fallback`` gives is left out: the
        model prices it like its op on each chunk (a chunk's R is that chunk's F)."""
        given = self.table(value, key, tuple(UNIT_COMPUTE) + extra)
        costs = {op: self.number(given[op], _join(key, op)) for op in UNIT_COMPUTE if op in given}
        for whole, parts in SPLITS.items():
            for op in parts:
                if op not in costs and whole in costs:
                    costs[op] = exact_ratio(costs[whole], 2)
        costs = {**fallback, **costs}
        return {op: costs[op] for op in UNIT_COMPUTE if op in costs}

    def link(self, value: Any, key: str, extra: tuple[str, ...] = ()) -> tuple[Number | None, Number | None, Mapping[str, Any]]:
        """(latency, bandwidth, the object) of a link object; absent fields are None."""
        given = self.table(value, key, ("latency", "bandwidth") + extra)
        latency = self.number(given["latency"], _join(key, "latency")) if "latency" in given else None
        bandwidth = (self.number(given["bandwidth"], _join(key, "bandwidth"), positive=True, bandwidth=True)
                     if "bandwidth" in given else None)
        return latency, bandwidth, given

    def pair(self, text: str, key: str) -> tuple[int, int]:
        """A ``"a-b"`` pair key as (low, high) distinct ranks."""
        pieces = text.split("-")
        if len(pieces) != 2 or not all(_ASCII_DIGITS.fullmatch(p) for p in pieces):
            raise self.fail(key, f"expected a pair of ranks written 'a-b' in ASCII digits, got {quote(text)}")
        a, b = (plain_int(p, f"{self.path}: {key}", CostFileError) for p in pieces)
        if a == b:
            raise self.fail(key, "a pair needs two different ranks")
        return min(a, b), max(a, b)

    # -- sections --------------------------------------------------------------

    def compute_section(self, value: Any) -> dict[str, Any]:
        defaults = self.op_costs(value, "compute", _PRICED_UNITS, extra=("per_chunk",))
        per_chunk = []
        chunks = self.table(value.get("per_chunk", {}), "compute.per_chunk", None)
        for text, overrides in chunks.items():
            key = _join("compute.per_chunk", text)
            chunk = self.index(text, key)
            merged = self.op_costs(overrides, key, defaults)
            # store only what differs, so equal models compare equal
            per_chunk += [(chunk, op, cost) for op, cost in merged.items() if cost != defaults.get(op)]
        return {"ops": tuple(sorted(defaults.items())), "per_chunk": tuple(sorted(per_chunk))}

    def links_section(self, value: Any) -> dict[str, Any]:
        latency, bandwidth, given = self.link(value, "links", extra=("bytes", "node_size", "inter_node", "pairs", "post",
                                                                   "contention", "nic", "port", "rails"))
        default = Link().overridden(latency, bandwidth)
        sizes = self.table(given.get("bytes", {}), "links.bytes", MESSAGE_KINDS)
        message_bytes = tuple((kind, self.number(sizes[kind], _join("links.bytes", kind)) if kind in sizes else 0) for kind in MESSAGE_KINDS)
        node_size = 0
        if "node_size" in given:
            node_size = self.number(given["node_size"], "links.node_size", positive=True)
            if not isinstance(node_size, int):
                raise self.fail("links.node_size", f"expected a whole number of ranks, got {node_size}")
        inter_node = None
        if "inter_node" in given:
            inter_latency, inter_bandwidth, _ = self.link(given["inter_node"], "links.inter_node")
            inter_node = default.overridden(inter_latency, inter_bandwidth)
        pairs = []
        for text, pair_value in self.table(given.get("pairs", {}), "links.pairs", None).items():
            key = _join("links.pairs", text)
            low, high = self.pair(text, key)
            pair_latency, pair_bandwidth, _ = self.link(pair_value, key)
            # None fields inherit, at lookup time, from the link the pair would otherwise use
            pairs.append((low, high, Link(pair_latency, pair_bandwidth)))
        if len({(a, b) for a, b, _ in pairs}) != len(pairs):
            raise self.fail("links.pairs", "the same pair of ranks is given twice")
        contention = given.get("contention", False)
        if not isinstance(contention, bool):
            raise self.fail("links.contention", f"expected true or false, got {_json_type(contention)}")
        nic = None
        if "nic" in given:
            if not node_size:
                raise self.fail("links.nic", "a NIC is shared by the devices of a node: give links.node_size too")
            nic_latency, nic_bandwidth, _ = self.link(given["nic"], "links.nic")
            nic = Link(nic_latency or 0, nic_bandwidth)
        port = None
        if "port" in given:
            port_latency, port_bandwidth, _ = self.link(given["port"], "links.port")
            port = Link(port_latency or 0, port_bandwidth)
        rails = None
        if "rails" in given:
            if not node_size:
                raise self.fail("links.rails", "a rail joins the devices of one index on every node: give "
                                "links.node_size too")
            rail_latency, rail_bandwidth, _ = self.link(given["rails"], "links.rails")
            rails = Link(rail_latency or 0, rail_bandwidth)
        return {
            "port": port,
            "rails": rails,
            "contention": contention,
            "nic": nic,
            "link": default,
            "post": self.number(given["post"], "links.post") if "post" in given else 0,
            "message_bytes": message_bytes,
            "node_size": node_size,
            "inter_node": inter_node,
            "pairs": tuple(sorted(pairs, key=lambda p: (p[0], p[1]))),
        }

    def allreduce_section(self, value: Any) -> dict[str, Any]:
        latency, bandwidth, given = self.link(value, "allreduce", extra=("bytes",))
        nbytes = self.number(given["bytes"], "allreduce.bytes") if "bytes" in given else 0
        return {"allreduce_link": Link().overridden(latency, bandwidth), "allreduce_bytes": nbytes}

    def sizes_section(self, value: Any) -> dict[str, Any]:
        given = self.table(value, "sizes", rules.SIZE_CLASSES)
        sizes = [(size_class, self.number(given[size_class], _join("sizes", size_class))) for size_class in given]
        return {"value_bytes": tuple(sorted(sizes))}

    def layers_section(self, value: Any) -> dict[str, Any]:
        entries = self.array(value, "layers")
        if len(entries) > MAX_LAYERS:
            raise self.fail("layers", f"{len(entries):,} layers, more than the {MAX_LAYERS:,} pipec partitions")
        layers, seen = [], {}
        for index, entry in enumerate(entries):
            key = f"layers[{index}]"
            given = self.fields(entry, key, LAYER_KEYS)
            name = self.name(given["name"], _join(key, "name"))
            if name in seen:
                raise self.fail(_join(key, "name"), f"{quote(name)} names layer {seen[name]} too: layer names are unique")
            seen[name] = index
            layers.append(LayerCost(name, *(self.number(given[field], _join(key, field)) for field in LAYER_KEYS[1:])))
        return {"layers": tuple(layers)}


# Top-level key -> the reader section that turns its value into CostModel fields.
_SECTIONS = {
    "compute": FieldReader.compute_section,
    "links": FieldReader.links_section,
    "allreduce": FieldReader.allreduce_section,
    "sizes": FieldReader.sizes_section,
    "layers": FieldReader.layers_section,
}


def costs_from_json(data: Any, path: str = "<costs>") -> CostModel:
    """Build a ``CostModel`` from a parsed cost file.

    Args:
        data: the JSON value (docs/costs.md describes the format).
        path: the file name to put in error messages.
    Returns:
        the model; omitted sections keep the unit model's values.
    Raises:
        CostFileError: naming ``path`` and the offending key.
    """
    reader = FieldReader(path)
    top = reader.table(data, "top level", tuple(_SECTIONS))
    fields: dict[str, Any] = {}
    for name, section in _SECTIONS.items():
        if name in top:
            fields.update(section(reader, top[name]))
    return CostModel(**fields, source=path)


def load_costs(path: str) -> CostModel:
    """Read and validate a JSON cost file.

    Args:
        path: the file.
    Returns:
        its ``CostModel``.
    Raises:
        CostFileError: not a regular file, over the size limit (``guarded_read.COSTS``),
            unreadable, not JSON (or NaN, Infinity, a number out of range,
            nesting too deep), or any invalid key or value.
    """
    # the one guarded reader: a regular file, at most COSTS.limit bytes, bounded nesting and numbers
    return costs_from_json(read_json(path, COSTS, CostFileError), path)


def rolled_up(data: Mapping[str, Any], ranges: Sequence[tuple[int, int]], path: str = "<costs>") -> dict[str, Any]:
    """The cost file ``data`` priced per chunk of a cut of its layers: what ``pipec simulate`` reads for a
    program whose chunk c holds layers ``ranges[c]`` (``pipec partition --costs-out``).

    Args:
        data: a parsed cost file with ``layers``.
        ranges: chunk -> (first, stop) layers, as ``roll_up`` takes them.
        path: the file's name, for messages.
    Returns:
        a copy of ``data`` without ``layers``, whose ``compute.per_chunk`` gives each chunk
        its layers' summed F and B (and so I = W = B / 2, FC = R = F; any per_chunk the
        file had is replaced); its other sections as they were.
    Raises:
        CostFileError: ``data`` is not a valid cost file, or has no layers.
        UsageError: ranges that do not cut its layers (``roll_up``).
    """
    model = costs_from_json(data, path)
    if not model.layers:
        raise CostFileError(f"{path}: no \"layers\" to roll up into chunks (`pipec profile` writes them)")
    chunks = roll_up(model.layers, ranges).per_chunk
    for chunk, ((first, stop), times) in enumerate(zip(ranges, chunks)):
        for op, time in zip(("F", "B"), times):
            if time > COST_LIMIT:
                raise CostFileError(f"{path}: layers[{first}] .. layers[{stop - 1}], chunk {chunk} of the cut, sum "
                                    f"to {op} = {time:g}, above the {COST_LIMIT_TEXT} a cost file holds per task: "
                                    f"their chunk cost file could not be read ({LIMITS_DOC})")
    compute = {key: value for key, value in data.get("compute", {}).items() if key != "per_chunk"}
    compute["per_chunk"] = {str(chunk): {"F": f, "B": b} for chunk, (f, b) in enumerate(chunks)}
    return {**{key: value for key, value in data.items() if key != "layers"}, "compute": compute}


def _within_limits(value: Number, key: str, source: str = "", *, bandwidth: bool = False) -> None:
    """Raise ``NumberLimitError`` when ``value``, a cost model's number at ``key``, is past the reader's limits."""
    problem = cost_number_problem(value, bandwidth=bandwidth)
    if problem is not None:
        raise NumberLimitError(f"{source or 'cost model'}: {key}: {problem}")


def _join(key: str, name: str) -> str:
    return f"{key}.{name}" if key != "top level" else name


def unit_priced_ops(data: Mapping[str, Any], used: set[str]) -> list[str]:
    """The compute ops of ``used`` that a cost file leaves at their unit costs while it prices others itself.

    A file with measured F and B (``pipec costs``: milliseconds) that gives no time for a sequence
    ring's attention ops prices those at 1 and 2: a makespan that adds milliseconds to unit costs
    means neither. An op priced through another (I and W from B, FC and R from F) counts as given
    when that one is; an op free under unit costs (U) is never named.

    Args:
        data: the parsed cost file.
        used: the ops of the program it prices.
    Returns:
        the ops left at unit costs, sorted; empty when the file prices no compute at all (unit
        costs throughout) or every used op.
    """
    compute = data.get("compute") or {}
    given = {key for key in compute if key in UNIT_COMPUTE}
    for times in (compute.get("per_chunk") or {}).values():
        given |= {key for key in times if key in UNIT_COMPUTE}
    if not given:
        return []
    derived = {part: whole for whole, parts in SPLITS.items() for part in parts} | PRICED_LIKE
    return sorted(op for op in used & UNIT_COMPUTE.keys()
                  if UNIT_COMPUTE[op] and op not in given and derived.get(op) not in given)

