"""Sequence rings take what every schedule takes: ``--trace``, ``--inject`` and a user's model spec.

A ring's list runs through the one interpreter loop once per attention call
(``runtime/family.run_instructions``), so:

* ``--trace`` writes the ring's instructions in the trace format every
  schedule writes: each rank's every instruction once per attention call and
  half (``args.call``: ``attention 1's backward``) and training step
  (``args.step``), named by its text, then the step's end as the optimizer step;
* ``--inject`` plants a fault in a ring's list as in any other: a hung rank
  ends the run at the timeout with its peer's one-line message naming the
  rank, the instruction, the attention call and the step; a killed one at once;
* a user's model spec that declares ``ring_model`` (``tests/ring_model_spec.py``)
  trains on 2 gloo ranks to the one-process parameters, and one that does
  not is refused before any worker starts, naming what it lacks.
"""
from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest
import torch

import ring_model_spec
from pipec.cli import main
from pipec.compiler.driver import compile_target
from pipec.errors import UsageError
from pipec.runtime.model import ModelConfig
from pipec.runtime.reference import reference_run
from pipec.runtime.sequence import check_ring_model
from runtime_util import assert_same_parameters, launch_batch
from test_run_cli import run_pipec

TESTS = Path(__file__).resolve().parent
STEPS = 2
SEED = 5
DEADLINE_S = 150.0
ZIGZAG_2 = ["zigzag_ring", "-D", "P=2"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """One set of 2 processes: the user's model with --save, then the built-in model with --trace."""
    folder = tmp_path_factory.mktemp("ring_family")
    saved, trace = str(folder / "user.pt"), str(folder / "trace.json")
    common = ["--steps", str(STEPS), "--seed", str(SEED), "--timeout", "60"]
    jobs = [[*ZIGZAG_2, *common, "--model", "ring_model_spec:SPEC", "--save", saved],
            [*ZIGZAG_2, *common, "--trace", trace]]
    env = {"PYTHONPATH": os.pathsep.join(filter(None, [str(TESTS), os.environ.get("PYTHONPATH")]))}
    run = launch_batch(jobs, 2, DEADLINE_S, env)
    return saved, trace, run


def test_a_users_model_spec_trains_with_a_ring_to_the_one_process_parameters(runs):
    saved, _, run = runs
    assert run.ok and os.path.exists(saved), run.describe()
    want = reference_run(ring_model_spec.Config(), STEPS, 1, SEED, ring_model_spec.SPEC)
    assert_same_parameters(torch.load(saved), want.state_dict, "ring_model_spec on zigzag_ring P=2")
    initial = reference_run(ring_model_spec.Config(), 0, 1, SEED, ring_model_spec.SPEC).state_dict
    assert all((want.state_dict[k] - initial[k]).abs().max() > 1e-4 for k in initial if "norm" not in k)
    printed = [float(v) for v in re.findall(r"^step \d+ loss (\S+)$", run.stdout[0], re.M)][:STEPS]
    assert printed == pytest.approx(want.losses, abs=2e-6), run.describe()


def test_the_trace_holds_every_ring_instruction_per_attention_call_and_step(runs):
    _, trace, run = runs
    assert run.ok and os.path.exists(trace), run.describe()
    with open(trace, encoding="utf-8") as handle:
        document = json.load(handle)
    program = compile_target("zigzag_ring", {"P": 2}).program
    assert document["otherData"]["schedule"] == program.name
    events = [e for e in document["traceEvents"] if e.get("ph") == "X" and e.get("cat") != "wait"]
    layers = ModelConfig().layers
    calls = {f"attention {i}'s {half}" for i in range(layers) for half in ("forward", "backward")}
    for rank, row in enumerate(program.ranks):
        mine = [e for e in events if e["pid"] == rank]
        for step in range(1, STEPS + 1):
            ring = [e for e in mine if e["args"]["step"] == step and e["args"]["index"] < len(row)]
            assert {e["args"]["call"] for e in ring} == calls, (rank, step)
            for layer in range(layers):
                halves = [sorted(e["args"]["index"] for e in ring if e["args"]["call"].startswith(f"attention {layer}'"))]
                assert halves == [list(range(len(row)))], (rank, step, layer)  # forward + backward: the whole list once
            assert all(e["name"] == row[e["args"]["index"]].text() and e["args"]["op"] == row[e["args"]["index"]].op
                       for e in ring)
            ends = [e for e in mine if e["args"]["step"] == step and e["args"]["index"] == len(row)]
            assert [e["name"] for e in ends] == ["optimizer step"], (rank, step)
        forward = [e["args"]["index"] for e in mine if e["args"].get("call") == "attention 0's forward"]
        assert all(row[i].op != "AB" for i in forward) and any(row[i].op == "AF" for i in forward)


def test_a_hung_rank_in_a_ring_ends_the_run_at_the_timeout_naming_the_call():
    """Rank 1 hangs before its first exchange: rank 0 waits at its EXCHANGE_WAIT0 (index 4) of the first
    layer's forward, and says so at the timeout; nothing is left running."""
    timeout = 3.0  # the phases before the fault (the model build) have --timeout + 3 s on a loaded machine
    done = run_pipec("run", *ZIGZAG_2, "--steps", "2", "--timeout", str(timeout), "--inject", "hang:1:0",
                     deadline_s=90)
    assert done.status == 1, done.describe()
    match = re.search(r"^rank 0, step 4 \(EXCHANGE_WAIT0, for \(0SEND_KV0;1RECV_KV0\)EXCHANGE0 of step 0, in "
                      r"attention 0's forward\): waited (\d+(?:\.\d+)?) s for rank 1: no answer within the "
                      r"timeout.*; training step 1$", done.stderr, re.M)
    assert match, done.describe()
    assert timeout <= float(match.group(1)) < timeout + 1.0, done.describe()
    assert "Traceback" not in done.stderr and not done.survivors, done.describe()


def test_a_killed_rank_in_a_ring_ends_the_run_at_once_with_its_peers_message():
    """Rank 1 kills itself in the first backward half autograd runs (the last layer's; index 9, before its
    1AB1): rank 0 sees it at once at that half's wait for rank 1."""
    done = run_pipec("run", *ZIGZAG_2, "--steps", "2", "--timeout", "30", "--inject", "kill:1:9", deadline_s=90)
    assert done.status == 1, done.describe()
    last = ModelConfig().layers - 1
    match = re.search(rf"^rank 0, step (\d+) \(EXCHANGE_WAIT\d, .*, in attention {last}'s backward\): waited "
                      r"(\d+(?:\.\d+)?) s for rank 1: the peer failed or closed the connection.*training step 1$",
                      done.stderr, re.M)
    assert match and float(match.group(2)) < 5, done.describe()
    assert re.search(r"^rank 1: killed by SIGKILL", done.stderr, re.M), done.describe()
    assert "Traceback" not in done.stderr and not done.survivors, done.describe()


def test_a_spec_without_ring_model_is_refused_before_any_worker_starts(capsys, no_launch, monkeypatch):
    monkeypatch.syspath_prepend(str(TESTS))
    assert main(["run", *ZIGZAG_2, "--model", "ring_model_spec:UNDECLARED"]) == 1
    err = capsys.readouterr().err
    assert ("zigzag_ring is a sequence-ring schedule, and model spec ring_model_spec:UNDECLARED does not declare "
            "ring_model(config)") in err, err
    assert "positions= and attend=" in err and "Traceback" not in err, err


def test_a_users_model_is_checked_against_the_rings_mask_and_cut():
    spec, config = ring_model_spec.SPEC, ring_model_spec.Config()
    full = compile_target("zigzag_ring", {"P": 2, "causal": False}).program
    with pytest.raises(UsageError, match=r"full attention mask, but model spec mine's attention is causal: .*"
                                         r"-D causal=true"):
        check_ring_model(spec, config, full, "mine")
    eight_chunks = compile_target("zigzag_ring", {"P": 4}).program
    with pytest.raises(UsageError, match=r"seq_len 6 cannot be cut into zigzag_ring's 8 chunks"):
        check_ring_model(spec, ring_model_spec.Config(seq_len=6), eight_chunks, "mine")
    broken = ring_model_spec.ModelSpec(**{**spec.__dict__, "ring_model": lambda config: (config.seq_len,)})
    with pytest.raises(UsageError, match=r"ring_model\(config\) must return a RingModel\(seq_len, causal\)"):
        check_ring_model(broken, config, eight_chunks, "mine")
    assert check_ring_model(spec, config, eight_chunks, "mine") == (8, True)
