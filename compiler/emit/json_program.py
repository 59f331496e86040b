"""A ``Program`` as JSON: what ``pipec compile --format json`` writes and the runtime loads.

The format, version 1::

    {"format": "pipec-program", "version": 1,
     "name": str, "params": {str: int}, "source": str,
     "num_ranks": int, "num_microbatches": int,
     "stages": [{"id", "rank", "pipeline", "position"}, ...],
     "pipelines": [[stage id, ...], ...], "mb_pipeline": [pipeline, ...],
     "devices": [device, ...] | null,
     "communicators": [{"id", "ranks", "purpose", "key"}, ...],
     "owners": [rank, ...] | null,
     "weights": {"groups", "route", "ring_by", "gradients", "prefetch",
                 "buffers", "num_steps"} | null,
     "ranks": [[instruction, ...], ...]}

An instruction is ``{"op", "text", "stage", "mb", "peer", "parts"}``: ``op`` and
``text`` (torch's token, e.g. ``2F0``) always; ``stage``, ``mb`` and ``peer``
only when set (an absent one reads back as -1, the IR's "none"), and those its
op's rule lists (``ops.OpRule.fields``) are required; ``parts``, a list of
sends and receives, only for a ``BATCH`` (an ``EXCHANGE`` of weight passing
holds its parts the same way; its ``mb`` and its parts' are steps and
exchange numbers, not microbatches). ``text`` is redundant and checked on
load: it is there for people and tools that read the file, and a hand edit that
changes one but not the other is caught instead of silently believed.
``communicators`` (``Program.communicators``, in creation order) may be absent,
as in files written before it existed: the program then derives them.
``owners`` (the owner rank of each layer) and ``weights`` (the rest of
``Program.weights``) are null for activation passing, and may be absent.

``pipec compile`` writes it with ``write_program_json``: compact, streamed
rank by rank, a newline before each rank's instructions (the same document as
``program_to_json``, never held whole in memory).

``program_from_json(program_to_json(p)) == p`` for every program. Loading
validates structure and ranges and reports the first problem as an
``ImportError_`` (at ``rank R, step S`` for an instruction); the semantic
checks (dataflow, matching, deadlock) stay in ``pipec.compiler.checks``.
"""
from __future__ import annotations

import json
from typing import Any, TextIO

from pipec.compiler import ops
from pipec.compiler.guarded_read import INT_LIMIT
from pipec.compiler.ir import (
    GRADIENT_ROUTES,
    NO_PEER,
    WEIGHT_ROUTES,
    Action,
    Communicator,
    Program,
    StageInfo,
    WeightPlan,
)
# The cyclic GC rescans every object built so far each time allocations trigger
# it; these passes build hundreds of thousands of acyclic ones.
from pipec.compiler.gc_pause import paused_gc
from pipec.errors import ImportError_

# Action._make skips NamedTuple's keyword handling: about 3x cheaper per instruction.
_make_action = Action._make

FORMAT = "pipec-program"
VERSION = 1

# Which instruction fields each op must carry (its rule's ``fields``; others are
# optional and default to -1). A BATCH carries parts instead. Listed by category
# (compute, sends and receives, frees, collectives, batches), the order the
# "unknown op" message names them in.
_REQUIRED_FIELDS: dict[str, tuple[str, ...]] = {
    op: ops.RULES[op].fields
    for category in ((ops.COMPUTE,), (ops.SEND, ops.RECV), (ops.FREE,), (ops.COLLECTIVE,), (ops.COLLECTIVE_WAIT,),
                     (ops.BATCH_OF,), ops.WEIGHT_CATEGORIES)
    for op in ops.ops_of(*category)
}
# The ops a posting instruction may hold: a BATCH sends and receives, an EXCHANGE its parts.
_PARTS_OF = {op: ops.COMM_OPS for op in ops.ops_of(ops.BATCH_OF)}
_PARTS_OF.update({op: ops.EXCHANGE_PART_OPS for op in ops.EXCHANGE_OPS})
# Weight passing's ops number steps and exchanges in ``mb``, not microbatches.
_STEP_NUMBERED = frozenset(ops.WEIGHT_OPS)
ops.declare_pass("json program", _REQUIRED_FIELDS)
# What collectives' communicators may be for (``ops.OpRule.communicator``).
_PURPOSES = tuple(dict.fromkeys(rule.communicator for rule in ops.RULES.values() if rule.communicator))


# ------------------------------------------------------------------------ write


def program_to_json(program: Program) -> dict:
    """Encode a program as a JSON-ready dict.

    Args:
        program: any ``Program``.
    Returns:
        a dict of plain lists, dicts, strings and ints in the version-1 format;
        ``json.dumps`` it to write a file (or use ``write_program_json``, which
        writes the same document without building it).
    """
    with paused_gc():
        ranks = [[_instruction_to_json(a) for a in row] for row in program.ranks]
    data = _header_to_json(program)
    data["ranks"] = ranks
    return data


def write_program_json(program: Program, out: TextIO) -> None:
    """Write a program as compact version-1 JSON to a text stream, rank by rank.

    The document is ``json.dumps(program_to_json(program), separators=(",", ":"))``
    with a newline before each rank's instructions and one at the end, but it
    is never held whole: building that dict of a million small dicts and
    dumping it took three times as long as the compile itself at P=64, N=512,
    v=2, and ~10 times the file's size in memory. Each instruction is
    formatted directly; ``program_from_json(json.load(...))`` gives the program back.

    Args:
        program: any ``Program``.
        out: a text stream; only its ``write`` is used.
    """
    header = json.dumps(_header_to_json(program), separators=(",", ":"))
    # the header's fields, then "ranks" last, the order program_to_json gives
    out.write(header[:-1] + ',"ranks":[')
    encode = _instruction_text
    with paused_gc():
        for r, row in enumerate(program.ranks):
            out.write("\n[" if r == 0 else ",\n[")
            out.write(",".join(map(encode, row)))
            out.write("]")
    out.write("]}\n")


def _header_to_json(program: Program) -> dict:
    """Every field of the format but ``ranks``, in the format's order."""
    return {
        "format": FORMAT,
        "version": VERSION,
        "name": program.name,
        "params": dict(program.params),
        "source": program.source,
        "num_ranks": program.num_ranks,
        "num_microbatches": program.num_microbatches,
        "stages": [
            {"id": s.id, "rank": s.rank, "pipeline": s.pipeline, "position": s.position}
            for s in program.stages
        ],
        "pipelines": [list(line) for line in program.pipelines],
        "mb_pipeline": list(program.mb_pipeline),
        "devices": None if program.devices is None else list(program.devices),
        "communicators": [
            {"id": c.id, "ranks": list(c.ranks), "purpose": c.purpose, "key": c.key}
            for c in program.communicators
        ],
        "owners": None if program.weights is None or program.weights.owners is None else list(program.weights.owners),
        "weights": None if program.weights is None else {
            "groups": list(program.weights.groups), "route": program.weights.route,
            "ring_by": program.weights.ring_by, "gradients": program.weights.gradients,
            "prefetch": program.weights.prefetch, "buffers": program.weights.buffers,
            "num_steps": program.weights.num_steps},
    }


def _instruction_to_json(action: Action) -> dict:
    out: dict[str, Any] = {"op": action.op, "text": action.text()}
    if action.stage != -1:
        out["stage"] = action.stage
    if action.mb != -1:
        out["mb"] = action.mb
    if action.peer != NO_PEER:
        out["peer"] = action.peer
    if action.parts:
        out["parts"] = [_instruction_to_json(p) for p in action.parts]
    return out


def _instruction_text(action: Action) -> str:
    """``_instruction_to_json(action)`` as compact JSON text, formatted directly (no dict, no encoder).

    Ops and tokens are plain ASCII names and digits (the rule table's; a test
    holds every op to that), so they need no escaping; the fields are ints.
    """
    stage, op, mb, peer, parts = action
    if parts:
        return _batch_text(action)
    if stage >= 0 and mb >= 0:
        # the common case, every compute, send and receive: one format, no branches
        if peer == NO_PEER:
            return f'{{"op":"{op}","text":"{stage}{op}{mb}","stage":{stage},"mb":{mb}}}'
        return f'{{"op":"{op}","text":"{stage}{op}{mb}","stage":{stage},"mb":{mb},"peer":{peer}}}'
    return _fields_text(action, action.text()) + "}"


def _batch_text(action: Action) -> str:
    """A ``BATCH`` (or an ``EXCHANGE``) as JSON text; each part's token is made once, for the part and for the batch's own text."""
    texts, encoded = [], []
    for part in action.parts:
        stage, op, mb, peer, parts = part
        if stage >= 0 and mb >= 0 and peer != NO_PEER and not parts:
            text = f"{stage}{op}{mb}"
            encoded.append(f'{{"op":"{op}","text":"{text}","stage":{stage},"mb":{mb},"peer":{peer}}}')
        else:
            text = part.text()
            encoded.append(_instruction_text(part))
        texts.append(text)
    text = "(" + ";".join(texts) + ")" + action.op + (str(action.mb) if action.mb >= 0 else "")
    return _fields_text(action, text) + ',"parts":[' + ",".join(encoded) + "]}"


def _fields_text(action: Action, text: str) -> str:
    """The unclosed object of ``op``, ``text`` and whichever of ``stage``, ``mb``, ``peer`` are set."""
    out = f'{{"op":"{action.op}","text":"{text}"'
    if action.stage != -1:
        out += f',"stage":{action.stage}'
    if action.mb != -1:
        out += f',"mb":{action.mb}'
    if action.peer != NO_PEER:
        out += f',"peer":{action.peer}'
    return out


# ------------------------------------------------------------------------- read


def program_from_json(data: dict) -> Program:
    """Decode (and validate) a version-1 program dict.

    Args:
        data: the parsed JSON, as written by ``program_to_json``.
    Returns:
        the ``Program`` it describes.
    Raises:
        ImportError_: a missing or mistyped field, an unknown op, an index out
            of range, or an instruction whose ``text`` disagrees with its fields.
    """
    if not isinstance(data, dict):
        raise ImportError_(f"a pipec program is a JSON object, not {type(data).__name__}")
    if data.get("format") != FORMAT:
        raise ImportError_(f"not a pipec program: \"format\" is {data.get('format')!r}, expected {FORMAT!r}")
    if data.get("version") != VERSION or type(data.get("version")) is not int:
        raise ImportError_(f"unsupported pipec program version {data.get('version')!r}; this pipec reads version {VERSION}")

    name = _get(data, "name", str)
    source = data.get("source", "")
    if not isinstance(source, str):
        raise ImportError_("field \"source\" must be a string")
    params = _get(data, "params", dict)
    for key, value in params.items():
        if type(value) is not int:
            raise ImportError_(f"parameter {key!r} must be an integer, got {value!r}")
    num_ranks = _get_int(data, "num_ranks", low=1)
    num_microbatches = _get_int(data, "num_microbatches", low=0)
    stages = _read_stages(_get(data, "stages", list), num_ranks)
    pipelines = _read_pipelines(_get(data, "pipelines", list), stages)
    mb_pipeline = _read_int_list(_get(data, "mb_pipeline", list), "mb_pipeline", len(pipelines))
    if len(mb_pipeline) != num_microbatches:
        raise ImportError_(f"\"mb_pipeline\" has {len(mb_pipeline)} entries for {num_microbatches} microbatches")
    devices = data.get("devices")
    if devices is not None:
        if not isinstance(devices, list):
            raise ImportError_("field \"devices\" must be a list or null")
        devices = _read_int_list(devices, "devices", None)
        if len(devices) != num_ranks:
            raise ImportError_(f"\"devices\" has {len(devices)} entries for {num_ranks} ranks")
    communicators = []
    if "communicators" in data:
        communicators = _read_communicators(_get(data, "communicators", list), num_ranks)
    weights = _read_weights(data, num_ranks, len(pipelines[0]) if pipelines else 0)
    raw_ranks = _get(data, "ranks", list)
    if len(raw_ranks) != num_ranks:
        raise ImportError_(f"\"ranks\" has {len(raw_ranks)} rows for {num_ranks} ranks")
    limits = (len(stages), num_microbatches, num_ranks)
    ranks = []
    with paused_gc():
        for r, row in enumerate(raw_ranks):
            if not isinstance(row, list):
                raise ImportError_(f"rank {r}'s instructions must be a list", rank=r)
            ranks.append(_read_row(row, r, limits, raw_ranks))
    return Program(
        name=name,
        num_ranks=num_ranks,
        num_microbatches=num_microbatches,
        stages=stages,
        pipelines=pipelines,
        mb_pipeline=mb_pipeline,
        ranks=ranks,
        params=dict(params),
        devices=devices,
        source=source,
        communicators=communicators,
        weights=weights,
    )


def _get(data: dict, key: str, kind: type):
    if key not in data:
        raise ImportError_(f"pipec program has no field \"{key}\"")
    value = data[key]
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise ImportError_(f"field \"{key}\" must be a {kind.__name__}, got {type(value).__name__}")
    return value


def _get_int(data: dict, key: str, low: int) -> int:
    value = _get(data, key, int)
    if value < low:
        raise ImportError_(f"field \"{key}\" must be at least {low}, got {value}")
    return value


def _read_int_list(values: list, what: str, bound: int | None) -> list[int]:
    for i, v in enumerate(values):
        if type(v) is not int or v < 0 or (bound is not None and v >= bound):
            limit = f" in 0..{bound - 1}" if bound is not None else " >= 0"
            raise ImportError_(f"\"{what}\"[{i}] must be an integer{limit}, got {v!r}")
    return list(values)


def _read_stages(raw: list, num_ranks: int) -> list[StageInfo]:
    stages = []
    for i, entry in enumerate(raw):
        if not isinstance(entry, dict):
            raise ImportError_(f"stages[{i}] must be an object")
        fields = []
        for key in ("id", "rank", "pipeline", "position"):
            value = entry.get(key)
            if type(value) is not int or value < 0:
                raise ImportError_(f"stages[{i}].{key} must be a non-negative integer, got {value!r}")
            fields.append(value)
        if fields[0] != i:
            raise ImportError_(f"stages[{i}] has id {fields[0]}; stage ids must equal their index")
        if fields[1] >= num_ranks:
            raise ImportError_(f"stage {i} is on rank {fields[1]}, but there are {num_ranks} ranks")
        stages.append(StageInfo(*fields))
    return stages


def _read_pipelines(raw: list, stages: list[StageInfo]) -> list[list[int]]:
    pipelines = []
    for p, line in enumerate(raw):
        if not isinstance(line, list):
            raise ImportError_(f"pipelines[{p}] must be a list of stage ids")
        pipelines.append(_read_int_list(line, f"pipelines[{p}]", len(stages)))
    # The stage table and the pipelines say the same thing twice; next_stage()
    # and prev_stage() rely on them agreeing.
    for info in stages:
        if info.pipeline >= len(pipelines) or info.position >= len(pipelines[info.pipeline]) \
                or pipelines[info.pipeline][info.position] != info.id:
            raise ImportError_(
                f"stage {info.id} says it is at position {info.position} of pipeline {info.pipeline}, "
                f"but \"pipelines\" disagrees"
            )
    return pipelines


def _read_communicators(raw: list, num_ranks: int) -> list[Communicator]:
    communicators = []
    for i, entry in enumerate(raw):
        if not isinstance(entry, dict):
            raise ImportError_(f"communicators[{i}] must be an object")
        for key in ("id", "key"):
            value = entry.get(key)
            if type(value) is not int or value < 0:
                raise ImportError_(f"communicators[{i}].{key} must be a non-negative integer, got {value!r}")
        if entry["id"] != i:
            raise ImportError_(f"communicators[{i}] has id {entry['id']}; communicator ids must equal their index")
        ranks = entry.get("ranks")
        if not isinstance(ranks, list) or not ranks:
            raise ImportError_(f"communicators[{i}].ranks must be a non-empty list of ranks")
        ranks = _read_int_list(ranks, f"communicators[{i}].ranks", num_ranks)
        if any(a >= b for a, b in zip(ranks, ranks[1:])):
            raise ImportError_(f"communicators[{i}].ranks must be ascending without repeats, got {ranks}")
        purpose = entry.get("purpose")
        if purpose not in _PURPOSES:
            raise ImportError_(f"communicators[{i}].purpose is {purpose!r}; known: "
                               + ", ".join(repr(p) for p in _PURPOSES))
        communicators.append(Communicator(i, tuple(ranks), purpose, entry["key"]))
    return communicators


def _read_weights(data: dict, num_ranks: int, num_layers: int) -> WeightPlan | None:
    """``Program.weights`` from ``owners`` and ``weights`` (both null or absent for activation passing)."""
    raw, owners = data.get("weights"), data.get("owners")
    if raw is None:
        if owners is not None:
            raise ImportError_("field \"owners\" needs \"weights\" (a weight-passing program has both)")
        return None
    if not isinstance(raw, dict):
        raise ImportError_("field \"weights\" must be an object or null")
    if owners is not None:
        if not isinstance(owners, list) or len(owners) != num_layers:
            raise ImportError_(f"field \"owners\" must list the owner rank of each of the {num_layers} layers")
        owners = tuple(_read_int_list(owners, "owners", num_ranks))
    groups = raw.get("groups")
    if not isinstance(groups, list) or len(groups) != num_ranks:
        raise ImportError_(f"weights.groups must list the group of each of the {num_ranks} ranks")
    groups = tuple(_read_int_list(groups, "weights.groups", num_ranks))
    route, gradients = raw.get("route"), raw.get("gradients")
    if route not in WEIGHT_ROUTES:
        raise ImportError_(f"weights.route is {route!r}; known: {', '.join(WEIGHT_ROUTES)}")
    if gradients not in GRADIENT_ROUTES:
        raise ImportError_(f"weights.gradients is {gradients!r}; known: {', '.join(GRADIENT_ROUTES)}")
    if (owners is None) != (route == "all_gather"):
        raise ImportError_("\"owners\" is null exactly when weights.route is all_gather (every rank keeps a shard)")
    numbers = {}
    for key, low in (("ring_by", None), ("prefetch", 0), ("num_steps", 0)):
        value = raw.get(key)
        if type(value) is not int or (low is not None and value < low):
            raise ImportError_(f"weights.{key} must be an integer{'' if low is None else f' >= {low}'}, got {value!r}")
        numbers[key] = value
    buffers = raw.get("buffers")
    if buffers is not None and (type(buffers) is not int or buffers < 1):
        raise ImportError_(f"weights.buffers must be a positive integer or null, got {buffers!r}")
    return WeightPlan(owners, groups, route, numbers["ring_by"], gradients, numbers["prefetch"], buffers,
                      numbers["num_steps"])


def _read_row(row: list, rank: int, limits: tuple[int, int, int], raw_ranks: list) -> list[Action]:
    actions = []
    for step, obj in enumerate(row):
        try:
            actions.append(_read_instruction(obj, limits, inside=None))
        except _BadInstruction as bad:
            raise ImportError_(str(bad), rank=rank, step=step, grid=_raw_grid(raw_ranks)) from None
    return actions


class _BadInstruction(Exception):
    """Internal: what is wrong with one instruction; located by the caller."""


def _read_instruction(obj: Any, limits: tuple[int, int, int], inside: str | None) -> Action:
    if not isinstance(obj, dict):
        raise _BadInstruction(f"an instruction must be an object, got {obj!r}")
    get = obj.get
    op = get("op")
    required = _REQUIRED_FIELDS.get(op) if isinstance(op, str) else None
    if required is None:
        raise _BadInstruction(f"unknown op {op!r}; known: {', '.join(_REQUIRED_FIELDS)}")
    if inside is not None and op not in _PARTS_OF[inside]:
        what = "sends and receives" if inside == ops.BATCH else "the parts of weight passing's exchanges"
        raise _BadInstruction(f"a {inside} may only hold {what}, not {op}")
    if inside is None and op in ops.EXCHANGE_PART_OPS:
        raise _BadInstruction(f"{op} is a part of an EXCHANGE, not an instruction of its own")
    num_stages, num_microbatches, num_ranks = limits
    if op in _STEP_NUMBERED:  # mb is a step or an exchange number: any integer >= -1
        num_microbatches = INT_LIMIT
    stage, mb, peer = get("stage", -1), get("mb", -1), get("peer", -1)
    # one combined test for the common, valid case; _index says what is wrong otherwise
    if not (type(stage) is int and type(mb) is int and type(peer) is int
            and -1 <= stage < num_stages and -1 <= mb < num_microbatches and -1 <= peer < num_ranks):
        _index(obj, "stage", num_stages)
        _index(obj, "mb", num_microbatches)
        _index(obj, "peer", num_ranks)
    for key in required:
        if key not in obj:
            raise _BadInstruction(f"{op} instruction needs field \"{key}\"")
    parts: tuple[Action, ...] = ()
    if "parts" in required:
        raw_parts = obj["parts"]
        if not isinstance(raw_parts, list) or not raw_parts:
            raise _BadInstruction(f"a {op} needs a non-empty list \"parts\"")
        parts = tuple(_read_instruction(p, limits, inside=op) for p in raw_parts)
    elif "parts" in obj:
        raise _BadInstruction(f"only a BATCH or an EXCHANGE has \"parts\", not {op}")
    action = _make_action((stage, op, mb, peer, parts))
    text = get("text")
    if text != action.text():
        raise _BadInstruction(f"\"text\" is {text!r} but the fields say {action.text()!r}")
    return action


def _index(obj: dict, key: str, bound: int) -> None:
    """Raise if an optional index field is neither absent/-1 nor an int in 0..bound-1."""
    value = obj.get(key, -1)
    if type(value) is not int or not -1 <= value < bound:
        raise _BadInstruction(f"\"{key}\" must be an integer in 0..{bound - 1}, got {value!r}")


def _raw_grid(raw_ranks: list) -> list[list[str]]:
    """The ranks as text for an error window, tolerating malformed entries."""
    grid = []
    for row in raw_ranks:
        cells = row if isinstance(row, list) else []
        grid.append([str(c.get("text", "?")) if isinstance(c, dict) else "?" for c in cells])
    return grid
