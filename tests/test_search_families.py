"""``pipec search`` beyond activation passing (issue 27, item 4): sequence rings' rings, weight passing's grids.

A ring search on one slow link pair finds a ring that avoids it, as fast as the ring on uniform links, and
claims the optimum only when every ring set was priced; a step-grid search beats TawPipe's grid under a link
latency and its written file is proved (tests/test_search_training.py trains one on gloo); what a family cannot search or
meet is refused with the reason.
"""
from __future__ import annotations

import pytest

from pipec.commands.search import resolve_target_text
from pipec.compiler.costs import costs_from_json
from pipec.compiler.driver import compile_spec, compile_target, lower_spec, resolve_target
from pipec.compiler.family import families_of
from pipec.compiler.family_search import FEASIBLE, OPTIMAL
from pipec.compiler.simulate import simulate

SLOW_PAIR = costs_from_json({"links": {"pairs": {"1-2": {"latency": 5}}}})  # the link 1 <-> 2, both ways
LATENCY = costs_from_json({"links": {"latency": 0.5}})


def _family_search(target: str, defines: dict, costs, memory=None, candidates=None, time_limit=60.0):
    spec = resolve_target(target).evaluate({k: str(v) for k, v in defines.items()})
    _, program = lower_spec(spec, costs)
    (family,) = families_of(program)
    return family.search(spec, program, costs, memory, time_limit=time_limit, candidates=candidates)


def _written(result, costs):
    """The searched file compiled (every check) and simulated."""
    compiled = compile_spec(resolve_target_text(result.text), costs=costs)
    return compiled, simulate(compiled.program, costs).makespan


def test_ring_search_avoids_a_slow_pair_and_proves_it_optimal():
    """Of the 3! rings from rank 0 on 4 ranks, 4 use the slow pair; the best avoids it and is exactly as fast
    as the shipped ring on uniform links."""
    result = _family_search("ring_attention", {"P": 4}, SLOW_PAIR)
    uniform = simulate(compile_target("ring_attention", {"P": 4}).program).makespan
    assert result.shipped == simulate(compile_target("ring_attention", {"P": 4}, costs=SLOW_PAIR).program,
                                      SLOW_PAIR).makespan
    assert (result.status, result.tried, result.total) == (OPTIMAL, 6, 6)
    assert result.makespan == uniform < result.shipped
    compiled, simulated = _written(result, SLOW_PAIR)
    (ring,) = compiled.program.rings.rings
    arcs = {(ring[i], ring[(i + 1) % 4]) for i in range(4)}
    assert not arcs & {(1, 2), (2, 1)}
    assert simulated == result.makespan


def test_an_unfinished_enumeration_claims_no_optimum():
    capped = _family_search("zigzag_ring", {"P": 4}, SLOW_PAIR, candidates=2)
    full = _family_search("zigzag_ring", {"P": 4}, SLOW_PAIR)
    assert (capped.status, capped.tried, capped.total) == (FEASIBLE, 2, 6)
    assert (full.status, full.tried) == (OPTIMAL, 6)
    assert full.makespan < full.shipped == capped.shipped


def test_grid_search_beats_tawpipe_and_the_written_grid_is_proved():
    """TawPipe on 2 groups of 1 rank, 2 microbatches each, under a link latency: the walk (60 grids, seeded)
    finds a faster grid and prefetch; the written file is proved and re-simulates to the search's makespan
    (tests/test_search_training.py trains such a grid on gloo)."""
    P, N = 2, 4
    result = _family_search("tawpipe", {"P": P, "G": 2, "N": N}, LATENCY, candidates=60)
    assert result.status == FEASIBLE and result.bound is None and result.tried == 60
    assert result.makespan < result.shipped == simulate(
        compile_target("tawpipe", {"P": P, "G": 2, "N": N}, costs=LATENCY).program, LATENCY).makespan
    compiled, simulated = _written(result, LATENCY)
    assert simulated == result.makespan


@pytest.mark.parametrize("argv,reason", [
    (["tawpipe", "--memory", "2"], "--memory 2 on rank 0 cannot be met: under weight passing a rank runs all 4 "
                                   "layers' forwards of a microbatch"),
    (["zigzag_ring", "--memory", "2"], "'zigzag_ring' is a sequence ring: its memory is KV buffers"),
    (["weipipe", "--recompute", "choose"], "only activation passing's search takes --recompute choose"),
    (["1f1b", "--candidates", "3"], "--candidates caps a family's own search"),
])
def test_what_a_family_search_cannot_do_is_refused_with_the_reason(argv, reason, capsys):
    from pipec.cli import main

    assert main(["search", *argv]) == 1
    assert reason in capsys.readouterr().err


def test_cli_prints_the_shipped_makespan_and_the_candidates(tmp_path, capsys):
    from pipec.cli import main

    costs = tmp_path / "slow.json"
    costs.write_text('{"links": {"pairs": {"1-2": {"latency": 5}}}}')
    out = tmp_path / "rings.pipe"
    assert main(["search", "ring_attention", "-D", "P=4", "--costs", str(costs), "-o", str(out)]) == 0
    printed = capsys.readouterr().out
    assert printed.startswith("status OPTIMAL, makespan 10.5, shipped 40, lower bound none, candidates 6 of 6, "
                              "simulated makespan 10.5")
    assert "rings cycle (0, " in out.read_text()
    assert main(["check", str(out)]) == 0


def test_a_written_table_reads_back_as_the_table():
    """``lookup_expression`` (how a searched file writes holders, homes, owners, groups) evaluated by pipec's own
    evaluator gives the table back, for a shuffled one and the identity."""
    import random

    from pipec.compiler.pipe_literals import lookup_expression

    holders = [rank for rank in range(4) for _ in range(3)]
    random.Random(3).shuffle(holders)
    for table in (holders, list(range(4))):
        text = (f"schedule t(P: ranks = 4) {{\n  sequence chunks {len(table)}\n  hold chunk c on rank "
                f"{lookup_expression('c', table)}\n  mask full\n  rings shift 1\n}}\n")
        assert list(resolve_target_text(text).rings.holders) == table
