"""BitPipe beyond N = P (paper section 1.5), unit costs, communication free.

The paper bounds the early-forward schedule's activations by (3D-3)/2 M_a, M_a
one microbatch's activations of a device's share (L/D layers); a BitPipe chunk
is half a share, so the bound is 3P - 3 chunk activations per rank. The
`-D bounded=true` order meets it; the default is the early-forward rhythm,
bubble (P-2)/(4N+P-2), which holds 3P to 4P. Both are held to exact figures, so
a change to either order shows here.
"""
from __future__ import annotations

from fractions import Fraction

import pytest
import torch

from pipec.compiler.checks import peak_activations
from pipec.compiler.driver import compile_target
from pipec.compiler.simulate import simulate
from pipec.runtime.model import ModelConfig
from pipec.runtime.reference import reference_run
from runtime_util import assert_same_parameters, launch_workers


def run(P: int, N: int, **params):
    compiled = compile_target("bitpipe", {"P": P, "N": N, **params})
    return compiled, simulate(compiled.program)


def rows(compiled) -> list[list[str]]:
    return [[a.text() for a in row] for row in compiled.compute.ranks]


# (P, N): makespan and bubble of the bounded order, and its peak activations per rank.
BOUNDED = {
    (4, 8): (52, Fraction(1, 13), [9, 9, 9, 9]),
    (4, 16): (100, Fraction(1, 25), [9, 9, 9, 9]),
    (8, 16): (108, Fraction(1, 9), [19] * 8),
    (8, 32): (206, Fraction(7, 103), [19] * 8),
}


@pytest.mark.parametrize("P,N", sorted(BOUNDED))
def test_bounded_meets_the_papers_activation_bound(P, N):
    compiled, result = run(P, N, bounded="true")
    makespan, bubble, peaks = BOUNDED[P, N]
    assert [r.peak_activations for r in result.ranks] == peaks
    assert peak_activations(compiled.program) == peaks  # what `pipec check` reports
    assert max(peaks) <= 3 * P - 3
    assert result.makespan == makespan
    assert result.bubble_fraction() == bubble
    assert bubble > Fraction(P - 2, 4 * N + P - 2)  # the price of the bound: early forward's bubble is lost


@pytest.mark.parametrize("P,N", sorted(BOUNDED))
def test_unbounded_keeps_the_early_forward_bubble_and_its_memory(P, N):
    compiled, result = run(P, N)  # the default
    assert result.bubble_fraction() == Fraction(P - 2, 4 * N + P - 2)
    peak = 3 * P if N == 2 * P else 4 * P
    assert peak_activations(compiled.program) == [peak] * P
    assert peak > 3 * P - 3  # early forward breaks the bound: the trade-off


@pytest.mark.parametrize("P", [4, 8])
def test_one_group_is_the_same_order_either_way(P):
    bounded, result = run(P, P, bounded="true")
    unbounded, _ = run(P, P)
    assert rows(bounded) == rows(unbounded)
    assert result.bubble_fraction() == Fraction(P - 2, 3 * P + P - 2)
    assert max(peak_activations(bounded.program)) == 2 * P


@pytest.mark.parametrize("P", [4, 8])
def test_bounded_peak_does_not_grow_with_microbatches(P):
    # the groups are evenly spaced: 8P microbatches hold what 2P do
    compiled, _ = run(P, 8 * P, bounded="true")
    assert peak_activations(compiled.program) == BOUNDED[P, 2 * P][2]


def test_bounded_order_trains_like_one_process(tmp_path):
    # test_runtime_exact runs P = 4 at N = P, where the order did not change: this runs a bounded N = 2P
    save, steps, seed = tmp_path / "model.pt", 3, 7
    run = launch_workers(["bitpipe", "-D", "P=4", "-D", "N=8", "-D", "bounded=true", "--steps", str(steps), "--seed", str(seed),
                          "--save", str(save), "--timeout", "60"], 4, 180.0)
    assert run.ok, run.describe()
    want = reference_run(ModelConfig(), steps, 8, seed).state_dict
    assert_same_parameters(torch.load(save), want, "bitpipe P=4 N=8 bounded")
    initial = reference_run(ModelConfig(), 0, 1, seed).state_dict
    assert any((want[k] - initial[k]).abs().max() > 1e-3 for k in initial)  # it trained: not a vacuous match
