"""Sequence rings in the JSON program: written, read back exactly, checked by ``pipec check``, hostile files refused.

Programs come from ``lower_plan`` on ``RingPlan``s shaped like the shipped
schedules (zigzag on one ring, TASP on the Hamiltonian rings) under every
choice of KV route, dK, dV route and transfer; the files ``pipec`` reads are
written by ``write_program_json``, as ``pipec compile --format json`` writes
them, then edited the way a hand or a hostile tool would.
"""
from __future__ import annotations

import copy
import io
import itertools
import json
from pathlib import Path

import pytest

from pipec.cli import main
from pipec.compiler import ops
from pipec.compiler.checks import check_all
from pipec.compiler.emit import format_text_grid
from pipec.compiler.emit.json_program import program_from_json, program_to_json, write_program_json
from pipec.compiler.ir import WORLD, Action, Communicator, Program, RingPlan
from pipec.compiler.lower_rings import lower_plan
from pipec.compiler.rings import hamiltonian_rings
from pipec.errors import ImportError_

ROUTES = list(itertools.product(("p2p", "all_to_all"), ("again", "kept"), ("behind", "direct")))


def zigzag(P: int, transfer: str = "p2p", kv: str = "again", dkv: str = "behind") -> Program:
    """Zigzag ring attention on P ranks: 2P chunks, rank r holding r and 2P - 1 - r, one ring."""
    holders = tuple(c if c < P else 2 * P - 1 - c for c in range(2 * P))
    plan = RingPlan(2 * P, holders, 1, (tuple(range(P)),), True, kv, dkv, transfer)
    return lower_plan(plan, "zigzag", {"P": P, "causal": True}, "inline")


def tasp(P: int, transfer: str = "all_to_all", kv: str = "again", dkv: str = "behind") -> Program:
    """TASP: zigzag holders, KV cut into one piece per Hamiltonian ring."""
    found = hamiltonian_rings(P)
    holders = tuple(c if c < P else 2 * P - 1 - c for c in range(2 * P))
    plan = RingPlan(2 * P, holders, len(found.cycles), tuple(found.cycles), True, kv, dkv, transfer, found.note)
    return lower_plan(plan, "tasp", {"P": P, "causal": True})


def written(program: Program) -> str:
    out = io.StringIO()
    write_program_json(program, out)
    return out.getvalue()


# --------------------------------------------------------------- round trip


@pytest.mark.parametrize("P", [2, 3, 5])
@pytest.mark.parametrize("transfer, kv, dkv", ROUTES, ids=["-".join(r) for r in ROUTES])
def test_ring_programs_round_trip_exactly(P, transfer, kv, dkv):
    for program in (zigzag(P, transfer, kv, dkv), tasp(P, transfer, kv, dkv)):
        check_all(program)  # a program the compiler could have made
        text = written(program)
        assert json.loads(text) == program_to_json(program)  # streamed and built: one document
        back = program_from_json(json.loads(text))
        assert back == program
        assert back.rings == program.rings and back.communicators == program.communicators
        assert back.ranks == program.ranks and back.params == program.params
        assert type(back.rings.holders) is tuple and all(type(ring) is tuple for ring in back.rings.rings)
        assert all(type(a) is Action and all(type(p) is Action for p in a.parts) for row in back.ranks for a in row)
        check_all(back)


def test_the_rings_header_and_the_nested_parts():
    program = zigzag(2, "all_to_all")
    data = program_to_json(program)
    assert data["rings"] == {"chunks": 4, "holders": [0, 1, 1, 0], "pieces": 1, "rings": [[0, 1]], "causal": True,
                             "kv": "again", "dkv": "behind", "transfer": "all_to_all", "note": ""}
    assert data["params"] == {"P": 2, "causal": True}
    assert data["communicators"] == [{"id": 0, "ranks": [0, 1], "purpose": WORLD, "key": 0}]
    assert data["num_microbatches"] == 4 and [s["rank"] for s in data["stages"]] == [0, 1, 1, 0]
    first = data["ranks"][0][0]
    assert first == {
        "op": "EXCHANGE", "text": "((0SEND_KV0;1RECV_KV0)ALLTOALL_KV0)EXCHANGE0", "mb": 0,
        "parts": [{"op": "ALLTOALL_KV", "text": "(0SEND_KV0;1RECV_KV0)ALLTOALL_KV0", "mb": 0, "parts": [
            {"op": "SEND_KV", "text": "0SEND_KV0", "stage": 0, "mb": 0, "peer": 1},
            {"op": "RECV_KV", "text": "1RECV_KV0", "stage": 1, "mb": 0, "peer": 1}]}]}
    assert data["ranks"][0][1] == {"op": "AF", "text": "0AF0", "stage": 0, "mb": 0}


def test_the_note_of_the_rings_found_round_trips():
    program = tasp(6)  # six ranks: the rings found are fewer than the most there could be
    assert program.rings.note
    assert program_from_json(json.loads(written(program))).rings.note == program.rings.note


def test_other_families_have_no_rings_field():
    from pipec.compiler.driver import compile_target

    for name, defines in (("1f1b", {"P": 2, "N": 2}), ("weipipe", {})):
        data = program_to_json(compile_target(name, defines).program)
        assert "rings" not in data
    # and a null one reads as none, as an absent one does
    data = program_to_json(compile_target("1f1b", {"P": 2, "N": 2}).program)
    data["rings"] = None
    assert program_from_json(data).rings is None


def test_the_text_grid_names_the_rings_and_nests_the_parts():
    text = format_text_grid(zigzag(2, "all_to_all"))
    header, rank0, rank1 = text.splitlines()
    assert header == ("schedule zigzag (P=2, causal=true): 2 ranks, 4 chunks of 1 KV piece on 1 ring (causal mask; "
                      "kv again, dkv behind, transfer all_to_all), 36 instructions")
    assert rank0.startswith("rank 0 | ((0SEND_KV0;1RECV_KV0)ALLTOALL_KV0)EXCHANGE0 0AF0 ")
    assert rank1.startswith("rank 1 | ((1SEND_KV0;0RECV_KV0)ALLTOALL_KV0)EXCHANGE0 ")


# ------------------------------------------------------------------ the CLI


def pipec(capsys, *argv: str) -> tuple[int, str, str]:
    """Run ``pipec``: exit status, stdout, stderr; never a traceback."""
    status = main(list(argv))
    out, err = capsys.readouterr()
    assert "Traceback" not in err
    return status, out, err


def write(tmp_path: Path, data) -> str:
    path = tmp_path / "prog.json"
    path.write_text(json.dumps(data) if not isinstance(data, str) else data)
    return str(path)


def test_pipec_check_proves_a_written_ring_program(tmp_path, capsys):
    path = str(tmp_path / "zigzag.json")
    status, _, _ = pipec(capsys, "compile", "zigzag_ring", "-D", "P=3", "-o", path)
    assert status == 0
    assert json.loads(Path(path).read_text())["rings"]["holders"] == [0, 1, 2, 2, 1, 0]
    status, out, err = pipec(capsys, "check", path)
    assert status == 0 and err == ""
    assert out.count("\n") == 1 and out.startswith("ok: zigzag_ring (P=3, causal=true): 3 ranks, 6 chunks")
    assert "each of the 21 visible blocks computed once forward and once backward" in out
    # the same line as for the schedule itself
    assert pipec(capsys, "check", "zigzag_ring", "-D", "P=3")[1] == out


@pytest.mark.parametrize("transfer", ["p2p", "all_to_all"])
def test_pipec_check_names_the_block_a_planted_file_lost(tmp_path, capsys, transfer):
    data = program_to_json(zigzag(3, transfer))
    row = data["ranks"][1]
    index = next(i for i, obj in enumerate(row) if obj["op"] == "AF" and obj["stage"] == 4)
    lost = row.pop(index)  # a forward block of query chunk 4 (rank 1's late chunk)
    kv, piece = divmod(lost["mb"], 1)
    status, out, err = pipec(capsys, "check", write(tmp_path, data))
    assert status == 1 and out == ""
    assert f"block (query chunk 4, kv chunk {kv}, piece {piece})" in err
    assert "rank 1" in err


def test_pipec_check_names_a_deadlock_planted_in_a_file(tmp_path, capsys):
    data = program_to_json(zigzag(3, "p2p"))
    row = data["ranks"][0]
    row.insert(0, row.pop(next(i for i, obj in enumerate(row) if obj["op"] == "EXCHANGE_WAIT")))
    status, _, err = pipec(capsys, "check", write(tmp_path, data))
    assert status == 1 and err


def test_render_and_simulate_of_a_ring_program_end_cleanly(tmp_path, capsys):
    path = write(tmp_path, program_to_json(zigzag(2)))
    status, _, err = pipec(capsys, "render", path, "-o", str(tmp_path / "graph.dot"))
    assert status == 0 and (tmp_path / "graph.dot").exists()
    status, _, err = pipec(capsys, "render", path, "-o", str(tmp_path / "timeline.svg"))
    assert status in (0, 1) and (status == 0 or err)  # drawn, or a message saying why not
    status, _, err = pipec(capsys, "simulate", path)  # simulate takes schedules: a message, not a traceback
    assert status == 1 and "compiled program" in err


def test_a_simulator_that_cannot_price_a_ring_is_a_message_not_a_traceback(tmp_path, capsys, monkeypatch):
    from pipec.compiler import simulate as simulate_module
    from pipec.errors import UsageError

    def refuse(program, *args, **kwargs):
        raise UsageError(f"{program.name} is a sequence ring; the simulator does not price its blocks yet")

    monkeypatch.setattr(simulate_module, "simulate", refuse)
    path = write(tmp_path, program_to_json(zigzag(2)))
    for argv in (("simulate", "zigzag_ring", "-D", "P=2"), ("render", "zigzag_ring", "-D", "P=2", "-o",
                 str(tmp_path / "a.svg")), ("render", path, "-o", str(tmp_path / "b.svg"))):
        status, out, err = pipec(capsys, *argv)
        assert status == 1 and out == "" and "does not price its blocks yet" in err


# ------------------------------------------------------------------ hostile


def _hostile():
    """(name, edit of a valid zigzag P=3 all_to_all program dict, a word the message must hold)."""

    def rings(**changes):
        return lambda d: d["rings"].update(changes)

    def first(op):
        """The first instruction of rank 0 with ``op``."""
        return lambda d: next(obj for obj in d["ranks"][0] if obj["op"] == op)

    exchange = first("EXCHANGE")

    def alltoall(d):
        return exchange(d)["parts"][0]

    def edit(where, change):
        def apply(d):
            change(where(d))
        return apply

    yield "ring not a permutation", rings(rings=[[0, 0, 1]]), "rings.rings[0]"
    yield "ring too short", rings(rings=[[0, 1]]), "rings.rings[0]"
    yield "ring of strings", rings(rings=[["0", "1", "2"]]), "rings.rings[0]"
    yield "no rings", rings(rings=[]), "rings.rings"
    yield "holder out of range", lambda d: d["rings"]["holders"].__setitem__(0, 3), "rings.holders"
    yield "holder negative", lambda d: d["rings"]["holders"].__setitem__(0, -1), "rings.holders"
    yield "unequal shares", lambda d: d["rings"]["holders"].__setitem__(0, 1), "same share"
    yield "holders short", rings(holders=[0, 1, 2]), "rings.holders"
    yield "stage off its holder", lambda d: d["stages"][0].__setitem__("rank", 1), "rings.holders"
    yield "pieces zero", rings(pieces=0), "rings.pieces"
    yield "pieces huge", rings(pieces=2**62), "attention tasks"
    yield "chunks huge", rings(chunks=10**6), "rings.chunks"
    yield "chunks beyond pipec's integers", rings(chunks=10**30), "range"
    yield "chunks a bool", rings(chunks=True), "rings.chunks"
    yield "causal a string", rings(causal="yes"), "rings.causal"
    yield "unknown kv", rings(kv="sideways"), "rings.kv"
    yield "unknown dkv", rings(dkv=["behind"]), "rings.dkv"
    yield "unknown transfer", rings(transfer="carrier pigeon"), "rings.transfer"
    yield "missing transfer", lambda d: d["rings"].pop("transfer"), "rings.transfer"
    yield "note a number", rings(note=7), "rings.note"
    yield "rings a list", lambda d: d.__setitem__("rings", [4]), "\"rings\""
    yield "microbatches not the blocks", lambda d: (d.__setitem__("num_microbatches", 7),
                                                    d["mb_pipeline"].append(0)), "blocks"
    yield "weights too", lambda d: d.__setitem__("weights", {}), "weights"
    yield "no world communicator", lambda d: d.__setitem__(
        "communicators", [{"id": 0, "ranks": [0, 1], "purpose": WORLD, "key": 0}]), "communicators"
    yield "alltoall inside a batch", edit(exchange, lambda obj: obj.__setitem__("op", "BATCH")), "BATCH"
    yield "alltoall on its own", lambda d: d["ranks"][0].insert(0, alltoall(d)), "part of an EXCHANGE"
    yield "alltoall inside an alltoall", edit(alltoall, lambda obj: obj["parts"].append(copy.deepcopy(obj))), \
        "may only hold"
    yield "exchange inside an alltoall", edit(alltoall, lambda obj: obj["parts"].append(
        {"op": "EXCHANGE", "text": "EXCHANGE9", "mb": 9, "parts": []})), "may only hold"
    yield "compute inside an alltoall", edit(alltoall, lambda obj: obj["parts"].append(
        {"op": "AF", "text": "0AF0", "stage": 0, "mb": 0})), "may only hold"
    yield "empty alltoall", edit(alltoall, lambda obj: obj.__setitem__("parts", [])), "non-empty"
    yield "alltoall with a stage", edit(alltoall, lambda obj: obj.__setitem__("stage", 1)), "has no \"stage\""
    yield "AF with a peer", edit(first("AF"), lambda obj: obj.__setitem__("peer", 1)), "has no \"peer\""
    yield "a pipeline op in a ring", lambda d: d["ranks"][0].insert(0, {"op": "F", "text": "0F0", "stage": 0,
                                                                         "mb": 0}), "not an instruction of a sequence"
    yield "bundle of no rank", edit(alltoall, lambda obj: obj["parts"][0].update(stage=4, text="4SEND_KV0")), \
        "\"stage\" (the bundle's holder rank) must be an integer in 0..2"
    yield "piece out of range", edit(alltoall, lambda obj: obj["parts"][0].update(mb=1, text="0SEND_KV1")), \
        "\"mb\" (its KV piece) must be an integer in 0..0"
    yield "block out of range", edit(first("AF"), lambda obj: obj.update(mb=6, text="0AF6")), "\"mb\""
    yield "huge exchange number", edit(exchange, lambda obj: obj.update(
        mb=2**63 - 1, text=obj["text"].replace(")EXCHANGE0", f")EXCHANGE{2**63 - 1}"))), "exchange"
    yield "exchange number beyond pipec's integers", edit(exchange, lambda obj: obj.update(mb=2**64)), "range"
    yield "text disagrees with the nested parts", edit(exchange, lambda obj: obj.update(
        text="((0SEND_KV0;1RECV_KV0)ALLTOALL_DKV0)EXCHANGE0")), "\"text\""


HOSTILE = list(_hostile())


@pytest.mark.parametrize("edit, word", [h[1:] for h in HOSTILE], ids=[h[0] for h in HOSTILE])
def test_hostile_ring_files_are_refused_with_a_message(tmp_path, capsys, edit, word):
    data = program_to_json(zigzag(3, "all_to_all"))
    edit(data)
    status, out, err = pipec(capsys, "check", write(tmp_path, data))
    assert status == 1 and out == ""
    assert word in err, err


def test_nesting_past_the_parser_is_refused(tmp_path, capsys):
    data = program_to_json(zigzag(2, "all_to_all"))
    text = json.dumps(data)
    deep = '{"op": "ALLTOALL_KV", "text": "x", "mb": 0, "parts": [' * 3000 + "]}" * 3000
    text = text.replace('"ranks": [[', '"ranks": [[' + deep + ", ", 1)
    status, _, err = pipec(capsys, "check", write(tmp_path, text))
    assert status == 1 and "nest" in err


def test_ring_ops_outside_a_ring_program_are_refused():
    from pipec.compiler.driver import compile_target

    data = program_to_json(compile_target("1f1b", {"P": 2, "N": 2}).program)
    data["ranks"][0].insert(0, {"op": "AF", "text": "0AF0", "stage": 0, "mb": 0})
    with pytest.raises(ImportError_) as info:
        program_from_json(data)
    assert info.value.rank == 0 and info.value.step == 0
    assert "AF is an instruction of a sequence ring" in str(info.value)
    # an all_to_all inside a BATCH: a pipeline's batch holds sends and receives only
    data = program_to_json(compile_target("1f1b", {"P": 2, "N": 2}).program)
    inner = {"op": "SEND_KV", "text": "0SEND_KV0", "stage": 0, "mb": 0, "peer": 1}
    alltoall = {"op": "ALLTOALL_KV", "text": "(0SEND_KV0)ALLTOALL_KV0", "mb": 0, "parts": [inner]}
    data["ranks"][0].insert(1, {"op": "BATCH", "text": "((0SEND_KV0)ALLTOALL_KV0)BATCH", "parts": [alltoall]})
    with pytest.raises(ImportError_) as info:
        program_from_json(data)
    assert info.value.step == 1 and "ALLTOALL_KV is an instruction of a sequence ring" in str(info.value)


def test_every_ring_op_is_read_and_only_where_it_may_stand():
    ring_ops = {op for op, rule in ops.RULES.items() if rule.family == ops.SEQUENCE_RING}
    seen = set()
    for transfer, kv, dkv in ROUTES:
        for row in zigzag(3, transfer, kv, dkv).ranks:
            for action in row:
                for part in (action, *action.parts, *(p for q in action.parts for p in q.parts)):
                    seen.add(part.op)
    assert ring_ops <= seen


def test_a_communicator_list_of_every_rank_is_what_a_ring_keeps():
    program = zigzag(2)
    program.communicators = [Communicator(0, (0, 1), WORLD, 0)]
    assert program_from_json(json.loads(written(program))) == program
