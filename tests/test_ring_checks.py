"""Sequence rings: the lowering covers the mask exactly once, and the checker names every planted mistake.

Programs come from ``lower_plan`` on ``RingPlan``s shaped like the shipped
schedules (contiguous ring, zigzag, TASP on the Hamiltonian rings); the
planted ones are those programs with one instruction changed, as a
hand-written loop would get it wrong.
"""
from __future__ import annotations

import itertools
from fractions import Fraction

import pytest

from pipec.compiler import ops
from pipec.compiler.checks import check_all
from pipec.compiler.checks.rings import check_rings
from pipec.compiler.ir import Action, RingPlan
from pipec.compiler.lower_rings import lower_plan, ring_program
from pipec.compiler.rings import hamiltonian_rings
from pipec.errors import CoverageError, DeadlockError, MatchError, RouteError


def zigzag(P: int) -> tuple[int, ...]:
    return tuple(c if c < P else 2 * P - 1 - c for c in range(2 * P))


def shapes(P: int, causal: bool, **routes) -> dict[str, RingPlan]:
    rings = hamiltonian_rings(P).cycles
    return {
        "ring": RingPlan(P, tuple(range(P)), 1, (tuple(range(P)),), causal, **routes),
        "zigzag": RingPlan(2 * P, zigzag(P), 1, (tuple(range(P)),), causal, **routes),
        "tasp": RingPlan(2 * P, zigzag(P), len(rings), rings, causal, **routes),
    }


def visible_blocks(plan: RingPlan) -> int:
    """Blocks a mask leaves, counted by formula: all C^2 K, or under the causal mask every pair of
    chunks (q, kv) with kv < q (C (C - 1) / 2 of them, K pieces each) plus the C K diagonal pieces."""
    C, K = plan.chunks, plan.pieces
    return C * C * K if not plan.causal else C * (C - 1) // 2 * K + C * K


ROUTES = [dict(kv=kv, dkv=dkv, transfer=transfer)
          for kv, dkv, transfer in itertools.product(("again", "kept"), ("behind", "direct"), ("p2p", "all_to_all"))]


@pytest.mark.parametrize("P", [2, 3, 5, 7, 8])
@pytest.mark.parametrize("causal", [True, False])
def test_every_visible_block_is_computed_once_each_way_and_every_partial_comes_home(P, causal):
    for routes in ROUTES:
        for name, plan in shapes(P, causal, **routes).items():
            program = lower_plan(plan, name)
            report = check_rings(program)
            assert report.blocks == visible_blocks(plan), (name, routes)
            for op in (ops.AF, ops.AB):
                computed = [(a.stage, a.mb) for row in program.ranks for a in row if a.op == op]
                assert len(computed) == len(set(computed)) == visible_blocks(plan)
            check_all(program)  # the driver's entry runs the same proof


def test_kv_again_keeps_two_buffers_per_piece_and_kv_kept_every_bundle():
    plan = shapes(5, True)["tasp"]
    again = check_rings(lower_plan(plan)).peak_kv_buffers
    kept = check_rings(lower_plan(RingPlan(**{**plan.__dict__, "kv": "kept"}))).peak_kv_buffers
    assert again == [2 * plan.pieces] * 5          # the bundle read and the one arriving, per piece
    assert kept == [(5 - 1) * plan.pieces] * 5     # every other rank's bundle of every piece


def test_zigzag_balances_causal_work_and_the_contiguous_ring_grows_with_the_rank():
    for P in (2, 3, 4, 8):
        for name, plan in shapes(P, True).items():
            work = [sum(plan.block_area(a.stage, *plan.unblock(a.mb))
                        for a in row if a.op == ops.AF) for row in lower_plan(plan).ranks]
            if name == "ring":  # rank r: r whole blocks and one diagonal (2r + 1 halves)
                assert work == [Fraction(2 * r + 1, 2) for r in range(P)]
            else:  # zigzag pairs: every rank the same, 2P + 1 halves... of a chunk pair
                assert len(set(work)) == 1, (name, work)


# ----------------------------------------------------------------- planted


def plant(program, rank: int, change):
    """``program`` with rank ``rank``'s list replaced by ``change(list)``."""
    rows = [list(row) for row in program.ranks]
    rows[rank] = change(rows[rank])
    return ring_program(program.rings, rows, "planted")


def first(row, op):
    return next(i for i, a in enumerate(row) if a.op == op)


def test_a_skipped_block_is_named():
    program = lower_plan(shapes(3, True)["zigzag"])
    skipped = next(a for a in program.ranks[1] if a.op == ops.AF)
    bad = plant(program, 1, lambda row: [a for a in row if a != skipped])
    with pytest.raises(CoverageError) as caught:
        check_rings(bad)
    kv, piece = program.rings.unblock(skipped.mb)
    # its chunk's first backward is the first to miss it, and names it as never computed
    assert f"the block (query chunk {skipped.stage}, kv chunk {kv}, piece {piece}) is never computed forward (1 " \
        f"visible block of chunk {skipped.stage} missing)" in caught.value.message
    assert caught.value.rank == 1


def test_a_block_never_computed_backward_is_named_at_the_end():
    program = lower_plan(shapes(3, False)["ring"])
    skipped = [a for a in program.ranks[2] if a.op == ops.AB][-1]
    bad = plant(program, 2, lambda row: [a for a in row if a != skipped])
    with pytest.raises(CoverageError, match=r"block \(query chunk 2, kv chunk \d, piece 0\) is never computed "
                                            r"backward"):
        check_rings(bad)


def test_a_block_computed_twice_is_named():
    program = lower_plan(shapes(4, True)["tasp"])
    row = program.ranks[3]
    twice = row[first(row, ops.AB)]
    bad = plant(program, 3, lambda r: r[:first(r, ops.AB) + 1] + [twice] + r[first(r, ops.AB) + 1:])
    with pytest.raises(CoverageError, match="computed twice backward") as caught:
        check_rings(bad)
    assert (caught.value.rank, caught.value.step) == (3, first(row, ops.AB) + 1)


def test_a_fully_masked_block_is_named():
    program = lower_plan(shapes(3, True)["ring"])
    masked = Action(0, ops.AF, program.rings.block(2, 0))  # kv chunk 2 comes after query chunk 0
    bad = plant(program, 0, lambda row: [row[0], masked] + row[1:])
    with pytest.raises(CoverageError, match=r"block \(query chunk 0, kv chunk 2, piece 0\) is masked out entirely"):
        check_rings(bad)


def test_a_backward_before_its_forward_is_complete_is_named():
    program = lower_plan(shapes(2, False)["ring"])
    row = program.ranks[0]
    early = row[first(row, ops.AB)]
    bad = plant(program, 0, lambda r: [early] + [a for a in r if a != early])
    with pytest.raises(CoverageError, match="backward before the forward of block"):
        check_rings(bad)


def test_a_forward_block_after_the_backwards_first_instruction_is_named_even_of_another_chunk():
    # Found by tests/mutants.py: each chunk's blocks were in order, so the program was proved, but the runtime
    # runs a rank's list as a forward half and a backward half, and this forward block sits in the second.
    program = lower_plan(shapes(2, True)["zigzag"])
    row = program.ranks[1]
    late = row[first(row, ops.AF)]
    post = first(row, ops.AB) - 1  # the post of the backward's first KV exchange, still open at its first AB
    assert row[post].op == ops.EXCHANGE and late.text() == "1AF1"
    rest = [a for a in row if a != late]
    check_rings(plant(program, 1, lambda r: rest[:post - 1] + [late] + rest[post - 1:]))  # just before: proved
    with pytest.raises(CoverageError) as caught:
        check_rings(plant(program, 1, lambda r: rest[:post] + [late] + rest[post:]))
    error = caught.value
    assert error.message == ("1AF1: a forward block comes after the backward's first instruction (step "
                             f"{post - 1}): this list cannot run its forward and its backward apart (a rank runs "
                             "its list's forward half in the model's forward and the rest in its backward)")
    assert (error.rank, error.step, error.marks) == (1, post, [(1, post - 1)])


def test_a_message_of_one_ranks_forward_half_that_meets_anothers_backward_half_is_named():
    # Found by tests/mutants.py: rank 0 waits the backward's first KV exchange before its first backward block,
    # so that exchange falls in its forward half; rank 1 posts it in its backward half. Matched in order, the
    # whole list was proved, but the runtime runs the halves apart, and rank 0's forward waits for ever.
    program = lower_plan(shapes(2, True)["zigzag"])
    row = program.ranks[0]
    post = first(row, ops.AB) - 1
    wait = next(i for i, a in enumerate(row) if a.op == ops.EXCHANGE_WAIT and a.mb == row[post].mb)
    moved = row[:post + 1] + [row[wait]] + [a for a in row[post + 1:] if a is not row[wait]]
    with pytest.raises(MatchError) as caught:
        check_rings(plant(program, 0, lambda r: moved))
    error = caught.value
    assert error.message == (f"{row[post].text()}: rank 0's forward half sends 2 message(s) to rank 1, whose forward "
                             "half receives 1: a message of one half would meet the other (a rank runs its list's "
                             "forward half in the model's forward and the rest in its backward)")
    assert (error.rank, error.step) == (0, post)


def test_a_dkv_partial_sent_to_the_wrong_rank_is_named():
    # dkv direct: rank 0 sends its partial of rank 1's bundle to rank 2 instead, and rank 2 takes it
    program = lower_plan(shapes(3, False, dkv="direct")["ring"])
    wrong = Action(1, ops.SEND_DKV, 0, 2)

    def resend(row):
        out = []
        for a in row:
            if a.op == ops.EXCHANGE:
                a = a._replace(parts=tuple(wrong if p.op == ops.SEND_DKV and p.stage == 1 else p for p in a.parts))
            out.append(a)
        return out

    def take(row):
        out = []
        for a in row:
            if a.op == ops.EXCHANGE and any(p.op == ops.RECV_DKV for p in a.parts):
                k = next(i for i, p in enumerate(a.parts) if p.op == ops.RECV_DKV)  # after its sends, in rank 0's order
                a = a._replace(parts=a.parts[:k] + (Action(1, ops.RECV_DKV, 0, 0),) + a.parts[k:])
            out.append(a)
        return out

    def expect_nothing(row):  # rank 1 no longer waits for rank 0's partial
        return [a._replace(parts=tuple(p for p in a.parts if p != Action(1, ops.RECV_DKV, 0, 0)))
                if a.op == ops.EXCHANGE else a for a in row]

    bad = plant(plant(plant(program, 0, resend), 2, take), 1, expect_nothing)
    with pytest.raises(RouteError, match="partial of rank 1's KV bundle of piece 0 is left on rank 2, never sent home"):
        check_rings(bad)


def test_a_partial_sent_on_before_the_incoming_one_is_added_is_named():
    # dkv behind: rank 1 posts its next partial before it waited for the one arriving
    program = lower_plan(shapes(3, True)["ring"])

    def hurry(row):
        waits = [i for i, a in enumerate(row) if a.op == ops.EXCHANGE_WAIT]
        dkv = [i for i, a in enumerate(row) if a.op == ops.EXCHANGE and a.parts[0].op == ops.SEND_DKV]
        i = dkv[1]  # the second partial exchange; the wait before it folds the first one's receive
        wait = max(w for w in waits if w < i)
        return row[:wait] + [row[i], row[wait]] + row[wait + 1:i] + row[i + 1:]

    with pytest.raises(RouteError, match="while another partial of it is still arriving"):
        check_rings(plant(program, 1, hurry))


def test_a_kv_buffer_reused_while_its_send_runs_is_named():
    # rank 0 splits its second ring step: the send of the bundle it received at the first step in one
    # exchange, the receive of the next bundle (into that bundle's buffer) in another, waited first
    P = 3
    program = lower_plan(shapes(P, False)["ring"])
    row = program.ranks[0]
    kv = [j for j, a in enumerate(row) if a.op == ops.EXCHANGE and a.parts[0].op == ops.SEND_KV]
    second = kv[1]  # sends the bundle received at the first step, receives the next one
    send, recv = row[second].parts

    def reuse(r):
        wait = next(j for j, a in enumerate(r) if a.op == ops.EXCHANGE_WAIT and a.mb == r[second].mb)
        return r[:second] + [Action(-1, ops.EXCHANGE, 100, -1, (send,)), Action(-1, ops.EXCHANGE, 101, -1, (recv,))] \
            + r[second + 1:wait] + [Action(-1, ops.EXCHANGE_WAIT, 101), Action(-1, ops.EXCHANGE_WAIT, 100)] + r[wait + 1:]

    with pytest.raises(RouteError, match="while that one is still being sent: a stale buffer reused"):
        check_rings(plant(program, 0, reuse))


def test_a_message_batched_differently_on_its_two_sides_is_named():
    program = lower_plan(shapes(3, False)["ring"])
    alltoall = lower_plan(shapes(3, False, transfer="all_to_all")["ring"])
    mixed = ring_program(program.rings, [alltoall.ranks[0]] + [list(r) for r in program.ranks[1:]], "mixed")
    with pytest.raises(MatchError) as caught:
        check_rings(mixed)
    assert "both sides of a message must move it alike" in caught.value.message


def test_a_part_outside_an_exchange_is_named():
    program = lower_plan(shapes(2, False)["ring"])
    row = program.ranks[0]
    i = first(row, ops.EXCHANGE)
    bare = plant(program, 0, lambda r: r[:i] + list(r[i].parts) + r[i + 1:])
    with pytest.raises(MatchError, match="outside an exchange"):
        check_rings(bare)


def test_a_cycle_of_waits_is_a_deadlock_naming_both_ranks():
    plan = RingPlan(2, (0, 1), 1, ((0, 1),), False)
    rows = []
    for r in (0, 1):
        other = 1 - r
        rows.append([Action(-1, ops.EXCHANGE, 0, -1, (Action(other, ops.RECV_KV, 0, other),)),
                     Action(-1, ops.EXCHANGE_WAIT, 0),
                     Action(-1, ops.EXCHANGE, 1, -1, (Action(r, ops.SEND_KV, 0, other),)),
                     Action(-1, ops.EXCHANGE_WAIT, 1)])
    with pytest.raises(DeadlockError) as caught:
        check_rings(ring_program(plan, rows, "cycle"))
    assert "rank 0 (instruction 1) waits in EXCHANGE_WAIT0" in caught.value.message
    assert "rank 1 (instruction 1) waits in EXCHANGE_WAIT0" in caught.value.message


def test_the_kth_all_to_all_must_be_the_same_on_every_rank():
    program = lower_plan(shapes(3, False, transfer="all_to_all")["ring"])
    row = program.ranks[2]
    i = first(row, ops.EXCHANGE)
    collective = row[i].parts[0]
    changed = row[i]._replace(parts=(collective._replace(op=ops.ALLTOALL_DKV),))
    with pytest.raises(MatchError, match=r"the 1st collective on communicator 0 .* is \S*ALLTOALL_DKV0 here but "
                                         r"\S*ALLTOALL_KV0 on rank 0"):
        check_rings(plant(program, 2, lambda r: r[:i] + [changed] + r[i + 1:]))


def test_a_ring_of_one_rank_moves_nothing():
    for routes in ROUTES:
        program = lower_plan(RingPlan(2, (0, 0), 1, ((0,),), True, **routes))
        assert [a.text() for a in program.ranks[0]] == ["0AF0", "1AF0", "1AF1", "0AB0", "1AB0", "1AB1"]
        assert check_rings(program).blocks == 3
