"""Emitters: JSON program (exact round trip, validated load), torch CSV, text grid."""
from __future__ import annotations

import copy
import csv
import io
import json

import pytest

from pipec.compiler.emit import format_text_grid, program_from_json, program_to_json, write_torch_csv
from pipec.compiler.ir import (
    ALLREDUCE_GRAD,
    ALLREDUCE_WAIT,
    FREE_F,
    RECV_B,
    RECV_F,
    SEND_B,
    SEND_F,
    Action,
    Program,
    StageInfo,
    batch,
)
from pipec.errors import ImportError_, PipecError, UsageError
from reference_orders import gpipe, interleaved_1f1b, one_f_one_b


def two_pipeline_program() -> Program:
    """A tiny bidirectional program: two pipelines, replicated stages, a batch, frees, all-reduce.

    Pipeline 0 runs stage 0 (rank 0) then stage 1 (rank 1); pipeline 1 runs
    stage 2 (rank 1) then stage 3 (rank 0). Microbatch 0 rides pipeline 0, 1 rides 1.
    """
    stages = [StageInfo(0, 0, 0, 0), StageInfo(1, 1, 0, 1), StageInfo(2, 1, 1, 0), StageInfo(3, 0, 1, 1)]
    rank0 = [
        Action(0, "F", 0),
        batch([Action(0, SEND_F, 0, 1), Action(3, RECV_F, 1, 1)]),
        Action(3, "F", 1),
        Action(3, "B", 1),
        batch([Action(3, SEND_B, 1, 1), Action(0, RECV_B, 0, 1)]),
        Action(0, "I", 0),
        Action(0, "W", 0),
        Action(0, FREE_F, 0),
        Action(0, ALLREDUCE_GRAD, -1, 1),
        Action(0, ALLREDUCE_WAIT),
    ]
    rank1 = [
        Action(2, "F", 1),
        batch([Action(2, SEND_F, 1, 0), Action(1, RECV_F, 0, 0)]),
        Action(1, "F", 0),
        Action(1, "B", 0),
        batch([Action(1, SEND_B, 0, 0), Action(2, RECV_B, 1, 0)]),
        Action(2, "B", 1),
        Action(2, ALLREDUCE_GRAD, -1, 0),
        Action(2, ALLREDUCE_WAIT),
    ]
    return Program(
        name="tiny_bidirectional",
        num_ranks=2,
        num_microbatches=2,
        stages=stages,
        pipelines=[[0, 1], [2, 3]],
        mb_pipeline=[0, 1],
        ranks=[rank0, rank1],
        params={"D": 2, "N": 2},
        devices=[1, 0],
        source="inline",
    )


def comm_program() -> Program:
    """1F1B (P=2, N=2) with hand-written communication, one batch, a free."""
    program = one_f_one_b(2, 2)
    program.ranks = [
        [Action(0, "F", 0), Action(0, SEND_F, 0, 1), Action(0, "F", 1), Action(0, SEND_F, 1, 1),
         Action(0, RECV_B, 0, 1), Action(0, "B", 0), Action(0, FREE_F, 0), Action(0, RECV_B, 1, 1), Action(0, "B", 1)],
        [Action(1, RECV_F, 0, 0), Action(1, "F", 0), Action(1, "B", 0),
         batch([Action(1, SEND_B, 0, 0), Action(1, RECV_F, 1, 0)]), Action(1, "F", 1), Action(1, "B", 1),
         Action(1, SEND_B, 1, 0)],
    ]
    return program


# ------------------------------------------------------------------------- JSON


@pytest.mark.parametrize(
    "program",
    [one_f_one_b(4, 8), gpipe(3, 5), interleaved_1f1b(4, 8, 2), two_pipeline_program(), comm_program()],
    ids=["1f1b", "gpipe", "interleaved", "bidirectional", "comms"],
)
def test_json_round_trip_is_exact(program):
    data = program_to_json(program)
    # through real JSON text, as the runtime reads it
    back = program_from_json(json.loads(json.dumps(data)))
    assert back == program
    assert back.ranks == program.ranks
    assert all(type(a) is Action for row in back.ranks for a in row)


def test_json_round_trip_of_lowered_programs():
    from pipec.compiler.liveness import insert_frees
    from pipec.compiler.lower_comms import insert_communication

    for program in (one_f_one_b(4, 8), interleaved_1f1b(2, 4, 3)):
        lowered = insert_frees(insert_communication(program))
        assert any(a.is_comm for row in lowered.ranks for a in row)
        assert program_from_json(json.loads(json.dumps(program_to_json(lowered)))) == lowered


def test_json_instruction_fields():
    data = program_to_json(two_pipeline_program())
    assert data["format"] == "pipec-program" and data["version"] == 1
    rank0 = data["ranks"][0]
    assert rank0[0] == {"op": "F", "text": "0F0", "stage": 0, "mb": 0}
    assert rank0[1]["op"] == "BATCH" and rank0[1]["text"] == "(0SEND_F0;3RECV_F1)BATCH"
    assert "stage" not in rank0[1] and "mb" not in rank0[1]
    assert rank0[1]["parts"][0] == {"op": "SEND_F", "text": "0SEND_F0", "stage": 0, "mb": 0, "peer": 1}
    assert rank0[8] == {"op": "ALLREDUCE_GRAD", "text": "0ALLREDUCE_GRAD", "stage": 0, "peer": 1}
    assert data["stages"][3] == {"id": 3, "rank": 0, "pipeline": 1, "position": 1}
    assert data["devices"] == [1, 0] and data["params"] == {"D": 2, "N": 2}


def _mutations():
    """(description, function mutating a valid program dict into an invalid one, located?)."""

    def drop(key):
        return lambda d: d.pop(key)

    def setf(key, value):
        return lambda d: d.__setitem__(key, value)

    def instr(rank, step, change):
        return lambda d: change(d["ranks"][rank][step])

    yield "format", setf("format", "something-else"), False
    yield "version", setf("version", 2), False
    for key in ("name", "params", "num_ranks", "num_microbatches", "stages", "pipelines", "mb_pipeline", "ranks"):
        yield f"missing {key}", drop(key), False
    yield "bool rank count", setf("num_ranks", True), False
    yield "rank count", setf("num_ranks", 3), False
    yield "param type", setf("params", {"D": "two"}), False
    yield "stage id", lambda d: d["stages"][1].__setitem__("id", 7), False
    yield "stage rank", lambda d: d["stages"][1].__setitem__("rank", 9), False
    yield "stage position disagrees", lambda d: d["stages"][1].__setitem__("position", 0), False
    yield "pipeline stage", lambda d: d["pipelines"][0].append(17), False
    yield "mb_pipeline length", lambda d: d["mb_pipeline"].append(0), False
    yield "devices length", setf("devices", [0]), False
    yield "rank row type", lambda d: d["ranks"].__setitem__(1, "0F0"), False
    yield "instruction type", instr(0, 0, lambda i: i.clear()), True
    yield "unknown op", instr(0, 2, lambda i: i.__setitem__("op", "FLY")), True
    yield "missing mb", instr(0, 2, lambda i: i.pop("mb")), True
    yield "missing peer", lambda d: d["ranks"][0][1]["parts"][0].pop("peer"), True
    yield "peer out of range", lambda d: d["ranks"][0][1]["parts"][0].__setitem__("peer", 5), True
    yield "stage out of range", instr(1, 0, lambda i: i.update(stage=4, text="4F1")), True
    yield "mb out of range", instr(1, 0, lambda i: i.update(mb=2, text="2F2")), True
    yield "mb string", instr(1, 0, lambda i: i.update(mb="1")), True
    yield "text disagrees", instr(1, 2, lambda i: i.__setitem__("text", "1F1")), True
    yield "empty batch", instr(0, 1, lambda i: i.__setitem__("parts", [])), True
    yield "compute inside batch", lambda d: d["ranks"][0][1]["parts"].append({"op": "F", "text": "0F1", "stage": 0, "mb": 1}), True
    yield "parts on a compute", instr(0, 0, lambda i: i.__setitem__("parts", [])), True


@pytest.mark.parametrize("what,mutate,located", list(_mutations()), ids=[m[0] for m in _mutations()])
def test_json_load_rejects_bad_input_with_a_pipec_error(what, mutate, located):
    data = copy.deepcopy(program_to_json(two_pipeline_program()))
    mutate(data)
    with pytest.raises(ImportError_) as info:
        program_from_json(data)
    if located:
        assert info.value.rank is not None and info.value.step is not None
        assert info.value.render().startswith(f"rank {info.value.rank}, step {info.value.step}:")


def test_json_load_rejects_non_objects():
    for data in ([], "x", None, 3):
        with pytest.raises(ImportError_):
            program_from_json(data)


def test_json_load_never_raises_anything_but_pipec_errors_on_truncated_instructions():
    # delete each field of each instruction in turn: always a valid program or a pipec error
    base = program_to_json(two_pipeline_program())
    for r, row in enumerate(base["ranks"]):
        for s, obj in enumerate(row):
            for key in obj:
                data = copy.deepcopy(base)
                del data["ranks"][r][s][key]
                try:
                    program_from_json(data)
                except PipecError:
                    pass


# -------------------------------------------------------------------- torch CSV


def _rows(text: str) -> list[list[str]]:
    return list(csv.reader(io.StringIO(text)))


def test_torch_csv_compute_only_is_each_ranks_compute_tokens():
    program = one_f_one_b(3, 4)
    rows = _rows(write_torch_csv(program, with_comms=False))
    assert rows == [[a.text() for a in row] for row in program.ranks]
    assert rows[2] == ["2F0", "2B0", "2F1", "2B1", "2F2", "2B2", "2F3", "2B3"]


def test_torch_csv_with_comms_expands_batches_and_drops_pipec_only_ops():
    program = comm_program()
    compute = _rows(write_torch_csv(program, with_comms=False))
    full = _rows(write_torch_csv(program, with_comms=True))
    assert compute[1] == ["1F0", "1B0", "1F1", "1B1"]
    assert full[0] == ["0F0", "0SEND_F0", "0F1", "0SEND_F1", "0RECV_B0", "0B0", "0RECV_B1", "0B1"]  # FREE_F gone
    assert full[1] == ["1RECV_F0", "1F0", "1B0", "1SEND_B0", "1RECV_F1", "1F1", "1B1", "1SEND_B1"]


def test_torch_csv_refuses_several_pipelines():
    with pytest.raises(UsageError, match="pipelines"):
        write_torch_csv(two_pipeline_program(), with_comms=False)


def test_torch_csv_numbers_stages_by_pipeline_position():
    # the same 1F1B, but stage ids listed in reverse: torch must still see 0..P-1 along the chain
    program = one_f_one_b(3, 3)
    rename = {0: 2, 1: 1, 2: 0}
    program.stages = [StageInfo(rename[s.id], s.rank, 0, s.position) for s in program.stages]
    program.stages.sort(key=lambda s: s.id)
    program.pipelines = [[2, 1, 0]]
    program.ranks = [[a._replace(stage=rename[a.stage]) for a in row] for row in program.ranks]
    rows = _rows(write_torch_csv(program, with_comms=False))
    assert rows == [[a.text() for a in row] for row in one_f_one_b(3, 3).ranks]


# -------------------------------------------------------------------- text grid


def test_text_grid_has_a_header_and_aligned_columns():
    program = comm_program()
    program.params = {"P": 2, "N": 2}
    text = format_text_grid(program)
    lines = text.rstrip("\n").split("\n")
    assert lines[0].startswith("schedule 1f1b (P=2, N=2):")
    assert "2 ranks" in lines[0] and "2 microbatches" in lines[0]
    assert len(lines) == 1 + program.num_ranks
    assert lines[1].startswith("rank 0 | 0F0 ") and lines[2].startswith("rank 1 | 1RECV_F0 ")
    # step k starts at the same column on every rank
    starts = []
    for rank, line in enumerate(lines[1:]):
        col, positions = line.index("|") + 2, []
        for step, action in enumerate(program.ranks[rank]):
            token = action.text()
            col = line.index(token, col)
            positions.append(col)
            col += len(token)
        starts.append(positions)
    shared = min(len(p) for p in starts)
    assert starts[0][:shared] == starts[1][:shared]


@pytest.mark.parametrize("target", ["1f1b", "1f1b_hsdp", "tasp"])
def test_the_text_grid_names_the_parameters_as_check_and_simulate_do(target, capsys):
    """In the schedule's order (P, N, ...), as ``pipec check`` and ``pipec simulate`` write them (was: sorted)."""
    from pipec.cli import main

    said = {}
    for command in (["compile", target, "--format", "text"], ["check", target], ["simulate", target]):
        assert main(command) == 0
        first = capsys.readouterr().out.splitlines()[0]
        said[command[0]] = first[first.index("(") + 1:first.index(")")]
    assert said["compile"] == said["check"] == said["simulate"], said
