"""Chimera (schedules/chimera.pipe): its basic unit at N = P, the direct concatenation of units at
N = kP, forward doubling (-D double=true) and the order of Chimera's own generator (-D reference=true), against the figures its comment states (unit costs
F = 1, B = 2, communication free) and against 1F1B under per-chunk costs F = 2, B = 4."""
from __future__ import annotations

from fractions import Fraction
from pathlib import Path

import pytest
import torch

from pipec.compiler.checks import peak_activations
from pipec.compiler.costs import costs_from_json
from pipec.compiler.driver import compile_target
from pipec.compiler.simulate import simulate
from pipec.errors import PipecError
from pipec.runtime.model import ModelConfig
from pipec.runtime.reference import reference_run
from runtime_util import assert_same_parameters, launch_batch

ROOT = Path(__file__).parent.parent

EVEN_P = (2, 4, 6, 8, 10, 12)


def run(name: str, costs=None, **params):
    compiled = compile_target(name, params, costs=costs)  # every check runs here
    return compiled, simulate(compiled.program, costs)


@pytest.mark.parametrize("P", EVEN_P)
def test_the_basic_unit_has_the_papers_bubble(P):
    compiled, result = run("chimera", P=P, N=P)
    N = P
    assert result.bubble_fraction() == Fraction(P - 2, 1) / (Fraction(3 * N, 2) + P - 2)
    assert result.makespan == 3 * N + 2 * (P - 2)
    # rank r holds P/2 + 1 + min(r, P-1-r) chunk activations: from (P+2)/2 at the ends to P in the middle
    peaks = [P // 2 + 1 + min(r, P - 1 - r) for r in range(P)]
    assert [r.peak_activations for r in result.ranks] == peaks == peak_activations(compiled.program)


@pytest.mark.parametrize("P,bubble", [(4, Fraction(1, 4)), (8, Fraction(1, 3))])
def test_the_basic_unit_bubble_at_4_and_8_ranks(P, bubble):
    assert run("chimera", P=P, N=P)[1].bubble_fraction() == bubble


@pytest.mark.parametrize("P", EVEN_P)
@pytest.mark.parametrize("k", (2, 3, 4))
def test_concatenated_units_join_seamlessly(P, k):
    """N = kP: the unit's 2(P-2) idle per rank and nothing more (each send leaves as its data is made)."""
    N = k * P
    compiled, result = run("chimera", P=P, N=N)
    idle = 2 * (P - 2)
    assert result.makespan == 3 * N + idle
    assert result.bubble_fraction() == Fraction(idle, 3 * N + idle)
    assert all(r.busy == 3 * N for r in result.ranks)
    assert [r.peak_activations for r in result.ranks] == [P] * P == peak_activations(compiled.program)
    # and below 1F1B's bubble (P-1)/(N+P-1), whose idle is 3(P-1) per rank
    assert result.bubble_fraction() < run("1f1b", P=P, N=N)[1].bubble_fraction()


# makespans under {"compute": {"F": 2, "B": 4}}: (P, N) -> (chimera, 1f1b)
SCALED = {(4, 4): (32, 42), (4, 8): (56, 66), (4, 16): (104, 114),
          (8, 8): (72, 90), (8, 16): (120, 138), (8, 32): (216, 234)}


@pytest.mark.parametrize("P,N", sorted(SCALED))
def test_no_slower_than_1f1b_under_per_chunk_costs(P, N):
    costs = costs_from_json({"compute": {"F": 2, "B": 4}})
    chimera, one = run("chimera", costs, P=P, N=N)[1], run("1f1b", costs, P=P, N=N)[1]
    assert (chimera.makespan, one.makespan) == SCALED[P, N]
    # both twice their unit-cost makespans: 3N + idle against 3(N + P - 1)
    idle = 2 * (P - 2)
    assert chimera.makespan == 2 * (3 * N + idle) and one.makespan == 6 * (N + P - 1)


def test_each_pipeline_keeps_1f1b_order_and_the_ranks_merge_them():
    """On stage s of either pipeline the forward of j + P-1-s comes right before the backward of j
    (within that pipeline's own tasks on the rank): 1F1B's order, over all N / 2 of its microbatches."""
    P, N = 4, 12
    compiled, _ = run("chimera", P=P, N=N)
    program = compiled.program
    for r, row in enumerate(compiled.compute.ranks):
        for pipeline in (0, 1):
            mine = [(a.op, a.mb) for a in row if (a.stage >= P) == pipeline]
            s = r if pipeline == 0 else P - 1 - r
            mbs = [m for m in range(N) if (m % P >= P // 2) == pipeline]
            warm = min(P - 1 - s, len(mbs))
            expected = [("F", m) for m in mbs[:warm]]
            for i, m in enumerate(mbs):
                if warm + i < len(mbs):
                    expected.append(("F", mbs[warm + i]))
                expected.append(("B", m))
            assert mine == expected, (r, pipeline)
        assert {program.stages[a.stage].rank for a in row} == {r}


def test_the_requires_name_the_constraint():
    with pytest.raises(PipecError, match="even number of ranks"):
        compile_target("chimera", {"P": 3, "N": 3})
    with pytest.raises(PipecError, match="multiple of P"):
        compile_target("chimera", {"P": 4, "N": 6})


def test_the_documented_keys_are_the_schedules():
    doc, pipe = (ROOT / "docs" / "language.md").read_text(), (ROOT / "schedules" / "chimera.pipe").read_text()
    for line in ("key F(s, m) = s + 2 * t(m)", "key B(s, m) = 2 * P - 2 - s + 2 * t(m)",
                 "def j(m) = m / P * (P / 2) + m % (P / 2)",
                 "def t(m) = double ? j(m) / 2 : j(m) + (reference ? m / P * (P / 2) : 0)"):
        assert line in doc and line in pipe


@pytest.mark.parametrize("P", EVEN_P)
@pytest.mark.parametrize("k", (1, 2, 4))
def test_forward_doubling_removes_the_intermediate_bubble_for_twice_the_activations(P, k):
    N = 2 * k * P
    compiled, result = run("chimera", P=P, N=N, double=True)
    idle = Fraction(3 * (P - 2), 2)
    assert result.makespan == 3 * N + idle
    assert result.bubble_fraction() == Fraction(P - 2, 2 * N + P - 2)
    assert result.bubble_fraction() <= Fraction(P - 2, 1) / (Fraction(3 * N, 2) + P - 2)  # the paper's ratio
    peaks = [P + 2 + 2 * min(r, P - 1 - r) for r in range(P)] if k == 1 else [2 * P] * P
    assert [r.peak_activations for r in result.ranks] == peaks == peak_activations(compiled.program)
    # a stage runs the forwards of a pair (microbatches 2i and 2i+1 of its pipeline) back to back, then their backwards
    def pair(m):
        return (m // P * (P // 2) + m % (P // 2)) // 2

    for row in compiled.compute.ranks:
        for a, b in zip(row[::2], row[1::2]):
            assert (a.op, a.stage, pair(a.mb)) == (b.op, b.stage, pair(b.mb)) and a.mb < b.mb


def test_forward_doubling_needs_pairs_of_units():
    with pytest.raises(PipecError, match="multiple of 2P"):
        compile_target("chimera", {"P": 4, "N": 4, "double": True})


DOUBLED_SCALED = {(4, 8): (54, 66), (4, 16): (102, 114), (8, 16): (114, 138), (8, 32): (210, 234)}


@pytest.mark.parametrize("P,N", sorted(DOUBLED_SCALED))
def test_forward_doubling_under_per_chunk_costs(P, N):
    costs = costs_from_json({"compute": {"F": 2, "B": 4}})
    chimera = run("chimera", costs, P=P, N=N, double=True)[1]
    assert (chimera.makespan, run("1f1b", costs, P=P, N=N)[1].makespan) == DOUBLED_SCALED[P, N]


# The options' exact runs (the default order is held to one process by tests/test_runtime_exact.py): P = 4,
# N = 8, 2 steps, both in one set of gloo processes.
TRAINED_P, TRAINED_N, TRAINED_STEPS, TRAINED_SEED = 4, 8, 2, 7
TRAINED_OPTIONS = ("double", "reference")


@pytest.fixture(scope="module")
def trained_options(tmp_path_factory):
    """Option -> the state dict ``pipec``'s workers saved training chimera with ``-D OPTION=true``."""
    folder = tmp_path_factory.mktemp("chimera_options")
    jobs = [["chimera", "-D", f"P={TRAINED_P}", "-D", f"N={TRAINED_N}", "-D", f"{option}=true", "--steps",
             str(TRAINED_STEPS), "--seed", str(TRAINED_SEED), "--save", str(folder / f"{option}.pt"), "--timeout", "60"]
            for option in TRAINED_OPTIONS]
    run = launch_batch(jobs, TRAINED_P, 240.0)
    assert run.ok, run.describe()
    return {option: torch.load(folder / f"{option}.pt") for option in TRAINED_OPTIONS}


def _one_process() -> dict:
    return reference_run(ModelConfig(), TRAINED_STEPS, TRAINED_N, TRAINED_SEED).state_dict


def test_forward_doubling_trains_like_one_process(trained_options):
    assert_same_parameters(trained_options["double"], _one_process(), "chimera double")


# Rank 0's order at P = 4, N = 8 as Chimera's generator (chimera_pipeline_rank.py of the SC'21
# repository, AutoGeneratePipelineRank) emits it, written down from its output: the down pipeline's
# stage 0 is pipec's stage 0, the up pipeline's stage 3 is pipec's stage 7.
GENERATOR_RANK0_4_8 = "0F0 0F1 7F2 7B2 7F3 7B3 0B0 0F4 0B1 0F5 7F6 7B6 7F7 7B7 0B4 0B5".split()


@pytest.mark.parametrize("P,N,makespan,default_makespan", [(4, 8, 30, 28), (8, 16, 66, 60)])
def test_the_reference_order_is_longer_and_holds_fewer_activations(P, N, makespan, default_makespan):
    compiled, result = run("chimera", P=P, N=N, reference=True)
    assert result.makespan == makespan and run("chimera", P=P, N=N)[1].makespan == default_makespan
    # the basic unit's peaks ([3, 4, 4, 3] at P = 4), where the default order holds P on every rank
    peaks = [P // 2 + 1 + min(r, P - 1 - r) for r in range(P)]
    assert [r.peak_activations for r in result.ranks] == peaks == peak_activations(compiled.program)
    assert [r.peak_activations for r in run("chimera", P=P, N=N)[1].ranks] == [P] * P


def test_the_reference_order_is_the_generators():
    reference = [str(a) for a in compile_target("chimera", {"P": 4, "N": 8, "reference": True}).compute.ranks[0]]
    default = [str(a) for a in compile_target("chimera", {"P": 4, "N": 8}).compute.ranks[0]]
    assert reference == GENERATOR_RANK0_4_8
    assert default != reference and "0F4" in default[:default.index("0B0")]  # the default starts the next unit earlier


@pytest.mark.parametrize("P", EVEN_P)
@pytest.mark.parametrize("k", (1, 2, 3, 4))
def test_the_reference_order_starts_each_unit_as_the_previous_one_drains(P, k):
    """Measured: every join of two units costs P - 2 slots of makespan (the default's joins
    nothing), and no rank holds more than in the basic unit."""
    N = k * P
    compiled, result = run("chimera", P=P, N=N, reference=True)
    assert result.makespan == 3 * N + (k + 1) * (P - 2)
    assert all(r.busy == 3 * N for r in result.ranks)
    assert [r.peak_activations for r in result.ranks] == [P // 2 + 1 + min(r, P - 1 - r) for r in range(P)]
    row = [str(a) for a in compiled.compute.ranks[0]]
    for u in range(1, k):  # on rank 0 the backward of a unit's first microbatch, then the next unit's first forward
        assert row[row.index(f"0B{(u - 1) * P}") + 1] == f"0F{u * P}"
    if k == 1:
        assert [[str(a) for a in r] for r in compiled.compute.ranks] == \
            [[str(a) for a in r] for r in compile_target("chimera", {"P": P, "N": N}).compute.ranks]


def test_the_reference_order_has_no_forward_doubling():
    with pytest.raises(PipecError, match="no forward doubling"):
        compile_target("chimera", {"P": 4, "N": 8, "double": True, "reference": True})


def test_the_reference_order_trains_like_one_process(trained_options):
    assert_same_parameters(trained_options["reference"], _one_process(), "chimera reference")
