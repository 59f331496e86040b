"""A greedy policy finishes under every non-negative cost model.

The list scheduler orders a policy by simulating the cost model, so latency,
bandwidth or uneven chunks change which task a rank finds ready first. Before
the in-flight check became a banker's check, a rank of ZB-V filled its limit
with first-arm forwards while the second arm's were still on the wire and
stalled for good. Every shipped greedy schedule, and the policies the docs
and tests write, must compile, check and simulate under each cost file here,
and a limit no order can meet must be a clear error naming the rank and the
limit.
"""
from __future__ import annotations

import re
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pipec.cli import main
from pipec.compiler.checks import peak_activations
from pipec.compiler.costs import costs_from_json
from pipec.compiler.driver import compile_target
from pipec.compiler.simulate import simulate
from pipec.errors import PipecError

SCHEDULES = Path(__file__).resolve().parent.parent / "schedules"
SHIPPED_GREEDY = sorted(p.stem for p in SCHEDULES.glob("*.pipe") if re.search(r"order\s+greedy", p.read_text()))

COST_FILES = {
    "unit": {},
    "latency 0.5": {"links": {"latency": 0.5}},
    "latency 3": {"links": {"latency": 3}},
    "bandwidth": {"links": {"latency": 0.1, "bandwidth": 2.0, "bytes": {"act": 3.0, "grad": 5.0}}},
    "per-chunk floats": {"compute": {"F": 1.3, "B": 2.7, "per_chunk": {"0": {"F": 0.7, "I": 2.1}, "3": {"W": 0.01, "B": 0.2}}}},
    "post": {"links": {"latency": 0.2, "post": 0.3}},
    "zero compute": {"compute": {"F": 0, "B": 0, "I": 0, "W": 0}, "links": {"latency": 1}},
    # what `pipec costs` writes for a 4-rank run (milliseconds), plus a hand-added latency
    "measured": {
        "compute": {
            "F": 3.812, "B": 8.204, "I": 4.377, "W": 3.827,
            "per_chunk": {"0": {"F": 5.113, "B": 9.61, "I": 5.2, "W": 4.41}, "7": {"F": 6.02, "B": 12.9, "I": 7.3, "W": 5.6}},
        },
        "links": {"post": 0.041, "latency": 0.35},
    },
}

# Policies written in the docs and tests, and DualPipe-like ones (two pipelines in opposite directions).
POLICIES = {
    "zb_greedy": """
schedule zb_greedy(P: ranks = 4, N: microbatches = 2 * P) {
  stages P
  place stage s on rank s
  backward split
  order greedy { inflight on rank r <= P - r; deferred on rank r <= r + 1; prefer I, F, W }
}""",
    "dualpipe_like": """
schedule dualpipe_like(P: ranks = 4, N: microbatches = 2 * P) {
  stages P
  pipelines 2
  route microbatch m to pipeline m % 2
  place stage s of pipeline p on rank p == 0 ? s : P - 1 - s
  backward split
  order greedy {
    inflight on rank r <= P
    deferred on rank r <= 2
    prefer I, F, W
    priority F(s, m) = (m, -s)
    priority I(s, m) = (m, -s)
  }
}""",
    "dual_v": """
schedule dual_v(P: ranks = 4, N: microbatches = 2 * P) {
  stages 2 * P
  pipelines 2
  route microbatch m to pipeline m % 2
  place stage s of pipeline p on rank s < P ? s : 2 * P - 1 - s when p == 0
  place stage s of pipeline p on rank s < P ? P - 1 - s : s - P when p == 1
  backward split
  order greedy { inflight on rank r <= 2 * P; prefer I, F, W; priority F(s, m) = (m, -s) }
}""",
}


def _target(tmp_path, name: str) -> str:
    if name in POLICIES:
        path = tmp_path / f"{name}.pipe"
        path.write_text(POLICIES[name])
        return str(path)
    return name


def _compile_and_simulate(target: str, P: int, N: int, data: dict):
    costs = costs_from_json(data)
    compiled = compile_target(target, {"P": P, "N": N}, costs=costs)  # checks the program too
    result = simulate(compiled.program, costs)
    assert result.makespan >= 0
    return compiled, result


def test_the_shipped_greedy_schedules_are_found():
    assert "zbv" in SHIPPED_GREEDY


@pytest.mark.parametrize("cost_name", sorted(COST_FILES))
@pytest.mark.parametrize("name", SHIPPED_GREEDY + sorted(POLICIES))
def test_every_greedy_policy_finishes_under_every_cost_file(tmp_path, name, cost_name):
    for P, N in ((2, 4), (4, 8), (4, 12)):
        compiled, _ = _compile_and_simulate(_target(tmp_path, name), P, N, COST_FILES[cost_name])
        limits = compiled.spec.policy.inflight
        assert all(limit is None or peak <= limit for peak, limit in zip(_peaks(compiled), limits))


def _peaks(compiled) -> list[int]:
    return peak_activations(compiled.program)


def test_zbv_checks_from_the_command_line_with_latency(tmp_path, capsys):
    path = tmp_path / "c.json"
    path.write_text('{"links": {"latency": 0.5}}')
    assert main(["check", "zbv", "-D", "P=4", "-D", "N=8", "--costs", str(path)]) == 0
    assert capsys.readouterr().out.startswith("ok: zbv")


def test_a_limit_no_order_can_meet_names_the_rank_and_the_limit(tmp_path, capsys):
    # rank 0 holds stages 0 and 2P-1 of the V: one microbatch keeps two activations there
    path = tmp_path / "tight.pipe"
    path.write_text(POLICIES["dual_v"].replace("inflight on rank r <= 2 * P", "inflight on rank r <= 1"))
    with pytest.raises(PipecError, match=r"rank 0's in-flight limit 1 can never be met.*at least 2"):
        compile_target(str(path), {"P": 4, "N": 8})
    assert main(["check", str(path), "-D", "P=4", "-D", "N=8"]) == 1
    err = capsys.readouterr().err
    assert "in-flight limit 1" in err and "Traceback" not in err


def test_the_tightest_possible_limit_still_finishes(tmp_path):
    # two slots per rank: microbatches must go through the V one at a time, and they do
    path = tmp_path / "tight.pipe"
    path.write_text(POLICIES["dual_v"].replace("inflight on rank r <= 2 * P", "inflight on rank r <= 2"))
    for data in (COST_FILES["unit"], COST_FILES["latency 3"], COST_FILES["measured"]):
        compiled, _ = _compile_and_simulate(str(path), 4, 8, data)
        assert max(_peaks(compiled)) <= 2


_time = st.one_of(st.just(0), st.integers(0, 5), st.floats(0, 10, allow_nan=False, allow_infinity=False))


@st.composite
def _cost_files(draw, chunks: int) -> dict:
    """A random non-negative cost file: ops, some chunks' overrides, links."""
    ops = draw(st.dictionaries(st.sampled_from("FBIW"), _time, max_size=4))
    per_chunk = draw(st.dictionaries(st.integers(0, chunks - 1).map(str), st.dictionaries(st.sampled_from("FBIW"), _time, max_size=4), max_size=3))
    links = draw(st.fixed_dictionaries({}, optional={
        "latency": _time,
        "bandwidth": st.floats(0.1, 10),
        "post": _time,
        "bytes": st.fixed_dictionaries({}, optional={"act": _time, "grad": _time}),
    }))
    return {"compute": dict(ops, per_chunk=per_chunk), "links": links}


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(P=st.integers(1, 4), N=st.integers(1, 9), data=st.data())
def test_zbv_finishes_under_any_non_negative_cost_file(P, N, data):
    cost_file = data.draw(_cost_files(2 * P))
    compiled, _ = _compile_and_simulate("zbv", P, N, cost_file)
    assert max(_peaks(compiled)) <= 2 * P
