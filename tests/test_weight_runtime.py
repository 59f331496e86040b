"""Exactness of the runtime on weight-passing programs: layers' weights travel, activations stay home.

Every route of the family runs on P gloo worker processes for three training
steps, and every parameter of the whole model must end within 1e-5 of one
process trained on the same data (``reference_run``):

* ring weights and ring gradients (WeiPipe) at P = 2 and P = 4, two
  microbatches per rank, with and without prefetch;
* direct weights and direct gradients (split backward and prefetch at P = 2,
  prefetch 2 at P = 4);
* staged weights and reduced gradients with two groups of two (TawPipe-like:
  group g runs layer t - g at step t, forward then backward), the layers
  owned across both groups so that the staging rank's legs run too;
* all_gather weights and reduce_scatter gradients (FSDP-like: every rank runs
  layer l at step l forward, then the backward in reverse);
* a user's model spec (float inputs, a persistent buffer, layers whose flat
  length is not a multiple of P) under the ring and under all_gather.

The programs are built by hand as evaluated specs (``ScheduleSpec`` with a
``WeightSpec`` and per-task steps) and compiled and checked by
``compile_spec``, so these tests do not depend on the ``.pipe`` syntax; the
runs of one world size share one set of processes (``launch_batch``), each
job reading its program with ``--program FILE`` as under ``pipec run``. A
planted fault (a program whose rank 0 lacks an exchange) must end both
workers with a named ``RuntimeFault`` at the timeout rather than hang. When a
weight-passing schedule ships (``schedules/weipipe.pipe``), ``pipec run``
trains it end to end.
"""
from __future__ import annotations

import dataclasses
import importlib
import json
import os
import re
import sys
import textwrap

import pytest
import torch

from pipec.compiler.checks import check_all
from pipec.compiler.driver import compile_spec, compile_target, shipped_schedules, task_kinds
from pipec.compiler.emit.json_program import write_program_json
from pipec.dsl.spec import ScheduleSpec, WeightSpec
from pipec.errors import ProgramError
from pipec.runtime.model import LLAMA, ModelConfig, build_chunk
from pipec.runtime.reference import reference_run
from pipec.runtime.weights import flat_weights, layer_layout, params_from_flat
from runtime_util import assert_same_parameters, launch_batch

STEPS = 3
SEED = 7
# Hard limit of one world size's batch of runs; a hang fails instead of stalling.
BATCH_DEADLINE_S = 240.0


# ------------------------------------------------------------------ programs


def weight_spec(name: str, P: int, L: int, order, steps, *, route: str, gradients: str, owners, groups=None,
                ring_by: int = 1, prefetch: int = 0, split: bool = False) -> ScheduleSpec:
    """An evaluated weight-passing schedule: one pipeline per rank (stage id = rank * L + layer),
    microbatch m at home on rank m % P, and the order with each task's step."""
    num_microbatches = 1 + max(m for row in order for _, _, m in row)
    weights = WeightSpec(route=route, ring_by=ring_by, gradients=gradients,
                         owners=None if owners is None else tuple(owners), groups=tuple(groups or [0] * P),
                         prefetch=prefetch, buffers=None)
    return ScheduleSpec(
        name=name, path=f"{name}.pipe", source="", params={"P": P, "N": num_microbatches}, num_ranks=P,
        num_microbatches=num_microbatches, num_stages=L, num_pipelines=P,
        mb_pipeline=[m % P for m in range(num_microbatches)], placement=[[p] * L for p in range(P)], devices=None,
        split_backward=split, tasks=task_kinds(), order=order, weights=weights, task_steps=steps)


def weipipe(P: int, A: int, prefetch: int = 0, owners=None) -> ScheduleSpec:
    """WeiPipe: P layers, A microbatches per rank; rank r's forward of microbatch r + jP runs layer
    (t - r) mod P at step t, its backward follows P steps later in reverse, both slots on the ring."""
    order, steps = [[] for _ in range(P)], [[] for _ in range(P)]
    for r in range(P):
        for t in range(A * P + 2 * P - 1):
            k = t - r
            if P <= k < A * P + P:
                order[r].append(("B", r * P + P - 1 - k % P, r + (k // P - 1) * P))
                steps[r].append(t)
            if 0 <= k < A * P:
                order[r].append(("F", r * P + k % P, r + k // P * P))
                steps[r].append(t)
    return weight_spec("weipipe", P, P, order, steps, route="ring", gradients="ring",
                       owners=owners or [(P - layer) % P for layer in range(P)], prefetch=prefetch)


def layer_by_layer(name: str, P: int, A: int, L: int, start, **weights) -> ScheduleSpec:
    """Rank r runs layer l forward at step start(r) + l on its A microbatches, then the backward in
    reverse (B, or I and W in the same step under ``split``)."""
    split = weights.get("split", False)
    order, steps = [[] for _ in range(P)], [[] for _ in range(P)]
    for r in range(P):
        mine = range(r, A * P, P)
        for layer in range(L):
            for m in mine:
                order[r].append(("F", r * L + layer, m))
                steps[r].append(start(r) + layer)
        for i, layer in enumerate(reversed(range(L))):
            for m in mine:
                for op in ("I", "W") if split else ("B",):
                    order[r].append((op, r * L + layer, m))
                    steps[r].append(start(r) + L + i)
    return weight_spec(name, P, L, order, steps, **weights)


def direct(P: int, A: int, L: int, **options) -> ScheduleSpec:
    return layer_by_layer("direct", P, A, L, lambda r: 0, route="direct", gradients="direct",
                          owners=[layer % P for layer in range(L)], **options)


def tawpipe(P: int, A: int, L: int, groups: int = 2, **options) -> ScheduleSpec:
    """Groups of P / groups ranks; group g runs layer t - g at step t. Layer l is owned by rank l mod P,
    so a group gets the layers owned in the other group through its staging rank."""
    size = P // groups
    return layer_by_layer("tawpipe", P, A, L, lambda r: r // size, route="staged", gradients="reduce",
                          owners=[layer % P for layer in range(L)], groups=[r // size for r in range(P)], **options)


def fsdp(P: int, A: int, L: int, **options) -> ScheduleSpec:
    return layer_by_layer("fsdp", P, A, L, lambda r: 0, route="all_gather", gradients="reduce_scatter",
                          owners=None, **options)


# ------------------------------------------------------------------ a user's model

USER_MODEL = '''
"""Residual tanh blocks on a regression task (docs/runtime.md's example), with a persistent buffer."""
from dataclasses import dataclass, replace

import torch
from torch import nn

from pipec.errors import UsageError
from pipec.runtime.model import ModelSpec, stream_seed


@dataclass(frozen=True)
class Config:
    width: int = 5
    blocks: int = 6
    rows: int = 3


class Chunk(nn.Module):
    def __init__(self, config, blocks, seed):
        super().__init__()
        self.blocks = nn.ModuleDict({str(i): torch.nn.utils.skip_init(nn.Linear, config.width, config.width)
                                     for i in blocks})
        self.register_buffer("scale", torch.full((config.width,), 0.5))
        with torch.no_grad():
            for i in blocks:
                generator = torch.Generator().manual_seed(stream_seed(seed, i))
                for parameter in self.blocks[str(i)].parameters():
                    parameter.normal_(0.0, 0.3, generator=generator)

    def forward(self, x):
        for block in self.blocks.values():
            x = x + self.scale * torch.tanh(block(x))
        return x


def build_chunk(config, chunk, num_chunks, seed):
    if config.blocks % num_chunks:
        raise UsageError(f"{config.blocks} blocks do not split into {num_chunks} chunks")
    per = config.blocks // num_chunks
    return Chunk(config, range(chunk * per, (chunk + 1) * per), seed)


def build_model(config, seed):
    return build_chunk(config, 0, 1, seed)


def synthetic_batch(config, step, num_microbatches, seed):
    generator = torch.Generator().manual_seed(stream_seed(seed, 1_000_000 + step))
    inputs = torch.randn(num_microbatches * config.rows, config.width, generator=generator)
    return inputs, inputs.flip(-1)


SPEC = ModelSpec(
    build_chunk=build_chunk,
    build_model=build_model,
    synthetic_batch=synthetic_batch,
    loss_fn=nn.functional.mse_loss,
    make_optimizer=lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9, foreach=False),
    config=Config(),
    activation_shape=lambda config: (config.rows, config.width),
)
# Weight passing never hands an activation to another rank: a spec need not give its shape.
NO_SHAPE = replace(SPEC, activation_shape=None)
'''
USER_MODULE = "weight_runtime_user_model"


# name -> (ranks, spec, model: None for the built-in one, else the user's spec's attribute)
CASES = {
    "weipipe-P2": (2, weipipe(2, 2), None),
    "direct-split-prefetch1-P2": (2, direct(2, 2, 4, split=True, prefetch=1), None),
    "user-weipipe-P2": (2, weipipe(2, 2), "NO_SHAPE"),
    "weipipe-P4": (4, weipipe(4, 2), None),
    "weipipe-prefetch1-P4": (4, weipipe(4, 2, prefetch=1), None),
    # owner l = rank l, the public code's map: the first copies reach their slots by sends
    "weipipe-own-l-P4": (4, weipipe(4, 2, prefetch=1, owners=list(range(4))), None),
    "direct-prefetch2-P4": (4, direct(4, 1, 4, prefetch=2), None),
    "tawpipe-P4": (4, tawpipe(4, 1, 4), None),
    "tawpipe-prefetch1-P4": (4, tawpipe(4, 1, 4, prefetch=1), None),
    "fsdp-P4": (4, fsdp(4, 1, 4), None),
    "user-fsdp-P4": (4, fsdp(4, 1, 6), "SPEC"),  # 30 weights a layer: shards of 8, padded to 32
}
# the route each case must take (a guard against a spec that does not say what its name says)
ROUTES = {"weipipe": ("ring", "ring"), "direct": ("direct", "direct"), "tawpipe": ("staged", "reduce"),
          "fsdp": ("all_gather", "reduce_scatter")}


def _model_args(model: str | None) -> list[str]:
    return [] if model is None else ["--model", f"{USER_MODULE}:{model}"]


@pytest.fixture(scope="module")
def user_model(tmp_path_factory):
    """The user's model module, written to a folder on the workers' PYTHONPATH (and this process's path)."""
    folder = tmp_path_factory.mktemp("user_model")
    (folder / f"{USER_MODULE}.py").write_text(textwrap.dedent(USER_MODEL))
    with pytest.MonkeyPatch.context() as patch:
        patch.syspath_prepend(str(folder))
        patch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(folder), os.environ.get("PYTHONPATH")])))
        yield importlib.import_module(USER_MODULE)


@pytest.fixture(scope="module")
def compiled():
    """name -> the checked program of each case."""
    return {name: compile_spec(spec).program for name, (_, spec, _) in CASES.items()}


@pytest.fixture(scope="module")
def batch_runs(tmp_path_factory, compiled, user_model):
    """Per world size: (the WorkerRun, case name -> saved state_dict path, the job names in order)."""
    folder = tmp_path_factory.mktemp("weight_runtime")
    out = {}
    for ranks in sorted({ranks for ranks, _, _ in CASES.values()}):
        names = [name for name, (p, _, _) in CASES.items() if p == ranks]
        saves, jobs = {}, []
        for name in names:
            path = folder / f"{name}.json"
            with open(path, "w") as handle:
                write_program_json(compiled[name], handle)
            saves[name] = str(folder / f"{name}.pt")
            jobs.append([name, "--program", str(path), "--steps", str(STEPS), "--seed", str(SEED),
                         "--timeout", "60", "--save", saves[name], *_model_args(CASES[name][2])])
        out[ranks] = (launch_batch(jobs, ranks, BATCH_DEADLINE_S), saves, names)
    return out


_references: dict = {}


def reference(name: str, user_model):
    """The one-process run of a case's model and microbatch count (cached: cases share them)."""
    _, spec, model = CASES[name]
    key = (model is None, spec.num_microbatches)
    if key not in _references:
        model_spec = LLAMA if model is None else user_model.SPEC
        config = ModelConfig() if model is None else model_spec.config
        _references[key] = reference_run(config, STEPS, spec.num_microbatches, SEED, spec=model_spec)
    return _references[key]


# ------------------------------------------------------------------ exactness


@pytest.mark.parametrize("name", list(CASES))
def test_weight_passing_trains_like_one_process(batch_runs, compiled, user_model, name):
    ranks, spec, model = CASES[name]
    program = compiled[name]
    assert (program.weights.route, program.weights.gradients) == ROUTES[spec.name]
    run, saves, _ = batch_runs[ranks]
    assert os.path.exists(saves[name]), f"{name} saved nothing:\n{run.describe()}"
    want = reference(name, user_model).state_dict
    assert_same_parameters(torch.load(saves[name]), want, name)
    # the parameters moved: a run that changed nothing would also "match" an untrained model
    model_spec = LLAMA if model is None else user_model.SPEC
    initial = model_spec.build_model(ModelConfig() if model is None else model_spec.config, SEED).state_dict()
    assert any((want[k] - initial[k]).abs().max() > 1e-3 for k in initial)


def test_batches_finished_cleanly(batch_runs):
    for ranks, (run, saves, _) in batch_runs.items():
        assert run.ok, run.describe()
        assert run.stdout[0].count(" done") == len(saves), run.describe()


@pytest.mark.parametrize("ranks", [2, 4])
def test_printed_losses_are_the_batch_losses(batch_runs, user_model, ranks):
    """Every rank computes the loss of its own microbatches; rank 0 prints their sum, the one-process loss."""
    run, _, names = batch_runs[ranks]
    lines = [line for line in run.stdout[0].splitlines() if line.startswith("step ")]
    assert len(lines) == STEPS * len(names), run.describe()
    for index, name in enumerate(names):
        printed = [float(line.split()[-1]) for line in lines[index * STEPS:(index + 1) * STEPS]]
        assert printed == pytest.approx(reference(name, user_model).losses, abs=2e-6), name


def test_the_programs_move_weights_not_activations(compiled):
    """What the runs above exercise: every exchange part of the family, and no activation message."""
    ops_seen = {part.op for program in compiled.values() for row in program.ranks for action in row
                for part in action.parts}
    assert ops_seen >= {"SEND_W", "RECV_W", "SEND_G", "RECV_G", "SHIFT_F", "SHIFT_B", "SHIFT_G", "FILL_F",
                        "FILL_B", "BCAST_W", "REDUCE_G", "ALLGATHER_W", "REDUCESCATTER_G"}
    assert not any(action.op in ("SEND_F", "RECV_F", "SEND_B", "RECV_B", "BATCH")
                   for program in compiled.values() for row in program.ranks for action in row)


# ------------------------------------------------------------------ flat layout


def test_a_layer_runs_the_same_on_its_flat_weights():
    """``functional_call`` on views of the flat vector computes what the module computes, and the flat
    vector's gradient is the parameters' gradients concatenated in ``parameters()`` order."""
    config = ModelConfig()
    module = build_chunk(config, 1, 4, SEED)
    layout = layer_layout(module, 3)
    flat = flat_weights(module)
    assert layout.size == flat.numel() == sum(p.numel() for p in module.parameters())
    assert layout.padded == 3 * layout.shard >= layout.size > 3 * (layout.shard - 1)
    x = torch.randn(config.microbatch_size, config.seq_len, config.dim, generator=torch.Generator().manual_seed(1))
    leaf = flat.clone().requires_grad_(True)
    out = torch.func.functional_call(module, params_from_flat(layout, leaf), (x,))
    assert torch.equal(out, module(x))
    out.square().mean().backward()
    module(x).square().mean().backward()
    assert torch.equal(leaf.grad, torch.cat([p.grad.reshape(-1) for p in module.parameters()]))


# ------------------------------------------------------------------ the worker's checks


def test_the_worker_plans_a_weight_program_without_an_activation_shape(user_model, compiled, tmp_path):
    """A weight-passing program needs no activation_shape (no activation leaves its rank): the plan of a
    worker given ``--program`` and the check ``pipec run`` makes before launching both pass without one and
    plan no layouts; an activation-passing program without one has its boundaries found by running the
    first microbatch through the chunks: the user model's (rows, width) fp32 hidden state."""
    from pipec.runtime.payload import tensor_layout
    from pipec.runtime.worker import check_plan_model, make_plan, parse_run_config

    path = tmp_path / "weipipe.json"
    with open(path, "w") as handle:
        write_program_json(compiled["user-weipipe-P2"], handle)
    config = parse_run_config(["weipipe", "--program", str(path), "--model", f"{USER_MODULE}:NO_SHAPE"])
    plan = make_plan(config, 2)
    assert plan.layouts is None and plan.program.weights is not None
    spec = user_model.NO_SHAPE
    assert check_plan_model(spec, spec.config, plan.program, SEED, "user") is None
    gpipe = compile_target("gpipe", {"P": 2, "N": 2}).program
    hidden = tensor_layout((spec.config.rows, spec.config.width))
    assert check_plan_model(spec, spec.config, gpipe, SEED, "user") == [hidden]


# ------------------------------------------------------------------ faults


def test_a_missing_exchange_ends_both_ranks_with_a_named_fault(tmp_path):
    """Rank 0's first exchange (its send of layer 0's weights to rank 1) is taken out of the program:
    rank 1 waits for the weights, rank 0 then for rank 1; each stops at the timeout with a one-line
    RuntimeFault naming its EXCHANGE_WAIT and the rank it waited for, instead of hanging.

    The worker itself refuses such a file before any step (rank 0 checks it:
    tests/test_checked_program.py); this runs it past that check, through the
    batch runner (``make_plan`` and ``train``), as the runtime would if it
    were ever handed an unchecked program."""
    program = compile_spec(direct(2, 1, 2)).program
    row = program.ranks[0]
    assert row[0].text() == "(0SEND_W0)EXCHANGE0" and row[1].text() == "EXCHANGE_WAIT0", row[:2]
    broken = dataclasses.replace(program, ranks=[row[2:], program.ranks[1]])
    with pytest.raises(ProgramError):  # what `python -m pipec.runtime --program` refuses
        check_all(broken)
    path = tmp_path / "broken.json"
    with open(path, "w") as handle:
        write_program_json(broken, handle)
    timeout = 2.0
    run = launch_batch([["broken", "--program", str(path), "--steps", "1", "--timeout", str(timeout)]], 2, 90.0)
    assert not run.timed_out and run.returncodes == [1, 1], run.describe()
    # whichever deadline passes first says "no answer"; the other rank may see its peer leave first
    reason = r"(no answer within the timeout|the peer failed or closed the connection)"
    rank1 = re.search(r"^rank 1, step 1 \(EXCHANGE_WAIT0, for \(2RECV_W0\)EXCHANGE0 of step 0\): "
                      rf"waited (\d+\.\d) s for rank 0: {reason}.*training step 1$", run.stderr[1], re.M)
    rank0 = re.search(r"^rank 0, step \d+ \(EXCHANGE_WAIT\d+, for \(1RECV_W1\)EXCHANGE\d+ of step \d+\): "
                      rf"waited (\d+\.\d) s for rank 1: {reason}.*training step 1$", run.stderr[0], re.M)
    assert rank1 and rank0, run.describe()
    timed_out = [float(m.group(1)) for m in (rank0, rank1) if m.group(2).startswith("no answer")]
    assert timed_out and all(timeout <= waited < timeout + 1.5 for waited in timed_out), run.describe()
    assert "Traceback" not in run.stderr[0] + run.stderr[1], run.describe()


# ------------------------------------------------------------------ end to end


@pytest.mark.skipif("weipipe" not in shipped_schedules(), reason="schedules/weipipe.pipe has not landed")
def test_pipec_run_trains_the_shipped_weipipe(tmp_path):
    """``pipec run weipipe``: compiled and checked once, P workers, the saved model equal to one process."""
    from test_run_cli import losses_of, run_pipec

    ranks = 4
    program = compile_target("weipipe", {"P": ranks}).program
    assert program.weights is not None and program.weights.route == "ring"
    save = tmp_path / "model.pt"
    done = run_pipec("run", "weipipe", "-D", f"P={ranks}", "--nproc", str(ranks), "--steps", "3",
                     "--seed", str(SEED), "--save", str(save), deadline_s=180)
    assert done.status == 0, done.describe()
    want = reference_run(ModelConfig(), 3, program.num_microbatches, SEED)
    assert_same_parameters(torch.load(save), want.state_dict, "pipec run weipipe")
    assert losses_of(done.stdout) == pytest.approx(want.losses, abs=2e-6)


def test_program_json_round_trips_the_weight_plan(compiled, tmp_path):
    """What a worker reads with --program: the same plan, communicators and lists as compiled."""
    from pipec.compiler.guarded_read import read_program

    for name in ("tawpipe-P4", "fsdp-P4", "weipipe-P2"):
        path = tmp_path / f"{name}.json"
        with open(path, "w") as handle:
            write_program_json(compiled[name], handle)
        back = read_program(str(path))
        assert back.weights == compiled[name].weights
        assert back.communicators == compiled[name].communicators
        assert back.ranks == compiled[name].ranks
        assert json.loads(path.read_text())["weights"]["route"] == compiled[name].weights.route


if __name__ == "__main__":  # pragma: no cover
    sys.exit(pytest.main([__file__, "-q"]))
