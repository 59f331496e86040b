"""`in order`: a greedy policy that waits for the next task of its order.

A list scheduler takes whatever is ready; Megatron's interleaved order keeps
some ranks idle for a moment to take the microbatch its order names next, and
that is what makes it shorter for N > 2P when messages take time (P=4, N=12,
v=3, one unit per message: 139 against the plain greedy policy's 147; with
free messages both take 117). `in order F, B` lets a policy say so without any
schedule-specific code: each rank runs its F tasks, and its B tasks, in
priority order, waiting for the next one.
"""
from __future__ import annotations

import pytest

from pipec.compiler.costs import costs_from_json
from pipec.compiler.driver import compile_target
from pipec.compiler.simulate import simulate
from pipec.errors import PipecError

# docs/language.md, section 7: Megatron's interleaved 1F1B as a policy.
GREEDY_INTERLEAVED = """
schedule interleaved_greedy(P: ranks = 4, N: microbatches = 2 * P, v: chunks = 2) {
  stages v * P
  place stage s on rank s % P
  order greedy {
    warmup on rank r = min((P - r - 1) * 2 + (v - 1) * P, v * N)
    priority F(s, m) = (m / P, s / P, m % P)
    priority B(s, m) = (m / P, -(s / P), m % P)
    in order F, B
  }
}
"""
SIZES = [(4, 8, 2), (4, 12, 3), (4, 16, 2), (8, 16, 2)]


def _compute_order(program) -> list[list[str]]:
    return [[a.text() for a in row if a.op in ("F", "B")] for row in program.ranks]


@pytest.fixture()
def policies(tmp_path):
    with_order = tmp_path / "in_order.pipe"
    with_order.write_text(GREEDY_INTERLEAVED)
    without = tmp_path / "plain.pipe"
    without.write_text(GREEDY_INTERLEAVED.replace("    in order F, B\n", ""))
    return str(with_order), str(without)


@pytest.mark.parametrize("P,N,v", SIZES)
def test_the_greedy_interleaved_policy_in_order_is_megatrons_order(policies, P, N, v):
    params = {"P": P, "N": N, "v": v}
    explicit = compile_target("interleaved_1f1b", params).program
    greedy = compile_target(policies[0], params).program
    assert _compute_order(greedy) == _compute_order(explicit)
    assert simulate(greedy).makespan == simulate(explicit).makespan


def test_without_in_order_the_policy_is_longer_where_it_should_wait(policies):
    params = {"P": 4, "N": 12, "v": 3}
    latency = costs_from_json({"links": {"latency": 1}})
    assert simulate(compile_target(policies[1], params).program, latency).makespan == 147
    assert simulate(compile_target(policies[0], params).program, latency).makespan == 139
    assert simulate(compile_target(policies[1], params).program).makespan == 117  # free messages: no wait pays
    assert simulate(compile_target(policies[0], params).program).makespan == 117


def test_in_order_holds_under_costs(policies):
    costs = costs_from_json({"compute": {"F": 1.3, "B": 2.1}, "links": {"latency": 0.5}})
    params = {"P": 4, "N": 12, "v": 3}
    explicit = compile_target("interleaved_1f1b", params, costs=costs).program
    greedy = compile_target(policies[0], params, costs=costs).program
    assert simulate(greedy, costs).makespan == simulate(explicit, costs).makespan


def test_an_order_against_the_dataflow_is_a_clear_error(tmp_path):
    path = tmp_path / "bad.pipe"
    # later chunks first: rank 0 would wait for F(4, 0), which needs its own F(0, 0) first
    text = GREEDY_INTERLEAVED.replace("(m / P, s / P, m % P)", "(-s, m)")
    path.write_text(text.replace("    warmup on rank r = min((P - r - 1) * 2 + (v - 1) * P, v * N)\n", ""))
    with pytest.raises(PipecError, match=r"rank 0 .* waits for F\(4, 0\), the next F of its `in order`"):
        compile_target(str(path), {})


@pytest.mark.parametrize("statement,words", [
    ("in order F, F", "`in order` lists a kind twice"),
    ("in order W", "this schedule has no W tasks"),
    ("in order F\n    in order B", "`in order` is already given"),
])
def test_in_order_mistakes_are_located(tmp_path, statement, words):
    path = tmp_path / "bad.pipe"
    path.write_text(GREEDY_INTERLEAVED.replace("in order F, B", statement))
    with pytest.raises(PipecError, match=words):
        compile_target(str(path), {})
