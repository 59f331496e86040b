"""The README's chains that used to dead-end (issue 25, item 7), each held by a test that can fail: a torch
CSV is drawn and simulated, import-torch says how to make one, partition takes link and all-reduce costs,
a cost file that leaves a program's ops at unit costs is warned about, and an asynchronous schedule's
simulation says what its learning rate needs."""
from __future__ import annotations

import json

import pytest

from pipec.cli import main
from pipec.compiler.costs import unit_priced_ops


def _run(capsys, *argv: str) -> tuple[int, str, str]:
    status = main(list(argv))
    out, err = capsys.readouterr()
    return status, out, err


@pytest.mark.parametrize("form", ["torch-csv", "torch-csv-comms"])
def test_a_torch_csv_is_simulated_and_drawn_like_its_schedule(tmp_path, capsys, form):
    csv = str(tmp_path / "schedule.csv")
    assert _run(capsys, "compile", "1f1b", "-D", "P=4", "-D", "N=8", "--format", form, "-o", csv)[0] == 0
    status, out, err = _run(capsys, "simulate", csv)
    assert status == 0, err
    assert out.startswith("schedule (a torch schedule CSV): makespan 33, bubble ratio 3/11")
    for suffix in ("svg", "dot"):
        status, _, err = _run(capsys, "render", csv, "-o", str(tmp_path / f"s.{suffix}"))
        assert status == 0, err
    assert (tmp_path / "s.dot").read_text().count("subgraph cluster") == 4  # a cluster per rank
    status, _, err = _run(capsys, "simulate", csv, "-D", "P=3")
    assert status == 1 and "has none" in err


def test_import_torch_of_a_missing_file_says_how_to_make_one(tmp_path, capsys):
    status, _, err = _run(capsys, "import-torch", str(tmp_path / "schedule.csv"))
    assert status == 1 and "pipec compile 1f1b -D P=4 -D N=8 --format torch-csv -o schedule.csv" in err


def _layers(tmp_path) -> str:
    layer = {"F": 1.0, "B": 2.0, "activation": 1000, "parameters": 1_000_000}
    path = tmp_path / "layers.json"
    path.write_text(json.dumps({"layers": [{"name": f"l{i}", **layer} for i in range(8)]}))
    return str(path)


def test_partition_without_an_allreduce_cost_replicates_everything_and_says_why(tmp_path, capsys):
    status, out, err = _run(capsys, "partition", "--costs", _layers(tmp_path), "-D", "P=4", "--replicate")
    assert status == 0 and ": 1 stages," in out
    assert "warning: no all-reduce cost" in err


def test_partition_with_link_and_allreduce_costs_pipelines_and_writes_them_on(tmp_path, capsys):
    chunks = tmp_path / "chunks.json"
    status, out, err = _run(capsys, "partition", "--costs", _layers(tmp_path), "-D", "P=4", "--replicate",
                            "--link", "0.05,100000", "--allreduce", "0.05,100000", "--costs-out", str(chunks))
    assert status == 0, err
    assert ": 4 stages," in out and err == ""
    written = json.loads(chunks.read_text())
    assert written["links"] == {"latency": 0.05, "bandwidth": 100000.0}
    assert written["allreduce"] == {"latency": 0.05, "bandwidth": 100000.0}


def test_a_bad_link_option_is_named(tmp_path, capsys):
    status, _, err = _run(capsys, "partition", "--costs", _layers(tmp_path), "-D", "P=4", "--link", "fast")
    assert status == 1 and "--link expects LATENCY,BANDWIDTH" in err


def test_ops_left_at_unit_costs_beside_measured_ones_are_named():
    measured = {"compute": {"F": 0.7, "B": 2.0, "per_chunk": {"0": {"F": 0.6}}}}
    assert unit_priced_ops(measured, {"AF", "AB", "EXCHANGE"}) == ["AB", "AF"]
    assert unit_priced_ops(measured, {"F", "I", "W", "R", "U"}) == []  # I, W from B; R from F; U free
    assert unit_priced_ops({"links": {"latency": 1.0}}, {"AF"}) == []  # no compute given: all units, one scale


def test_simulating_attention_with_measured_pipeline_costs_warns(tmp_path, capsys):
    costs = tmp_path / "my_costs.json"
    costs.write_text(json.dumps({"compute": {"F": 0.7, "B": 2.0}}))
    status, _, err = _run(capsys, "simulate", "tasp", "-D", "P=4", "--costs", str(costs), "--json")
    assert status == 0 and "prices some compute ops but not AB, AF" in err


def test_an_asynchronous_simulation_notes_the_learning_rate_staleness_needs(capsys):
    status, out, _ = _run(capsys, "simulate", "pipedream", "-D", "P=4", "-D", "N=32")
    assert status == 0
    assert "note: pipedream is asynchronous: up to 32 updates per stage a step, gradients up to 3 update(s) stale" in out
    assert "note:" not in _run(capsys, "simulate", "1f1b", "-D", "P=4")[1]
