"""Sequence rings (ring, zigzag and TASP attention): KV travels rings of ranks (docs/rings.md).

Its programs carry a ``RingPlan`` (chunks, holders, rings). Lowering writes
the whole program, order and exchanges, from the rings (``lower_rings``); its
buffers are replaced by its exchanges, never freed, and its memory is KV
bytes, which the ring check bounds, so activation and byte budgets do not
apply; block times are exact fractions, reported as plain numbers; torch's
CSV has no form for it. Its ops stand only in its programs, which hold only
them and the exchanges; a program file's ``rings`` is read here.
"""
from __future__ import annotations

from dataclasses import replace

from pipec.compiler.family import Family, register
from pipec.compiler.guarded_read import quote, read_int_list
from pipec.compiler.ir import DKV_ROUTES, KV_ROUTES, TRANSFERS, WORLD, RingPlan
from pipec.compiler.lower_rings import lower_rings
from pipec.compiler.memory_counts import peak_kv_bytes
from pipec.compiler.ops import (
    PART_RECV, PART_SEND, RING_PART_OPS, RULES, SEQUENCE_RING, SHARED, SIZE_KV, VALUE_KINDS,
)
from pipec.dsl.limits import MAX_CHUNKS, MAX_TASKS
from pipec.errors import ImportError_, UsageError, counted

# What a ring program's file may hold: the family's ops and the exchanges every family shares, that post
# and wait its parts; a KV or dK, dV move names a bundle (``stage`` its holder rank, ``mb`` its piece).
_PROGRAM_OPS = frozenset(op for op, rule in RULES.items() if rule.family in (SEQUENCE_RING, SHARED))
_MOVES = frozenset(op for op in RING_PART_OPS if RULES[op].category in (PART_SEND, PART_RECV))


class SequenceRings(Family):
    name = SEQUENCE_RING
    runs_ops_of = (SEQUENCE_RING,)
    stage_checks = False
    frees_values = False
    exact_times = True
    keeps_own_ops = True
    counts_activations = False
    runs_in_stages = True
    writes_own_steps = True
    searches_itself = True

    def plan_of(self, program):
        return program.rings

    def written_step(self, program, rank, index):
        return program.rings.step_of(rank, index, len(program.ranks[rank]))

    def plan_to_json(self, program):
        plan = program.rings
        return {"rings": {"chunks": plan.chunks, "holders": list(plan.holders), "pieces": plan.pieces,
                          "rings": [list(ring) for ring in plan.rings], "causal": plan.causal, "kv": plan.kv,
                          "dkv": plan.dkv, "transfer": plan.transfer, "note": plan.note}}

    def plan_from_json(self, data, header):
        if data.get("rings") is None:
            return None
        plan = _read_rings(data["rings"], header["num_ranks"])
        _check_ring_header(plan, header)
        return plan

    def instruction_bounds(self, plan, op, bounds):
        if op not in _PROGRAM_OPS:
            return None
        if op in _MOVES:
            bounds = (bounds[2], plan.pieces, bounds[2])
        fields = RULES[op].fields
        return tuple(bound if key in fields else 0 for key, bound in zip(("stage", "mb", "peer"), bounds))

    def spec_plan(self, spec):
        return spec.rings

    def lower(self, spec, costs):
        program = lower_rings(spec)
        return replace(program, ranks=[[a for a in row if a.is_compute] for row in program.ranks]), program

    def search(self, spec, program, costs, memory, *, time_limit, candidates, seed=0):
        """The rings KV travels, relabelled (``ring_search``; an enumeration in a fixed order, so ``seed`` is not
        read); memory limits are refused before (KV buffers)."""
        from pipec.compiler.families.ring_search import refuse_ring_search, search_rings  # it compiles candidates

        refusal = refuse_ring_search(spec)
        if refusal is not None:
            raise UsageError(f"pipec search: {refusal}")
        return search_rings(spec, program, costs, time_limit=time_limit, candidates=candidates)

    def refuse_memory_budget(self, name):
        return (f"'{name}' is a sequence ring: its memory is KV buffers, which the ring check bounds "
                "(two per piece under `kv again`); activation and byte budgets do not apply to it")

    def refuse_torch_csv(self, name):
        return (f"{name} is a sequence ring (ring attention: KV moves between ranks holding chunks of one "
                "sequence); torch's schedule CSV moves activations between the stages of one pipeline and has no "
                "form for it")

    def peak_bytes(self, program, sizes):
        kv = (peak_kv_bytes(program, program.rings, sizes[SIZE_KV]) if SIZE_KV in sizes
              else [0] * len(program.ranks))
        return [{size_class: kv[rank] if size_class == SIZE_KV else 0 for size_class in sizes}
                for rank in range(len(program.ranks))]

    def shape_text(self, program):
        plan = program.rings
        return (f"{counted(plan.chunks, 'chunk')} of {counted(plan.pieces, 'KV piece')} on "
                f"{counted(len(plan.rings), 'ring')}")

    def grid_shape_text(self, program):
        plan = program.rings
        return (f"{self.shape_text(program)} ({'causal' if plan.causal else 'full'} mask; kv {plan.kv}, "
                f"dkv {plan.dkv}, transfer {plan.transfer})")

    def note(self, program):
        return program.rings.note

    def value_share(self, program, part, kind):
        plan = program.rings
        if VALUE_KINDS[kind].size_class == SIZE_KV and 0 <= part.stage < plan.num_ranks:
            return plan.bundle_share(part.stage)  # a bundle: one piece of each of its holder's chunks
        return None

    def block_area(self, program, action):
        plan = program.rings
        if not (0 <= action.stage < plan.chunks and 0 <= action.mb < plan.chunks * plan.pieces):
            return None
        return plan.block_area(action.stage, *plan.unblock(action.mb))

    def proof_text(self, program, memory_text):
        # Blocks, KV and partials are what a ring moves and computes; it has no stages' activations.
        plan = program.rings
        blocks = sum(1 for q in range(plan.chunks) for kv in range(plan.chunks) for piece in range(plan.pieces)
                     if plan.visible(q, kv, piece))
        return (f"each of the {blocks} visible blocks computed once forward and once backward, KV where every "
                "block runs, every dK, dV contribution home once, messages matched, deadlock-free"
                + (f"\nnote: {plan.note}" if plan.note else ""))


def _read_rings(raw, num_ranks: int) -> RingPlan:
    """The ``RingPlan`` of a program file's ``rings`` (set), each field checked."""
    if not isinstance(raw, dict):
        raise ImportError_("field \"rings\" must be an object or null")
    chunks = raw.get("chunks")
    if type(chunks) is not int or not 1 <= chunks <= MAX_CHUNKS:
        raise ImportError_(f"rings.chunks must be an integer in 1..{MAX_CHUNKS:,}, got {quote(chunks)}")
    holders = raw.get("holders")
    if not isinstance(holders, list) or len(holders) != chunks:
        raise ImportError_(f"rings.holders must list the rank holding each of the {chunks} chunks")
    holders = tuple(read_int_list(holders, "rings.holders", num_ranks))
    counts = [0] * num_ranks
    for rank in holders:
        counts[rank] += 1
    if chunks % num_ranks or any(count != chunks // num_ranks for count in counts):
        rank = min(range(num_ranks), key=counts.__getitem__)
        raise ImportError_(f"rings.holders: rank {rank} holds {counts[rank]} of the {chunks} chunks, but every one "
                           f"of the {num_ranks} ranks holds the same share of the sequence")
    causal = raw.get("causal")
    if type(causal) is not bool:
        raise ImportError_(f"rings.causal must be true or false, got {quote(causal)}")
    pieces = raw.get("pieces")
    if type(pieces) is not int or pieces < 1:
        raise ImportError_(f"rings.pieces must be an integer >= 1, got {quote(pieces)}")
    pairs = chunks * (chunks + 1) // 2 if causal else chunks * chunks
    if 2 * pairs * pieces > MAX_TASKS:
        raise ImportError_(f"rings: {chunks} chunks of {pieces:,} pieces are {2 * pairs * pieces:,} attention tasks "
                           f"(a forward and a backward per visible block); pipec's limit is {MAX_TASKS:,}")
    rings = raw.get("rings")
    if not isinstance(rings, list) or not rings:
        raise ImportError_("rings.rings must be a non-empty list of rings, each listing every rank once")
    everyone = list(range(num_ranks))
    for i, ring in enumerate(rings):
        if not isinstance(ring, list) or len(ring) != num_ranks or any(type(r) is not int for r in ring) \
                or sorted(ring) != everyone:
            raise ImportError_(f"rings.rings[{i}] must list each of the {num_ranks} ranks once (a ring over "
                               f"every rank), got {quote(ring)}")
    routes = {}
    for key, known in (("kv", KV_ROUTES), ("dkv", DKV_ROUTES), ("transfer", TRANSFERS)):
        value = raw.get(key)
        if type(value) is not str or value not in known:
            raise ImportError_(f"rings.{key} is {quote(value)}; known: {', '.join(known)}")
        routes[key] = value
    note = raw.get("note", "")
    if not isinstance(note, str):
        raise ImportError_(f"rings.note must be a string, got {quote(note)}")
    return RingPlan(chunks, holders, pieces, tuple(tuple(ring) for ring in rings), causal, routes["kv"],
                    routes["dkv"], routes["transfer"], note)


def _check_ring_header(plan: RingPlan, header: dict) -> None:
    """The rest of the header says what ``lower_rings.ring_program`` makes of the plan: the checks and the
    simulator count on it."""
    stages, chunks, holders = header["stages"], plan.chunks, plan.holders
    if len(stages) != chunks:
        raise ImportError_(f"a sequence ring's stages are its query chunks: {chunks} chunks, but {len(stages)} stages")
    for info in stages:
        if info.rank != holders[info.id]:
            raise ImportError_(f"stage {info.id} (query chunk {info.id}) is on rank {info.rank}, but "
                               f"rings.holders[{info.id}] is {holders[info.id]}")
    num_microbatches = header["num_microbatches"]
    if num_microbatches != chunks * plan.pieces:
        raise ImportError_(f"a sequence ring's microbatches are its blocks, chunks x pieces = "
                           f"{chunks * plan.pieces:,}; \"num_microbatches\" is {num_microbatches:,}")
    communicators, num_ranks = header["communicators"], header["num_ranks"]
    if communicators and not any(c.purpose == WORLD and c.ranks == tuple(range(num_ranks)) for c in communicators):
        raise ImportError_(f"communicators: a sequence ring's all_to_all meets every rank, but none of the "
                           f"{len(communicators)} communicators is {WORLD!r} over all {num_ranks} ranks")


FAMILY = register(SequenceRings(), RingPlan)
