"""``pipec search`` with recomputation and byte budgets (issue 27).

A recomputed target's tasks (FC, R) are searched and written back so that the file compiles to the
same tasks in the same order, passes ``pipec check`` at the count and byte limits the search held
(the limits the checks count: saved activations; bytes per size class), and re-simulates to the
solver's makespan; a byte budget binds; ``--recompute choose`` recomputes only the stages that buy
time; optimizer updates are refused, with the reason (tests/test_search_training.py trains a recomputed
searched order on gloo).
"""
from __future__ import annotations

import pytest

from pipec.commands.search import resolve_target_text
from pipec.compiler.costs import costs_from_json
from pipec.compiler.driver import compile_spec, compile_target, lower_spec, resolve_target
from pipec.compiler.memory_counts import peak_activations, peak_bytes
from pipec.compiler.search import CHOOSE, OPTIMAL, search_order
from pipec.compiler.search_pipe import order_to_pipe
from pipec.compiler.simulate import simulate
from pipec.errors import BudgetError, UsageError

pytest.importorskip("ortools")

# unit times; a saved activation weighs 2.5 bytes, a recomputed stage's kept input (one boundary) 0.5
SIZED = costs_from_json({"compute": {"F": 1, "B": 2, "I": 1, "W": 1}, "sizes": {"activation": 2.5, "boundary": 0.5}})


def _compute(name: str, P: int, N: int, remat: bool, costs=None):
    spec = resolve_target(name).evaluate({"P": str(P), "N": str(N), "remat": str(remat).lower()})
    return lower_spec(spec, costs)[0]


def _written(compute, result, costs=None, **budgets):
    """The searched order written, compiled and proved (at ``budgets``): its compiled form."""
    return compile_spec(resolve_target_text(order_to_pipe(compute, result.order)), costs=costs, **budgets)


def test_recomputed_target_is_written_back_to_its_tasks_and_proved_at_the_limit():
    P, N, limit = 4, 8, 2
    compute = _compute("zb_h1", P, N, remat=True)
    result = search_order(compute, memory=[limit] * P, time_limit=120, workers=2)
    assert result.status == OPTIMAL and result.recomputed == list(range(P))
    text = order_to_pipe(compute, result.order)
    assert "recompute stage s when s == 0 or s == 1 or s == 2 or s == 3" in text
    written = compile_spec(resolve_target_text(text), memory_budget=limit)  # every check, --budget 2
    assert [list(row) for row in written.compute.ranks] == result.order  # the written R's, none placed anew
    assert sorted(map(tuple, sum(written.compute.ranks, []))) == sorted(map(tuple, sum(compute.ranks, [])))
    assert max(peak_activations(written.program)) == limit
    assert simulate(written.program).makespan == result.makespan
    # the shipped order runs each R just before its I: the search finds one at least as fast at this memory
    shipped = compile_target("zb_h1", {"P": P, "N": N, "remat": True}, memory_budget=limit).program
    assert result.makespan <= simulate(shipped).makespan


def test_byte_budget_binds_and_the_written_order_passes_it():
    """Activation budgets of 3 and of 2 values (7.5 and 5 bytes of 2.5): the smaller is no faster, each
    written order passes `pipec check --budget-bytes` at its budget and not a byte below its peak."""
    P, N = 3, 6
    compute = _compute("1f1b", P, N, remat=False, costs=SIZED)
    makespans = []
    for budget in (7.5, 5):
        result = search_order(compute, SIZED, byte_budget={"activation": budget}, time_limit=120, workers=2)
        assert result.status == OPTIMAL
        written = _written(compute, result, SIZED, byte_budget={"activation": budget})
        peak = max(peaks["activation"] for peaks in peak_bytes(written.program, SIZED.sizes))
        assert peak <= budget
        with pytest.raises(BudgetError):
            _written(compute, result, SIZED, byte_budget={"activation": peak - 0.5})
        assert simulate(written.program, SIZED).makespan == result.makespan
        makespans.append(result.makespan)
    assert makespans[0] == (N + P - 1) * 3 < makespans[1]


def test_the_shipped_orders_own_peaks_do_not_slow_the_search():
    """At the count and bytes the shipped recomputed ZB-H1 holds (the checks' counts), the model admits an
    order as fast: it counts no more than the checks do."""
    P, N = 3, 6
    shipped = compile_target("zb_h1", {"P": P, "N": N, "remat": True}, costs=SIZED).program
    activations = peak_activations(shipped)
    budget = {size_class: max(peaks[size_class] for peaks in peak_bytes(shipped, SIZED.sizes))
              for size_class in ("activation", "boundary")}
    assert budget == {"activation": 7.5, "boundary": 1.5}  # a saved activation or a stash, and W's stashes
    compute = _compute("zb_h1", P, N, remat=True, costs=SIZED)
    result = search_order(compute, SIZED, activations, byte_budget=budget, time_limit=120, workers=2)
    written = _written(compute, result, SIZED, memory_budget=max(activations), byte_budget=budget)
    assert result.status == OPTIMAL
    assert result.makespan == simulate(written.program, SIZED).makespan == simulate(shipped, SIZED).makespan
    with pytest.raises(UsageError, match=r"budget of 2 bytes for activation holds no value of it \(2.5 bytes each"):
        search_order(compute, SIZED, byte_budget={"activation": 2}, time_limit=120, workers=2)


def test_a_boundary_budget_limits_the_kept_inputs_of_recomputed_stages():
    """One kept input per rank (0.5 bytes): each recomputed forward's R comes before the next forward."""
    P, N = 2, 4
    compute = _compute("1f1b", P, N, remat=True, costs=SIZED)
    result = search_order(compute, SIZED, byte_budget={"boundary": 0.5}, time_limit=120, workers=2)
    written = _written(compute, result, SIZED, byte_budget={"boundary": 0.5})
    for row in written.compute.ranks:
        forwards = [a.op for a in row if a.op in ("FC", "R")]
        assert forwards == ["FC", "R"] * N
    assert simulate(written.program, SIZED).makespan == result.makespan


def test_choose_recomputes_only_where_it_buys_time():
    P, N = 2, 4
    compute = _compute("1f1b", P, N, remat=False)
    free = search_order(compute, recompute=CHOOSE, time_limit=120, workers=2)
    assert free.recomputed == [] and free.makespan == (N + P - 1) * 3  # nothing to gain: no recompute
    plain = search_order(compute, memory=[1, 1], time_limit=120, workers=2)
    chosen = search_order(compute, memory=[1, 1], recompute=CHOOSE, time_limit=120, workers=2)
    assert chosen.status == OPTIMAL and chosen.recomputed == [0]  # the last stage's B follows its F at once
    assert chosen.makespan == 16 < plain.makespan == 24
    text = order_to_pipe(compute, chosen.order)
    assert "recompute stage s when s == 0\n" in text
    written = compile_spec(resolve_target_text(text), memory_budget=1)
    assert [list(row) for row in written.compute.ranks] == chosen.order
    assert simulate(written.program).makespan == chosen.makespan
    # no byte for a kept input: the choice is not to recompute, and memory forces F, B, F, B, ...
    kept_none = search_order(compute, SIZED, [1, 1], byte_budget={"boundary": 0}, recompute=CHOOSE, time_limit=120,
                             workers=2)
    assert kept_none.recomputed == [] and kept_none.makespan == plain.makespan


def test_cli_byte_budget_and_choice(tmp_path, capsys):
    from pipec.cli import main

    costs = tmp_path / "costs.json"
    costs.write_text('{"sizes": {"activation": 4, "boundary": 1}}')
    out = tmp_path / "best.pipe"
    assert main(["search", "1f1b", "-D", "P=2", "-D", "N=4", "--costs", str(costs), "--budget-bytes", "activation=4",
                 "--recompute", "choose", "--time-limit", "120", "-o", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "status OPTIMAL, makespan 16," in printed and "simulated makespan 16" in printed
    assert "recomputed stages 0" in printed
    assert main(["check", str(out), "--costs", str(costs), "--budget-bytes", "activation=4"]) == 0


def test_a_byte_budget_needs_the_size_of_its_class(capsys):
    from pipec.cli import main

    assert main(["search", "1f1b", "-D", "P=2", "-D", "N=2", "--budget-bytes", "activation=8"]) == 1
    assert 'add "sizes": {"activation": BYTES}' in capsys.readouterr().err
    compute = _compute("1f1b", 2, 2, remat=False)
    with pytest.raises(UsageError, match="needs its size"):
        search_order(compute, byte_budget={"activation": 8})


@pytest.mark.parametrize("target", ["pipedream", "pipedream_2bw"])
def test_optimizer_updates_are_refused_with_the_reason(target, capsys):
    from pipec.cli import main

    assert main(["search", target, "-D", "P=2", "-D", "N=4"]) == 1
    err = capsys.readouterr().err
    assert "does not reorder optimizer updates (U)" in err and "weight version" in err
    compute, _ = lower_spec(resolve_target(target).evaluate({"P": "2", "N": "4"}))
    with pytest.raises(UsageError, match="trains another model"):
        search_order(compute)
