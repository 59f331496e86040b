"""``pipec search --method heuristic`` (issue 27, item 3): the fast evaluator is the simulator, the analytic
bound never exceeds a proven optimum, the heuristic keeps the memory limits, reaches known optima, is
deterministic under a seed, and writes orders that check and train like one process.
"""
from __future__ import annotations

import random

import pytest

from pipec.compiler.costs import costs_from_json
from pipec.compiler.driver import compile_spec, lower_spec, resolve_target
from pipec.compiler.memory_counts import peak_activations
from pipec.compiler.search import OPTIMAL, order_makespan, order_timing, search_order, search_problem
from pipec.compiler.search_bound import lower_bound
from pipec.compiler.search_heuristic import HEURISTIC, heuristic_search
from pipec.compiler.search_limits import search_limits
from pipec.compiler.search_pipe import order_to_pipe
from pipec.compiler.search_seeds import memory_list_rows
from pipec.compiler.simulate import simulate
from pipec.commands.search import resolve_target_text

LATENCY = {"latency": 0.5}


def _lowered(target: str, P: int, N: int, links=None):
    costs = costs_from_json({"links": links}) if links else None
    spec = resolve_target(target).evaluate({"P": str(P), "N": str(N)})
    compute, _ = lower_spec(spec, costs)
    return spec, compute, costs


def _one_f_one_b_memory(P: int, times: int = 1) -> list[int]:
    return [times * (P - r) for r in range(P)]


def _written(compute, result, costs, memory):
    """The result's order written, proved at ``memory`` and compiled (raises if any check fails)."""
    compiled = compile_spec(resolve_target_text(order_to_pipe(compute, result.order)), costs=costs,
                            memory_budget=max(memory))
    assert [list(row) for row in compiled.compute.ranks] == result.order
    assert all(peak <= limit for peak, limit in zip(peak_activations(compiled.program), memory))
    return compiled


@pytest.mark.parametrize("target,P,N,links", [("zb_h1", 3, 4, LATENCY), ("zbv", 2, 3, LATENCY), ("1f1b", 3, 3, None)])
def test_the_evaluator_prices_random_orders_as_the_simulator(target, P, N, links):
    """Random valid orders (list schedules under random priorities), not only the shipped ones."""
    _, compute, costs = _lowered(target, P, N, links)
    problem = search_problem(compute, costs)
    timing = order_timing(problem)
    rng = random.Random(3)
    for _ in range(3):
        rows = memory_list_rows(timing, [], P, [rng.random() for _ in timing.keys])
        order = [[problem.tasks[t].action for t in row] for row in rows]
        written = compile_spec(resolve_target_text(order_to_pipe(compute, order)), costs=costs)
        assert order_makespan(problem, order) == simulate(written.program, costs).makespan


@pytest.mark.parametrize("target,P,N,links,times,optimum", [
    ("1f1b", 4, 8, LATENCY, 1, 41), ("zb_h1", 4, 8, LATENCY, 1, 31), ("zb_h1", 8, 16, LATENCY, 1, 67),
    ("zb_h1", 4, 8, {"latency": 1}, 2, 30)])
def test_the_bound_is_at_most_the_proven_optimum(target, P, N, links, times, optimum):
    """Optima CP-SAT proved (docs/search.md; the last is ZB-H2's 3N + (P - 1)(F + L), which the bound meets)."""
    _, compute, costs = _lowered(target, P, N, links)
    problem = search_problem(compute, costs)
    bound = lower_bound(problem, search_limits(problem, _one_f_one_b_memory(P, times))).makespan
    assert bound <= optimum
    if times == 2:
        assert bound == optimum == 3 * N + (P - 1) * 2


def test_the_heuristic_reaches_1f1bs_optimum_from_a_memory_bound_order():
    """The target alternates F and B (one live activation per rank); at 1F1B's memory the heuristic reaches
    (N + P - 1)(F + B), proves it by the bound, and the written order checks at that memory."""
    P, N = 4, 6
    text = ("schedule alternating(P: ranks = 4, N: microbatches = 6) { stages P  place stage s on rank s "
            "order rank r { for m in 0 .. N { F(r, m); B(r, m) } } }")
    compute, _ = lower_spec(resolve_target_text(text))
    memory = _one_f_one_b_memory(P)
    result = heuristic_search(compute, memory=memory, evaluations=2000)
    assert order_makespan(search_problem(compute), compute.ranks) > (N + P - 1) * 3
    assert result.status == OPTIMAL and result.makespan == result.bound == (N + P - 1) * 3
    assert simulate(_written(compute, result, None, memory).program).makespan == result.makespan


def test_the_heuristic_keeps_a_tight_memory_limit_and_meets_the_exact_optimum():
    """Two live activations per rank on 1F1B's placement: CP-SAT's optimum is 51 (docs/search.md); the heuristic
    finds an order that keeps the limit, no faster than that optimum, and its bound stays below it."""
    spec, compute, _ = _lowered("1f1b", 4, 8)
    result = heuristic_search(compute, memory=[2] * 4, spec=spec, evaluations=3000)
    assert result.bound <= 51 <= result.makespan
    assert result.makespan == 51
    _written(compute, result, None, [2] * 4)


def test_the_heuristic_is_deterministic_under_a_seed_and_beats_zbv_under_latency():
    spec, compute, costs = _lowered("zbv", 2, 4, LATENCY)
    memory = [4, 4]
    first = heuristic_search(compute, costs, memory, spec=spec, seed=5, evaluations=1500)
    again = heuristic_search(compute, costs, memory, spec=spec, seed=5, evaluations=1500)
    assert (first.order, first.makespan, first.evaluations) == (again.order, again.makespan, again.evaluations)
    shipped = order_makespan(search_problem(compute, costs), compute.ranks)
    assert first.bound <= first.makespan < shipped
    assert simulate(_written(compute, first, costs, memory).program, costs).makespan == first.makespan


def test_cli_heuristic_writes_a_checked_order_and_labels_it(tmp_path, capsys):
    from pipec.cli import main

    out = tmp_path / "best.pipe"
    assert main(["search", "zb_h1", "-D", "P=4", "-D", "N=8", "--memory", "4,3,2,1", "--method", "heuristic",
                 "--evaluations", "500", "-o", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "status OPTIMAL, makespan 27, lower bound 27" in printed and "simulated makespan 27" in printed
    assert "method heuristic: " in printed
    assert main(["check", str(out), "--budget", "4"]) == 0
    assert main(["search", "1f1b", "-D", "P=2", "-D", "N=2", "--method", "auto", "--time-limit", "5"]) == 0
    assert "method exact" in capsys.readouterr().out
    assert main(["search", "1f1b", "-D", "P=2", "-D", "N=2", "--method", "heuristic", "--recompute", "choose"]) == 1
    assert "--recompute choose needs --method exact" in capsys.readouterr().err


def test_a_few_evaluations_are_all_spent():
    """Six restarts share the moves: 5 of them are 5 moves tried, not 5 // 6 = 0 per restart."""
    spec, compute, costs = _lowered("zb_h1", 2, 4, LATENCY)
    result = heuristic_search(compute, costs, [2, 1], spec=spec, evaluations=5)
    assert result.evaluations == 5


def test_auto_keeps_the_heuristics_order_when_cp_sat_finds_none_in_its_time(monkeypatch):
    """Past EXACT_TASKS, ``auto`` hands CP-SAT the rest of the time; should CP-SAT end without an order (its share
    too short to read the hint), the heuristic's order is the answer, not an error."""
    from pipec.compiler import search_method
    from pipec.errors import NoOrderFound

    def no_order(*args, **kwargs):
        raise NoOrderFound("pipec search: no order found within 1.0 s")

    monkeypatch.setattr(search_method, "EXACT_TASKS", 0)
    monkeypatch.setattr(search_method, "search_order", no_order)
    spec, compute, costs = _lowered("zb_h1", 2, 4, LATENCY)
    searched = search_method.search_by_method("auto", compute, costs, [2, 1], spec=spec, evaluations=50)
    assert searched.method == HEURISTIC and searched.result.order


@pytest.mark.parametrize("argv,said", [
    (["weipipe", "-D", "P=2", "--memory", "4,4,4"], "--memory gives 3 limits for 2 ranks"),
    (["zb_h1", "-D", "P=2", "--workers", "100000"], "--workers takes 1 to 64"),
    (["zb_h1", "-D", "P=2", "-o", "/nonexistent-folder/best.pipe"], "the folder '/nonexistent-folder' does not exist"),
])
def test_bad_arguments_are_named_before_any_search(argv, said, capsys):
    from pipec.cli import main

    assert main(["search", *argv]) == 1
    err = capsys.readouterr().err
    assert said in err and "Traceback" not in err


def test_a_memory_limit_past_every_value_binds_nothing():
    """A limit beyond the solver's int64 is no limit, not a crash."""
    _, compute, _ = _lowered("1f1b", 2, 4)
    assert search_order(compute, memory=[10**20, 10**20], time_limit=120).makespan == (4 + 2 - 1) * 3
