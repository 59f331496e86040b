"""``pipec search`` on several pipelines (issue 27): BitPipe and Chimera.

Issue 27's BitPipe question, settled: at the paper's activation bound (3P - 3 chunk activations per
rank) the optimum equals the early-forward order's makespan, which the shipped orders reach only
above the bound (`-D bounded=true` stays within it, slower). Two such orders found by the search are
stored beside this file and held to the bound and the makespan; the written files declare the
pipelines, routes, per-pipeline placement and device map, compile to the searched order and pass
the checks (tests/test_search_training.py trains a searched two-pipeline order on gloo).
"""
from __future__ import annotations

from pathlib import Path

import pytest

from pipec.commands.search import resolve_target_text
from pipec.compiler.costs import costs_from_json
from pipec.compiler.driver import compile_spec, compile_target, lower_spec, resolve_target, task_kinds
from pipec.compiler.memory_counts import peak_activations
from pipec.compiler.search import CHOOSE, OPTIMAL, search_order
from pipec.compiler.search_pipe import order_to_pipe
from pipec.compiler.simulate import simulate
from pipec.dsl import parse, resolve
from pipec.errors import UsageError

pytest.importorskip("ortools")

HERE = Path(__file__).parent


def _bound(P: int) -> int:
    """BitPipe's paper bound, (3D - 3)/2 device shares, in chunks of half a share: 3P - 3 per rank."""
    return 3 * P - 3


def _shipped(name: str, P: int, N: int, **params):
    """(makespan, peak activations per rank) of a shipped order, simulated."""
    compiled = compile_target(name, {"P": P, "N": N, **params})
    return simulate(compiled.program).makespan, peak_activations(compiled.program)


def _compute(name: str, P: int, N: int, **params):
    defines = {"P": str(P), "N": str(N), **{k: str(v).lower() for k, v in params.items()}}
    return lower_spec(resolve_target(name).evaluate(defines))[0]


def test_bitpipe_at_the_papers_bound_reaches_the_early_forward_makespan(tmp_path, capsys):
    """P = 4, N = 2P, at most 9 chunk activations per rank: the optimum is 51, the early-forward order's
    makespan (which holds 12), not the bounded order's 52. The written file is BitPipe's placement: two
    pipelines, its route, its V-shaped stages per pipeline and its device map, and holds the bound."""
    from pipec.cli import main

    P, N = 4, 8
    early, early_peaks = _shipped("bitpipe", P, N)
    bounded, bounded_peaks = _shipped("bitpipe", P, N, bounded=True)
    assert (early, bounded) == (51, 52) and max(early_peaks) > _bound(P) >= max(bounded_peaks)
    out = tmp_path / "best.pipe"
    # the bounded order as the hint (its own order, -D bounded=true: the same tasks and placement)
    assert main(["search", "bitpipe", "-D", f"P={P}", "-D", f"N={N}", "-D", "bounded=true", "--memory",
                 str(_bound(P)), "--time-limit", "120", "-o", str(out)]) == 0
    assert f"status OPTIMAL, makespan {early}, lower bound {early}" in capsys.readouterr().out
    text = out.read_text()
    assert "pipelines 2" in text and "route microbatch m to pipeline m % 4 < 2 ? 0 : 1" in text
    written = compile_spec(resolve_target(str(out)).evaluate({}), memory_budget=_bound(P))  # every check
    target = compile_target("bitpipe", {"P": P, "N": N})
    assert written.program.devices == target.program.devices == [0, 3, 2, 1]
    assert [(s.rank, s.pipeline, s.position) for s in written.program.stages] == \
        [(s.rank, s.pipeline, s.position) for s in target.program.stages]
    assert written.program.mb_pipeline == target.program.mb_pipeline
    assert simulate(written.program).makespan == early


@pytest.mark.parametrize("P,N", [(4, 16), (8, 16)])
def test_stored_bitpipe_orders_meet_the_bound_and_the_early_forward_makespan(P, N):
    """The orders the search found (docs/search.md, several pipelines): BitPipe's tasks on its placement,
    proved at 3P - 3 activations per rank, as fast as the early-forward order (which exceeds the bound)."""
    stored = compile_spec(resolve_target(str(HERE / f"searched_bitpipe_p{P}_n{N}.pipe")).evaluate({}),
                          memory_budget=_bound(P))
    early, early_peaks = _shipped("bitpipe", P, N)
    bounded, _ = _shipped("bitpipe", P, N, bounded=True)
    target = _compute("bitpipe", P, N)
    assert sorted(sum(stored.compute.ranks, [])) == sorted(sum(target.ranks, []))  # the same tasks, same ids
    assert [s.rank for s in stored.program.stages] == [s.rank for s in target.stages]
    assert max(peak_activations(stored.program)) <= _bound(P) < max(early_peaks)
    assert simulate(stored.program).makespan == early < bounded


def test_stored_order_as_hint_is_proven_optimal():
    """From the stored P = 4, N = 4P order the solver proves at once that nothing beats it at the bound."""
    P, N = 4, 16
    hint = compile_spec(resolve_target(str(HERE / "searched_bitpipe_p4_n16.pipe")).evaluate({})).compute.ranks
    result = search_order(_compute("bitpipe", P, N), memory=[_bound(P)] * P, hint=hint, time_limit=120, workers=2)
    assert result.status == OPTIMAL and result.makespan == result.bound == _shipped("bitpipe", P, N)[0] == 99


def test_chimera_default_makespan_at_its_reference_orders_memory():
    """Chimera's reference order (its generator's) holds [3, 4, 4, 3] and takes 30 at P = 4, N = 8; the
    default takes 28 holding 4 everywhere. The search finds 28 within the reference's memory."""
    P, N = 4, 8
    memory = [3, 4, 4, 3]
    reference, reference_peaks = _shipped("chimera", P, N, reference=True)
    default, default_peaks = _shipped("chimera", P, N)
    assert reference_peaks == memory and (reference, default) == (30, 28) and default_peaks != memory
    compute = _compute("chimera", P, N)
    result = search_order(compute, memory=memory, time_limit=120, workers=2)
    written = compile_spec(resolve_target_text(order_to_pipe(compute, result.order)))
    assert result.status == OPTIMAL and result.makespan == default
    assert [list(row) for row in written.compute.ranks] == result.order
    assert all(peak <= limit for peak, limit in zip(peak_activations(written.program), memory))


def test_recompute_is_chosen_per_chunk_for_every_replica():
    """Under --recompute choose both replicas of a chunk recompute or neither (the language recomputes a
    position along every pipeline), the recomputed target's order is a valid hint (each choice hinted
    once), and the written file declares the chosen positions and compiles to the searched order."""
    P, N, limit = 4, 4, 2
    compute = _compute("chimera", P, N, remat=True)
    result = search_order(compute, memory=[limit] * P, recompute=CHOOSE, hint=compute.ranks, time_limit=120,
                          workers=2)
    assert result.status == OPTIMAL
    chunks = {compute.stages[stage].position for stage in result.recomputed}
    assert result.recomputed == sorted(s.id for s in compute.stages if s.position in chunks)  # all replicas
    assert 0 < len(chunks) < P  # recomputing every chunk is not needed, none is not enough
    text = order_to_pipe(compute, result.order)
    assert "recompute stage s when " + " or ".join(f"s == {c}" for c in sorted(chunks)) in text
    written = compile_spec(resolve_target_text(text), memory_budget=limit)
    assert [list(row) for row in written.compute.ranks] == result.order
    assert simulate(written.program).makespan == result.makespan


def test_cli_prints_the_recomputed_positions_it_writes(tmp_path, capsys):
    """Positions along a pipeline (0 .. stages - 1), as the written `recompute stage s when ...` names them,
    not global stage ids (Chimera's pipeline 1 has ids 4 .. 7 at P = 4)."""
    from pipec.cli import main

    out = tmp_path / "best.pipe"
    assert main(["search", "chimera", "-D", "P=4", "-D", "N=4", "-D", "remat=true", "--memory", "2",
                 "--recompute", "choose", "--time-limit", "120", "-o", str(out)]) == 0
    printed = capsys.readouterr().out.splitlines()[-1]
    assert printed.startswith("recomputed stages ")
    positions = [int(p) for p in printed.removeprefix("recomputed stages ").split(", ")]
    assert all(p < 4 for p in positions)
    assert "recompute stage s when " + " or ".join(f"s == {p}" for p in positions) in out.read_text()


def test_a_model_the_solver_rejects_is_named_not_reported_as_no_order(monkeypatch):
    """A variable hinted twice makes CP-SAT reject the model: the error says so."""
    from pipec.compiler import search

    real = search._add_hint

    def hint_twice(model, problem, hint, start, end, *rest):
        real(model, problem, hint, start, end, *rest)
        key = next(iter(start))
        model.AddHint(start[key], 0)

    monkeypatch.setattr(search, "_add_hint", hint_twice)
    compute = _compute("1f1b", 2, 2)
    with pytest.raises(UsageError, match="the solver rejected the model .*a pipec bug.*duplicate"):
        search_order(compute, hint=compute.ranks, time_limit=5)


def test_two_pipelines_searched_under_their_own_orders_memory_are_as_fast():
    """BitPipe at P = 2, N = 4 within 4 activations per rank (its own order holds 6): as fast, and the
    written order holds the limit (tests/test_search_training.py trains it)."""
    P, N, limit = 2, 4, 4
    shipped, shipped_peaks = _shipped("bitpipe", P, N)
    compute = _compute("bitpipe", P, N)
    result = search_order(compute, memory=[limit] * P, time_limit=120, workers=2)
    assert result.status == OPTIMAL and result.makespan == shipped and max(shipped_peaks) > limit
    written = compile_spec(resolve_target_text(order_to_pipe(compute, result.order)), memory_budget=limit)
    assert max(peak_activations(written.program)) <= limit


def test_a_single_pipelines_device_map_is_written_too():
    """The writer keeps the target's device map whatever its pipelines (it dropped it before), so the
    written file runs on, and is priced between, the devices the search was given."""
    source = """schedule mapped(P: ranks = 3, N: microbatches = 3) {
  stages P
  place stage s on rank s
  map rank r to device r == 0 ? 1 : r == 1 ? 0 : 2
  order rank r { for m in 0 .. N { F(r, m) } for m in 0 .. N { B(r, m) } }
}
"""
    spec = resolve(parse(source, "<mapped>").schedules[0], "<mapped>", source, task_kinds()).evaluate({})
    costs = costs_from_json({"links": {"latency": 1}})
    compute = lower_spec(spec, costs)[0]
    result = search_order(compute, costs, time_limit=120, workers=2)
    text = order_to_pipe(compute, result.order)
    assert "map rank r to device r < 1 ? 1 : (r < 2 ? 0 : 2)" in text
    written = compile_spec(resolve_target_text(text), costs=costs)
    assert written.program.devices == compute.devices == [1, 0, 2]
    assert simulate(written.program, costs).makespan == result.makespan
