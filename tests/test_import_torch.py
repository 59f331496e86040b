"""Import of torch.distributed.pipelining schedule CSVs, and export back to torch.

torch's own schedules, written by torch's own CSV writer (compute-only and with
torch's communication lowering), must import and pass every pipec check; pipec's
CSV must load into torch and give back the same per-rank order.
"""
from __future__ import annotations

import csv
import io
import json
import subprocess
import sys
from unittest import mock

import pytest

pytest.importorskip("torch")
from torch.distributed.pipelining import schedules as torch_schedules  # noqa: E402
from torch.distributed.pipelining.stage import PipelineStage  # noqa: E402

from pipec.cli import main  # noqa: E402
from pipec.compiler.driver import compile_target  # noqa: E402
from pipec.compiler.emit import program_from_json, program_to_json, write_torch_csv  # noqa: E402
from pipec.compiler.import_torch import import_and_check, prepare_imported, read_torch_csv  # noqa: E402
from pipec.compiler.ir import COMPUTE_OPS  # noqa: E402
from pipec.compiler.lower_comms import insert_communication  # noqa: E402
from pipec.compiler.simulate import simulate  # noqa: E402
from pipec.errors import ImportError_, MatchError, ProgramError, WellFormedError  # noqa: E402
from reference_orders import gpipe, interleaved_1f1b, one_f_one_b  # noqa: E402

# ------------------------------------------------------------------ torch side


def mock_stages(pp: int, local_stages: int, num_stages: int) -> list:
    """Stand-ins for PipelineStage, as torch's _schedule_visualizer.get_schedule_ops builds them."""
    stage = mock.create_autospec(PipelineStage, instance=True)
    stage.group_rank = 0
    stage.group_size = pp
    stage.submod = None
    stage.num_stages = num_stages
    return [stage] * local_stages


def torch_runtime_schedule(cls, pp: int, nmb: int, local_stages: int = 2, defer_pp_recv: bool = False):
    """A torch multi-stage schedule; its constructor runs torch's communication lowering."""
    return cls(mock_stages(pp, local_stages, local_stages * pp), nmb, defer_pp_recv=defer_pp_recv)


def torch_single_as_runtime(cls, pp: int, nmb: int):
    """A single-stage torch schedule (GPipe, 1F1B) lowered by torch's _PipelineScheduleRuntime.

    torch's single-stage schedules put REDUCE_GRAD (a data-parallel token) into
    their compute order, which torch's own compute-only lowering refuses; it is
    dropped before lowering (torch adds its own back).
    """
    single = cls(mock_stages(pp, 1, pp)[0], nmb)
    order = {
        rank: [a for a in actions if a is not None and a.computation_type != torch_schedules.REDUCE_GRAD]
        for rank, actions in single.pipeline_order.items()
    }
    runtime = torch_schedules._PipelineScheduleRuntime(mock_stages(pp, 1, pp), nmb)
    runtime.pipeline_order = single.pipeline_order  # written as torch's own compute form, REDUCE_GRAD and all
    runtime._prepare_schedule_with_comms(order)
    return runtime


def torch_csv(schedule, tmp_path, fmt: str) -> str:
    """The schedule as written by torch's own _dump_csv."""
    path = tmp_path / f"torch_{fmt}.csv"
    schedule._dump_csv(str(path), format=fmt)
    return path.read_text()


TORCH_MULTI_CASES = [
    (torch_schedules.ScheduleInterleaved1F1B, pp, nmb, v)
    for pp, nmb, v in [(2, 4, 2), (4, 8, 2), (3, 5, 2), (2, 4, 3), (4, 3, 2)]
] + [
    (torch_schedules.ScheduleInterleavedZeroBubble, pp, nmb, 2)
    for pp, nmb in [(2, 4), (4, 8), (3, 6)]
] + [
    (torch_schedules.ScheduleZBVZeroBubble, pp, nmb, 2)
    for pp, nmb in [(2, 4), (4, 8), (3, 5)]
] + [
    (torch_schedules.ScheduleDualPipeV, pp, nmb, 2)
    for pp, nmb in [(2, 4), (3, 6), (4, 8), (2, 7)]
]


def _case_id(case) -> str:
    cls, pp, nmb, v = case
    return f"{cls.__name__.removeprefix('Schedule')}-pp{pp}-n{nmb}-v{v}"


def _assert_imported(text: str, expect_comms: bool, pp: int, num_stages: int, nmb: int):
    program, had_comms = read_torch_csv(text)
    assert had_comms is expect_comms
    assert (program.num_ranks, len(program.stages), program.num_microbatches) == (pp, num_stages, nmb)
    checked = prepare_imported(program, had_comms)  # raises on any failed check
    tasks = [(a.stage, a.op, a.mb) for row in checked.ranks for a in row if a.op in COMPUTE_OPS]
    assert len(tasks) == len(set(tasks))
    assert {(s, m) for s, op, m in tasks if op == "F"} == {(s, m) for s in range(num_stages) for m in range(nmb)}
    # what torch wrote is what pipec holds, compute for compute
    ours = [[a.text() for a in row if a.op in COMPUTE_OPS] for row in checked.ranks]
    return program, checked, ours


def _torch_compute_rows(text: str) -> list[list[str]]:
    """torch's compute tokens per rank, read by torch's own parser (groups as their parts)."""
    rows = []
    for row in csv.reader(io.StringIO(text)):
        actions = [torch_schedules._Action.from_str(cell) for cell in row]
        leaves = [leaf for a in actions if a is not None for leaf in (a.sub_actions or (a,))]
        rows.append([str(leaf) for leaf in leaves if leaf.computation_type.value in COMPUTE_OPS])
    return rows


@pytest.mark.parametrize("pp,nmb,v", [(4, 6, 2), (4, 10, 2), (3, 5, 2), (4, 3, 2), (2, 4, 3), (4, 8, 2), (2, 6, 2)])
def test_interleaved_1f1b_with_torchs_group_size_is_torchs_order(pp, nmb, v, tmp_path):
    """torch's ScheduleInterleaved1F1B runs Megatron's order with a microbatch group of N / max(1, N // P)
    (its microbatches per round), N % P != 0 included; pipec's interleaved_1f1b with that G is the same order,
    compute for compute, and proved (issue 26, item 3)."""
    group = nmb // max(1, nmb // pp)
    schedule = torch_runtime_schedule(torch_schedules.ScheduleInterleaved1F1B, pp, nmb, local_stages=v)
    theirs = _torch_compute_rows(torch_csv(schedule, tmp_path, "compute_only"))
    ours = compile_target("interleaved_1f1b", {"P": pp, "N": nmb, "v": v, "G": group}).program
    assert [[a.text() for a in row if a.op in COMPUTE_OPS] for row in ours.ranks] == theirs
    assert compile_target("interleaved_1f1b", {"P": pp, "N": nmb, "v": v}).program.params["G"] == group  # the default


@pytest.mark.parametrize("case", TORCH_MULTI_CASES, ids=[_case_id(c) for c in TORCH_MULTI_CASES])
def test_torch_multi_stage_schedules_import_and_pass_every_check(case, tmp_path):
    cls, pp, nmb, v = case
    schedule = torch_runtime_schedule(cls, pp, nmb, local_stages=v)
    compute_text = torch_csv(schedule, tmp_path, "compute_only")
    comms_text = torch_csv(schedule, tmp_path, "compute_comms")

    _, lowered, ours = _assert_imported(compute_text, False, pp, v * pp, nmb)
    assert ours == _torch_compute_rows(compute_text)
    assert any(a.is_comm for row in lowered.ranks for a in row)

    as_written, checked, ours = _assert_imported(comms_text, True, pp, v * pp, nmb)
    assert checked is as_written  # checked as written, nothing added
    assert ours == _torch_compute_rows(comms_text)
    # every torch send and receive is there, with the peer torch's own stage map gives
    torch_messages = [[str(a) for a in schedule.pipeline_order_with_comms[r] if "SEND" in str(a) or "RECV" in str(a)]
                      for r in range(pp)]
    assert [[a.text() for a in row if a.is_comm] for row in checked.ranks] == torch_messages
    neighbour = {"SEND_F": +1, "RECV_F": -1, "SEND_B": -1, "RECV_B": +1}
    for row in checked.ranks:
        for a in row:
            if a.is_comm:
                assert a.peer == schedule.stage_index_to_group_rank[a.stage + neighbour[a.op]]
    assert torch_fifo_violation(schedule.pipeline_order_with_comms, schedule.stage_index_to_group_rank) is None


def torch_fifo_violation(order: dict, stage_to_rank: dict) -> tuple | None:
    """An independent witness, computed from torch's own actions: the first ordered
    pair of ranks whose receives do not take the tensors in the order they were sent.

    torch's p2p ops carry no tag, so NCCL and gloo match them in posting order per
    pair of ranks; a receive that is out of order takes another tensor's data.
    """
    tensor_of = {  # token type -> (kind, producer stage offset)
        "SEND_F": ("act", 0), "SEND_B": ("grad", 0), "RECV_F": ("act", -1), "RECV_B": ("grad", +1),
    }
    peer_offset = {"SEND_F": +1, "SEND_B": -1, "RECV_F": -1, "RECV_B": +1}
    sent, received = {}, {}
    for rank, actions in order.items():
        for a in actions:
            kind = a.computation_type.value
            if kind not in tensor_of:
                continue
            peer = stage_to_rank[a.stage_index + peer_offset[kind]]
            tensor = (tensor_of[kind][0], a.stage_index + tensor_of[kind][1], a.microbatch_index)
            if kind.startswith("SEND"):
                sent.setdefault((rank, peer), []).append(tensor)
            else:
                received.setdefault((peer, rank), []).append(tensor)
    for pair in sorted(sent):
        if sent[pair] != received.get(pair):
            return pair, sent[pair], received.get(pair)
    return None


DEFERRED_CASES = [
    (cls, pp, nmb)
    for cls in (torch_schedules.ScheduleInterleaved1F1B, torch_schedules.ScheduleInterleavedZeroBubble,
                torch_schedules.ScheduleZBVZeroBubble, torch_schedules.ScheduleDualPipeV)
    for pp, nmb in [(2, 4), (3, 6), (4, 8)]
]


@pytest.mark.parametrize("cls,pp,nmb", DEFERRED_CASES, ids=[f"{c.__name__.removeprefix('Schedule')}-pp{p}-n{n}" for c, p, n in DEFERRED_CASES])
def test_torch_deferred_receive_lowering_is_judged_like_an_independent_fifo_witness(cls, pp, nmb, tmp_path):
    """torch's defer_pp_recv=True lowering moves each receive to just before its
    consumer. Where one pair of ranks carries both activations and gradients the
    same way, that can reorder receives against the peer's sends (torch 2.13:
    ZBVZeroBubble at every pp, DualPipeV at pp >= 3, InterleavedZeroBubble at
    pp = 2): with untagged p2p the receive gets another tensor's data (silently,
    when shapes agree). pipec must reject exactly those schedules."""
    schedule = torch_runtime_schedule(cls, pp, nmb, defer_pp_recv=True)
    witness = torch_fifo_violation(schedule.pipeline_order_with_comms, schedule.stage_index_to_group_rank)
    program, had_comms = read_torch_csv(torch_csv(schedule, tmp_path, "compute_comms"))
    if witness is None:
        prepare_imported(program, had_comms)
        return
    (src, dst), _, _ = witness
    with pytest.raises(MatchError, match="out of order") as info:
        prepare_imported(program, had_comms)
    assert f"from rank {src} to rank {dst}" in info.value.message


def test_torch_deferred_receive_lowering_misorders_these_schedules():
    # pinned, so that the test above cannot pass by finding nothing wrong anywhere
    for cls, pp, nmb, defer, misordered in [
        (torch_schedules.ScheduleZBVZeroBubble, 2, 4, True, True),
        (torch_schedules.ScheduleDualPipeV, 4, 8, True, True),
        (torch_schedules.ScheduleInterleavedZeroBubble, 2, 4, True, True),
        (torch_schedules.ScheduleInterleaved1F1B, 4, 8, True, False),
        (torch_schedules.ScheduleDualPipeV, 4, 8, False, False),  # default lowering: receives in send order
    ]:
        schedule = torch_runtime_schedule(cls, pp, nmb, defer_pp_recv=defer)
        witness = torch_fifo_violation(schedule.pipeline_order_with_comms, schedule.stage_index_to_group_rank)
        assert (witness is not None) is misordered, (cls.__name__, pp, nmb, witness)


@pytest.mark.parametrize("pp,nmb", [(2, 4), (4, 8), (3, 3)])
def test_torch_gpipe_imports_and_passes(pp, nmb, tmp_path):
    runtime = torch_single_as_runtime(torch_schedules.ScheduleGPipe, pp, nmb)
    compute_text = torch_csv(runtime, tmp_path, "compute_only")
    assert "REDUCE_GRAD" in compute_text  # skipped on import
    _, _, ours = _assert_imported(compute_text, False, pp, pp, nmb)
    assert ours == [[f"{r}F{m}" for m in range(nmb)] + [f"{r}B{m}" for m in range(nmb)] for r in range(pp)]
    _assert_imported(torch_csv(runtime, tmp_path, "compute_comms"), True, pp, pp, nmb)


@pytest.mark.parametrize("pp,nmb", [(2, 4), (4, 8)])
def test_torch_1f1b_order_is_rejected_because_torch_numbers_its_last_rank_wrong(pp, nmb, tmp_path):
    """torch 2.x's Schedule1F1B._get_pipeline_order (the IR its visualizer and CSV use;
    not what its own 1F1B runtime executes) gives the last rank F1..F{N} instead of
    F0..F{N-1}: with no warm-up forwards its counter starts at 0 and is incremented
    before use. pipec must refuse it, as torch's own validator does."""
    single = torch_schedules.Schedule1F1B(mock_stages(pp, 1, pp)[0], nmb)
    last = [str(a) for a in single.pipeline_order[pp - 1] if a is not None]
    assert f"{pp - 1}F{nmb}" in last and f"{pp - 1}F0" not in last  # the torch bug itself
    path = tmp_path / "1f1b.csv"
    runtime = torch_schedules._PipelineScheduleRuntime(mock_stages(pp, 1, pp), nmb)
    runtime.pipeline_order = single.pipeline_order
    runtime._dump_csv(str(path), format="compute_only")
    with pytest.raises(ImportError_) as caught:  # the other stages' forwards say N: the last rank is named
        read_torch_csv(path.read_text())
    assert caught.value.rank == pp - 1
    assert caught.value.message == (f"{pp - 1}F{nmb} is a stray: the stages' forwards say N = {nmb} (microbatches "
                                    f"0..{nmb - 1}); rank {pp - 1} lacks {pp - 1}F0")
    # torch agrees
    order = {r: [a for a in acts if a is not None and a.computation_type != torch_schedules.REDUCE_GRAD]
             for r, acts in single.pipeline_order.items()}
    with pytest.raises(AssertionError, match="without first running Forward"):
        torch_schedules._PipelineScheduleRuntime(mock_stages(pp, 1, pp), nmb)._prepare_schedule_with_comms(order)


def test_torch_interleaved_with_one_local_stage_is_a_plain_pipeline(tmp_path):
    # a single chain, one stage per rank, built by torch: Interleaved1F1B with one local stage
    schedule = torch_runtime_schedule(torch_schedules.ScheduleInterleaved1F1B, 4, 8, local_stages=1)
    _assert_imported(torch_csv(schedule, tmp_path, "compute_only"), False, 4, 4, 8)
    _assert_imported(torch_csv(schedule, tmp_path, "compute_comms"), True, 4, 4, 8)


def test_overlap_f_b_groups_expand_in_order():
    text = "0F0,1F0,(0F1;1B0)OVERLAP_F_B,1B1,0B0,0B1\n"
    program, _ = read_torch_csv(text)
    assert [a.text() for a in program.ranks[0]] == ["0F0", "1F0", "0F1", "1B0", "1B1", "0B0", "0B1"]


def test_fsdp_tokens_and_empty_cells_are_skipped():
    text = "0UNSHARD,0F0,,0F1,0B0,,0B1,0REDUCE_GRAD,0RESHARD\n"
    program, had_comms = read_torch_csv(text)
    assert not had_comms
    assert [a.text() for a in program.ranks[0]] == ["0F0", "0F1", "0B0", "0B1"]


# ------------------------------------------------------------- pipec -> torch


def _torch_compute_program(cls, pp: int, nmb: int, name: str):
    """A V-shaped order (local hand-off at the bottom of the V) taken from torch, compute only."""
    schedule = cls(mock_stages(pp, 2, 2 * pp), nmb)
    text = "".join(",".join("" if a is None else str(a) for a in schedule.pipeline_order[r]) + "\n" for r in range(pp))
    program, _ = read_torch_csv(text, source=name)
    return program


def _pipec_programs():
    return [
        one_f_one_b(4, 8), one_f_one_b(2, 5), gpipe(3, 4), interleaved_1f1b(4, 8, 2), interleaved_1f1b(2, 4, 3),
        _torch_compute_program(torch_schedules.ScheduleZBVZeroBubble, 4, 8, "zbv.csv"),
        _torch_compute_program(torch_schedules.ScheduleDualPipeV, 3, 6, "dualpipev.csv"),
    ]


@pytest.mark.parametrize("program", _pipec_programs(), ids=lambda p: f"{p.name}-{p.num_ranks}x{p.num_microbatches}")
def test_pipec_csv_loads_into_torch_with_the_same_order(program, tmp_path):
    pp, num_stages, nmb = program.num_ranks, len(program.stages), program.num_microbatches
    local = num_stages // pp

    compute_path = tmp_path / "compute.csv"
    compute_path.write_text(write_torch_csv(program, with_comms=False))
    multi = torch_schedules.PipelineScheduleMulti(mock_stages(pp, local, num_stages), nmb)
    multi._load_csv(str(compute_path))  # torch validates the order and infers the stage map
    assert {r: [str(a) for a in acts] for r, acts in multi.pipeline_order.items()} == \
        {r: [a.text() for a in row] for r, row in enumerate(program.ranks)}
    assert multi.stage_index_to_group_rank == {s.id: s.rank for s in program.stages}

    lowered = insert_communication(program)
    comms_path = tmp_path / "comms.csv"
    comms_path.write_text(write_torch_csv(lowered, with_comms=True))
    runtime = torch_schedules._PipelineScheduleRuntime(mock_stages(pp, local, num_stages), nmb)
    runtime._load_csv(str(comms_path), format="compute_comms")
    expected = [[p.text() for a in row for p in (a.parts or (a,)) if p.op in COMPUTE_OPS or p.is_comm]
                for row in lowered.ranks]
    assert [[str(a) for a in runtime.pipeline_order_with_comms[r]] for r in range(pp)] == expected
    # torch's dry run of the communication schedule makes progress to the end
    torch_schedules._simulate_comms_compute(
        runtime.pipeline_order_with_comms, lambda s: runtime.stage_index_to_group_rank[s], num_stages
    )
    # and the CSV reads back into pipec as the same program, minus batching
    back, had_comms = read_torch_csv(comms_path.read_text())
    assert had_comms and [[a.text() for a in row] for row in back.ranks] == expected
    prepare_imported(back, had_comms)


def test_imported_program_json_round_trip_is_exact(tmp_path):
    schedule = torch_runtime_schedule(torch_schedules.ScheduleDualPipeV, 2, 4)
    program, _ = read_torch_csv(torch_csv(schedule, tmp_path, "compute_comms"), source="dualpipev.csv")
    assert program_from_json(json.loads(json.dumps(program_to_json(program)))) == program


# ---------------------------------------------------------------------- errors


@pytest.mark.parametrize(
    "text,rank,step,fragment",
    [
        ("0F0,0F1,0B0,0B1\n1F0,1X3,1B0\n", 1, 1, "'1X3' is not a torch"),
        ("0F0,1F0x\n", 0, 1, "'1F0x' is not a torch"),
        ("0F0,,0F\n", 0, 2, "needs a microbatch"),
        ("0F0,(0F1;0B0)FUSED\n", 0, 1, "sub-action group"),
        ("0F0,(0F1;0Q0)OVERLAP_F_B\n", 0, 1, "'0Q0' is not a torch"),
        ("0F0,1SEND_F0,0B0\n1RECV_F0,1F0,1B0\n", 0, 1, "stage 1 runs on rank 1"),
        ("0F0,0B0\n1RECV_B0,1F0,1B0\n", 1, 0, "no stage 2"),
        ("0F0,0SEND_F4,0B0\n1F0,1B0\n", 0, 1, "microbatch 4 never computes"),
        ("0F0,1F0,0SEND_F0,1B0,0B0\n", 0, 2, "local"),
    ],
)
def test_bad_tokens_are_import_errors_at_rank_and_step(text, rank, step, fragment):
    with pytest.raises(ImportError_) as info:
        read_torch_csv(text)
    error = info.value
    assert (error.rank, error.step) == (rank, step)
    assert fragment in error.message
    rendered = error.render()
    assert rendered.startswith(f"rank {rank}, step {step}:")
    assert "[" in rendered.split("\n", 1)[1]  # the grid window marks the cell


def test_a_stage_on_two_ranks_names_both():
    text = "0F0,1F0,1B0,0B0\n2F0,1F1,1B1,2B0\n"
    with pytest.raises(WellFormedError) as info:
        read_torch_csv(text)
    error = info.value
    assert (error.rank, error.step) == (1, 1)
    assert "stage 1" in error.message and "rank 0" in error.message and "rank 1" in error.message
    assert (0, 1) in error.marks


def test_missing_stage_and_empty_csv_are_import_errors():
    with pytest.raises(ImportError_, match="stage.*1.*never compute"):
        read_torch_csv("0F0,0B0\n2F0,2B0\n")
    with pytest.raises(ImportError_, match="empty"):
        read_torch_csv("\n\n")
    with pytest.raises(ImportError_, match="no compute"):
        read_torch_csv("0UNSHARD,0RESHARD\n")


def test_a_stray_microbatch_names_its_rank_not_the_others():
    """N is what the stages' forwards agree on, so one rank's stray index blames that rank (issue 26): rank 0
    is whole; rank 1 has 1F2 where 1F0 belongs."""
    with pytest.raises(ImportError_) as caught:
        read_torch_csv("0F0,0F1,0B0,0B1\n1F1,1B0,1F2,1B1\n")
    assert (caught.value.rank, caught.value.step) == (1, 2)
    assert caught.value.message == ("1F2 is a stray: the stages' forwards say N = 2 (microbatches 0..1); "
                                    "rank 1 lacks 1F0")
    # a stray beside a whole set: nothing lacking, the stray named alone
    with pytest.raises(ImportError_) as caught:
        read_torch_csv("0F0,0F1,0B0,0B1\n1F0,1F1,1F2,1B0,1B1\n2F0,2F1,2B0,2B1\n")
    assert caught.value.message == "1F2 is a stray: the stages' forwards say N = 2 (microbatches 0..1)"
    # a tie (one stage runs 2 forwards, the other 3): the count a stage runs as exactly 0..N-1 wins
    with pytest.raises(ImportError_) as caught:
        read_torch_csv("0F0,0F1,0B0,0B1\n1F0,1F1,1B0,1B1,1F7\n")
    assert (caught.value.rank, caught.value.step) == (1, 4)
    assert caught.value.message == "1F7 is a stray: the stages' forwards say N = 2 (microbatches 0..1)"
    # a rank short of its last microbatch: N from the majority, the missing task named by the checks
    program, had_comms = read_torch_csv("0F0,0F1,0B0,0B1\n1F0,1B0\n2F0,2F1,2B0,2B1\n")
    assert program.num_microbatches == 2
    with pytest.raises(WellFormedError, match="1F1"):
        prepare_imported(program, had_comms)


def test_an_incomplete_schedule_fails_the_checks(tmp_path):
    program, had_comms = read_torch_csv("0F0,0F1,0B0\n1F0,1B0,1F1,1B1\n")  # 0B1 missing
    with pytest.raises(WellFormedError, match="0B1"):
        prepare_imported(program, had_comms)
    # torch's own communication schedule, less one receive: checked as written, so caught
    schedule = torch_runtime_schedule(torch_schedules.ScheduleInterleaved1F1B, 2, 4)
    text = torch_csv(schedule, tmp_path, "compute_comms")
    assert ",1RECV_F0," in text
    program, had_comms = read_torch_csv(text.replace(",1RECV_F0,", ",", 1))
    with pytest.raises(ProgramError):
        prepare_imported(program, had_comms)


# ------------------------------------------------------------------------- CLI


def test_cli_missing_file_exits_1_without_traceback(tmp_path, capsys):
    missing = tmp_path / "nope.csv"
    assert main(["import-torch", str(missing)]) == 1
    err = capsys.readouterr().err
    assert "nope.csv" in err and "Traceback" not in err
    done = subprocess.run([sys.executable, "-m", "pipec", "import-torch", str(missing)], capture_output=True, text=True)
    assert done.returncode == 1
    assert "nope.csv" in done.stderr and "Traceback" not in done.stderr


def test_cli_bad_csv_exits_1_with_the_located_error(tmp_path, capsys):
    path = tmp_path / "bad.csv"
    path.write_text("0F0,0B0\n1F0,1Z0,1B0\n")
    assert main(["import-torch", str(path)]) == 1
    err = capsys.readouterr().err
    assert err.startswith("rank 1, step 1:") and "Traceback" not in err


def test_cli_summary_and_json(tmp_path, capsys):
    path = tmp_path / "zbv.csv"
    schedule = torch_runtime_schedule(torch_schedules.ScheduleZBVZeroBubble, 2, 4)
    schedule._dump_csv(str(path), format="compute_only")
    program, result = import_and_check(str(path))

    assert main(["import-torch", str(path)]) == 0
    line = capsys.readouterr().out.strip()
    assert line.startswith("zbv: 2 ranks, 4 stages, 4 microbatches")
    assert f"{program.instruction_count()} instructions" in line and f"makespan {result.makespan:g}" in line

    assert main(["import-torch", str(path), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert (report["num_ranks"], report["num_stages"], report["num_microbatches"]) == (2, 4, 4)
    assert report["makespan"] == result.makespan and report["bubble_ratio"] == result.bubble_ratio
    assert len(report["ranks"]) == 2 and {"busy", "idle", "peak_activations"} <= set(report["ranks"][0])


def test_cli_with_costs_file(tmp_path, capsys):
    path = tmp_path / "gpipe.csv"
    path.write_text(write_torch_csv(gpipe(2, 2), with_comms=False))
    costs = tmp_path / "costs.json"
    costs.write_text(json.dumps({"compute": {"F": 2, "B": 4}}))
    assert main(["import-torch", str(path), "--json"]) == 0
    unit = json.loads(capsys.readouterr().out)
    assert main(["import-torch", str(path), "--json", "--costs", str(costs)]) == 0
    doubled = json.loads(capsys.readouterr().out)
    assert doubled["makespan"] == 2 * unit["makespan"]
    assert main(["import-torch", str(path), "--costs", str(tmp_path / "missing.json")]) == 1
    assert "Traceback" not in capsys.readouterr().err


@pytest.mark.parametrize("pp, nmb", [(2, 4), (4, 8), (4, 4), (8, 16)])
def test_torchs_zbv_makespans_are_the_ones_pipecs_zbv_is_held_to(pp, nmb):
    from test_schedules import TORCH_ZBV_MAKESPAN

    program = prepare_imported(_torch_compute_program(torch_schedules.ScheduleZBVZeroBubble, pp, nmb, "zbv.csv"), False)
    assert simulate(program).makespan == TORCH_ZBV_MAKESPAN[pp, nmb]


def test_a_csv_of_more_ranks_than_pipec_takes_is_refused_before_the_work():
    """A row is a rank: past ``MAX_RANKS`` rows the CSV is refused at the first row too many, before any table
    of ranks is built (was: no limit; a million rows ended in a MemoryError traceback, 20,000 took 69 s)."""
    from pipec.compiler.import_torch import read_torch_csv
    from pipec.dsl.limits import MAX_RANKS
    from pipec.errors import ImportError_

    with pytest.raises(ImportError_) as caught:
        read_torch_csv("0F0\n" * 1_000_000, "big.csv")
    assert str(caught.value).startswith(f"big.csv:{MAX_RANKS + 1}: the schedule CSV has more than {MAX_RANKS:,} rows")
    program, _ = read_torch_csv("0F0,0B0\n" + "\n" * (2 * MAX_RANKS), "blank.csv")  # trailing blank lines: no ranks
    assert program.num_ranks == 1
