"""A partition file: which consecutive layers of a model each pipeline stage holds, on which ranks.

``pipec partition --json`` writes one; ``pipec run --partition FILE`` cuts a
model given by its layers (``runtime/layered.py``) as it says. The format,
version 1:

    {"format": "pipec partition", "version": 1, "layers": L, "ranks": P,
     "names": [L layer names],
     "stages": [{"layers": [first, stop], "replicas": r, "ranks": [r ranks],
                 "time": t, "memory": bytes}, ...],
     "time_per_microbatch": T}

Stages are in pipeline order; stage s holds layers ``first .. stop - 1``, and
together the stages hold every layer once, in order (``stages[0]`` starts at 0,
each stage starts where the one before stopped, the last stops at L). A stage
with ``replicas`` r > 1 runs on r ranks (data parallel inside the pipeline),
named by ``ranks``. ``time`` (per microbatch, as the cost file's unit),
``memory`` (bytes per rank), ``time_per_microbatch`` and ``names`` are the
partitioner's predictions and labels: read and kept, not used to cut.

The file is read through the one guarded reader (``guarded_read.read_json``:
a regular file within ``PARTITION``'s limit, bounded JSON), and every mistake
is an error that names the file and the key (``part.json: stages[2].layers:
...``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pipec.compiler.guarded_read import Kind, json_type, quote, read_json
from pipec.errors import UsageError

FORMAT = "pipec partition"
VERSION = 1
# A partition is a few lines per stage and a name per layer: 16 MiB holds
# hundreds of thousands of layers.
PARTITION = Kind("partition file", "the partition file", 16 << 20, "16 MiB")

_TOP_KEYS = ("format", "version", "layers", "ranks", "names", "stages", "time_per_microbatch")
_STAGE_KEYS = ("layers", "replicas", "ranks", "time", "memory")


@dataclass(frozen=True)
class PartitionStage:
    """One stage of a partition.

    Attributes:
        first, stop: the layers it holds, ``first .. stop - 1`` (``stop`` exclusive).
        replicas: how many ranks run it (1: not replicated).
        ranks: those ranks, ``replicas`` distinct ones.
        time: the predicted time of one microbatch on it.
        memory: the predicted bytes it needs per rank.
    """

    first: int
    stop: int
    replicas: int
    ranks: tuple[int, ...]
    time: float
    memory: float


@dataclass(frozen=True)
class Partition:
    """A model's layers cut into pipeline stages (the module docstring has the file format).

    Attributes:
        layers: L, the model's layer count.
        ranks: P, the ranks the partition was made for.
        names: the layers' names, L of them.
        stages: in pipeline order, holding layers 0 .. L - 1 contiguously.
        time_per_microbatch: the predicted time per microbatch of the whole pipeline.
    """

    layers: int
    ranks: int
    names: tuple[str, ...]
    stages: tuple[PartitionStage, ...]
    time_per_microbatch: float

    @property
    def cut(self) -> tuple[tuple[int, int], ...]:
        """Per stage, its layers as ``(first, stop)``."""
        return tuple((stage.first, stage.stop) for stage in self.stages)


def load_partition(path: str) -> Partition:
    """Read and validate a partition file.

    Args:
        path: the file, as the user gave it.
    Returns:
        its ``Partition``: stages contiguous over 0 .. L - 1, each with at
        least one layer, ``replicas`` >= 1 distinct ranks in 0 .. P - 1.
    Raises:
        UsageError: the guarded reader's (no such file, not a regular file, over
            the limit, not JSON), or ``FILE: KEY: problem`` for anything in it
            that does not fit the format.
    """
    return partition_from_json(read_json(path, PARTITION), path)


def partition_from_json(data: Any, path: str = "<partition>") -> Partition:
    """Build a ``Partition`` from a parsed partition file (``load_partition``'s checks).

    Args:
        data: the JSON value.
        path: the file name for messages.
    Raises:
        UsageError: ``path: KEY: problem``.
    """
    reader = _Reader(path)
    top = reader.object(data, "top level", _TOP_KEYS, "a partition")
    if top["format"] != FORMAT:
        raise reader.fail("format", f"expected {quote(FORMAT)} (a file `pipec partition --json` writes), "
                                    f"got {json_type(top['format'])}")
    version = reader.integer(top["version"], "version", low=1)
    if version != VERSION:
        raise reader.fail("version", f"this pipec reads version {VERSION}, got {version}")
    layers = reader.integer(top["layers"], "layers", low=1)
    ranks = reader.integer(top["ranks"], "ranks", low=1)
    names = reader.array(top["names"], "names")
    if len(names) != layers:
        raise reader.fail("names", f"expected one name per layer, {layers}, got {len(names)}")
    for index, name in enumerate(names):
        if not isinstance(name, str):
            raise reader.fail(f"names[{index}]", f"expected a string, got {json_type(name)}")
    stages_data = reader.array(top["stages"], "stages")
    if not stages_data:
        raise reader.fail("stages", "expected at least one stage")
    stages, first = [], 0
    for index, value in enumerate(stages_data):
        stage = reader.stage(value, f"stages[{index}]", first, layers, ranks)
        stages.append(stage)
        first = stage.stop
    if first != layers:
        raise reader.fail(f"stages[{len(stages) - 1}].layers",
                          f"the last stage stops at layer {first}, but the model has {layers} layers: the stages "
                          f"must hold every layer")
    time = reader.number(top["time_per_microbatch"], "time_per_microbatch")
    return Partition(layers, ranks, tuple(names), tuple(stages), time)


class _Reader:
    """Checks of one partition file's values; every failure names the file and the key."""

    def __init__(self, path: str):
        self.path = path

    def fail(self, key: str, problem: str) -> UsageError:
        return UsageError(f"{self.path}: {key}: {problem}")

    def object(self, value: Any, key: str, keys: tuple[str, ...], what: str) -> dict:
        """``value``, a JSON object with exactly ``keys`` (``what`` has them: "a partition", "a stage")."""
        if not isinstance(value, dict):
            raise self.fail(key, f"expected an object, got {json_type(value)}")
        unknown = [name for name in value if name not in keys]
        if unknown:
            raise self.fail(key, f"unknown key {quote(unknown[0])} ({what} has {', '.join(keys)})")
        missing = [name for name in keys if name not in value]
        if missing:
            raise self.fail(key, f"missing {', '.join(missing)}")
        return value

    def array(self, value: Any, key: str) -> list:
        if not isinstance(value, list):
            raise self.fail(key, f"expected an array, got {json_type(value)}")
        return value

    def integer(self, value: Any, key: str, *, low: int, high: int | None = None) -> int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise self.fail(key, f"expected an integer, got {json_type(value)}")
        if value < low or (high is not None and value > high):
            bounds = f"at least {low}" if high is None else f"in {low} .. {high}"
            raise self.fail(key, f"expected an integer {bounds}, got {value}")
        return value

    def number(self, value: Any, key: str) -> float:
        """A number >= 0 (a time or a size)."""
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise self.fail(key, f"expected a number, got {json_type(value)}")
        if value < 0:
            raise self.fail(key, f"expected a number at least 0, got {value}")
        return float(value)

    def stage(self, value: Any, key: str, first: int, layers: int, ranks: int) -> PartitionStage:
        """Stage ``key``, which must start at layer ``first``."""
        stage = self.object(value, key, _STAGE_KEYS, "a stage")
        bounds = self.array(stage["layers"], f"{key}.layers")
        if len(bounds) != 2:
            raise self.fail(f"{key}.layers", f"expected [first, stop], got {len(bounds)} values")
        start = self.integer(bounds[0], f"{key}.layers[0]", low=0)
        stop = self.integer(bounds[1], f"{key}.layers[1]", low=0)
        if start != first:
            where = "the first stage must start at layer 0" if first == 0 else \
                f"the stage before stops at layer {first}, so this one must start there"
            raise self.fail(f"{key}.layers", f"starts at layer {start}, but {where} (stages hold consecutive "
                                             f"layers, in pipeline order)")
        if not start < stop <= layers:
            raise self.fail(f"{key}.layers", f"expected [first, stop] with {start} < stop <= {layers} (stop is "
                                             f"exclusive; a stage holds at least one layer), got [{start}, {stop}]")
        replicas = self.integer(stage["replicas"], f"{key}.replicas", low=1, high=ranks)
        on = self.array(stage["ranks"], f"{key}.ranks")
        held = tuple(self.integer(rank, f"{key}.ranks[{i}]", low=0, high=ranks - 1) for i, rank in enumerate(on))
        if len(set(held)) != len(held):
            raise self.fail(f"{key}.ranks", f"a rank is named twice: {list(held)}")
        if len(held) != replicas:
            raise self.fail(f"{key}.ranks", f"expected one rank per replica, {replicas}, got {len(held)}: "
                                            f"{list(held)}")
        return PartitionStage(start, stop, replicas, held, self.number(stage["time"], f"{key}.time"),
                              self.number(stage["memory"], f"{key}.memory"))


__all__ = ["FORMAT", "PARTITION", "Partition", "PartitionStage", "VERSION", "load_partition", "partition_from_json"]
