"""``pipec run`` from before the launch to after the last worker: what is checked before any worker
starts (the output paths, the model's cut and its activation shape), how fast a run ends after a stopped
worker's peer names the fault, and what an interrupted run says."""
from __future__ import annotations

import os
import re
import shutil
import signal
import textwrap
import time

import pytest

from pipec.cli import main
from pipec.errors import UsageError
from pipec.runtime import worker
from test_run_cli import run_pipec

GPIPE_2 = ["gpipe", "-D", "P=2", "-D", "N=2"]


@pytest.mark.parametrize("option, what", [("--save", "the saved model (--save)"), ("--trace", "the trace (--trace)")])
def test_an_output_that_cannot_be_written_fails_before_any_worker_starts(option, what, tmp_path, capsys, no_launch):
    target = tmp_path / "no_such_folder" / "out"
    assert main(["run", *GPIPE_2, "--steps", "1", option, str(target)]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"cannot write {what} '{target}'" in err and "does not exist" in err, err


MODEL = '''
from dataclasses import dataclass

import torch
from torch import nn

from pipec.errors import UsageError


@dataclass(frozen=True)
class Config:
    width: int = 32
    blocks: int = 4
    rows: int = 4
    claimed: int = 32


def build_chunk(config, chunk, num_chunks, seed):
    if config.blocks % num_chunks:
        raise UsageError(f"{config.blocks} blocks do not split into {num_chunks} chunks")
    torch.manual_seed(seed)
    return nn.Sequential(*(nn.Linear(config.width, config.width) for _ in range(config.blocks // num_chunks)))


def build_model(config, seed):
    return build_chunk(config, 0, 1, seed)


def synthetic_batch(config, step, num_microbatches, seed):
    inputs = torch.randn(num_microbatches * config.rows, config.width)
    return inputs, inputs


loss_fn = nn.functional.mse_loss
make_optimizer = lambda params: torch.optim.SGD(params, lr=0.1)
config = Config()


def activation_shape(config):
    return (config.rows * 2, config.claimed)
'''


@pytest.fixture
def user_model(tmp_path, monkeypatch):
    (tmp_path / "lifecycle_model.py").write_text(textwrap.dedent(MODEL))
    monkeypatch.syspath_prepend(str(tmp_path))
    return "lifecycle_model"


def test_a_wrong_activation_shape_is_named_before_any_worker_starts(user_model, capsys, no_launch):
    assert main(["run", *GPIPE_2, "--steps", "1", "--model", user_model, "--config", "claimed=64"]) == 1
    err = capsys.readouterr().err
    assert err == (f"model spec {user_model}: activation_shape (8, 64) does not match what chunk 0 outputs (4, 32) "
                   "for one microbatch (fix activation_shape(config), or the config's sizes)\n"), err


def test_a_model_that_cannot_be_cut_is_named_before_any_worker_starts(user_model, capsys, no_launch):
    assert main(["run", *GPIPE_2, "--steps", "1", "--model", user_model, "--config", "blocks=3"]) == 1
    err = capsys.readouterr().err
    assert err == f"model spec {user_model}: 3 blocks do not split into 2 chunks\n", err


def test_a_worker_under_torchrun_checks_the_shape_before_joining(user_model):
    config = worker.parse_run_config([*GPIPE_2, "--model", user_model, "--config", "claimed=64"])
    with pytest.raises(UsageError, match=r"activation_shape \(8, 64\) does not match what chunk 0 outputs \(4, 32\)"):
        worker.make_plan(config, 2)


def test_an_interrupted_run_says_where_its_logs_are(monkeypatch, capsys):
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.launcher import api

    def interrupted(config, entrypoint):
        def start(*args):
            raise SignalException("interrupted", signal.SIGINT)
        return start

    monkeypatch.setattr(api, "elastic_launch", interrupted)
    assert main(["run", *GPIPE_2, "--steps", "1"]) == 130
    err = capsys.readouterr().err
    found = re.search(r"^worker logs: (\S+)$", err, re.M)
    assert found and os.path.isdir(found.group(1)), err
    shutil.rmtree(found.group(1))


def test_a_stopped_worker_ends_the_run_within_seconds_of_its_peers_fault():
    # rank 1 stops itself (SIGSTOP) before sending microbatch 0's gradient: it cannot act on SIGTERM, and the
    # launcher's own grace before SIGKILL is 30 s; the run must end a few seconds after rank 0 names the fault
    done = run_pipec("run", *GPIPE_2, "--steps", "2", "--timeout", "1.5", "--inject", "stop:1:6")
    ended = time.time()
    assert done.status == 1 and not done.survivors, done.describe()
    assert re.search(r"^rank 0, step 4 \(0B0\b.*waited \d+\.\d s for rank 1: no answer", done.stderr, re.M), done.describe()
    assert re.search(r"^\s*rank 1: stopped by the launcher", done.stderr, re.M), done.describe()
    logs = re.search(r"^worker logs: (\S+)$", done.stderr, re.M).group(1)
    try:
        [fault_log] = [os.path.join(root, "stderr.log") for root, _, files in os.walk(logs)
                       if "stderr.log" in files and os.path.basename(root) == "0"]
        after_fault = ended - os.stat(fault_log).st_mtime  # rank 0 wrote its fault line, then exited
        assert after_fault < 10, f"the run ended {after_fault:.1f} s after the fault line\n{done.describe()}"
    finally:
        shutil.rmtree(logs, ignore_errors=True)
