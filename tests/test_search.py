"""``pipec search`` (issue 27, first slice): CP-SAT's exact orders for activation passing.

The proven optima are held to the shipped hand-made schedules' simulated makespans (1F1B's
(N + P - 1)(F + B) is optimal at its memory; ZB-H1 at 1F1B's memory); every written order is
proved by the checks, compiles to the searched order, re-simulates to the solver's makespan (tests/test_search_training.py trains
searched orders on gloo).
"""
from __future__ import annotations

import builtins

import pytest

from pipec.compiler.driver import compile_spec, compile_target, lower_spec, resolve_target
from pipec.compiler.search import OPTIMAL, search_order
from pipec.compiler.search_pipe import order_to_pipe
from pipec.compiler.simulate import simulate
from pipec.commands.search import resolve_target_text
from pipec.errors import UsageError

pytest.importorskip("ortools")


def _search(name: str, P: int, N: int, memory):
    compute, _ = lower_spec(resolve_target(name).evaluate({"P": str(P), "N": str(N)}))
    return compute, search_order(compute, memory=memory, time_limit=120, workers=2)


def _one_f_one_b_memory(P: int) -> list[int]:
    return [P - r for r in range(P)]  # rank r holds at most P - r activations under 1F1B


def test_1f1b_placement_optimum_is_1f1b():
    P, N = 4, 8
    _, result = _search("1f1b", P, N, _one_f_one_b_memory(P))
    shipped = simulate(compile_target("1f1b", {"P": P, "N": N}).program).makespan
    assert result.status == OPTIMAL
    assert result.makespan == result.bound == shipped == (N + P - 1) * 3


def test_split_backward_optimum_at_1f1b_memory_meets_zb_h1():
    P, N = 4, 8
    _, result = _search("zb_h1", P, N, _one_f_one_b_memory(P))
    zb_h1 = simulate(compile_target("zb_h1", {"P": P, "N": N}).program).makespan
    assert result.status == OPTIMAL
    assert result.makespan <= zb_h1 == 3 * N + P - 1


def test_memory_limit_binds():
    """One live activation per rank forces F, B, F, B, ...: the makespan grows past 1F1B's."""
    P, N = 2, 4
    compute, result = _search("1f1b", P, N, [1, 1])
    assert result.status == OPTIMAL
    assert result.makespan > (N + P - 1) * 3
    for row in result.order:
        assert [a.op for a in row] == ["F", "B"] * N


def test_written_order_checks_and_recompiles_to_the_searched_order():
    P, N = 4, 8
    compute, result = _search("zb_h1", P, N, _one_f_one_b_memory(P))
    text = order_to_pipe(compute, result.order)
    compiled = compile_spec(resolve_target_text(text), memory_budget=P)  # proved by every check
    assert [list(row) for row in compiled.compute.ranks] == result.order
    assert simulate(compiled.program).makespan == result.makespan


@pytest.mark.parametrize("P,N", [(4, 8), (4, 12), (8, 16)])
def test_twice_1f1b_memory_reaches_the_zero_bubble_bound(P, N):
    """ZB-H2's claim, proven: under a link latency L = 1, ZB-H1's memory (rank r: P - r) leaves ranks idle
    waiting on each microbatch's round trip (the optimum is 39, 53, 87), while twice it reaches
    3N + (P - 1)(F + L), the least any order can take: the last rank's first forward cannot start earlier
    and it then has 3N of work. (With free links both limits give ZB-H1's 3N + P - 1.)"""
    from pipec.compiler.costs import costs_from_json

    costs = costs_from_json({"links": {"latency": 1}})
    compute, _ = lower_spec(resolve_target("zb_h1").evaluate({"P": str(P), "N": str(N)}), costs)
    once = search_order(compute, costs, _one_f_one_b_memory(P), time_limit=120, workers=2)
    twice = search_order(compute, costs, [2 * m for m in _one_f_one_b_memory(P)], time_limit=120, workers=2)
    assert once.status == twice.status == OPTIMAL
    assert twice.makespan == 3 * N + (P - 1) * (1 + 1) < once.makespan


def test_cli_prints_status_bound_and_simulated_makespan(tmp_path, capsys):
    from pipec.cli import main

    out = tmp_path / "best.pipe"
    assert main(["search", "zb_h1", "-D", "P=2", "-D", "N=4", "--memory", "2,1", "--time-limit", "120",
                 "-o", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "status OPTIMAL" in printed and "gap 0.0%" in printed and "simulated makespan 13" in printed
    assert "backward split" in out.read_text()


def test_missing_ortools_is_a_clear_error(monkeypatch):
    real_import = builtins.__import__

    def no_ortools(name, *args, **kwargs):
        if name.startswith("ortools"):
            raise ImportError("no ortools")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_ortools)
    compute, _ = lower_spec(resolve_target("1f1b").evaluate({"P": "2", "N": "2"}))
    with pytest.raises(UsageError, match=r"pip install 'pipec\[search\]'"):
        search_order(compute)


def test_measured_costs_and_latency_resimulate_to_the_solvers_makespan():
    """Decimal costs (a float as the decimal it prints as) and a link latency: the model prices them as the
    simulator does, and the search beats ZB-H1 at its own memory."""
    from pipec.compiler.costs import costs_from_json

    P, N = 4, 8
    costs = costs_from_json({"compute": {"F": 0.52, "B": 0.72, "I": 0.36, "W": 0.36}, "links": {"latency": 0.01}})
    compute, _ = lower_spec(resolve_target("zb_h1").evaluate({"P": str(P), "N": str(N)}), costs)
    result = search_order(compute, costs, _one_f_one_b_memory(P), time_limit=120, workers=2)
    written = compile_spec(resolve_target_text(order_to_pipe(compute, result.order)), costs=costs)
    assert result.status == OPTIMAL
    assert simulate(written.program, costs).makespan == pytest.approx(float(result.makespan), abs=1e-9)
    assert result.makespan < simulate(compile_target("zb_h1", {"P": P, "N": N}, costs=costs).program, costs).makespan


@pytest.mark.parametrize("target,reason", [("megatron_mlp", "megatron_mlp is tensor-parallel: its order is derived"),
                                           ("1f1b_dp", "1f1b_dp is a composition on a mesh")])
def test_a_target_without_an_order_to_search_is_refused_by_its_family(target, reason, capsys):
    """Its family says why (``Family.refuse_search``): a derived order, or a pipeline placed on groups."""
    from pipec.cli import main

    assert main(["search", target]) == 1
    assert f"pipec search: {reason}" in capsys.readouterr().err


@pytest.mark.parametrize("target,P,N,links", [("1f1b", 4, 8, None), ("zb_h1", 4, 8, {"latency": 0.5}),
                                              ("zbv", 4, 8, {"latency": 0.5}), ("interleaved_1f1b", 4, 8, None)])
def test_the_models_timing_of_a_fixed_order_is_the_simulators(target, P, N, links):
    """``order_makespan`` (what a heuristic and a hint are priced by) equals the simulator's makespan of the
    shipped order, at unit costs and under a link latency."""
    from pipec.compiler.costs import costs_from_json
    from pipec.compiler.search import order_makespan, search_problem

    costs = costs_from_json({"links": links}) if links else None
    compiled = compile_target(target, {"P": P, "N": N}, costs=costs)
    problem = search_problem(compiled.compute, costs)
    assert order_makespan(problem, compiled.compute.ranks) == simulate(compiled.program, costs).makespan


def test_a_deadlocking_order_is_priced_as_none_and_refused_as_a_hint():
    from pipec.compiler.search import order_makespan, search_problem

    compute, _ = lower_spec(resolve_target("1f1b").evaluate({"P": "2", "N": "2"}))
    problem = search_problem(compute)
    stuck = [list(compute.ranks[0]), list(reversed(compute.ranks[1]))]  # rank 1 starts with a backward
    assert order_makespan(problem, stuck) is None
    with pytest.raises(UsageError, match="deadlocks"):
        search_order(compute, hint=stuck, time_limit=5)
    foreign = [list(compute.ranks[0]) + [compute.ranks[0][0]._replace(mb=9)], list(compute.ranks[1])]
    with pytest.raises(UsageError, match=r"F\(0, 9\): not a task"):
        order_makespan(problem, foreign)


def test_cli_hint_of_another_size_is_named(capsys):
    from pipec.cli import main

    assert main(["search", "1f1b", "-D", "P=2", "-D", "N=2", "--hint", "gpipe", "--time-limit", "5"]) == 0
    capsys.readouterr()
    assert main(["search", "1f1b", "-D", "P=2", "-D", "N=2", "--hint", "zbv", "--time-limit", "5"]) == 1
    assert "the hint: the order holds F(3, 0): not a task of the searched target" in capsys.readouterr().err
