"""Every kind of order ``pipec search`` writes trains like one process (issue 27: "a test at P = 2 and 4 on gloo").

One searched file per way of searching: the exact model on one pipeline, with recomputation and on two
pipelines (BitPipe), the heuristic, a weight-passing grid (TawPipe), and the exact model at P = 4 under a
link latency at twice 1F1B's memory (so not ZB-H1's own order). Each is searched here as the command
searches it, written, and trained for 2 steps on gloo; its parameters are held to one process within the
runtime tests' tolerance. The files of one world size train in one set of processes (``launch_batch``:
the workers' start-up, most of such a test's time, is paid once per world size).
"""
from __future__ import annotations

import pytest
import torch

from pipec.compiler.costs import costs_from_json
from pipec.compiler.driver import compile_target, lower_spec, resolve_target
from pipec.compiler.family import families_of
from pipec.compiler.memory_counts import peak_activations
from pipec.compiler.search import OPTIMAL, search_order
from pipec.compiler.search_heuristic import heuristic_search
from pipec.compiler.search_pipe import order_to_pipe
from pipec.compiler.simulate import simulate
from pipec.runtime.model import ModelConfig
from pipec.runtime.reference import reference_run
from runtime_util import assert_same_parameters, launch_batch

pytest.importorskip("ortools")

SEED = 7
STEPS = 2
N = 4
LATENCY = costs_from_json({"links": {"latency": 1}})


def _lowered(target: str, P: int, costs=None, **defines):
    spec = resolve_target(target).evaluate({"P": str(P), "N": str(N), **{k: str(v) for k, v in defines.items()}})
    return spec, lower_spec(spec, costs)[0]


def _one_f_one_b(P: int, times: int = 1) -> list[int]:
    return [times * (P - r) for r in range(P)]  # rank r holds at most P - r activations under 1F1B


def _exact_1f1b() -> str:
    _, compute = _lowered("1f1b", 2)
    return order_to_pipe(compute, search_order(compute, memory=_one_f_one_b(2), time_limit=120, workers=2).order)


def _recomputed_1f1b() -> str:
    _, compute = _lowered("1f1b", 2, remat="true")
    result = search_order(compute, memory=[1, 1], time_limit=120, workers=2)
    assert result.recomputed == [0, 1]
    return order_to_pipe(compute, result.order)


def _two_pipelines() -> str:
    """BitPipe within 4 activations per rank, where its own order holds 6, as fast as its own order."""
    _, compute = _lowered("bitpipe", 2)
    shipped = compile_target("bitpipe", {"P": 2, "N": N}).program
    result = search_order(compute, memory=[4, 4], time_limit=120, workers=2)
    assert result.status == OPTIMAL and result.makespan == simulate(shipped).makespan
    assert max(peak_activations(shipped)) > 4
    return order_to_pipe(compute, result.order)


def _heuristic() -> str:
    spec, compute = _lowered("zb_h1", 2, LATENCY)
    return order_to_pipe(compute, heuristic_search(compute, LATENCY, _one_f_one_b(2, 2), spec=spec,
                                                   evaluations=500).order)


def _weight_grid() -> str:
    """TawPipe on 2 groups of 1 rank: the walk's grid (60 candidates) beats the shipped one."""
    spec, _ = _lowered("tawpipe", 2, LATENCY, G=2)
    _, program = lower_spec(spec, LATENCY)
    (family,) = families_of(program)
    result = family.search(spec, program, LATENCY, None, time_limit=60.0, candidates=60)
    assert result.makespan < result.shipped
    return result.text


def _exact_zb_h1_under_latency() -> str:
    _, compute = _lowered("zb_h1", 4, LATENCY)
    return order_to_pipe(compute, search_order(compute, LATENCY, _one_f_one_b(4, 2), time_limit=120,
                                               workers=2).order)


# name -> (world size, the searched file's text)
CASES = {
    "exact_1f1b": (2, _exact_1f1b),
    "recomputed_1f1b": (2, _recomputed_1f1b),
    "two_pipelines_bitpipe": (2, _two_pipelines),
    "heuristic_zb_h1": (2, _heuristic),
    "weight_grid_tawpipe": (2, _weight_grid),
    "exact_zb_h1_p4_latency": (4, _exact_zb_h1_under_latency),
}


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """name -> the parameters its searched file ended with after ``STEPS`` steps on gloo."""
    folder = tmp_path_factory.mktemp("searched")
    jobs: dict[int, list[list[str]]] = {}
    for name, (world, write) in CASES.items():
        path = folder / f"{name}.pipe"
        path.write_text(write())
        jobs.setdefault(world, []).append([str(path), "--steps", str(STEPS), "--seed", str(SEED), "--save",
                                           str(folder / f"{name}.pt"), "--timeout", "60"])
    for world, batch in sorted(jobs.items()):
        run = launch_batch(batch, world, 240.0)
        assert run.ok, run.describe()
    return {name: torch.load(folder / f"{name}.pt") for name in CASES}


@pytest.mark.parametrize("name", list(CASES))
def test_a_searched_order_trains_like_one_process(trained, name):
    want = reference_run(ModelConfig(), STEPS, N, SEED).state_dict
    assert_same_parameters(trained[name], want, f"searched {name} (P={CASES[name][0]})")
