"""Recomputation (activation checkpointing) as part of the schedule.

``recompute stage s [when COND]`` makes a stage's forward keep only its input
(FC, as the order still writes F) and runs the forward again (R) right before
the backward, unless the order writes R itself. The language, the checks,
the memory counts, the simulator, the cost files, the emitters and the
runtime all read FC and R from the rule table; these tests hold each of them
to exact figures: makespans and bubbles as fractions under unit costs, peak
counts and bytes, the named errors, and parameters within 1e-5 of one process.
"""
from __future__ import annotations

import copy
import json
import re
from fractions import Fraction
from types import SimpleNamespace

import pytest
import torch

from pipec.cli import main
from pipec.compiler.checks import check_all, peak_activations
from pipec.compiler.checks.memory import peak_kept_inputs
from pipec.compiler.costs import costs_from_json
from pipec.compiler.driver import compile_spec, compile_target
from pipec.compiler.emit import format_text_grid, program_from_json, program_to_json, write_torch_csv
from pipec.compiler.import_torch import prepare_imported, read_torch_csv
from pipec.compiler.measured_costs import measure_costs
from pipec.compiler.memory_counts import peak_bytes
from pipec.compiler.render import style
from pipec.compiler.render.graph import task_graph_dot
from pipec.compiler.simulate import simulate
from pipec.errors import BudgetError, EvalError, ParseError, ResolveError, ScheduleError, SourceErrors, WellFormedError
from pipec.runtime.model import ModelConfig
from pipec.runtime.reference import reference_run
from pipec.runtime.trace import chrome_events
from runtime_util import assert_same_parameters, launch_batch
from source_util import error_of, located, messages, spec_of

# Unit costs: F = R = 1, B = 2.
F, R, B = 1, 1, 2

ONE_F_ONE_B = """
schedule one_f_one_b(P: ranks = 4, N: microbatches = 2 * P) {
  stages P
  place stage s on rank s
  recompute stage s when s % 2 == 0
  order rank r {
    let warm = min(P - 1 - r, N)
    for m in 0 .. warm     { F(r, m) }
    for i in 0 .. N - warm { F(r, warm + i); B(r, i) }
    for m in N - warm .. N { B(r, m) }
  }
}
"""


def compute_rows(program) -> list[list[str]]:
    return [[action.text() for action in row if action.is_compute] for row in program.ranks]


def remat(name: str, P: int, N: int, on: bool = True, **more):
    return compile_target(name, {"P": P, "N": N, "remat": on, **more}).program


# ---------------------------------------------------------------- the language


def test_a_recomputed_stage_runs_fc_and_r_right_before_its_backward():
    spec = spec_of(ONE_F_ONE_B, P=2, N=3)
    assert spec.recomputed == frozenset({0})
    # the order as written: F of stage 0 runs as FC, stage 1's stays F; no R yet
    assert spec.order[0] == [("FC", 0, 0), ("FC", 0, 1), ("B", 0, 0), ("FC", 0, 2), ("B", 0, 1), ("B", 0, 2)]
    assert spec.order[1] == [("F", 1, 0), ("B", 1, 0), ("F", 1, 1), ("B", 1, 1), ("F", 1, 2), ("B", 1, 2)]
    rows = compute_rows(compile_spec(spec).program)
    assert rows[0] == ["0FC0", "0FC1", "0R0", "0B0", "0FC2", "0R1", "0B1", "0R2", "0B2"]
    assert rows[1] == ["1F0", "1B0", "1F1", "1B1", "1F2", "1B2"]


def test_without_when_every_stage_and_several_declarations_add_up():
    every = ONE_F_ONE_B.replace("recompute stage s when s % 2 == 0", "recompute stage s")
    assert spec_of(every, P=4).recomputed == frozenset(range(4))
    two = ONE_F_ONE_B.replace("recompute stage s when s % 2 == 0",
                              "recompute stage s when s == 1\n  recompute stage t when t == P - 1")
    assert spec_of(two, P=4).recomputed == frozenset({1, 3})


def test_a_written_recompute_stays_where_it_is_written():
    # the drain's recomputes each one backward early: rank r holds two saved activations then
    early = ONE_F_ONE_B.replace("recompute stage s when s % 2 == 0", "recompute stage s").replace(
        "for m in N - warm .. N { B(r, m) }",
        "if warm > 0 { R(r, N - warm) }\n    for m in N - warm .. N { if m + 1 < N { R(r, m + 1) } B(r, m) }")
    program = compile_spec(spec_of(early, P=4, N=8)).program
    assert compute_rows(program)[0][-6:] == ["0R5", "0R6", "0B5", "0R7", "0B6", "0B7"]
    assert peak_activations(program) == [2, 2, 1, 1]  # rank 3 has no drain
    assert [peak_kept_inputs(row) for row in program.ranks] == [4, 3, 2, 1]
    result = simulate(program)  # the drain waits on the gradients, not on the recomputes: as fast
    assert (result.makespan, result.bubble_fraction()) == (41, Fraction(9, 41))


def test_r_of_a_stage_that_is_not_recomputed_is_an_error_at_the_task():
    text = ONE_F_ONE_B.replace("for m in N - warm .. N { B(r, m) }", "for m in N - warm .. N { R(r, m); B(r, m) }")
    error = error_of(ScheduleError, text, P=4, N=8)
    assert located(error, 10, 30) == (
        "R(1, 6) recomputes stage 1's forward, but stage 1 is not recomputed: add a `recompute stage s when COND` "
        "whose condition holds for s = 1, or drop R(1, 6)")


def test_r_in_a_schedule_that_recomputes_nothing_says_to_add_recompute():
    text = ONE_F_ONE_B.replace("  recompute stage s when s % 2 == 0\n", "").replace(
        "for m in 0 .. warm     { F(r, m) }", "for m in 0 .. warm     { F(r, m); R(r, m) }")
    error = error_of(ResolveError, text)
    assert located(error, 7, 39) == ("R(...) runs a recomputed stage's forward again, and this schedule recomputes no "
                                     "stage: add `recompute stage s` (or `recompute stage s when COND`)")


def test_fc_is_written_as_f_and_r_takes_no_priority():
    error = error_of(ResolveError, ONE_F_ONE_B.replace("{ F(r, m) }", "{ FC(r, m) }"))
    assert located(error, 8, 30) == "FC(...) is what F(...) becomes on a recomputed stage (`recompute stage`); write F(s, m)"
    greedy = """
    schedule g(P: ranks = 4, N: microbatches = 8) {
      stages P
      place stage s on rank s
      recompute stage s
      order greedy { priority R(s, m) = m }
    }
    """
    error = error_of(ResolveError, greedy)
    assert located(error, 6, 18).startswith("R tasks take no priority: the compiler runs each right before its backward")


def test_a_recompute_twice_is_named_with_its_first_place():
    text = ONE_F_ONE_B.replace("recompute stage s when s % 2 == 0", "recompute stage s").replace(
        "for m in N - warm .. N { B(r, m) }", "for m in N - warm .. N { R(r, m); R(r, m); B(r, m) }")
    error = error_of(ScheduleError, text, P=2, N=2)
    assert located(error, 10, 39) == "R(0, 1) is scheduled twice (first at rank 0, step 3)"


def test_recompute_in_weight_passing_and_in_a_ring_is_a_located_error():
    weights = """
    schedule w(P: ranks = 2, N: microbatches = 2) {
      stages P
      home microbatch m on rank m % P
      own layer l on rank l
      weights direct
      recompute stage s
      order rank r { at step 0 { F(0, r) } at step 1 { F(1, r) } at step 2 { B(1, r) } at step 3 { B(0, r) } }
    }
    """
    error = error_of(ResolveError, weights)
    assert located(error, 7, 3) == ("`recompute stage` belongs to activation passing: weight passing already recomputes "
                                    "every layer (its F keeps only the layer's input, its B runs the forward again)")
    written = weights.replace("      recompute stage s\n", "").replace("at step 2 { B(1, r) }",
                                                                         "at step 2 { R(1, r) B(1, r) }")
    error = error_of(ResolveError, written)
    assert located(error, 7, 74) == ("R(...) recomputes a stage's forward, and weight passing needs none: its B "
                                     "already runs the layer's forward again from the input its F kept")
    ring = """
    schedule z(P: ranks = 2) {
      sequence chunks 2 * P
      hold chunk c on rank c < P ? c : 2 * P - 1 - c
      mask causal
      rings shift 1
      recompute stage s
    }
    """
    error = error_of(ResolveError, ring)
    assert located(error, 7, 3).startswith("`recompute stage` belongs to activation passing: a sequence ring keeps no "
                                           "stage activations to recompute")


def test_a_bad_condition_is_reported_where_it_is_written():
    text = ONE_F_ONE_B.replace("when s % 2 == 0", "when s + 1").replace(
        "place stage s on rank s", "place stage s on rank s\n  recompute stage t when remat")
    assert messages(error_of(SourceErrors, text)) == [  # every one at once, in the order of the text
        (5, 26, "unknown name 'remat'"), (6, 26, "a `when` condition must be a boolean, not an integer")]
    error = error_of(EvalError, ONE_F_ONE_B.replace("when s % 2 == 0", "when 1 / (s - 1) == 0"), P=4)
    assert located(error, 5, 31) == "division by zero ('/' by a value that is 0)"  # evaluated at s = 1


def test_recompute_is_a_keyword():
    text = ONE_F_ONE_B.replace("stages P", "let recompute = 1\n  stages P")
    error = error_of(ParseError, text)
    assert located(error, 3, 7) == "'recompute' is a keyword and cannot be used as a name; pick another name"


# ------------------------------------------------------------- the simulator


@pytest.mark.parametrize("P,N", [(4, 8), (3, 6), (2, 5), (3, 3)])
def test_1f1b_recomputing_every_stage_under_unit_costs(P, N):
    """Every rank is busy N (F + R + B) and idles 1F1B's (P - 1)(F + B): R needs no gradient, so the
    backward's gradient travels while R runs, and only the last rank's steady F, R, B (never waiting)
    and the gradient's way back lie on the longest path. That is shorter than 1F1B with a backward of
    R + B = 3, (N + P - 1)(F + R + B), where R would wait for the gradient."""
    result = simulate(remat("1f1b", P, N))
    makespan = N * (F + R + B) + (P - 1) * (F + B)
    assert result.makespan == makespan and makespan < (N + P - 1) * (F + R + B)
    assert result.bubble_fraction() == Fraction((P - 1) * (F + B), makespan)
    assert [rank.busy for rank in result.ranks] == [N * (F + R + B)] * P
    plain = simulate(remat("1f1b", P, N, on=False))
    assert plain.makespan == (N + P - 1) * (F + B)  # 1F1B: bubble (P - 1)/(N + P - 1)


def test_the_figures_of_1f1b_p4_n8():
    on, off = simulate(remat("1f1b", 4, 8)), simulate(remat("1f1b", 4, 8, on=False))
    assert (on.makespan, on.bubble_fraction(), off.makespan, off.bubble_fraction()) == (
        41, Fraction(9, 41), 33, Fraction(3, 11))


def test_not_recomputing_the_last_stage_is_faster_for_the_same_peak():
    """The last stage holds one saved activation at a time anyway: recomputing it only costs time."""
    text = ONE_F_ONE_B.replace("when s % 2 == 0", "when s < P - 1")
    program = compile_spec(spec_of(text, P=4, N=8)).program
    result = simulate(program)
    assert (result.makespan, result.bubble_fraction()) == (39, Fraction(3, 13))
    assert peak_activations(program) == [1, 1, 1, 1] == peak_activations(remat("1f1b", 4, 8))
    assert [peak_kept_inputs(row) for row in program.ranks] == [4, 3, 2, 0]


def test_r_is_priced_like_the_chunks_forward_unless_the_cost_file_says_otherwise():
    program = remat("1f1b", 4, 8)
    # F = 2, B = 4: R defaults to F = 2, so the unit figures double
    doubled = costs_from_json({"compute": {"F": 2, "B": 4}})
    assert doubled.compute("R", 0) == doubled.compute("FC", 3) == 2
    assert simulate(program, doubled).makespan == 2 * 41
    # R given: 8 R of 3 more on every rank's busy time; the idle time stays (P - 1)(F + B) = 18
    slow = simulate(program, costs_from_json({"compute": {"F": 2, "B": 4, "R": 5}}))
    assert (slow.makespan, [rank.busy for rank in slow.ranks]) == (8 * (2 + 5 + 4) + 18, [88] * 4)
    # per chunk: a chunk's R is that chunk's F unless given
    chunked = costs_from_json({"compute": {"R": 1.5, "per_chunk": {"0": {"F": 3}, "1": {"R": 0.5}}}})
    assert (chunked.compute("R", 0), chunked.compute("R", 1), chunked.compute("R", 2)) == (1.5, 0.5, 1.5)
    only_f = costs_from_json({"compute": {"per_chunk": {"0": {"F": 3}}}})
    assert (only_f.compute("R", 0), only_f.compute("FC", 0), only_f.compute("R", 1)) == (3, 3, 1)
    assert costs_from_json({}) == costs_from_json({"compute": {}})  # unit models compare equal


def test_the_list_scheduler_prices_r_with_the_backward():
    """zbv (greedy, split backward): with every stage recomputed, the order is the one it takes for
    I = R + I = 2 without recomputation, each R right before its I; unit-cost zbv's order differs."""
    def order(program):
        return [[(a.op, a.stage, a.mb) for a in row if a.is_compute] for row in program.ranks]

    recomputed = order(remat("zbv", 4, 8))
    assert all(row[i + 1] == ("I",) + task[1:] for row in recomputed for i, task in enumerate(row) if task[0] == "R")
    stripped = [[("F" if op == "FC" else op, s, m) for op, s, m in row if op != "R"] for row in recomputed]
    heavier = compile_target("zbv", {"P": 4, "N": 8}, costs=costs_from_json({"compute": {"I": 2, "W": 1}})).program
    assert stripped == order(heavier)
    assert stripped != order(remat("zbv", 4, 8, on=False))
    result = simulate(remat("zbv", 4, 8))
    assert (result.makespan, result.bubble_fraction()) == (69, Fraction(5, 69))


def test_without_remat_every_shipped_program_is_as_before():
    for name in ("gpipe", "1f1b", "interleaved_1f1b", "zb_h1", "zbv", "chimera", "bitpipe"):
        P, N = 4, 8 if name not in ("chimera", "bitpipe") else 4
        default = compile_target(name, {"P": P, "N": N}).program
        assert default.ranks == remat(name, P, N, on=False).ranks
        assert not any(a.op in ("FC", "R") for row in default.ranks for a in row)
        on = remat(name, P, N)
        assert peak_activations(on) == [1] * P  # R right before the backward: one saved activation at a time


# --------------------------------------------------------------------- memory


@pytest.mark.parametrize("P", [4, 6])
def test_peaks_and_bytes_of_1f1b(P):
    on, off = remat("1f1b", P, 2 * P), remat("1f1b", P, 2 * P, on=False)
    assert peak_activations(off) == [P - r for r in range(P)]
    assert peak_activations(on) == [1] * P
    assert [peak_kept_inputs(row) for row in on.ranks] == [P - r for r in range(P)]
    assert [peak_kept_inputs(row) for row in off.ranks] == [0] * P
    A, b = 1000, 7
    sizes = {"activation": A, "boundary": b}
    assert peak_bytes(on, sizes) == [{"activation": A, "boundary": (P - r) * b} for r in range(P)]
    assert peak_bytes(off, sizes) == [{"activation": (P - r) * A, "boundary": 0} for r in range(P)]
    stats = simulate(on, sizes=sizes).to_json()["ranks"]
    assert [rank["peak_bytes"] for rank in stats] == peak_bytes(on, sizes)


def test_simulate_json_reports_the_kept_inputs(capsys):
    def ranks(*extra):
        assert main(["simulate", "1f1b", "-D", "P=4", "-D", "N=8", *extra, "--json"]) == 0
        return json.loads(capsys.readouterr().out)["ranks"]

    on, off = ranks("-D", "remat=true"), ranks()
    assert [rank["peak_activations"] for rank in off] == [4, 3, 2, 1]
    assert [rank["peak_activations"] for rank in on] == [1, 1, 1, 1]
    assert [rank["peak_kept_inputs"] for rank in on] == [4, 3, 2, 1]
    assert all("peak_kept_inputs" not in rank for rank in off)  # a program that recomputes nothing is as before


def test_a_byte_budget_for_kept_inputs_is_enforced(capsys):
    costs = costs_from_json({"sizes": {"activation": 100, "boundary": 10}})
    compile_target("1f1b", {"P": 4, "N": 8, "remat": True}, costs=costs, byte_budget={"boundary": 40})
    with pytest.raises(BudgetError) as info:
        compile_target("1f1b", {"P": 4, "N": 8, "remat": True}, costs=costs, byte_budget={"boundary": 39})
    assert info.value.rank == 0 and "40 bytes of boundary-sized values alive here" in info.value.message


# --------------------------------------------------------------------- checks


def _edited(program, rank: int, edit):
    """A copy of ``program`` whose rank ``rank`` list is ``edit(list of texts)``, rebuilt from the JSON form."""
    data = copy.deepcopy(program_to_json(program))
    row = data["ranks"][rank]
    data["ranks"][rank] = edit(row)
    return program_from_json(data)


def _index(row, text: str) -> int:
    return next(i for i, instruction in enumerate(row) if instruction["text"] == text)


def test_a_recompute_after_its_backward_is_named_at_the_backward():
    program = remat("1f1b", 2, 2)

    def late(row):
        r = row.pop(_index(row, "1R0"))
        row.insert(_index(row, "1B0") + 1, r)
        return row

    bad = _edited(program, 1, late)
    with pytest.raises(WellFormedError) as info:
        check_all(bad)
    error = info.value
    step = [a.text() for a in bad.ranks[1]].index("1B0")
    assert (error.rank, error.step) == (1, step)
    assert error.message == f"1B0 needs 1R0, which comes later on this rank (step {step + 1})"
    assert error.render().startswith(f"rank 1, step {step}: {error.message}") and "[1B0]" in error.render()


def test_a_backward_without_its_recompute_and_a_forward_run_twice_are_named():
    program = remat("1f1b", 2, 2)
    bad = _edited(program, 1, lambda row: [i for i in row if i["text"] != "1R1"])
    with pytest.raises(WellFormedError) as info:
        check_all(bad)
    assert info.value.message == ("task 1R1 is missing (1FC1 keeps only its input: the stage is recomputed, and "
                                  "its backward reads what R remakes)")
    assert info.value.rank == 1

    def twice(row):
        fc = row[_index(row, "1FC0")]
        row.insert(_index(row, "1FC0"), {**fc, "op": "F", "text": "1F0"})
        return row

    with pytest.raises(WellFormedError) as info:
        check_all(_edited(program, 1, twice))
    assert info.value.message == "1F0 and 1FC0 both appear: a forward is either F, or FC then R on a recomputed stage"


def test_pipec_check_of_an_edited_program_exits_1_naming_rank_and_step(tmp_path, capsys):
    program = remat("1f1b", 2, 2)
    data = program_to_json(program)
    row = data["ranks"][0]
    row.insert(_index(row, "0FC0"), row.pop(_index(row, "0R0")))  # R before the forward that keeps its input
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(data))
    assert main(["check", str(path)]) == 1
    out, err = capsys.readouterr()
    assert err.startswith("rank 0, step 0: 0R0 needs 0FC0, which comes later on this rank (step 1)")
    assert "Traceback" not in out + err


# ------------------------------------------------------------------- emitters


def test_torch_csv_writes_fc_as_f_and_drops_r():
    on, off = remat("1f1b", 4, 8), remat("1f1b", 4, 8, on=False)
    compute_only = write_torch_csv(on, with_comms=False)
    assert compute_only == write_torch_csv(off, with_comms=False)  # the same order, without recomputation
    comms = write_torch_csv(on, with_comms=True)
    tokens = {re.fullmatch(r"[0-9]+([A-Z_]+)[0-9]*", cell).group(1) for line in comms.splitlines()
              for cell in line.split(",")}
    assert "F" in tokens and "B" in tokens and not tokens & {"FC", "R"}
    for text in (compute_only, comms):  # torch's CSV reads back as a plain program that checks
        imported, had_comms = read_torch_csv(text, "export.csv")
        prepared = prepare_imported(imported, had_comms)
        assert simulate(prepared).makespan == 33


def test_json_round_trip_and_text_grid_hold_fc_and_r():
    for program in (remat("1f1b", 4, 8), remat("zbv", 2, 4), remat("bitpipe", 4, 4)):
        data = json.loads(json.dumps(program_to_json(program)))
        assert program_from_json(data) == program
        ops = {instruction["op"] for row in data["ranks"] for instruction in row}
        assert {"FC", "R"} <= ops
        r = next(instruction for row in data["ranks"] for instruction in row if instruction["op"] == "R")
        assert set(r) == {"op", "text", "stage", "mb"}
    grid = format_text_grid(remat("1f1b", 2, 2))
    assert "rank 0 | 0FC0" in grid and " 0R0 " in grid and "remat=true" in grid


def test_drawings_style_fc_and_r():
    assert style.fill_of("FC", 0) != style.fill_of("F", 0) != style.fill_of("R", 0)
    assert [op for op, _, _ in style.legend({"F", "FC", "R", "B"})] == ["F", "B", "FC", "R"]
    dot = task_graph_dot(remat("1f1b", 2, 2))
    nodes = {line.split("[")[0].strip(): line for line in dot.splitlines() if 'label="' in line and "->" not in line}
    fc = next(node for node, line in nodes.items() if 'label="1FC0"' in line)
    r = next(node for node, line in nodes.items() if 'label="1R0"' in line)
    b = next(node for node, line in nodes.items() if 'label="1B0"' in line)
    assert f"{fc} -> {r}" in dot and f"{r} -> {b}" in dot  # data edges: R reads FC's input, B what R remade


def test_pipec_list_shows_remat_on_every_activation_passing_schedule(capsys):
    assert main(["list"]) == 0
    lines = {line.split()[0]: line for line in capsys.readouterr().out.splitlines()}
    for name in ("gpipe", "1f1b", "interleaved_1f1b", "zb_h1", "zbv", "chimera", "bitpipe"):
        assert "remat: bool = false" in lines[name], lines[name]
    for name in ("weipipe", "tawpipe", "fsdp", "ring_attention", "zigzag_ring", "tasp"):
        assert "remat" not in lines[name]


# -------------------------------------------------------------- measured costs


def test_a_recomputing_runs_trace_prices_f_from_r():
    """FC and R measured per chunk; a run that ran no plain F prices F as R (R is F's computation
    again), so a schedule without recomputation is priced by it too."""
    program = remat("1f1b", 2, 4)
    planted = {"FC": 0.75, "R": 1.25, "B": 2.5}  # ms, on both chunks
    records = []
    for rank, row in enumerate(program.ranks):
        steps = []
        for step in range(2):
            clock, events = 1.0 + step, []
            for index, action in enumerate(row):
                ms = planted.get(action.op, 0.0) * (1 + action.stage)  # chunk 1 twice as slow
                events.append((index, clock, clock + ms / 1000, 0.0))
                clock += ms / 1000
            steps.append(events)
        records += chrome_events(rank, row, steps, t0=0.0)
    measured = measure_costs({"traceEvents": records}, program)
    per_chunk = measured.data["compute"]["per_chunk"]
    assert per_chunk["0"] == {"F": 1.25, "B": 2.5, "FC": 0.75, "R": 1.25}
    assert per_chunk["1"] == {"F": 2.5, "B": 5.0, "FC": 1.5, "R": 2.5}
    costs = costs_from_json(measured.data)
    plain = simulate(remat("1f1b", 2, 4, on=False), costs)
    assert plain.ranks[1].busy == pytest.approx(4 * (2.5 + 5.0))


# -------------------------------------------------------------------- runtime


class _Noisy(torch.nn.Module):
    """A chunk whose forward draws random numbers (dropout): what R must replay."""

    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(8, 8)
        self.dropout = torch.nn.Dropout(0.5)

    def forward(self, x):
        return self.dropout(torch.tanh(self.linear(x)))


def _one_stage_step(module):
    """A rank holding the last stage (1) of a two-stage pipeline, one microbatch, its input handed over."""
    from pipec.runtime import interpreter, payload
    from pipec.runtime.precision import FP32

    wire = payload.Wire(payload.tensor_layout((4, 8)), torch.device("cpu"))
    ctx = SimpleNamespace(prev=[-1, 0], next=[1, -1], stages={1: module}, device=torch.device("cpu"),
                          loss_fn=lambda out, target: ((out - target) ** 2).sum(), rank=0, row=[],
                          precision=FP32, wire_of=lambda kind, producer: wire, stash=None, placed=None)
    step = interpreter._Step(ctx, [None], [torch.ones(4, 8)], 1)
    step.produced[step.key(interpreter.ACT, 0, 0)] = torch.randn(4, 8, generator=torch.Generator().manual_seed(1))
    return interpreter, step


def test_r_replays_the_forwards_random_numbers_and_saves_what_f_would():
    from pipec.compiler.ir import Action

    module = _Noisy()
    results = []
    for recompute in (False, True):
        interpreter, step = _one_stage_step(module)
        module.zero_grad()
        torch.manual_seed(5)
        if recompute:
            interpreter.HANDLERS["FC"](step, Action(1, "FC", 0), 0)
            after_forward = torch.get_rng_state()
            torch.rand(100)  # other work between the forward and the recompute draws numbers too
            before_r = torch.get_rng_state()
            interpreter.HANDLERS["R"](step, Action(1, "R", 0), 1)
            assert torch.equal(torch.get_rng_state(), before_r)  # R leaves the rank's generator as it found it
        else:
            interpreter.HANDLERS["F"](step, Action(1, "F", 0), 0)
            after_forward = torch.get_rng_state()
        (leaf,), loss = step.saved[1]
        interpreter.HANDLERS["B"](step, Action(1, "B", 0), 2)
        results.append((after_forward, step.loss.item(), loss.item(), leaf.grad.clone(), module.linear.weight.grad.clone()))
    (rng_f, step_loss_f, loss_f, input_grad_f, grad_f), (rng_fc, step_loss_fc, loss_r, input_grad_r, grad_r) = results
    assert torch.equal(rng_f, rng_fc)  # FC draws what F draws: the run's random stream is the same either way
    assert step_loss_f == step_loss_fc == loss_f == loss_r
    assert torch.equal(input_grad_f, input_grad_r) and torch.equal(grad_f, grad_r)
    # the test can fail: another dropout mask gives another gradient
    interpreter, step = _one_stage_step(module)
    module.zero_grad()
    torch.manual_seed(6)
    interpreter.HANDLERS["F"](step, Action(1, "F", 0), 0)
    interpreter.HANDLERS["B"](step, Action(1, "B", 0), 2)
    assert not torch.equal(module.linear.weight.grad, grad_f)


STEPS, SEED = 3, 11
# One set of processes per world size; both finish in well under half a minute on two cores.
RUNS = {4: ("1f1b", 8), 2: ("zbv", 4)}


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    folder = tmp_path_factory.mktemp("recompute_runs")
    out = {}
    for ranks, (name, n) in RUNS.items():
        save = str(folder / f"{name}.pt")
        job = [name, "-D", f"P={ranks}", "-D", f"N={n}", "-D", "remat=true", "--steps", str(STEPS), "--seed",
               str(SEED), "--timeout", "60", "--save", save]
        out[ranks] = (launch_batch([job], ranks, 120.0), save)
    return out


@pytest.mark.parametrize("ranks", sorted(RUNS))
def test_training_with_every_stage_recomputed_equals_one_process(trained, ranks):
    run, save = trained[ranks]
    assert run.ok, run.describe()
    name, n = RUNS[ranks]
    want = reference_run(ModelConfig(), STEPS, n, SEED).state_dict
    assert_same_parameters(torch.load(save, weights_only=True), want, f"{name} P={ranks} remat")
