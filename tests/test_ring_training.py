"""Sequence-parallel training with ring programs: the built-in model, its sequence cut across the ranks.

Real multi-process runs over gloo, three steps each with ``--save``, against
the one-process reference with one microbatch (``reference_run(config, 3, 1,
seed)``): zigzag_ring at P = 2 (through ``pipec run``, as a user types it)
and P = 4, ring_attention and tasp at P = 3 (sharing one set of processes,
``launch_batch``; ``seq_len`` 24, which their 3 chunks and 6 chunks x 2
pieces cut). Every parameter must come within 1e-5 and have moved, and the
printed losses must be the reference's. Then what cannot run is refused
before any worker starts: a full-mask ring, a ``seq_len`` the chunks do not
cut, a model spec that does not declare ``ring_model``; ``--trace`` and
``--inject`` pass the checks (``tests/test_ring_family.py`` runs them). In
this process: the forward/backward split of a ring list, and the whole model
through a one-rank ring inside autograd.
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys

import pytest
import torch

from pipec.cli import main
from pipec.commands import run as run_command
from pipec.compiler import ops
from pipec.compiler.driver import compile_target
from pipec.compiler.ir import RingPlan
from pipec.compiler.lower_rings import lower_plan
from pipec.errors import UsageError
from pipec.runtime import worker
from pipec.runtime.model import ModelConfig, build_model, loss_fn
from pipec.runtime.reference import reference_run
from pipec.runtime.rings import RingAttention, RingContext, forward_end, run_ring_attention
from pipec.runtime.sequence import ring_attend
from runtime_util import assert_same_parameters, launch_batch

STEPS = 3
SEED = 7
DEADLINE_S = 120.0
LONG = ModelConfig(seq_len=24)  # 3 chunks; 6 chunks x 2 pieces (tasp at P = 3)
# rank 0's line; `pipec run` adds the step's speed and memory behind " | "
LOSS_LINE = re.compile(r"^step (\d+) loss (\S+)(?: \| .*)?$", re.M)

# name -> (target, ranks, config overrides, the config the reference trains)
CASES = {
    "zigzag_ring-P2": ("zigzag_ring", 2, [], ModelConfig()),
    "ring_attention-P3": ("ring_attention", 3, ["seq_len=24"], LONG),
    "tasp-P3": ("tasp", 3, ["seq_len=24"], LONG),
    "zigzag_ring-P4": ("zigzag_ring", 4, [], ModelConfig()),
}


def _arguments(case: str, save: str) -> list[str]:
    target, ranks, overrides, _ = CASES[case]
    config = [item for override in overrides for item in ("--config", override)]
    return [target, "-D", f"P={ranks}", "--steps", str(STEPS), "--seed", str(SEED), "--timeout", "60",
            "--save", save, *config]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """case -> (saved state_dict path, rank 0's stdout, a description of the run for messages)."""
    folder = tmp_path_factory.mktemp("ring_training")
    saves = {case: str(folder / f"{case}.pt") for case in CASES}
    out = {}
    # the command a user types: pipec run compiles once and launches through torch's elastic launcher
    case = "zigzag_ring-P2"
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    try:
        done = subprocess.run([sys.executable, "-m", "pipec", "run", *_arguments(case, saves[case]), "--nproc", "2"],
                              capture_output=True, text=True, timeout=DEADLINE_S, env=env, stdin=subprocess.DEVNULL)
        out[case] = (saves[case], done.stdout, f"status {done.returncode}\n{done.stdout}\n{done.stderr}")
    except subprocess.TimeoutExpired as expired:
        out[case] = (saves[case], "", f"pipec run timed out after {DEADLINE_S} s: {expired}")
    # the others as torchrun would start them, one set of processes per world size
    for ranks in (3, 4):
        cases = [c for c in CASES if CASES[c][1] == ranks and c not in out]
        run = launch_batch([_arguments(c, saves[c]) for c in cases], ranks, DEADLINE_S)
        lines = LOSS_LINE.findall(run.stdout[0])
        for index, c in enumerate(cases):
            mine = "".join(f"step {k} loss {v}\n" for k, v in lines[index * STEPS:(index + 1) * STEPS])
            out[c] = (saves[c], mine, run.describe())
    return out


_references: dict = {}


def reference(config: ModelConfig):
    if config not in _references:
        _references[config] = reference_run(config, STEPS, 1, SEED)
    return _references[config]


@pytest.mark.parametrize("case", list(CASES))
def test_ring_training_ends_with_the_one_process_parameters(runs, case):
    path, stdout, described = runs[case]
    assert os.path.exists(path), f"{case} saved nothing:\n{described}"
    config = CASES[case][3]
    want = reference(config)
    assert_same_parameters(torch.load(path), want.state_dict, case)
    initial = reference_run(config, 0, 1, SEED).state_dict
    assert all((want.state_dict[k] - initial[k]).abs().max() > 1e-4 for k in initial if "norm" not in k), \
        "every weight matrix moved in three steps"
    printed = [float(value) for _, value in LOSS_LINE.findall(stdout)]
    assert printed == pytest.approx(want.losses, abs=2e-6), (printed, want.losses, described)
    assert printed[-1] < printed[0]


# ------------------------------------------------------------------ refused before any worker starts


def test_a_full_mask_ring_is_refused_with_the_define_to_use(capsys, no_launch):
    assert main(["run", "zigzag_ring", "-D", "P=2", "-D", "causal=false", "--steps", "1"]) == 1
    err = capsys.readouterr().err
    assert "full attention mask" in err and "causal" in err and "-D causal=true" in err, err
    assert "Traceback" not in err


def test_a_sequence_length_the_chunks_do_not_cut_names_both_numbers(capsys, no_launch):
    assert main(["run", "tasp", "-D", "P=3", "--steps", "1"]) == 1  # 16 tokens, 6 chunks x 2 pieces
    err = capsys.readouterr().err
    assert "seq_len 16" in err and "6 chunks x 2 pieces" in err and "multiple of 12" in err, err
    assert main(["run", "ring_attention", "-D", "P=3", "--config", "seq_len=20", "--steps", "1"]) == 1
    err = capsys.readouterr().err
    assert "seq_len 20" in err and "3 chunks" in err and "multiple of 3" in err, err


def test_trace_and_injection_pass_the_checks_and_a_model_without_ring_model_is_refused(capsys, tmp_path,
                                                                                      monkeypatch):
    """``--trace`` and ``--inject`` are checked as for every schedule and reach the launch; a spec that
    does not declare ``ring_model`` is refused before it, naming what it lacks."""
    launched = []

    def launch(python_args, nproc, **options):
        launched.append(python_args)
        shutil.rmtree(options["run_dir"], ignore_errors=True)
        return run_command.LaunchResult(True)
    monkeypatch.setattr(run_command, "launch", launch)
    assert main(["run", "zigzag_ring", "-D", "P=2", "--trace", str(tmp_path / "t.json")]) == 0
    assert main(["run", "zigzag_ring", "-D", "P=2", "--inject", "hang:0:3"]) == 0
    assert len(launched) == 2, capsys.readouterr().err
    (tmp_path / "ring_user_model.py").write_text(
        "import dataclasses\n"
        "from pipec.runtime import model\n"
        "SPEC = dataclasses.replace(model.LLAMA, ring_model=None)\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    assert main(["run", "zigzag_ring", "-D", "P=2", "--model", "ring_user_model:SPEC"]) == 1
    err = capsys.readouterr().err
    assert "does not declare ring_model(config)" in err and "positions= and attend=" in err, err
    assert "Traceback" not in err and len(launched) == 2, err


def test_the_worker_refuses_the_same_under_torchrun():
    """Without ``pipec run``'s checks (torchrun), every worker says it before joining the group."""
    config = worker.parse_run_config(["zigzag_ring", "-D", "P=2", "-D", "causal=false"])
    with pytest.raises(UsageError, match="-D causal=true"):
        worker.make_plan(config, 2)
    config = worker.parse_run_config(["zigzag_ring", "-D", "P=4", "--config", "seq_len=12"])
    with pytest.raises(UsageError, match="seq_len 12 .* 8 chunks.*multiple of 8"):
        worker.make_plan(config, 4)


# ------------------------------------------------------------------ in this process


@pytest.mark.parametrize("target,ranks", [("ring_attention", 3), ("zigzag_ring", 4), ("tasp", 3), ("tasp", 5)])
def test_the_forward_half_ends_where_the_backward_starts(target, ranks):
    """Every AF and every forward KV exchange (posted and waited) before the split; every AB after it."""
    program = compile_target(target, {"P": ranks}).program
    for rank, row in enumerate(program.ranks):
        end = forward_end(RingContext(program, rank, timeout=5.0))
        before, after = row[:end], row[end:]
        assert all(a.op != ops.AB for a in before) and all(a.op != ops.AF for a in after)
        numbers = lambda actions, op: {a.mb for a in actions if a.op == op}  # noqa: E731
        assert numbers(before, ops.EXCHANGE) == numbers(before, ops.EXCHANGE_WAIT) == set(range(ranks - 1)), rank
        assert min(numbers(after, ops.EXCHANGE)) == ranks - 1


def test_the_split_halves_equal_the_whole_list_and_run_once():
    program = lower_plan(RingPlan(2, (0, 0), 2, ((0,),), True, dkv="direct"), "alone")
    generator = torch.Generator().manual_seed(3)
    q, k, v, grad = (torch.randn((2, 3, 8, 4), generator=generator, dtype=torch.float64) for _ in range(4))
    whole = run_ring_attention(program, 0, q, k, v, grad, timeout=5.0)
    ring = RingAttention(program, 0, timeout=5.0)
    out = ring.forward(q, k, v)
    assert torch.equal(out, whole.local("out"))
    with pytest.raises(UsageError, match="runs once"):
        ring.forward(q, k, v)
    for got, name in zip(ring.backward(grad), ("dq", "dk", "dv")):
        assert torch.equal(got, whole.local(name)), name
    with pytest.raises(UsageError, match="runs once"):
        ring.backward(grad)
    with pytest.raises(UsageError, match="after forward"):
        RingAttention(program, 0, timeout=5.0).backward(grad)


def test_the_whole_model_through_a_one_rank_ring_in_autograd_matches_its_own_attention():
    """Two chunks of two pieces on one rank (no exchange, no group): the model's loss and every gradient
    through ``RingAttentionFunction`` equal the model's own causal attention, to fp32 rounding."""
    config = ModelConfig()
    program = lower_plan(RingPlan(2, (0, 0), 2, ((0,),), True), "alone")
    inputs = torch.randint(config.vocab, (2, config.seq_len), generator=torch.Generator().manual_seed(1))
    targets = (inputs * 7) % config.vocab
    grads = []
    for attend in (None, ring_attend(RingContext(program, 0, timeout=5.0))):
        model = build_model(config, SEED)
        positions = None if attend is None else torch.arange(config.seq_len)
        loss = loss_fn(model(inputs, positions=positions, attend=attend), targets)
        loss.backward()
        grads.append((loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()}))
    (want_loss, want), (got_loss, got) = grads
    assert got_loss == pytest.approx(want_loss, abs=1e-6)
    worst = max((got[n] - want[n]).abs().max().item() for n in want)
    assert worst <= 1e-6, worst
