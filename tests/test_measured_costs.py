"""A cost file measured by a run (compiler.measured_costs, ``pipec costs --trace``)."""
from __future__ import annotations

import json

import pytest

from pipec.cli import main
from pipec.compiler.costs import costs_from_json
from pipec.compiler.driver import compile_target
from pipec.compiler.ir import COMPUTE_OPS
from pipec.compiler.measured_costs import measure_costs
from pipec.compiler.simulate import simulate
from pipec.errors import UsageError
from pipec.runtime.trace import chrome_events, write_chrome_trace

# Planted compute times, ms, per (chunk, op); step 1 (warm-up) takes 50 times as long and must not count.
PLANTED = {(0, "F"): 1.5, (1, "F"): 2.5, (0, "I"): 0.25, (1, "I"): 2.0, (0, "W"): 3.0, (1, "W"): 2.5}
WARM_UP = 50
POST_MS = 0.125


def planted_trace(program, steps=3, jitter=True, **ran) -> dict:
    """A trace as ``pipec run --trace`` writes one, each compute taking its planted time (around it when jitter),
    after a planted wait of 0.4 ms that must not count."""
    per_rank = []
    for rank, row in enumerate(program.ranks):
        records = []
        for step in range(1, steps + 1):
            clock, step_records, seen = float(step * 10), [], {}
            for index, action in enumerate(row):
                if action.op not in COMPUTE_OPS:  # posting takes POST_MS per message, at every step
                    start, clock = clock, clock + POST_MS / 1000 * max(len(action.parts), 1)
                    step_records.append((index, start, clock, 0.0))
                    continue
                key = (program.stages[action.stage].chunk, action.op)
                k = seen[key] = seen.get(key, -1) + 1
                ms = PLANTED[key] * (WARM_UP if step == 1 else 1)
                ms *= 1 + (0.1 * (k % 3 - 1) if jitter else 0)  # 0.9, 1, 1.1 times alike: the median is the planted one
                start, waited = clock, 0.0004
                clock += waited + ms / 1000
                step_records.append((index, start, clock, waited))
            records.append(step_records)
        per_rank.append(chrome_events(rank, row, records, t0=0.0))
    document = {"traceEvents": [], "otherData": {"schedule": program.name, "params": dict(program.params), **ran}}
    for events in per_rank:
        document["traceEvents"] += events
    return document


@pytest.fixture(scope="module")
def zb_h1():
    return compile_target("zb_h1", {"P": "2", "N": "6"}).program


def test_medians_per_chunk_and_op_skip_the_first_step_and_waits(zb_h1):
    measured = measure_costs(planted_trace(zb_h1), zb_h1)
    per_chunk = measured.data["compute"]["per_chunk"]
    for (chunk, op), ms in PLANTED.items():
        assert per_chunk[str(chunk)][op] == pytest.approx(ms, abs=1e-4)
    # split backward measured: B is I + W, per chunk and at the top
    assert per_chunk["0"]["B"] == pytest.approx(3.25) and per_chunk["1"]["B"] == pytest.approx(4.5)
    top = measured.data["compute"]
    assert top["B"] == pytest.approx(top["I"] + top["W"])
    assert measured.steps == [2, 3]
    assert measured.data["links"] == {"post": POST_MS}  # a batch's time split over its parts
    assert measured.messages == 2 * sum(max(len(a.parts), 1) for row in zb_h1.ranks for a in row
                                        if a.op in ("SEND_F", "SEND_B", "RECV_F", "RECV_B", "BATCH"))
    assert measured.samples[0, "F"] == 2 * 6 and (0, "B") not in measured.samples  # 6 microbatches x 2 steps


def test_a_one_step_trace_is_measured_from_that_step(zb_h1):
    measured = measure_costs(planted_trace(zb_h1, steps=1, jitter=False), zb_h1)
    assert measured.steps == [1]
    assert measured.data["compute"]["per_chunk"]["1"]["F"] == pytest.approx(2.5 * WARM_UP)


def test_the_measured_file_prices_another_schedule(zb_h1):
    data = measure_costs(planted_trace(zb_h1, jitter=False), zb_h1).data
    costs = costs_from_json(json.loads(json.dumps({"compute": data["compute"]})))  # posting aside
    gpipe = compile_target("gpipe", {"P": "2", "N": "2"}).program
    result = simulate(gpipe, costs)
    # gpipe P=2 N=2: F0 F1 on chunk 0 then chunk 1, backward the other way, all on the critical path
    f0, f1, b0, b1 = 1.5, 2.5, 0.25 + 3.0, 2.0 + 2.5
    assert float(result.makespan) == pytest.approx(f0 + 2 * f1 + 2 * b1 + b0, abs=1e-3)


def test_a_trace_of_another_program_is_refused(zb_h1):
    other = compile_target("zb_h1", {"P": "2", "N": "4"}).program
    with pytest.raises(UsageError, match="does not match the program"):
        measure_costs(planted_trace(zb_h1), other)
    with pytest.raises(UsageError, match="no compute events"):
        measure_costs({"traceEvents": []}, other)


def run_cli(capsys, *argv):
    status = main(list(argv))
    out, err = capsys.readouterr()
    return status, out, err


def test_cli_writes_the_file_and_a_table_or_prints_the_json(capsys, tmp_path, zb_h1):
    trace = tmp_path / "run.json"
    trace.write_text(json.dumps(planted_trace(zb_h1, target="zb_h1")))
    status, out, err = run_cli(capsys, "costs", "--trace", str(trace), "-o", str(tmp_path / "c.json"))
    assert (status, err) == (0, "")
    assert "median compute time per task, ms" in out and "=I+W" in out and "wrote" in out
    written = json.loads((tmp_path / "c.json").read_text())
    status, out, _ = run_cli(capsys, "costs", "--trace", str(trace))
    assert status == 0 and json.loads(out) == written
    status, out, err = run_cli(capsys, "simulate", "1f1b", "-D", "P=2", "-D", "N=4", "--costs", str(tmp_path / "c.json"))
    assert status == 0 and "makespan" in out


def test_cli_errors_exit_1_without_traceback(capsys):
    status, _, err = run_cli(capsys, "costs", "--trace", "missing.json")
    assert status == 1 and "cannot read trace 'missing.json'" in err and "Traceback" not in err
    with pytest.raises(SystemExit) as info:  # argparse's own error, with the usage
        main(["costs"])
    assert info.value.code == 1 and "the following arguments are required: --trace" in capsys.readouterr().err


def test_cli_names_a_trace_of_other_parameters(capsys, tmp_path, zb_h1):
    trace = tmp_path / "run.json"
    trace.write_text(json.dumps(planted_trace(zb_h1, target="zb_h1")))
    status, _, err = run_cli(capsys, "costs", "--trace", str(trace), "-D", "N=4")
    assert status == 1 and "does not match the program" in err and "Traceback" not in err
