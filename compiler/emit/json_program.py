"""A ``Program`` as JSON: what ``pipec compile --format json`` writes and the runtime loads.

``program_to_json`` encodes any ``Program`` as a JSON-ready dict;
``write_program_json`` writes the same document compactly, streamed rank by
rank with a newline before each rank's instructions (never held whole in
memory; its docstring says why);
``program_from_json`` decodes and validates one. The format (version 1: the
header, the instructions, the weight-passing and sequence-ring sections, an
example) is described in docs/formats.md, "The JSON program".

Guarantees: ``program_from_json(program_to_json(p)) == p`` for every program.
Loading validates structure and ranges (every field an op's rule lists, every
index in range, each family's section consistent with its instructions) and
reports the first problem as an ``ImportError_``, at ``rank R, step S`` for an
instruction; the semantic checks (dataflow, matching, deadlock) stay in
``pipec.compiler.checks``. Each instruction's ``text`` (torch's token) is
redundant and checked on load: it is there for people and tools that read the
file, and a hand edit that changes one but not the other is caught instead of
silently believed.
"""
from __future__ import annotations

import json
from dataclasses import replace
from typing import Any, TextIO

from pipec.compiler import ops
from pipec.compiler.guarded_read import INT_LIMIT, quote
from pipec.compiler.guarded_read import read_int_list as _read_int_list
from pipec.compiler.ir import (NO_PEER, ROW_SHARE, SEQUENCE_SHARE, SHARE_SPLITS, Action, Communicator, Mesh, Placement,
                               Program, StageInfo, build_program)
# The cyclic GC rescans every object built so far each time allocations trigger
# it; these passes build hundreds of thousands of acyclic ones.
from pipec.compiler.family import all_families, families_of, runs_in_stages
from pipec.compiler.gc_pause import paused_gc
from pipec.dsl.limits import MAX_RANKS, MAX_TASKS
from pipec.errors import ImportError_

# The most instructions a program file may hold: what the language's largest task grid (MAX_TASKS) compiles
# to with its sends and receives and frees, about four per task, with room to spare; each costs about 1 KiB
# to check and simulate, so this bounds the work to some GiB before it starts.
MAX_PROGRAM_INSTRUCTIONS = 4 * MAX_TASKS
# A mesh names at most this many axes (pp, dp, cp and a few more: what any composition uses).
MAX_MESH_AXES = 8

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
# Sequence rings: the sends and receives that move KV and dK, dV partials, and
# the all_to_all parts that hold them (the one part with parts of its own).
_RING_MOVES = tuple(op for op in ops.RING_PART_OPS if ops.RULES[op].category in (ops.PART_SEND, ops.PART_RECV))
_ALLTOALL_OPS = tuple(op for op in ops.RING_PART_OPS if "parts" in ops.RULES[op].fields)
# The ops a posting instruction may hold: a BATCH sends and receives, an EXCHANGE
# its parts, an all_to_all the ring's sends and receives; and how messages say so.
_PARTS_OF = {op: ops.COMM_OPS for op in ops.ops_of(ops.BATCH_OF)}
# (a composed program's exchange posts its stage group's gradient reduction, SYNC_GRAD or REDUCE_GRAD: the
# group collectives are read only in a program with a stage on a group, ``_limits``)
_PARTS_OF.update({op: ops.EXCHANGE_PART_OPS for op in ops.EXCHANGE_OPS})
_PARTS_OF.update({op: _RING_MOVES for op in _ALLTOALL_OPS})
_PARTS_WORDS = {op: "sends and receives" for op in ops.ops_of(ops.BATCH_OF)}
_PARTS_WORDS.update({op: "the parts of an exchange (weight passing's or a sequence ring's)" for op in ops.EXCHANGE_OPS})
_PARTS_WORDS.update({op: f"the sends and receives of KV and dK, dV partials ({', '.join(_RING_MOVES)})"
                     for op in _ALLTOALL_OPS})
# A compute of a stage on a group of ranks may hold sub-steps (a program with such a stage only).
_PARTS_OF.update({op: ops.SUBSTEP_OPS for op in ops.COMPUTE_OPS})
_PARTS_WORDS.update({op: f"sub-steps ({', '.join(ops.SUBSTEP_OPS)})" for op in ops.COMPUTE_OPS})
_SUBSTEPS = frozenset(ops.SUBSTEP_OPS)
# Weight passing's ops (and the exchanges sequence rings share) number steps
# and exchanges in ``mb``, not microbatches.
_STEP_NUMBERED = frozenset(ops.WEIGHT_OPS)
# A sequence ring's ops, for the message naming one in another program (which
# program may hold which ops: ``Family.instruction_bounds``).
_RING_FAMILY = frozenset(op for op, rule in ops.RULES.items() if rule.family == ops.SEQUENCE_RING)
ops.declare_pass("json program", _REQUIRED_FIELDS)
# What collectives' communicators may be for (``ops.OpRule.communicator``).
_GROUP_PURPOSES = (ops.STAGE_GROUP, ops.SHARD_REPLICAS)
_PURPOSES = tuple(dict.fromkeys(rule.communicator for rule in ops.RULES.values() if rule.communicator
                                 and rule.communicator not in _GROUP_PURPOSES))
# ... and in a program with a stage on a group of ranks, that group's (under HSDP its shard and replica groups).
_PLACED_PURPOSES = _PURPOSES + _GROUP_PURPOSES


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
        "stages": [_stage_to_json(s) for s in program.stages],
        "pipelines": [list(line) for line in program.pipelines],
        "mb_pipeline": list(program.mb_pipeline),
        "devices": None if program.devices is None else list(program.devices),
        "communicators": [
            {"id": c.id, "ranks": list(c.ranks), "purpose": c.purpose, "key": c.key}
            for c in program.communicators
        ],
        # a weight-passing program fills these; every other program's file has them null
        "owners": None,
        "weights": None,
        # a family's plan fields, in the family's words (a sequence ring adds "rings")
        **{key: value for family in families_of(program) for key, value in family.plan_to_json(program).items()},
        # only under weight stashing: other programs' files stay as they were
        **({} if program.weight_versions == 1 else {"weight_versions": program.weight_versions}),
        # only in a composed program: its rank axes, outermost first
        **({} if program.mesh is None else {"mesh": [[name, size] for name, size in program.mesh.axes]}),
        # only in a context-parallel composition: the ring program its stages run inside F and B
        **({} if program.stage_ring is None else {"stage_ring": program_to_json(program.stage_ring)}),
    }


def _stage_to_json(info: StageInfo) -> dict:
    out = {"id": info.id, "rank": info.rank, "pipeline": info.pipeline, "position": info.position}
    if info.placement is not None:  # only a stage on a group: every other file is as before
        out["placement"] = {"ranks": list(info.placement.ranks), "communicator": info.placement.communicator}
        if info.placement.sharded:
            out["placement"]["sharded"] = True
        if info.placement.split != ROW_SHARE:
            out["placement"]["split"] = info.placement.split
        if info.placement.hybrid:  # HSDP only: every other placement is written as before
            out["placement"]["shard_groups"] = list(info.placement.shard_groups)
            out["placement"]["replica_groups"] = list(info.placement.replica_groups)
        # each member's roles (``Placement``): the facts the runtime acts on, written whatever they are
        out["placement"]["shares"] = list(info.placement.shares)
        if info.placement.sharded:
            out["placement"]["shards"] = list(info.placement.shards)
        out["placement"]["saver"] = info.placement.saver
    return out


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
    number = str(action.mb) if action.mb >= 0 else ""
    own = f"{action.stage}{action.op}{number}" if action.stage >= 0 else action.op + number  # a compute's sub-steps
    text = "(" + ";".join(texts) + ")" + own
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


def program_from_json(data: dict, *, nested: bool = False) -> Program:
    """Decode (and validate) a version-1 program dict.

    Args:
        data: the parsed JSON, as written by ``program_to_json``.
    Returns:
        the ``Program`` it describes.
    Raises:
        ImportError_: a missing or mistyped field, an unknown op, an index out
            of range, or an instruction whose ``text`` disagrees with its fields.
    """
    _check_format(data)
    name = _get(data, "name", str)
    source = data.get("source", "")
    if not isinstance(source, str):
        raise ImportError_("field \"source\" must be a string")
    params = _get(data, "params", dict)
    for key, value in params.items():
        if type(value) not in (int, bool):
            raise ImportError_(f"parameter {quote(key)} must be an integer or a boolean, got {quote(value)}")
    num_ranks = _get_int(data, "num_ranks", low=1, high=(MAX_RANKS, "ranks"))
    num_microbatches = _get_int(data, "num_microbatches", low=0, high=(MAX_TASKS, "tasks"))
    _check_instruction_count(data)
    stages = _read_stages(_get(data, "stages", list), num_ranks)
    pipelines = _read_pipelines(_get(data, "pipelines", list), stages)
    mb_pipeline = _read_int_list(_get(data, "mb_pipeline", list), "mb_pipeline", len(pipelines))
    if len(mb_pipeline) != num_microbatches:
        raise ImportError_(f"\"mb_pipeline\" has {len(mb_pipeline)} entries for {num_microbatches} microbatches")
    devices = _read_devices(data, num_ranks)
    communicators = _read_communicators(data, stages, num_ranks)
    stages = _stated_hybrid_shards(stages, communicators)
    header = {"num_ranks": num_ranks, "num_microbatches": num_microbatches, "stages": stages, "pipelines": pipelines,
              "communicators": communicators}
    plans = [(family, plan) for family in all_families()  # each family reads its own fields
             for plan in (family.plan_from_json(data, header),) if plan is not None]
    weight_versions = data.get("weight_versions", 1)
    if weight_versions is not None and (type(weight_versions) is not int or weight_versions < 1):
        raise ImportError_(f"field \"weight_versions\" must be a positive integer or null, got {quote(weight_versions)}")
    mesh = _read_mesh(data, num_ranks)
    stage_ring = _read_stage_ring(data, stages, nested)
    raw_ranks = _get(data, "ranks", list)
    if len(raw_ranks) != num_ranks:
        raise ImportError_(f"\"ranks\" has {len(raw_ranks)} rows for {num_ranks} ranks")
    limits = _op_limits(len(stages), num_microbatches, num_ranks, plans or [(all_families()[0], None)],
                        any(s.placement for s in stages))
    ranks = []
    with paused_gc():
        for r, row in enumerate(raw_ranks):
            if not isinstance(row, list):
                raise ImportError_(f"rank {r}'s instructions must be a list", rank=r)
            ranks.append(_read_row(row, r, limits, raw_ranks))
    return build_program(name, num_ranks, num_microbatches, stages, pipelines, mb_pipeline, ranks,
                         plans=[plan for _, plan in plans], params=dict(params), devices=devices, source=source,
                         communicators=communicators, weight_versions=weight_versions, mesh=mesh,
                         stage_ring=stage_ring)


def _read_stage_ring(data: dict, stages: list[StageInfo], nested: bool) -> Program | None:
    """``stage_ring``: absent or null, else the sequence-ring program (a program document of its own, one level
    deep) that the context-parallel stages run, one ring rank per member of each such stage's group."""
    raw = data.get("stage_ring")
    sequence = [s for s in stages if s.placement is not None and s.placement.split == SEQUENCE_SHARE]
    if raw is None:
        if sequence:
            raise ImportError_(f"stage {sequence[0].id} is placed with split \"sequence\" but the program has no "
                               "\"stage_ring\" to run its attention with")
        return None
    if nested:
        raise ImportError_("a \"stage_ring\" holds a \"stage_ring\" of its own; a ring program runs inside a stage, "
                           "and nothing runs inside the ring")
    if not isinstance(raw, dict):
        raise ImportError_(f"field \"stage_ring\" must be a program document or null, got {quote(raw)}")
    try:
        ring = program_from_json(raw, nested=True)
    except ImportError_ as error:
        raise ImportError_(f"in \"stage_ring\": {error.message}") from None
    if not runs_in_stages(ring):
        raise ImportError_("field \"stage_ring\" must be a sequence-ring program (with \"rings\")")
    for info in sequence:
        if len(info.placement.ranks) != ring.num_ranks:
            raise ImportError_(f"stage {info.id} is placed on {len(info.placement.ranks)} ranks, but its "
                               f"\"stage_ring\" runs on {ring.num_ranks}")
    if not sequence:
        raise ImportError_("the program has a \"stage_ring\" but no stage placed with split \"sequence\" runs it")
    return ring


def _read_mesh(data: dict, num_ranks: int) -> Mesh | None:
    """``mesh``: absent or null for a program of plain ranks, else [[axis, size], ...] whose sizes multiply
    to ``num_ranks``."""
    raw = data.get("mesh")
    if raw is None:
        return None
    if not isinstance(raw, list) or not raw or len(raw) > MAX_MESH_AXES:
        raise ImportError_(f"field \"mesh\" must list 1 to {MAX_MESH_AXES} axes as [name, size], got {quote(raw)}")
    axes = []
    for i, axis in enumerate(raw):
        if not (isinstance(axis, list) and len(axis) == 2 and isinstance(axis[0], str)
                and axis[0].isidentifier() and type(axis[1]) is int and 1 <= axis[1] <= num_ranks):
            raise ImportError_(f"mesh[{i}] must be [name, size] with a name and a size of 1 to {num_ranks}, "
                               f"got {quote(axis)}")
        if any(axis[0] == name for name, _ in axes):
            raise ImportError_(f"mesh[{i}] names the axis {quote(axis[0])} twice")
        axes.append((axis[0], axis[1]))
    mesh = Mesh(tuple(axes))
    if mesh.size != num_ranks:
        raise ImportError_(f"field \"mesh\" has {mesh.size} ranks ({' x '.join(str(n) for _, n in axes)}) "
                           f"for a program of {num_ranks}")
    return mesh


def _check_format(data) -> None:
    """``data`` is a JSON object of this format, at the version this pipec reads."""
    if not isinstance(data, dict):
        raise ImportError_(f"a pipec program is a JSON object, not {type(data).__name__}")
    if data.get("format") != FORMAT:
        raise ImportError_(f"not a pipec program: \"format\" is {data.get('format')!r}, expected {FORMAT!r}")
    if data.get("version") != VERSION or type(data.get("version")) is not int:
        raise ImportError_(f"unsupported pipec program version {data.get('version')!r}; this pipec reads version {VERSION}")


def _read_devices(data: dict, num_ranks: int) -> list[int] | None:
    """``Program.devices`` from ``devices`` (null or absent: the identity): a permutation of the ranks."""
    devices = data.get("devices")
    if devices is None:
        return None
    if not isinstance(devices, list):
        raise ImportError_("field \"devices\" must be a list or null")
    if len(devices) != num_ranks:
        raise ImportError_(f"\"devices\" has {len(devices)} entries for {num_ranks} ranks")
    devices = _read_int_list(devices, "devices", num_ranks)
    # as the language's device map: a permutation of the ranks (a rank per device, every device used)
    seen: dict[int, int] = {}
    for rank, device in enumerate(devices):
        if device in seen:
            raise ImportError_(f"\"devices\"[{rank}] is device {device}, which rank {seen[device]} runs on too: "
                               f"\"devices\" must be a permutation of 0..{num_ranks - 1}")
        seen[device] = rank
    return devices


def _get(data: dict, key: str, kind: type):
    if key not in data:
        raise ImportError_(f"pipec program has no field \"{key}\"")
    value = data[key]
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise ImportError_(f"field \"{key}\" must be a {kind.__name__}, got {type(value).__name__}")
    return value


def _get_int(data: dict, key: str, low: int, high: tuple[int, str] | None = None) -> int:
    """``data[key]``, an integer at least ``low`` and, with ``high`` = (limit, what it bounds), at most the limit,
    which the message names: refused here, before anything the size makes is built."""
    value = _get(data, key, int)
    if value < low:
        raise ImportError_(f"field \"{key}\" must be at least {low}, got {value}")
    if high is not None and value > high[0]:
        raise ImportError_(f"field \"{key}\" is {value:,}, past pipec's limit of {high[0]:,} {high[1]} "
                           f"(the language's, dsl/limits.py); nothing was read further")
    return value


def _check_instruction_count(data: dict) -> None:
    """The program's instructions (its rows' lengths, parts not counted) within ``MAX_PROGRAM_INSTRUCTIONS``,
    counted before any is decoded."""
    rows = data.get("ranks")
    if not isinstance(rows, list):
        return  # named where "ranks" is read
    count = sum(len(row) for row in rows if isinstance(row, list))
    if count > MAX_PROGRAM_INSTRUCTIONS:
        raise ImportError_(f"the program has {count:,} instructions, past pipec's limit of "
                           f"{MAX_PROGRAM_INSTRUCTIONS:,} for a program file; nothing was decoded")


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
        stages.append(StageInfo(*fields, _read_placement(entry, i, fields[1], num_ranks)))
    return stages


def _read_placement(entry: dict, i: int, rank: int, num_ranks: int) -> Placement | None:
    """``stages[i].placement`` (absent or null: the stage lives on ``rank`` alone); its communicator is checked
    once the communicators are read (``_check_placements``)."""
    raw = entry.get("placement")
    if raw is None:
        return None
    if not isinstance(raw, dict) or not isinstance(raw.get("ranks"), list):
        raise ImportError_(f"stages[{i}].placement must be an object with a list \"ranks\" and a \"communicator\"")
    ranks = _read_int_list(raw["ranks"], f"stages[{i}].placement.ranks", num_ranks)
    if len(ranks) < 2 or any(a >= b for a, b in zip(ranks, ranks[1:])):
        raise ImportError_(f"stages[{i}].placement.ranks must list two or more ranks, ascending without repeats, "
                           f"got {ranks} (a stage on one rank is written by its \"rank\" alone)")
    if rank != ranks[0]:
        raise ImportError_(f"stage {i} is on rank {rank} but placed on ranks {ranks}: a stage on a group names "
                           "its first member as its \"rank\"")
    groups = {}
    for key in ("shard_groups", "replica_groups"):  # HSDP's (``Placement``); checked with the communicators
        value = raw.get(key, [])
        if not isinstance(value, list) or any(type(c) is not int or c < 0 for c in value):
            raise ImportError_(f"stages[{i}].placement.{key} must be a list of communicator ids, got {quote(value)}")
        groups[key] = tuple(value)
    communicator = raw.get("communicator")
    hybrid = bool(groups["shard_groups"])
    if type(communicator) is not int or communicator < (-1 if hybrid else 0):
        raise ImportError_(f"stages[{i}].placement.communicator must be a non-negative integer (-1 with "
                           f"\"shard_groups\"), got {quote(communicator)}")
    sharded = raw.get("sharded", False)
    if type(sharded) is not bool:
        raise ImportError_(f"stages[{i}].placement.sharded must be true or false, got {quote(sharded)}")
    split = raw.get("split", ROW_SHARE)
    if split not in SHARE_SPLITS:
        raise ImportError_(f"stages[{i}].placement.split must be one of {', '.join(map(quote, SHARE_SPLITS))}, "
                           f"got {quote(split)}")
    roles = {}
    for key in ("shares", "shards"):  # absent (files written before roles): the plain ones (``Placement``)
        if key in raw:
            if not isinstance(raw[key], list) or len(raw[key]) != len(ranks):
                raise ImportError_(f"stages[{i}].placement.{key} must list one integer per member ({len(ranks)}), "
                                   f"got {quote(raw[key])}")
            roles[key] = tuple(_read_int_list(raw[key], f"stages[{i}].placement.{key}", len(ranks)))
    if "saver" in raw:
        if type(raw["saver"]) is not int or not 0 <= raw["saver"] < num_ranks:
            raise ImportError_(f"stages[{i}].placement.saver must be a rank of the program (0..{num_ranks - 1}), "
                               f"got {quote(raw['saver'])}")
        roles["saver"] = raw["saver"]
    return Placement(tuple(ranks), communicator, sharded, split, **groups, **roles)


def _stated_hybrid_shards(stages: list[StageInfo], communicators: list[Communicator]) -> list[StageInfo]:
    """``stages`` with every HSDP placement that states no shards given the plain ones: each member's index in
    its shard group (what ``mesh_placement`` states; a file written before roles holds none)."""
    out = []
    for info in stages:
        placement = info.placement
        if placement is not None and placement.hybrid and not placement.shards:
            groups = [communicators[c].ranks for c in placement.shard_groups]
            shards = tuple(next((g.index(r) for g in groups if r in g), -1) for r in placement.ranks)
            info = replace(info, placement=replace(placement, shards=shards))
        out.append(info)
    return out


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


def _read_communicators(data: dict, stages: list[StageInfo], num_ranks: int) -> list[Communicator]:
    """``Program.communicators`` (absent: derived by the program), and each placed stage's among them."""
    placed = any(info.placement is not None for info in stages)
    raw = _get(data, "communicators", list) if "communicators" in data else []
    communicators = []
    purposes = _PLACED_PURPOSES if placed else _PURPOSES
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
        if purpose not in purposes:
            raise ImportError_(f"communicators[{i}].purpose is {purpose!r}; known: "
                               + ", ".join(repr(p) for p in purposes))
        communicators.append(Communicator(i, tuple(ranks), purpose, entry["key"]))
    _check_placements(stages, communicators)
    return communicators


def _check_placements(stages: list[StageInfo], communicators: list[Communicator]) -> None:
    """Each placed stage meets on a communicator of the program whose members are exactly its group."""
    for info in stages:
        placement = info.placement
        if placement is None:
            continue
        if placement.hybrid:  # the groups' shape is the prover's (``checks.placement``); here: they exist
            listed = placement.shard_groups + placement.replica_groups + (placement.communicator,)
            if max(listed) >= len(communicators):
                raise ImportError_(f"stage {info.id} is placed on ranks {list(placement.ranks)} with hybrid "
                                   f"sharding meeting on communicator {max(listed)}, but \"communicators\" lists "
                                   f"{len(communicators)}")
            continue
        if placement.communicator >= len(communicators):
            raise ImportError_(f"stage {info.id} is placed on ranks {list(placement.ranks)} meeting on communicator "
                               f"{placement.communicator}, but \"communicators\" lists {len(communicators)}")
        group = communicators[placement.communicator]
        if group.ranks != placement.ranks or group.purpose != ops.STAGE_GROUP:
            raise ImportError_(f"stage {info.id} is placed on ranks {list(placement.ranks)}, but its communicator "
                               f"{group.id} is {group.purpose!r} on ranks {list(group.ranks)}: a stage's group meets "
                               f"on a communicator of exactly its members ({ops.STAGE_GROUP!r})")


# What an instruction's fields may hold, per op: (required fields, then the
# bounds of stage, mb and peer: each lies in -1..bound-1, -1 being "none").
_Limits = dict


def _op_limits(num_stages: int, num_microbatches: int, num_ranks: int, plans: list, placed: bool = False) -> _Limits:
    """The ops this program may hold, each with its required fields and its fields' bounds.

    Each of the program's families (``plans``: (family, its plan)) may refuse
    an op or narrow its bounds (``Family.instruction_bounds``): a sequence ring
    holds only its family's ops and the exchanges, and no other program holds
    its ops. The sub-steps only a program with a stage on a group of ranks (``placed``) may hold,
    where they name a compute's stage and microbatch.
    """
    limits: _Limits = {}
    for op, required in _REQUIRED_FIELDS.items():
        if op in _SUBSTEPS and not placed:
            continue
        step_numbered = op in _STEP_NUMBERED and op not in _SUBSTEPS
        bounds = (num_stages, INT_LIMIT if step_numbered else num_microbatches, num_ranks)
        for family, plan in plans:
            bounds = bounds and family.instruction_bounds(plan, op, bounds)
        if bounds is not None:
            limits[op] = (required, *bounds)
    return limits


def _read_row(row: list, rank: int, limits: _Limits, raw_ranks: list) -> list[Action]:
    actions = []
    for step, obj in enumerate(row):
        try:
            actions.append(_read_instruction(obj, limits, inside=None))
        except _BadInstruction as bad:
            raise ImportError_(str(bad), rank=rank, step=step, grid=_raw_grid(raw_ranks)) from None
    return actions


class _BadInstruction(Exception):
    """Internal: what is wrong with one instruction; located by the caller."""


def _read_instruction(obj: Any, limits: _Limits, inside: str | None) -> Action:
    if not isinstance(obj, dict):
        raise _BadInstruction(f"an instruction must be an object, got {quote(obj)}")
    get = obj.get
    op = get("op")
    entry = limits.get(op) if isinstance(op, str) else None
    if entry is None:
        raise _BadInstruction(_not_an_op(op, limits))
    if inside is not None and op not in _PARTS_OF[inside]:
        raise _BadInstruction(f"{_a(inside)} may only hold {_PARTS_WORDS[inside]}, not {op}")
    if inside is None and op in _SUBSTEPS:
        raise _BadInstruction(f"{op} is a sub-step of a compute (one of its \"parts\"), not an instruction of its own")
    if inside is None and op in ops.EXCHANGE_PART_OPS:
        raise _BadInstruction(f"{op} is a part of an EXCHANGE, not an instruction of its own")
    required, num_stages, num_microbatches, num_ranks = entry
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
            raise _BadInstruction(f"{_a(op)} needs a non-empty list \"parts\"")
        parts = tuple(_read_instruction(p, limits, inside=op) for p in raw_parts)
    elif "parts" in obj and inside is None and op in ops.COMPUTE_OPS and _SUBSTEPS & limits.keys():
        parts = _read_substeps(obj["parts"], op, limits)
    elif "parts" in obj:
        raise _BadInstruction(f"only a BATCH, an EXCHANGE or an all_to_all ({', '.join(_ALLTOALL_OPS)}) has "
                              f"\"parts\", not {op}")
    action = _make_action((stage, op, mb, peer, parts))
    text = get("text")
    if text != action.text():
        raise _BadInstruction(f"\"text\" is {quote(text)} but the fields say {action.text()!r}")
    return action


def _read_substeps(raw_parts: Any, op: str, limits: _Limits) -> tuple[Action, ...]:
    """A compute's sub-steps (a program with a stage on a group of ranks); the prover checks what they name."""
    if not isinstance(raw_parts, list) or not raw_parts:
        raise _BadInstruction(f"{_a(op)} with sub-steps needs a non-empty list \"parts\"")
    return tuple(_read_instruction(p, limits, inside=op) for p in raw_parts)


def _not_an_op(op: Any, limits: _Limits) -> str:
    """Why ``op`` is no instruction of this program: unknown, or another family's."""
    if isinstance(op, str) and op in _REQUIRED_FIELDS:
        if op in _SUBSTEPS:
            return (f"{op} is a sub-step of a compute of a stage placed on a group of ranks, and this program places "
                    "none (no stage has a \"placement\")")
        if op in _RING_FAMILY:
            return (f"{op} is an instruction of a sequence ring, and this program is none (its header has no "
                    "\"rings\")")
        return f"{op} is not an instruction of a sequence ring (its ops: {', '.join(limits)})"
    return f"unknown op {quote(op)}; known: {', '.join(limits)}"


def _a(op: str) -> str:
    """``op`` with its article: a BATCH, an EXCHANGE."""
    return f"an {op}" if op[:1] in "AEIOU" else f"a {op}"


# What a sequence ring's fields name, for messages: a block is a query chunk
# against a KV piece, a move's bundle its holder rank's piece.
_FIELD_WORDS = {
    **{op: {"stage": "the query chunk", "mb": "the block"} for op in ops.RING_COMPUTE_OPS},
    **{op: {"stage": "the bundle's holder rank", "mb": "its KV piece"} for op in _RING_MOVES},
}


def _index(obj: dict, key: str, bound: int) -> None:
    """Raise if an optional index field is neither absent/-1 nor an int in 0..bound-1."""
    value = obj.get(key, -1)
    if type(value) is not int or not -1 <= value < bound:
        op = obj.get("op")
        if bound == 0:
            raise _BadInstruction(f"{op} has no \"{key}\" (absent, or -1), got {quote(value)}")
        words = _FIELD_WORDS.get(op, {}).get(key)
        named = f"\"{key}\" ({words})" if words else f"\"{key}\""
        raise _BadInstruction(f"{named} must be an integer in 0..{bound - 1}, got {quote(value)}")


def _raw_grid(raw_ranks: list) -> list[list[str]]:
    """The ranks as text for an error window, tolerating malformed entries."""
    grid = []
    for row in raw_ranks:
        cells = row if isinstance(row, list) else []
        grid.append([str(c.get("text", "?")) if isinstance(c, dict) else "?" for c in cells])
    return grid
