"""The shipped schedules against the facts of DESIGN.md section 8 (unit costs, no
communication cost), through the whole compiler: order, communication, every
check, liveness, simulation."""
from __future__ import annotations

from fractions import Fraction

import pytest

from pipec.compiler.checks import peak_activations
from pipec.compiler.driver import compile_target, resolve_target, shipped_schedules
from pipec.compiler.ir import COMM_OPS, BATCH
from pipec.compiler.ops import EXCHANGE
from pipec.compiler.simulate import simulate


def run(name: str, **params):
    compiled = compile_target(name, params)
    return compiled, simulate(compiled.program)


def compute_rows(program) -> list[list[str]]:
    return [[a.text() for a in row if a.is_compute] for row in program.ranks]


@pytest.mark.parametrize("P,N", [(2, 2), (2, 5), (3, 7), (4, 4), (4, 8), (8, 16)])
def test_1f1b_bubble_and_memory(P, N):
    compiled, result = run("1f1b", P=P, N=N)
    assert result.bubble_fraction() == Fraction(P - 1, N + P - 1)
    assert [r.peak_activations for r in result.ranks] == [P - r for r in range(P)]
    assert peak_activations(compiled.program) == [P - r for r in range(P)]


@pytest.mark.parametrize("P,N", [(2, 3), (4, 8), (8, 8)])
def test_gpipe_makespan_equals_1f1b(P, N):
    _, gpipe = run("gpipe", P=P, N=N)
    _, one = run("1f1b", P=P, N=N)
    assert gpipe.makespan == one.makespan
    assert [r.peak_activations for r in gpipe.ranks] == [N] * P


@pytest.mark.parametrize("P,N,v", [(2, 4, 2), (4, 8, 2), (4, 8, 3), (4, 4, 4), (8, 16, 2)])
def test_interleaved_bubble(P, N, v):
    _, result = run("interleaved_1f1b", P=P, N=N, v=v)
    assert result.bubble_fraction() == Fraction(P - 1, v * N + P - 1)


@pytest.mark.parametrize("P,N,v", [(4, 8, 2), (2, 6, 3)])
def test_interleaved_follows_megatron_order(P, N, v):
    compiled, _ = run("interleaved_1f1b", P=P, N=N, v=v)
    for r, row in enumerate(compiled.compute.ranks):
        forwards = [(a.stage // P, a.mb) for a in row if a.op == "F"]
        expected = [((k // P) % v, k // (P * v) * P + k % P) for k in range(v * N)]
        assert forwards == expected
        backwards = [(a.stage // P, a.mb) for a in row if a.op == "B"]
        assert backwards == [(v - 1 - c, m) for c, m in expected]
        first_backward = next(i for i, a in enumerate(row) if a.op == "B")
        assert first_backward == min((P - r - 1) * 2 + (v - 1) * P, v * N) + 1


@pytest.mark.parametrize("P,N", [(2, 5), (4, 4), (4, 8), (8, 8), (8, 16)])
def test_zb_h1_bubble_and_memory(P, N):
    compiled, result = run("zb_h1", P=P, N=N)
    assert result.bubble_fraction() == Fraction(P - 1, 3 * N + P - 1)
    assert [r.peak_activations for r in result.ranks] == [P - r for r in range(P)]
    # W is delayed, not hoarded: rank r owes at most r + 1 weight gradients at once.
    for r, row in enumerate(compiled.compute.ranks):
        owed = peak = 0
        for action in row:
            owed += {"I": 1, "W": -1}.get(action.op, 0)
            peak = max(peak, owed)
        assert peak == min(r + 1, N)


@pytest.mark.parametrize("P,N", [(4, 8), (8, 16)])
def test_zbv_is_near_zero_bubble(P, N):
    compiled, result = run("zbv", P=P, N=N)
    _, one = run("1f1b", P=P, N=N)
    assert result.bubble_ratio < 0.07
    assert result.bubble_ratio < one.bubble_ratio / 3
    # V shape: rank 0 holds the first and the last stage; the turn at the bottom is local.
    assert compiled.program.stages[0].rank == compiled.program.stages[2 * P - 1].rank == 0


# torch's ScheduleZBVZeroBubble under unit costs (pipec import-torch of its CSV): (P, N) -> makespan
TORCH_ZBV_MAKESPAN = {(2, 4): 25, (2, 8): 49, (3, 6): 38, (4, 8): 51, (4, 16): 99, (6, 12): 77, (8, 16): 103,
                      (4, 4): 30, (8, 8): 62}


@pytest.mark.parametrize("P,N", sorted(TORCH_ZBV_MAKESPAN))
def test_zbv_matches_torchs_makespan_and_bounds_waiting_weight_gradients(P, N):
    compiled, result = run("zbv", P=P, N=N)
    if N >= 2 * P:
        assert result.makespan == TORCH_ZBV_MAKESPAN[P, N]
        for r, row in enumerate(compiled.compute.ranks):  # at most r + 1 W wait on rank r
            waiting = most = 0
            for action in row:
                waiting += {"I": 1, "W": -1}.get(action.op, 0)
                most = max(most, waiting)
            assert most <= r + 1
            assert result.ranks[r].peak_waiting_w == most  # what simulate reports
    else:  # no limit with fewer microbatches: shorter than torch's
        assert result.makespan < TORCH_ZBV_MAKESPAN[P, N]


def test_chimera_two_pipelines_with_replicas_all_reduced():
    compiled, result = run("chimera", P=4, N=4)
    program = compiled.program
    assert len(program.pipelines) == 2
    assert [program.stages[s].rank for s in program.pipelines[1]] == [3, 2, 1, 0]
    for row in program.ranks:
        assert sum(1 for a in row if a.op == "ALLREDUCE_GRAD") == 2  # one per chunk replica held
    _, one = run("1f1b", P=4, N=4)
    assert result.bubble_ratio < one.bubble_ratio


BITPIPE_REFERENCE_D4 = """
F0.0 F1.0 F2.3 F2.4 F3.3 F3.4 F0.7 B0.7 F1.7 B1.7 B2.4 B2.3 B3.4 B3.3 B0.0 B1.0
F0.1 F2.2 F1.1 F3.2 F2.5 F0.6 F3.5 F1.6 B0.6 B2.5 B1.6 B3.5 B2.2 B0.1 B3.2 B1.1
F2.1 F0.2 F3.1 F1.2 F0.5 F2.6 F1.5 F3.6 B2.6 B0.5 B3.6 B1.5 B0.2 B2.1 B1.2 B3.1
F2.0 F3.0 F0.3 F0.4 F1.3 F1.4 F2.7 B2.7 F3.7 B3.7 B0.4 B0.3 B1.4 B1.3 B2.0 B3.0
"""


@pytest.mark.parametrize("P,N,bubble", [(4, 4, Fraction(1, 7)), (8, 8, Fraction(1, 5))])
def test_bitpipe_bubble(P, N, bubble):
    _, result = run("bitpipe", P=P, N=N)
    assert result.bubble_fraction() == bubble == Fraction(P - 2, 3 * N + P - 2)


def test_bitpipe_reproduces_the_reference_order():
    compiled, result = run("bitpipe", P=4, N=4)
    S = 8
    ours = [" ".join(f"{a.op}{a.mb}.{a.stage % S}" for a in row) for row in compiled.compute.ranks]
    assert ours == BITPIPE_REFERENCE_D4.strip().splitlines()
    assert result.makespan == 28


def test_bitpipe_placement_layers_and_device_map():
    compiled, _ = run("bitpipe", P=4, N=4)
    program = compiled.program
    L, D = 16, 4
    per_chunk = L // (2 * D)
    held = sorted(
        (program.stages[s].pipeline, program.stages[s].position) for s in range(len(program.stages)) if program.stages[s].rank == 0
    )
    layers = {tuple(range(pos * per_chunk, (pos + 1) * per_chunk)) for _, pos in held}
    assert layers == {(0, 1), (6, 7), (14, 15), (8, 9)}
    eight, _ = run("bitpipe", P=8, N=8)
    assert eight.program.devices == [0, 7, 2, 5, 4, 3, 6, 1]
    # Mirrored replicas (chunk j on pipeline ranks j and D-1-j) sit on adjacent devices.
    for j in range(8):
        assert abs(eight.program.devices[j] - eight.program.devices[7 - j]) == 1


def test_bitpipe_bottom_of_v_is_local():
    compiled, _ = run("bitpipe", P=4, N=4)
    program = compiled.program
    for row in program.ranks:
        for action in row:
            for part in action.comms():
                assert not (part.op == "SEND_F" and program.stages[part.stage].position == 3), "the V's turn is a local copy"


@pytest.mark.parametrize("name", sorted(shipped_schedules()))
@pytest.mark.parametrize("P,N", [(2, 4), (4, 8)])
def test_every_shipped_schedule_compiles_checks_and_simulates(name, P, N):
    declared = {param.name for param, _, _ in resolve_target(name).params}
    compiled, result = run(name, **{key: value for key, value in (("P", P), ("N", N)) if key in declared})
    program = compiled.program
    # a composition's pipeline runs on P ranks, each stage on a group spanning its data axes (2 ranks each by
    # default: D, or HSDP's R x S)
    assert program.num_ranks == (P * 2 ** (len(program.mesh.axes) - 1) if program.mesh is not None else P)
    assert 0 <= result.bubble_ratio < 1
    # activation passing sends messages; weight passing moves weights in exchanges
    has_comms = any(a.op in COMM_OPS or a.op in (BATCH, EXCHANGE) for row in program.ranks for a in row)
    assert has_comms


ZB_GREEDY = """
schedule zb_greedy(P: ranks = 4, N: microbatches = 2 * P) {
  stages P
  place stage s on rank s
  backward split
  order greedy {
    inflight on rank r <= P - r
    deferred on rank r <= r + 1
    prefer I, F, W
  }
}
"""


@pytest.mark.parametrize("P,N", [(2, 5), (4, 4), (4, 8), (8, 16)])
def test_a_greedy_zero_bubble_policy_meets_zb_h1_with_bounded_weight_gradients(tmp_path, P, N):
    # docs/language.md's policy: no Python written for it, ZB-H1's bubble and memory, W bounded like zb_h1's
    path = tmp_path / "zb_greedy.pipe"
    path.write_text(ZB_GREEDY)
    compiled = compile_target(str(path), {"P": str(P), "N": str(N)})
    result = simulate(compiled.program)
    assert result.bubble_fraction() == Fraction(P - 1, 3 * N + P - 1)
    assert [r.peak_activations for r in result.ranks] == [P - r for r in range(P)]
    assert [r.peak_waiting_w for r in result.ranks] == [min(r + 1, N) for r in range(P)]
