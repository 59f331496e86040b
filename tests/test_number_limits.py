"""Numbers at the edge (issue 24, item 2): every number pipec reads is held to the guarded reader's
limits (a cost file's at most 1e15, a bandwidth at least 1e-15: docs/costs.md, "Limits"), and every
total the simulator and the partitioner form is checked; an overflow is a located ``PipecError``
(exit 1, no traceback), and no JSON pipec writes holds ``Infinity`` or ``NaN``."""
from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pipec.commands._common import dump_json
from pipec.compiler.costs import CostModel, LayerCost, Link, costs_from_json
from pipec.compiler.driver import compile_target
from pipec.compiler.emit.json_program import program_from_json, program_to_json
from pipec.compiler.simulate import simulate
from pipec.errors import ImportError_, PipecError, UsageError

from cli_util import cli


def strict_json(text: str):
    """``text`` parsed as JSON that has no NaN or Infinity (what pipec's own reader accepts)."""
    def refuse(token):
        raise AssertionError(f"{token} in JSON")
    return json.loads(text, parse_constant=refuse)


def finite_result(result) -> None:
    """Every total a simulation reports is finite and an integer one within +-2^63 (its JSON is strict)."""
    text = json.dumps(result.to_json(), allow_nan=False)
    assert math.isfinite(float(result.makespan)) and math.isfinite(result.bubble_fraction())
    for total in [result.makespan] + [t for stats in result.ranks for t in (stats.busy, stats.idle)]:
        assert math.isfinite(total) if isinstance(total, float) else abs(total) < 2**63
    strict_json(text)


# ----------------------------------------------------------------- simulate


def test_a_1e308_cost_file_is_a_located_error_of_simulate(tmp_path):
    big = tmp_path / "big.json"
    big.write_text('{"compute": {"F": 1e308, "B": 1e308}}')
    for extra in ([], ["--json"]):
        done = subprocess.run([sys.executable, "-m", "pipec", "simulate", "1f1b", "-D", "P=4", "-D", "N=8",
                               "--costs", str(big), *extra], capture_output=True, text=True, timeout=120)
        assert done.returncode == 1, done.stderr
        assert "Traceback" not in done.stderr and "Infinity" not in done.stdout
        assert f"{big}: compute.F: 1e+308 is above pipec's limit of 1e15" in done.stderr
        assert 'docs/costs.md, "Limits"' in done.stderr


def test_a_tiny_bandwidth_and_a_huge_size_are_refused_at_their_keys(tmp_path, capsys):
    path = tmp_path / "costs.json"
    path.write_text('{"links": {"bandwidth": 1e-300, "bytes": {"act": 1}}}')
    status, _, err = cli(capsys, "simulate", "1f1b", "--costs", str(path))
    assert status == 1 and f"{path}: links.bandwidth: a bandwidth of 1e-300 is below pipec's limit of 1e-15" in err
    path.write_text('{"sizes": {"activation": 1e16}}')
    status, _, err = cli(capsys, "check", "1f1b", "--costs", str(path))
    assert status == 1 and f"{path}: sizes.activation: 1e+16 is above pipec's limit of 1e15" in err


def test_integer_totals_past_2_63_are_named_and_float_ones_are_reported(tmp_path, capsys):
    # F = B = 10^15 (the limit, as integers) over 4,700 microbatches: each rank is busy 9.4e18 > 2^63
    path = tmp_path / "ints.json"
    path.write_text('{"compute": {"F": 1000000000000000, "B": 1000000000000000}}')
    status, out, err = cli(capsys, "simulate", "1f1b", "-D", "P=2", "-D", "N=4700", "--costs", str(path), "--json")
    assert status == 1 and not out, out
    assert f"{path}: the makespan is 9,402,000,000,000,000,000, past pipec's integer range" in err
    path.write_text('{"compute": {"F": 1e15, "B": 1e15}}')  # the same as floats: finite, reported
    status, out, err = cli(capsys, "simulate", "1f1b", "-D", "P=2", "-D", "N=4700", "--costs", str(path), "--json")
    assert status == 0, err
    assert strict_json(out)["makespan"] == pytest.approx(9.402e18)


def test_a_cost_model_built_in_python_is_held_to_the_same_limits():
    from pipec.errors import NumberLimitError

    with pytest.raises(NumberLimitError, match=r"cost model: compute.F: 1e\+308 is above"):
        CostModel(ops=(("B", 2), ("F", 1e308), ("I", 1), ("W", 1)))
    with pytest.raises(NumberLimitError, match="links.pairs.0-1.bandwidth"):
        CostModel(pairs=((0, 1, Link(0, 5e-324)),))
    with pytest.raises(NumberLimitError, match="layer 'x': parameters"):
        LayerCost("x", 1, 2, 3, float("inf"))


def test_totals_and_json_output_never_carry_infinity():
    from pipec.compiler.guarded_read import checked_total
    from pipec.errors import NumberLimitError

    assert checked_total(2**63 - 1, "t") == 2**63 - 1
    for bad in (float("inf"), float("nan"), 2**63, -2**63):
        with pytest.raises(NumberLimitError, match="costs.json: the total"):
            checked_total(bad, "the total", "costs.json")
    with pytest.raises(NumberLimitError, match="the partition file holds a number that is not finite"):
        dump_json({"time": float("inf")}, "the partition file")


# ----------------------------------------------------------------- the property


_HUGE = st.one_of(st.floats(0, 1e308, allow_nan=False, allow_infinity=False), st.floats(0, 1e15),
                  st.integers(0, 10**15))
_COSTS = st.fixed_dictionaries({
    "compute": st.fixed_dictionaries({}, optional={op: _HUGE for op in ("F", "B", "I", "W")}),
    "links": st.fixed_dictionaries({}, optional={
        "latency": _HUGE, "bandwidth": st.one_of(_HUGE.filter(bool), st.floats(5e-324, 1e-10)),
        "bytes": st.fixed_dictionaries({"act": _HUGE, "grad": _HUGE}), "contention": st.booleans()}),
})


@settings(max_examples=50, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=_COSTS, schedule=st.sampled_from(["1f1b", "zb_h1", "interleaved_1f1b"]))
def test_random_finite_costs_raise_only_pipec_errors_from_the_simulator_api(data, schedule):
    """Finite costs up to 1e308, read as a file is or built in Python: compiling and simulating raise only
    ``PipecError``, and whatever is reported is finite."""
    try:
        costs = costs_from_json(data, "random.json")
    except PipecError:
        costs = None
    ops = data["compute"]
    link = data["links"]
    built = [costs]
    try:  # the same numbers past the reader, straight into the API
        built.append(CostModel(ops=tuple(sorted({"F": 1, "B": 2, "I": 1, "W": 1, **ops}.items())),
                               link=Link(link.get("latency", 0), link.get("bandwidth")),
                               message_bytes=tuple(link.get("bytes", {"act": 0, "grad": 0}).items()),
                               contention=link.get("contention", False)))
    except PipecError:
        pass
    for model in built:
        if model is None:
            continue
        try:
            compiled = compile_target(schedule, {"P": "2", "N": "4"}, costs=model)
            finite_result(simulate(compiled.program, model))
        except PipecError:
            pass


# ----------------------------------------------------------------- partition


def _layers_file(path, layers) -> str:
    path.write_text(json.dumps({"layers": [{"name": f"l{i}", "F": f, "B": b, "activation": 8, "parameters": 8}
                                           for i, (f, b) in enumerate(layers)]}))
    return str(path)


def test_partition_refuses_huge_per_layer_costs_and_writes_no_infinity(tmp_path, capsys):
    costs = _layers_file(tmp_path / "layers.json", [(1e308, 1e308), (1.0, 2.0), (1.0, 2.0)])
    out_file = tmp_path / "part.json"
    status, out, err = cli(capsys, "partition", "--costs", costs, "-D", "P=2", "--json", "-o", str(out_file))
    assert status == 1 and "Infinity" not in out
    assert f"{costs}: layers[0].F: 1e+308 is above pipec's limit of 1e15" in err
    assert not out_file.exists()
    # at the limit, each layer is read; the chunks' sums pass it, so the chunk cost file is refused, none written
    costs = _layers_file(tmp_path / "edge.json", [(1e15, 1e15)] * 4)
    chunks = tmp_path / "chunks.json"
    status, out, err = cli(capsys, "partition", "--costs", costs, "-D", "P=2", "-o", str(out_file),
                           "--costs-out", str(chunks))
    assert status == 1, out
    assert f"{costs}: layers[0] .. layers[1], chunk 0 of the cut, sum to F = 2e+15, above the 1e15" in err
    assert not out_file.exists() and not chunks.exists()
    status, out, err = cli(capsys, "partition", "--costs", costs, "-D", "P=2", "--json")
    assert status == 0, err
    assert strict_json(out)["time_per_microbatch"] == 4e15


# ----------------------------------------------------------------- budgets, counts, program JSON


def test_memory_budgets_at_the_edge(tmp_path, capsys):
    costs = tmp_path / "sizes.json"
    costs.write_text('{"sizes": {"activation": 1000000000000000}}')
    base = ("check", "1f1b", "-D", "P=4", "-D", "N=8", "--costs", str(costs), "--budget-bytes")
    status, out, err = cli(capsys, *base, "activation=9223372036854775807")  # 2^63 - 1: the largest
    assert status == 0 and out.startswith("ok:"), err
    status, _, err = cli(capsys, *base, "activation=9223372036854775808")
    assert status == 1 and "--budget-bytes activation" in err and "2^63" in err
    status, _, err = cli(capsys, *base, "activation=99999999999999999999.5")  # a decimal past it
    assert status == 1 and "--budget-bytes activation: '99999999999999999999.5' is past pipec's integer range" in err
    layers = _layers_file(tmp_path / "layers.json", [(1, 2), (1, 2)])
    status, out, err = cli(capsys, "partition", "--costs", layers, "-D", "P=2", "--memory", "9223372036854775807")
    assert status == 0, err
    status, _, err = cli(capsys, "partition", "--costs", layers, "-D", "P=2", "--memory", "9223372036854775808")
    assert status == 1 and "--memory" in err


@pytest.mark.parametrize("argv", [("rings", "1_0"), ("rings", "١٢"), ("rings", "--nodes", "2", "--per-node", "²"),
                                  ("demo", "--steps", "-1"), ("demo", "--steps", "1_0")])
def test_command_line_counts_are_plain_ascii_integers(capsys, argv):
    status, out, err = cli(capsys, *argv)
    assert status == 1 and "ASCII digits" in err and not out


def test_config_overrides_are_read_as_every_number_is():
    from pipec.runtime.model import ModelConfig
    from pipec.runtime.worker import override_config

    assert override_config(ModelConfig(), ["layers=16"]).layers == 16
    for item in ("layers=1_6", "layers=١٦", "layers=99999999999999999999"):
        with pytest.raises(UsageError, match="--config layers"):
            override_config(ModelConfig(), [item])


def test_program_json_devices_are_a_permutation_of_the_ranks():
    data = program_to_json(compile_target("1f1b", {"P": "2", "N": "2"}).program)
    for devices, message in (([0, 0], "rank 0 runs on too"), ([0, 2**62], r"\"devices\"\[1\] must be an integer in 0..1")):
        with pytest.raises(ImportError_, match=message):
            program_from_json({**data, "devices": devices})
    assert program_from_json({**data, "devices": [1, 0]}).devices == [1, 0]
