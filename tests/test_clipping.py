"""``--clip-grad-norm X``: one global norm over every rank, replicas counted once, one factor everywhere.

Held to ``torch.nn.utils.clip_grad_norm_`` on one process (``reference_run``'s
``clip_grad_norm``), with the threshold below every step's norm so that
clipping acts at each step: BitPipe (every chunk on two ranks: counted twice,
the norm would be sqrt(2) too large), WeiPipe (gradients on their owners),
FSDP (shards) and zigzag (replicas of the whole model).
"""
from __future__ import annotations

import re

import pytest
import torch

from pipec.compiler.driver import compile_target
from pipec.runtime import clipping
from pipec.runtime.model import ModelConfig
from pipec.runtime.reference import reference_run
from runtime_util import assert_same_parameters, launch_batch

STEPS, N, SEED = 3, 4, 2
THRESHOLD = 0.5
NORM_LINE = re.compile(r"^step (\d+) loss (\S+) grad norm (\S+)$", re.M)
SCHEDULES = ("bitpipe", "weipipe", "fsdp", "zigzag_ring")


def _n(name: str) -> int:
    return 1 if name.endswith("ring") else N


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    folder = tmp_path_factory.mktemp("clip")
    jobs = [[name, "-D", "P=2", *([] if _n(name) == 1 else ["-D", f"N={N}"]), "--steps", str(STEPS),
             "--seed", str(SEED), "--clip-grad-norm", str(THRESHOLD), "--save", str(folder / f"{name}.pt")]
            for name in SCHEDULES]
    run = launch_batch(jobs, 2, 240.0)
    assert run.ok, run.describe()
    norms = [float(norm) for _, _, norm in NORM_LINE.findall(run.stdout[0])]
    assert len(norms) == STEPS * len(SCHEDULES), run.stdout[0]
    return folder, {name: norms[i * STEPS:(i + 1) * STEPS] for i, name in enumerate(SCHEDULES)}


def _reference_norms(steps: int, n: int) -> list[float]:
    """The global norm of each step's gradients on one process, under clipping (what rank 0 prints)."""
    from pipec.runtime.model import LLAMA, split_microbatches

    model = LLAMA.build_model(ModelConfig(), SEED)
    optimizer = LLAMA.make_optimizer(model.parameters())
    norms = []
    for step in range(steps):
        optimizer.zero_grad()
        for inputs, targets in split_microbatches(LLAMA.synthetic_batch(ModelConfig(), step, n, SEED), n):
            (LLAMA.loss_fn(model(inputs), targets) / n).backward()
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), THRESHOLD).item())
        optimizer.step()
    return norms


@pytest.mark.parametrize("name", SCHEDULES)
def test_clipping_by_the_global_norm_trains_like_one_process(runs, name):
    folder, norms = runs
    assert all(norm > THRESHOLD for norm in norms[name]), norms[name]  # clipping acted at every step
    assert norms[name] == pytest.approx(_reference_norms(STEPS, _n(name)), rel=1e-5)
    want = reference_run(ModelConfig(), STEPS, _n(name), SEED, clip_grad_norm=THRESHOLD).state_dict
    got = torch.load(folder / f"{name}.pt", weights_only=True)
    assert_same_parameters(got, want, f"{name} --clip-grad-norm {THRESHOLD}")


def test_a_replicated_chunk_is_counted_by_its_lowest_rank_only():
    """BitPipe at P = 4 puts each chunk on two ranks: each chunk's gradient is counted once."""
    from types import SimpleNamespace

    program = compile_target("bitpipe", {"P": 4, "N": 4}).program
    counted = {}
    for rank in range(program.num_ranks):
        chunks = {info.position for info in program.stages if info.rank == rank}
        flat = {chunk: torch.full((1,), float(chunk)) for chunk in chunks}
        context = SimpleNamespace(weights=None, program=program, rank=rank, flat_grads=flat)
        counted[rank] = sorted(int(t.item()) for t in clipping.counted_gradients(context))
    every = sorted(chunk for chunks in counted.values() for chunk in chunks)
    assert every == list(range(program.num_chunks))  # each chunk exactly once over all ranks
    for rank, chunks in counted.items():
        for chunk in chunks:
            assert rank == min(info.rank for info in program.stages if info.position == chunk)
