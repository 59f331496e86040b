"""Weight passing (WeiPipe, TawPipe, FSDP): lowering, the checks that prove it, and the facts it is held to.

The facts: WeiPipe's bubble under unit costs, (P-1)/(AP+P-1) for A >= 2
microbatches per rank; TawPipe's owner map, a bijection, and its rule that the
G groups of a step run layers owned by G distinct groups; TawPipe holding half
of WeiPipe's borrowed weight buffers. The hazards of the public code (an add
racing a reduce, a buffer dropped while its send is in flight, collectives of
two communicators met in different orders, a wait on nothing) are planted in
compiled programs and must each be named.
"""
from __future__ import annotations

import json
from pathlib import Path
from dataclasses import replace
from fractions import Fraction

import pytest

from pipec.compiler import ops
from pipec.compiler.checks import check_all, check_weights
from pipec.compiler.driver import compile_spec, compile_target, lower_spec, resolve_target
from pipec.compiler.emit.json_program import program_from_json, program_to_json
from pipec.compiler.ir import Action, Program
from pipec.compiler.memory_counts import peak_weight_buffers
from pipec.compiler.simulate import simulate
from pipec.errors import DeadlockError, MatchError, RouteError, ScheduleError


def program_of(target: str, **defines) -> Program:
    return compile_target(target, defines).program


def with_row(program: Program, rank: int, row: list[Action]) -> Program:
    ranks = list(program.ranks)
    ranks[rank] = row
    return replace(program, ranks=ranks)


def parts_of(action: Action) -> list[str]:
    return [part.op for part in action.parts]


# ------------------------------------------------------------------ WeiPipe


@pytest.mark.parametrize("P, A", [(2, 2), (3, 2), (4, 2), (4, 3), (5, 2), (8, 4), (6, 3)])
def test_weipipe_bubble_is_the_papers_formula_under_unit_costs(P, A):
    result = simulate(program_of("weipipe", P=P, N=A * P))
    assert result.bubble_fraction() == Fraction(P - 1, A * P + P - 1)
    assert result.makespan == 3 * (A * P + P - 1)


def test_weipipe_default_is_three_elevenths_and_p8_a4_is_seven_thirty_ninths():
    assert simulate(program_of("weipipe")).bubble_fraction() == Fraction(3, 11)
    assert simulate(program_of("weipipe", P=8, N=32)).bubble_fraction() == Fraction(7, 39)


@pytest.mark.parametrize("prefetch", [0, 1])
def test_weipipe_rings_move_every_slot_one_rank_a_step(prefetch):
    """Both rings flow r -> r + 1 (the backward one behind the forward one), one ring step per
    step on every rank; each rank holds at most two copies per slot (the one it runs, the one
    arriving)."""
    spec = resolve_target("weipipe").evaluate({"P": 4, "N": 8})
    spec.weights = replace(spec.weights, prefetch=prefetch)
    program = compile_spec(spec).program
    report = check_weights(program)
    assert report.peak_buffers == [4, 4, 4, 4]
    shifts = [[part.mb for action in row if action.op == ops.EXCHANGE for part in action.parts
               if part.op == ops.SHIFT_F] for row in program.ranks]
    assert all(steps == shifts[0] for steps in shifts)  # a ring step meets every rank
    assert simulate(program).bubble_fraction() == Fraction(3, 11)


# ------------------------------------------------------------------ TawPipe


@pytest.mark.parametrize("P, G", [(4, 2), (4, 4), (6, 3), (8, 2), (24, 3)])
def test_tawpipe_owner_map_is_the_papers_bijection_and_in_the_json(P, G):
    S = P // G
    program = program_of("tawpipe", P=P, G=G)
    owners = program_to_json(program)["owners"]
    assert owners == [(l % G) * S + l // G for l in range(P)]
    assert sorted(owners) == list(range(P))
    assert program.weights.groups == tuple(r // S for r in range(P))


@pytest.mark.parametrize("A", [1, 2, 3])
def test_tawpipe_groups_of_a_step_run_layers_of_distinct_owner_groups(A):
    P, G = 24, 3
    spec = resolve_target("tawpipe").evaluate({"P": P, "G": G, "N": A * P})
    S = P // G
    owner_group = [((l % G) * S + l // G) // S for l in range(P)]
    by_step: dict[int, dict[int, set[int]]] = {}
    for rank, (tasks, steps) in enumerate(zip(spec.order, spec.task_steps)):
        for (kind, stage, mb), step in zip(tasks, steps):
            by_step.setdefault(step, {}).setdefault(rank // S, set()).add(stage % P)
    for step, groups in by_step.items():
        assert all(len(layers) == 1 for layers in groups.values()), step  # a group runs one layer a step
        owners = [owner_group[next(iter(layers))] for layers in groups.values()]
        assert len(set(owners)) == len(owners), (step, groups)


def test_tawpipe_holds_half_of_weipipes_borrowed_buffers():
    weipipe = peak_weight_buffers(program_of("weipipe", P=4, N=4))
    tawpipe = peak_weight_buffers(program_of("tawpipe", P=4, G=2))
    assert max(weipipe) == 4 and max(tawpipe) == 2


def test_tawpipe_weights_go_owner_to_staging_rank_then_a_broadcast_in_the_group():
    program = program_of("tawpipe", P=4, G=2)
    # layer 1 is owned by rank 2 (group 1); group 0 (ranks 0, 1) gets it through rank 0, the rank
    # with rank 2's index inside its group: SEND_W 2 -> 0 one exchange before the broadcast from 0
    sends = [(rank, part) for rank, row in enumerate(program.ranks) for action in row if action.op == ops.EXCHANGE
             for part in action.parts if part.op == ops.SEND_W and program.stages[part.stage].position == 1]
    assert {(rank, part.peer) for rank, part in sends} == {(2, 0)}
    broadcasts = {part.peer for action in program.ranks[1] if action.op == ops.EXCHANGE for part in action.parts
                  if part.op == ops.BCAST_W and program.stages[part.stage].position == 1}
    assert broadcasts == {0}


# ------------------------------------------------------------------ FSDP


def test_fsdp_gathers_one_step_ahead_and_reduce_scatters_after_the_backward():
    program = program_of("fsdp", P=4)
    row = program.ranks[0]
    first_gather = next(i for i, a in enumerate(row) if a.op == ops.EXCHANGE and ops.ALLGATHER_W in parts_of(a))
    first_forward = next(i for i, a in enumerate(row) if a.op == ops.F)
    assert first_gather < first_forward
    # the gather of layer 1 is posted before layer 0 runs: it overlaps it
    gather_1 = next(i for i, a in enumerate(row) if a.op == ops.EXCHANGE and any(
        p.op == ops.ALLGATHER_W and program.stages[p.stage].position == 1 for p in a.parts))
    assert gather_1 < first_forward
    scatters = [p for a in row if a.op == ops.EXCHANGE for p in a.parts if p.op == ops.REDUCESCATTER_G]
    assert sorted(program.stages[p.stage].position for p in scatters) == [0, 1, 2, 3]
    assert program_to_json(program)["owners"] is None
    assert simulate(program).bubble_ratio == 0


# ------------------------------------------------------------------ programs round-trip and re-check


@pytest.mark.parametrize("target", ["weipipe", "tawpipe", "fsdp"])
def test_weight_programs_round_trip_through_json_and_check_again(target):
    program = program_of(target)
    again = program_from_json(json.loads(json.dumps(program_to_json(program))))
    assert again == program
    check_all(again)


def test_simulate_json_reports_traffic_and_borrowed_buffers():
    result = simulate(program_of("tawpipe", P=4, G=2), sizes={"weight": 10})
    data = result.to_json()
    assert [rank["peak_weight_buffers"] for rank in data["ranks"]] == [2, 1, 1, 2]
    # groups are the nodes: a layer from the other group crosses once, then is broadcast inside
    assert data["traffic"]["weight"] == {"intra": 160, "inter": 80}
    assert data["traffic"]["wgrad_partial"] == {"intra": 80, "inter": 40}


# ------------------------------------------------------------------ planted hazards


def test_an_add_racing_the_reduce_of_its_partial_is_named():
    """TawPipe's public code adds gradients right after an asynchronous reduce, with no wait."""
    program = program_of("tawpipe", P=4, G=2)
    row = list(program.ranks[0])
    reduce_at = next(i for i, a in enumerate(row) if a.op == ops.EXCHANGE and ops.REDUCE_G in parts_of(a))
    layer = program.stages[next(p for p in row[reduce_at].parts if p.op == ops.REDUCE_G).stage].position
    backward = max(i for i in range(reduce_at) if row[i].op == ops.B and program.stages[row[i].stage].position == layer)
    row.insert(backward, row.pop(reduce_at))  # the reduce posted before the add it should carry
    with pytest.raises(RouteError, match=r"adds layer \d+'s weight gradient while exchange \d+ is sending or reducing"):
        check_weights(with_row(program, 0, row))


def test_a_copy_dropped_while_its_send_is_in_flight_is_named():
    """A staging rank's copy freed before the broadcast that sends it completed."""
    program = program_of("tawpipe", P=4, G=2)
    rank = 0
    row = list(program.ranks[rank])
    cast = next(i for i, a in enumerate(row) if a.op == ops.EXCHANGE
                and any(p.op == ops.BCAST_W and p.peer == rank and not program.weights.owners[
                    program.stages[p.stage].position] == rank for p in a.parts))
    part = next(p for p in row[cast].parts if p.op == ops.BCAST_W)
    free = next(i for i, a in enumerate(row) if a.op == ops.FREE_W and a.stage == part.stage and a.mb == part.mb)
    row.insert(cast + 1, row.pop(free))
    with pytest.raises(RouteError, match="while a send of it is in flight"):
        check_weights(with_row(program, rank, row))


def test_more_borrowed_buffers_than_the_bound_is_named():
    spec = resolve_target("weipipe").evaluate({})
    spec.weights = replace(spec.weights, buffers=3)
    with pytest.raises(RouteError, match=r"4 borrowed weight buffers are alive here, more than the program's bound "
                                         r"of 3"):
        compile_spec(spec)


def _weipipe_variant(tmp_path, *changes: tuple[str, str]) -> str:
    """The shipped weipipe.pipe with some declarations replaced (its order written once, in schedules/)."""
    source = (Path(__file__).parent.parent / "schedules" / "weipipe.pipe").read_text()
    for old, new in changes:
        assert old in source, old
        source = source.replace(old, new)
    path = tmp_path / "weipipe_variant.pipe"
    path.write_text(source)
    return str(path)


def test_two_communicators_met_in_different_orders_deadlock_and_are_named(tmp_path):
    """A ring step (every rank) and a group reduce in one exchange: one rank swaps them."""
    # WeiPipe's ring, its gradients reduced in groups of two instead
    path = _weipipe_variant(tmp_path, ("gradients ring", "gradients reduce\n  group rank r in r / 2"))
    program = compile_target(path).program  # as lowered: one order everywhere, proven
    rank = 0
    row = list(program.ranks[rank])
    index = next(i for i, a in enumerate(row) if a.op == ops.EXCHANGE
                 and ops.REDUCE_G in parts_of(a) and ops.SHIFT_F in parts_of(a))
    parts = row[index].parts
    swapped = tuple(p for p in parts if p.op == ops.REDUCE_G) + tuple(p for p in parts if p.op != ops.REDUCE_G)
    row[index] = row[index]._replace(parts=swapped)
    with pytest.raises(DeadlockError) as caught:
        check_weights(with_row(program, rank, row))
    message = str(caught.value)
    assert "REDUCE_G" in message and "SHIFT_F" in message and "rank 0" in message and "rank 1" in message


def test_collectives_of_one_communicator_in_another_order_are_named():
    program = program_of("weipipe")
    row = list(program.ranks[1])
    index = next(i for i, a in enumerate(row) if a.op == ops.EXCHANGE
                 and ops.SHIFT_F in parts_of(a) and ops.SHIFT_B in parts_of(a))
    row[index] = row[index]._replace(parts=tuple(reversed(row[index].parts)))
    with pytest.raises(MatchError, match=r"collective on communicator 0 .* is \S*SHIFT_\w+ here but \S*SHIFT_\w+ on "
                                         r"rank \d+"):
        check_weights(with_row(program, 1, row))


def test_a_wait_on_nothing_is_named():
    program = program_of("fsdp", P=2)
    row = list(program.ranks[1])
    row.insert(3, Action(-1, ops.EXCHANGE_WAIT, 999))
    with pytest.raises(MatchError, match="waits for exchange 999, which this rank has not posted"):
        check_weights(with_row(program, 1, row))


def test_a_task_without_its_weights_is_named():
    program = program_of("fsdp", P=2)
    row = [a for a in program.ranks[0] if not (a.op == ops.EXCHANGE and ops.ALLGATHER_W in parts_of(a))
           and not (a.op == ops.EXCHANGE_WAIT and a.mb == 0)]
    with pytest.raises((RouteError, MatchError, DeadlockError)):
        check_weights(with_row(program, 0, row))
    # the same on a ring: a backward slot that holds another layer
    weipipe = program_of("weipipe")
    row = list(weipipe.ranks[0])
    backward = next(i for i, a in enumerate(row) if a.op == ops.B)
    row[backward] = row[backward]._replace(stage=row[backward].stage - 1)
    with pytest.raises(RouteError, match=r"runs layer \d+ backward, but this rank's backward slot holds layer"):
        check_weights(with_row(weipipe, 0, row))


def test_a_gradient_that_never_reaches_its_owner_is_named():
    program = program_of("tawpipe", P=4, G=2)
    for rank, row in enumerate(program.ranks):
        index = next((i for i, a in enumerate(row) if a.op == ops.EXCHANGE and ops.SEND_G in parts_of(a)), None)
        if index is None:
            continue
        send = next(p for p in row[index].parts if p.op == ops.SEND_G)
        kept = tuple(p for p in row[index].parts if p is not send)
        row = list(row)
        row[index] = row[index]._replace(parts=kept) if kept else row[index]
        if not kept:
            del row[index:index + 2]
        peer_row = [a if a.op != ops.EXCHANGE else a._replace(parts=tuple(
            p for p in a.parts if not (p.op == ops.RECV_G and p.peer == rank and p.mb == send.mb
                                       and program.stages[p.stage].position == program.stages[send.stage].position)))
            for a in program.ranks[send.peer]]
        peer_row = _drop_empty_exchanges(peer_row)
        broken = with_row(with_row(program, rank, row), send.peer, peer_row)
        with pytest.raises(RouteError, match="never reached the owner|lacks microbatch"):
            check_weights(broken)
        return
    pytest.fail("tawpipe sends no gradient partial")


def _drop_empty_exchanges(row: list[Action]) -> list[Action]:
    empty = {a.mb for a in row if a.op == ops.EXCHANGE and not a.parts}
    return [a for a in row if not (a.op in (ops.EXCHANGE, ops.EXCHANGE_WAIT) and a.mb in empty)]


# ------------------------------------------------------------------ orders a route cannot serve


def _compile_source(tmp_path, body: str):
    path = tmp_path / "weights.pipe"
    path.write_text(body)
    return compile_target(str(path))


def test_staged_group_running_two_layers_in_a_step_is_a_located_error(tmp_path):
    source = """
schedule bad(P: ranks = 4, N: microbatches = 4) {
  stages 4
  home microbatch m on rank m
  group rank r in r / 2
  own layer l on rank l
  weights staged
  order rank r {
    for l in 0 .. 4 { at step l + r % 2 { F(l, r) } }
    for l in 0 .. 4 { at step 8 + l { B(3 - l, r) } }
  }
}
"""
    with pytest.raises(ScheduleError, match=r"rank 1, step 1: weights staged .* but rank 0 runs layer 1 and rank 1 "
                                            r"runs layer 0"):
        _compile_source(tmp_path, source)


def test_a_ring_slot_asked_for_two_layers_is_a_located_error(tmp_path):
    source = """
schedule bad(P: ranks = 2, N: microbatches = 2) {
  stages 2
  home microbatch m on rank m
  own layer l on rank l
  weights ring by 1
  order rank r {
    at step 0 { F(0, r) }
    at step 1 { F(1, r) }
    at step 2 { B(1, r) }
    at step 3 { B(0, r) }
  }
}
"""
    with pytest.raises(ScheduleError, match=r"runs layer \d forward, but the forward ring slot it holds then carries "
                                            r"layer \d"):
        _compile_source(tmp_path, source)


def test_lowering_is_deterministic_and_checked_after_frees():
    spec = resolve_target("tawpipe").evaluate({"P": 8, "G": 2, "N": 16})
    first, second = lower_spec(spec)[1], lower_spec(spec)[1]
    assert first == second
    compiled = compile_spec(spec)
    assert any(a.op == ops.FREE_W for row in compiled.program.ranks for a in row)
    assert any(a.op == ops.FREE_F for row in compiled.program.ranks for a in row)


# ------------------------------------------------------------------ hostile sizes


_STEPS = """
schedule far(P: ranks = 2, N: microbatches = 2) {{
  stages 1
  home microbatch m on rank m
  own layer l on rank 0
  weights direct
  {extra}
  order rank r {{
    at step 0 {{ F(0, r) }}
    at step {last} {{ B(0, r) }}
  }}
}}
"""


def test_a_step_beyond_the_step_grid_limit_is_a_located_error_not_a_hang(tmp_path):
    from pipec.errors import EvalError
    with pytest.raises(EvalError, match=r"step 1000000000000 on 2 rank\(s\) makes .* more than pipec's limit"):
        _compile_source(tmp_path, _STEPS.format(extra="", last=10**12))


def test_prefetch_further_than_the_order_goes_posts_everything_first(tmp_path):
    from pipec.errors import EvalError
    program = _compile_source(tmp_path, _STEPS.format(extra="prefetch 500", last=3)).program
    assert program.weights.prefetch == program.weights.num_steps == 4
    with pytest.raises(EvalError, match=r"`prefetch` must be at most 2,000,000"):
        _compile_source(tmp_path, _STEPS.format(extra="prefetch 100000000000", last=3))


# ------------------------------------------------------------------ what moves per step


def _taken_per_boundary(program: Program, rank: int) -> dict[int, list[str]]:
    """Exchange number // 2 (the boundary) -> the values this rank takes there (ring steps naming a layer,
    receives, broadcasts off their root)."""
    out: dict[int, list[str]] = {}
    for action in program.ranks[rank]:
        if action.op != ops.EXCHANGE:
            continue
        for part in action.parts:
            takes = (part.op in (ops.SHIFT_F, ops.SHIFT_B, ops.SHIFT_G) and part.stage >= 0) \
                or part.op in (ops.RECV_W, ops.RECV_G) or (part.op == ops.BCAST_W and part.peer != rank)
            if takes:
                out.setdefault(action.mb // 2, []).append(part.op)
    return out


def test_weipipe_moves_three_weight_sized_values_a_step_and_tawpipe_two():
    """The paper's 36 H^2 against 24 H^2 per step for a LLaMA layer of 12 H^2 (weights as big as gradients):
    in WeiPipe's steady state a rank takes its forward slot, its backward slot and a gradient partial each
    step; in TawPipe a group takes one layer's weights and gives one gradient each backward step."""
    weipipe = program_of("weipipe", P=4, N=16)
    steady = [ops_ for boundary, ops_ in _taken_per_boundary(weipipe, 1).items() if 8 <= boundary <= 14]
    assert steady and all(sorted(ops_) == [ops.SHIFT_B, ops.SHIFT_F, ops.SHIFT_G] for ops_ in steady)

    P, G = 8, 2
    tawpipe = program_of("tawpipe", P=P, G=G, N=P)
    S = P // G
    inter = {}
    for rank, row in enumerate(tawpipe.ranks):
        for action in row:
            if action.op != ops.EXCHANGE:
                continue
            for part in action.parts:
                if part.op in (ops.SEND_W, ops.SEND_G) and rank // S != part.peer // S:
                    inter.setdefault((part.mb, part.peer // S if part.op == ops.SEND_W else rank // S), []).append(
                        part.op)
    # per (step, group): at most one layer in and one gradient out over the inter-node links
    assert max(len(moved) for moved in inter.values()) <= 2
    assert any(sorted(moved) == [ops.SEND_G, ops.SEND_W] for moved in inter.values())


def test_a_ring_slot_the_owner_never_holds_starts_from_a_copy_the_owner_sends(tmp_path):
    """WeiPipe with the public code's owners (layer l on rank l): no forward slot passes its layer's owner
    before its first use, so the owner sends that rank a copy, which fills the slot and is dropped."""
    path = _weipipe_variant(tmp_path, ("own layer l on rank (P - l) % P", "own layer l on rank l"))
    for P in (2, 3, 4, 5):
        program = compile_target(path, {"P": P, "N": 2 * P}).program
        sends = [p for row in program.ranks for a in row if a.op == ops.EXCHANGE for p in a.parts
                 if p.op == ops.SEND_W]
        assert bool(sends) == (P > 2)  # at P = 2 the two owner maps are the same
        assert all(p.peer != rank for rank, row in enumerate(program.ranks) for a in row
                   if a.op == ops.EXCHANGE for p in a.parts if p.op == ops.SEND_W)
        assert simulate(program).bubble_fraction() == Fraction(P - 1, 2 * P + P - 1)
