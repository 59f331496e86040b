"""compiler/spread.py: measurements say when they are noise (issue 25, item 8): the spread of repeats, and
warnings for ranks that outnumber the cores, a busy machine, or repeats spread wide."""
from __future__ import annotations

import json

from pipec.cli import main
from pipec.compiler.spread import LARGE_SPREAD, Spread, noise_warnings


def test_a_spread_is_min_median_max_and_its_relative_width():
    spread = Spread.of([3.0, 1.0, 2.0, 2.0])
    assert spread == (1.0, 2.0, 3.0) and spread.relative == 1.0
    assert spread.text() == "min 1 / median 2 / max 3 (spread 100%)"
    assert Spread.of([0.0, 0.0]).relative == 0.0


def test_a_quiet_measurement_draws_no_warning():
    assert noise_warnings({"F": Spread.of([1.0, 1.1, 1.2])}, processes=2, cores=4, load=0.0) == []


def test_ranks_that_outnumber_the_cores_are_named():
    (warning,) = noise_warnings({}, processes=4, cores=2)
    assert warning.startswith("4 ranks shared 2 core(s)")


def test_a_busy_machine_is_named_for_a_single_process():
    (warning,) = noise_warnings({}, processes=1, cores=2, load=1.5)
    assert "load average 1.50 on 2 core(s)" in warning


def test_the_widest_spread_past_the_limit_is_named():
    wide = Spread.of([1.0, 1.0, 1.0 + 2 * LARGE_SPREAD])
    warnings = noise_warnings({"chunk 0 F": Spread.of([1.0, 1.1]), "chunk 1 B": wide}, processes=1, cores=8, load=0.0)
    assert len(warnings) == 1 and warnings[0].startswith("chunk 1 B's repeats spread 100%")


def _write_trace(path, cores: int, scale_of_step) -> None:
    """A trace of 1f1b on 2 ranks, 2 microbatches, 3 steps: every compute task of step s takes scale_of_step(s) ms."""
    from pipec.compiler.driver import compile_target
    from pipec.compiler.ops import COMPUTE_OPS

    program = compile_target("1f1b", {"P": "2", "N": "2"}).program
    events = []
    for step in (1, 2, 3):
        for rank, row in enumerate(program.ranks):
            for index, action in enumerate(row):
                if action.op in COMPUTE_OPS:
                    events.append({"name": action.text(), "cat": "compute", "ph": "X", "pid": rank, "tid": 0,
                                   "ts": 0.0, "dur": 1000.0 * scale_of_step(step, index),
                                   "args": {"step": step, "index": index}})
    other = {"schedule": "1f1b", "target": "1f1b", "params": {"P": 2, "N": 2}, "cores": cores}
    path.write_text(json.dumps({"traceEvents": events, "otherData": other}))


def test_pipec_costs_prints_the_spread_and_warns_of_shared_cores_and_wide_repeats(tmp_path, capsys):
    trace = tmp_path / "run.json"
    _write_trace(trace, cores=1, scale_of_step=lambda step, index: 1.0 if step == 2 else 1.0 + 9 * (index % 2))
    assert main(["costs", "--trace", str(trace), "-o", str(tmp_path / "c.json")]) == 0
    out, err = capsys.readouterr()
    assert "widest spread" in out and "min 1 / median" in out
    assert "warning: 2 ranks shared 1 core(s)" in err
    assert "repeats spread 900% around their median" in err


def test_pipec_costs_of_even_repeats_on_enough_cores_warns_of_nothing(tmp_path, capsys):
    trace = tmp_path / "run.json"
    _write_trace(trace, cores=2, scale_of_step=lambda step, index: 1.0)
    assert main(["costs", "--trace", str(trace), "-o", str(tmp_path / "c.json")]) == 0
    out, err = capsys.readouterr()
    assert "(spread 0%)" in out and err == ""


def test_pipec_profile_prints_the_spread_of_its_repeats(capsys):
    assert main(["profile", "--config", "layers=1", "--repeats", "3"]) == 0
    out = capsys.readouterr().out
    assert "spread of the repeats (F + B): whole model min" in out and "widest " in out
