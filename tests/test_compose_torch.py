"""pipec's PP x FSDP and PP x DP programs as torch's schedule CSV, run by torch's own runtime over FSDP2, train exactly.

``mesh_placement.place_on_mesh`` puts a pipeline schedule on a (pp, dp) mesh with
sharded or replicated stages; ``write_torch_csv`` writes it as one row per pp
rank with the program's own ``UNSHARD`` (before a compute holding a GATHER),
``RESHARD`` and ``REDUCE_GRAD`` (``emit/torch_csv_mesh.py``). Four gloo
processes (``torch_fsdp_worker.py``) wrap each stage in ``fully_shard``
(sharded) or FSDP2's ``replicate`` (replicated) on the dp sub-mesh of a
``DeviceMesh`` (pp, dp), load the CSV with torch's
``_load_csv(format="compute_comms")`` (one case through
``pipec.torch.schedule_for`` instead), feed member i of each dp group rows
share i of every microbatch, and train two SGD steps: every gradient and
final parameter must match one process training the whole batch with the
same N to 1e-5, and FSDP2 must all-gather exactly as often as the CSV says
UNSHARD for a sharded stage. The rest needs no processes: the CSV's shape,
torch's parser and pipec's importer reading it back, the compile command's
text, and every refusal.
"""
from __future__ import annotations

import os
import re
import sys
from dataclasses import replace

import pytest
import torch

import pipec.api
from pipec.compiler import ops
from pipec.compiler.mesh_placement import DataParallel, place_on_mesh
from pipec.compiler.emit.torch_csv import NEWEST_TORCH, TorchRuntime, installed_torch_runtime, write_torch_csv
from pipec.compiler.import_torch import prepare_imported, read_torch_csv
from pipec.compiler.ir import Action, Mesh
from pipec.errors import UsageError
from runtime_util import _launch

import torch_runtime_worker as reference_worker
from torch_fsdp_worker import CASES, DP, NUM_MICROBATCHES, PP, VIA_SCHEDULE_FOR, composed, pipeline

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "torch_fsdp_worker.py")
# Four processes importing torch, then five trainings of two steps each: about 12 s alone; a loaded machine is
# slower, and a hang is killed here.
DEADLINE_S = 240.0
MESH = Mesh((("pp", PP), ("dp", DP)))
# The cases run by torch's _load_csv, and one run through pipec.torch.schedule_for.
RUNS = [*CASES, "1f1b_zero3" + VIA_SCHEDULE_FOR]

runtime = installed_torch_runtime()
needs_fsdp_runtime = pytest.mark.skipif(
    runtime is None or not (runtime.reduce_grad and runtime.fsdp_tokens),
    reason="the installed torch's runtime has no REDUCE_GRAD/UNSHARD (torch < 2.10)",
)


def rows(text: str) -> list[list[str]]:
    return [line.split(",") if line else [] for line in text.split("\n")[:-1]]


# ------------------------------------------------------------------ torch's runtime trains it


@pytest.fixture(scope="module")
def torch_runs(tmp_path_factory):
    """Every run's export trained by torch's runtime over FSDP2 in one set of 4 gloo processes."""
    folder = tmp_path_factory.mktemp("torch_fsdp")
    for run in RUNS:
        case = run.split("@")[0]
        (folder / f"{run}.csv").write_text(
            write_torch_csv(composed(case), with_comms=True, for_torch=installed_torch_runtime()))
    done = _launch([sys.executable, WORKER, str(folder), *RUNS], PP * DP, DEADLINE_S, None)
    assert done.ok, done.describe()
    return {run: [torch.load(folder / f"{run}.csv.rank{rank}.pt") for rank in range(PP * DP)] for run in RUNS}


@needs_fsdp_runtime
@pytest.mark.parametrize("case", RUNS)
def test_torch_runtime_trains_the_fsdp_export_like_one_process(case, torch_runs):
    num_stages = len(pipeline(case.split("@")[0]).stages)
    grads, params = reference_worker.reference(num_stages)
    for rank, result in enumerate(torch_runs[case]):
        assert result["pp_rank"] == MESH.coords(rank)["pp"]
        for key, value in result["params"].items():
            torch.testing.assert_close(value, params[key], atol=1e-5, rtol=0, msg=f"{case} rank {rank}: {key}")
            for step, step_grads in enumerate(result["grads"]):
                torch.testing.assert_close(step_grads[key], grads[step][key], atol=1e-5, rtol=0,
                                           msg=f"{case} rank {rank}: step {step} gradient of {key}")
    for pp_rank in range(PP):  # every member of every group holds its stages, and they cover the model
        held = [set(result["params"]) for result in torch_runs[case] if result["pp_rank"] == pp_rank]
        assert len(held) == DP and all(h == held[0] for h in held)
    assert set().union(*(result["params"] for result in torch_runs[case])) == set(params)


@needs_fsdp_runtime
@pytest.mark.parametrize("case", RUNS)
def test_fsdp_gathers_and_reduces_exactly_where_the_csv_says(case, torch_runs):
    """FSDP2 all-gathers only at a sharded stage's UNSHARDs (its own reshard after each forward is off; a
    replicated stage's UNSHARD gathers nothing) and reduces each stage's gradient once, at its REDUCE_GRAD.
    The first step also runs torch's shape inference, so the last is counted."""
    program = composed(case.split("@")[0])
    table = rows(write_torch_csv(program, with_comms=True, for_torch=NEWEST_TORCH))
    for rank, result in enumerate(torch_runs[case]):
        row = table[result["pp_rank"]]
        sharded_unshards = sum(1 for a in program.ranks[rank] for p in a.parts if p.op == ops.GATHER)
        last_step = result["collectives"][-1]
        assert last_step.get("gather", 0) == sharded_unshards
        assert sharded_unshards == (sum(c.endswith("UNSHARD") for c in row) if CASES[case.split("@")[0]][2] else 0)
        assert last_step.get("reduce", 0) == sum(cell.endswith("REDUCE_GRAD") for cell in row) > 0


# ------------------------------------------------------------------ the CSV itself


@pytest.mark.parametrize("case", sorted(CASES))
def test_one_row_per_pp_rank_carrying_the_programs_own_data_axis_steps(case):
    program = composed(case)
    table = rows(write_torch_csv(program, with_comms=True, for_torch=NEWEST_TORCH))
    assert len(table) == PP
    for pp_rank, row in enumerate(table):
        member_row = program.ranks[MESH.rank_at({"pp": pp_rank, "dp": 0})]
        gathers = [a for a in member_row if a.is_compute and any(p.op == ops.GATHER for p in a.parts)]
        reductions = [p for a in member_row if a.op == ops.EXCHANGE for p in a.parts]
        replicated = [p.stage for p in reductions if p.op == ops.SYNC_GRAD]
        # a sharded stage's unshards are its gathers; a replicated stage is unsharded once and closed once
        assert sum(c.endswith("UNSHARD") for c in row) == len(gathers) + len(replicated)
        assert sum(c.endswith("RESHARD") for c in row) == sum(a.op == ops.RESHARD for a in member_row) + len(replicated)
        assert sum(c.endswith("REDUCE_GRAD") for c in row) == len(reductions) > 0
        for compute in gathers:  # the UNSHARD right before its compute
            token = compute._replace(parts=()).text()
            assert row[row.index(token) - 1] == f"{compute.stage}UNSHARD"
        for stage in {int(m[1]) for m in re.finditer(r"(\d+)F\d+", ",".join(row))}:
            _stage_is_whole_whenever_it_computes(row, stage)


def _stage_is_whole_whenever_it_computes(row: list[str], stage: int) -> None:
    """What torch's runtime asserts of an FSDP stage, and one REDUCE_GRAD after its last backward."""
    whole = False
    for cell in row:
        if cell in (f"{stage}UNSHARD", f"{stage}RESHARD"):
            assert whole == (cell == f"{stage}RESHARD"), (stage, cell, row)
            whole = cell == f"{stage}UNSHARD"
        elif re.fullmatch(rf"{stage}[FBIW]\d+", cell):
            assert whole, (stage, cell, row)
    assert not whole, f"stage {stage} is left whole"
    backwards = [i for i, cell in enumerate(row) if re.fullmatch(rf"{stage}[BW]\d+", cell)]
    assert row.count(f"{stage}REDUCE_GRAD") == 1 and max(backwards) < row.index(f"{stage}REDUCE_GRAD")
    assert len(backwards) == NUM_MICROBATCHES


@pytest.mark.parametrize("case", sorted(CASES))
def test_torchs_parser_and_pipecs_importer_read_it_back_as_the_pipeline(case):
    from torch.distributed.pipelining.schedules import _Action

    text = write_torch_csv(composed(case), with_comms=True, for_torch=NEWEST_TORCH)
    for row in rows(text):
        assert [str(_Action.from_str(cell)) for cell in row] == row
    program, had_comms = read_torch_csv(text, source=f"<{case}>")
    assert had_comms
    checked = prepare_imported(program, had_comms)  # the pp rows, without the FSDP steps, prove as a pipeline
    original = pipeline(case)
    assert [[a.text() for a in row] for row in checked.ranks] == \
        [[p.text() for a in row for p in (a.parts or (a,)) if p.op != ops.FREE_F] for row in original.ranks]


@pytest.mark.parametrize("case", sorted(CASES))
def test_compute_only_form_is_the_pipelines(case):
    """torch's lowering of a compute-only CSV places UNSHARD/RESHARD/REDUCE_GRAD by its own rule."""
    assert write_torch_csv(composed(case), with_comms=False) == write_torch_csv(pipeline(case), with_comms=False)


def test_the_compile_command_writes_a_composed_program():
    """What ``pipec compile --format torch-csv(-comms)`` writes for a program (its ``_text_of``); composed
    programs come from .pipe files once the language has them, and program JSON cannot carry one yet."""
    from pipec.commands.compile import _text_of

    program = pipec.api.Program(composed("1f1b_zero3"))
    assert _text_of(program, "torch-csv-comms") == \
        write_torch_csv(composed("1f1b_zero3"), with_comms=True, for_torch=installed_torch_runtime() or NEWEST_TORCH)
    assert _text_of(program, "torch-csv") == write_torch_csv(pipeline("1f1b_zero3"), with_comms=False)


# ------------------------------------------------------------------ what torch's format cannot express


def test_other_meshes_and_steps_are_refused_by_rank_and_step():
    program = composed("1f1b_zero3")
    three_axes = Mesh((("pp", PP), ("dp", DP), ("cp", 1)))
    with pytest.raises(UsageError, match="mesh of 3 axes"):
        write_torch_csv(replace(program, mesh=three_axes), with_comms=True)
    ranks = [list(row) for row in program.ranks]
    ranks[1][2], ranks[1][3] = ranks[1][3], ranks[1][2]
    with pytest.raises(UsageError, match=r"^rank 1, step 2: its order differs from rank 0's"):
        write_torch_csv(replace(program, ranks=ranks), with_comms=True)
    ranks = [list(row) for row in program.ranks]
    ranks[0][1] = ranks[0][1]._replace(peer=3)  # 0SEND_F0 to the other dp coordinate's member of pp 1
    with pytest.raises(UsageError, match=r"^rank 0, step 1: 0SEND_F0 goes to rank 3 at dp 1, but rank 0 is at dp 0"):
        write_torch_csv(replace(program, ranks=ranks), with_comms=True)
    ranks = [list(row) for row in program.ranks]
    ranks[0][0] = ranks[0][0]._replace(parts=(Action(0, ops.SYNC_GRAD),))
    with pytest.raises(UsageError, match=r"^rank 0, step 0: .*no form for a SYNC_GRAD inside a compute"):
        write_torch_csv(replace(program, ranks=ranks), with_comms=True)


def test_a_torch_without_reduce_grad_is_refused():
    with pytest.raises(UsageError, match=r"torch 2\.8\.0's runtime has no REDUCE_GRAD"):
        write_torch_csv(composed("1f1b_zero3"), with_comms=True, for_torch=TorchRuntime("2.8.0", reduce_grad=False))


def test_a_data_axis_of_one_writes_the_pipeline():
    program = place_on_mesh(pipeline("1f1b_zero3"), Mesh((("pp", PP), ("dp", 1))), "pp", DataParallel("dp", True))
    assert write_torch_csv(program, with_comms=True, for_torch=NEWEST_TORCH) == \
        write_torch_csv(pipeline("1f1b_zero3"), with_comms=True, for_torch=NEWEST_TORCH)


class _Stage:
    """What ``schedule_for`` reads of a ``PipelineStage`` before torch sees it."""

    def __init__(self, index: int, rank: int, group_size: int):
        self.stage_index, self.group_rank, self.group_size, self.num_stages = index, rank, group_size, 2
        self.submod = torch.nn.Linear(2, 2)  # not an FSDP2 module


@pytest.mark.parametrize("stages, message", [
    ([_Stage(0, 0, group_size=4)], "1f1b runs on 2 pp ranks (its pp process group); the stages' process group has 4"),
    ([_Stage(0, 1, group_size=2)], "rank 1: 1f1b places stages [1] here; the stages given are [0]"),
    ([_Stage(1, 1, group_size=2)],
     "1f1b places its stages on data-parallel groups; stage(s) [1] are not FSDP2 modules"),
])
def test_schedule_for_takes_a_composed_programs_pp_group_and_fsdp2_stages(stages, message):
    import pipec.torch

    with pytest.raises(UsageError, match=re.escape(message)):
        pipec.torch.schedule_for(pipec.api.Program(composed("1f1b_zero3")), stages)
