"""TawPipe x DP (``schedules/tawpipe_dp.pipe``, ``compiler/weight_placement.py``): weight passing on a mesh.

D replicas of TawPipe on ``mesh dp = D, pp = P``: the placement (each member runs its pp rank's list with
its peers and groups inside its replica, every owner all-reduces each owned layer's gradient over its data
group after the last fold into it), the prover (a planted all-reduce before the owner's last fold, a
missing one, a non-owner's), the language (``shard over`` refused at the policy), the simulator (the
all-reduce priced as a ring on the links between replicas, half the plain makespan), torch's CSV refused,
and the exact run: 4 gloo ranks, 3 steps, built-in model, a user's model spec and a clipped run, within 1e-5
of one process with the same N (one set of processes for all three runs).
"""
from __future__ import annotations

import os

import pytest
import torch

import payload_model
from pipec.compiler import ops
from pipec.compiler.checks import check_all
from pipec.compiler.costs import costs_from_json
from pipec.compiler.driver import compile_target
from pipec.compiler.simulate import simulate
from pipec.errors import RouteError, ScheduleError, WellFormedError
from pipec.runtime.model import ModelConfig
from pipec.runtime.reference import reference_run
from runtime_util import assert_same_parameters, launch_batch

P, D, N = 2, 2, 2
STEPS, SEED = 3, 7
TESTS = os.path.dirname(os.path.abspath(__file__))


@pytest.fixture(scope="module")
def composed():
    """The shipped composition at its defaults (P = 2, G = 1, D = 2, N = 2), and plain TawPipe alike."""
    return compile_target("tawpipe_dp").program, compile_target("tawpipe", {"P": "2", "G": "1", "N": "2"}).program


def _sync_exchange(row):
    """(index, layer stage) of each EXCHANGE holding a SYNC_GRAD in ``row``."""
    return [(i, a.parts[0].stage) for i, a in enumerate(row)
            if a.op == ops.EXCHANGE and any(p.op == ops.SYNC_GRAD for p in a.parts)]


def test_each_replica_runs_tawpipe_inside_itself(composed):
    program, plain = composed
    assert program.num_ranks == P * D and [program.mesh.label(r) for r in (0, 3)] == ["dp 0, pp 0", "dp 1, pp 1"]
    for rank, row in enumerate(program.ranks):
        replica, pp = divmod(rank, P)  # dp outermost: a replica's ranks are contiguous
        without_sync = [a for a in row if not (a.op == ops.EXCHANGE and a.parts[0].op == ops.SYNC_GRAD)]
        assert len(without_sync) == len(plain.ranks[pp]) + len(_sync_exchange(row))  # the waits added
        for action in row:
            for part in (action,) + action.parts:
                if part.peer >= 0:
                    assert part.peer // P == replica, (rank, part.text())
            if ops.RULES[action.op].communicator is not None or action.op == ops.EXCHANGE:
                for part in action.parts:
                    group = program.communicator_on(part, rank)
                    if part.op in (ops.BCAST_W, ops.REDUCE_G):  # the replica's copy of the node's group
                        assert {r // P for r in group.ranks} == {replica}
                    if part.op == ops.SYNC_GRAD:                # the data group: every replica's rank at pp
                        assert group.ranks == tuple(pp + P * d for d in range(D))
    # every communicator once, in one order: the replicas' groups, then the data groups
    assert [c.ranks for c in program.communicators] == [(0, 1), (2, 3), (0, 2), (1, 3)]
    # every member's rows: share i of D of its pp rank's microbatches
    assert all(info.placement.ranks == (info.rank, info.rank + P) for info in program.stages)


def test_the_owner_all_reduces_each_owned_layer_right_after_its_last_fold(composed):
    program, _ = composed
    for rank, row in enumerate(program.ranks):
        pp = rank % P
        synced = _sync_exchange(row)
        owned = {layer for layer, owner in enumerate(program.weights.owners) if owner == pp}
        assert sorted(program.stages[stage].position for _, stage in synced) == sorted(owned)
        for index, stage in synced:
            layer = program.stages[stage].position
            assert program.stages[stage].ranks[0] == pp  # the owner's own stage of the layer
            before = row[index - 1]  # the wait of the exchange that brought the last partial, or the last B
            folds = [p for a in row[:index] if a.op == ops.EXCHANGE and a.mb == before.mb for p in a.parts
                     if p.op == ops.REDUCE_G and program.stages[p.stage].position == layer]
            assert (before.op == ops.EXCHANGE_WAIT and folds) or before.op == ops.B
            later = [a for a in row[index + 1:] if a.op == ops.EXCHANGE and any(
                p.op in (ops.REDUCE_G, ops.RECV_G) and program.stages[p.stage].position == layer for p in a.parts)]
            assert not later
        # posted, then waited at the end of the list
        assert [a.op for a in row[-len(synced):]] == [ops.EXCHANGE_WAIT] * len(synced)


def _moved_before_wait(program, rank: int, exchange: int) -> None:
    row = program.ranks[rank]
    index, _ = _sync_exchange(row)[0]
    sync = row.pop(index)
    row.insert(next(i for i, a in enumerate(row) if a.op == ops.EXCHANGE_WAIT and a.mb == exchange), sync)


def test_an_all_reduce_before_the_owners_last_fold_is_named_at_its_rank_and_instruction():
    program = compile_target("tawpipe_dp").program
    for rank in (1, 3):  # both replicas alike: the meeting itself still matches
        _moved_before_wait(program, rank, 6)
    with pytest.raises(RouteError) as caught:
        check_all(program)
    assert str(caught.value).startswith("rank 1, step 10: 3SYNC_GRAD all-reduces layer 1's gradient over the data "
                                        "group before exchange 6")
    assert "after the owner's last fold" in str(caught.value)


def test_a_missing_or_foreign_all_reduce_is_refused():
    program = compile_target("tawpipe_dp").program
    for row in program.ranks:
        row[:] = [a for a in row if not (a.op == ops.EXCHANGE and a.parts[0].op == ops.SYNC_GRAD)]
        del row[-1]  # its wait
    with pytest.raises(WellFormedError, match="never reduces the weight gradient of stage"):
        check_all(program)
    program = compile_target("tawpipe_dp").program
    for rank in (0, 2):  # layer 0's owner all-reduces its own partial of layer 1 (owned by pp 1) as well
        row = program.ranks[rank]
        index, stage = _sync_exchange(row)[0]
        row[index] = row[index]._replace(parts=row[index].parts + (row[index].parts[0]._replace(stage=1),))
    with pytest.raises(RouteError, match="does not own the layer"):
        check_all(program)


def test_shard_over_a_weight_passing_pipeline_is_refused_at_the_policy(tmp_path):
    source = tmp_path / "taw_fsdp.pipe"
    source.write_text('schedule taw_fsdp(P: int = 2, D: int = 2) {\n  mesh dp = D, pp = P\n'
                      '  pipeline tawpipe(P = P, G = 1, N = P) from "tawpipe"\n  shard over dp\n}\n')
    with pytest.raises(ScheduleError) as caught:
        compile_target(str(source))
    assert ":4:3:" in str(caught.value) and "nothing to shard over the data axis" in str(caught.value)


def test_a_route_of_every_rank_is_refused_at_the_pipeline(tmp_path):
    source = tmp_path / "weipipe_dp.pipe"
    source.write_text('schedule weipipe_dp(P: int = 2, D: int = 2) {\n  mesh dp = D, pp = P\n'
                      '  pipeline weipipe(P = P, N = P) from "weipipe"\n  replicate over dp\n}\n')
    with pytest.raises(ScheduleError) as caught:
        compile_target(str(source))
    assert ":3:3:" in str(caught.value) and "by 'ring', a collective of every rank" in str(caught.value)


def test_the_simulator_prices_the_all_reduce_between_replicas(composed):
    program, plain = composed
    assert simulate(program).makespan * 2 == simulate(plain).makespan  # each member runs half the rows
    costs = costs_from_json({"sizes": {"activation": 1000, "weight": 4000}})
    traffic = simulate(program, costs).traffic
    # a ring all-reduce of 2 members moves 2 (k-1)/k W = W per member: 2 layers x 2 owners x 2 members
    assert traffic["wgrad"] == {"intra": 0, "inter": 16000}
    assert traffic["weight"]["inter"] == 0  # weights stay inside each replica's node
    assert traffic["weight"]["intra"] == 2 * simulate(plain, costs).traffic["weight"]["intra"]
    # on links: nodes of 2 (a replica each), the link between them half as fast. A ring of 2 moves W = 100 bytes
    # per hop at 5 bytes per unit: 20; layer 1's all-reduce (pp 1) overlaps that rank's remaining work
    slow = costs_from_json({"links": {"bandwidth": 10, "bytes": {"act": 40, "grad": 40}, "node_size": 2,
                                      "inter_node": {"bandwidth": 5}}, "sizes": {"activation": 40, "weight": 100}})
    timed = simulate(program, slow)
    syncs = {rank: [s for s in timed.timeline[rank] if s.is_comm and s.action.op == ops.SYNC_GRAD] for rank in range(4)}
    assert {s.end - s.start for slots in syncs.values() for s in slots} == {20}
    later = [s for s in timed.timeline[1] if s.start >= syncs[1][0].start and s.action.op != ops.SYNC_GRAD]
    assert any(s.start < syncs[1][0].end for s in later)


def test_torch_csv_is_refused_with_the_reason(composed):
    from pipec.compiler.family import first_refusal

    refusal = first_refusal(composed[0], lambda family: family.refuse_torch_csv("tawpipe_dp"))
    assert refusal is not None and "passes weights between ranks" in refusal


# the built-in model; a user's spec (a hidden state and a mask); clipped (each layer's gradient counted once in
# the norm, by the first replica's owner, though every replica's owner holds it)
RUNS = {"builtin": [], "user": ["--model", "payload_model:SPEC", "--config", "rows=4"],
        "clip": ["--clip-grad-norm", "0.5"]}


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    folder = tmp_path_factory.mktemp("compose_weights")
    jobs = [["tawpipe_dp", "--steps", str(STEPS), "--seed", str(SEED), "--timeout", "90",
             "--save", str(folder / f"{name}.pt"), *extra] for name, extra in RUNS.items()]
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [TESTS, os.environ.get("PYTHONPATH")])))
        run = launch_batch(jobs, P * D, 300.0)
    assert run.ok, run.describe()
    return folder


@pytest.mark.parametrize("name", RUNS)
def test_tawpipe_dp_trains_like_one_process(trained, name):
    saved = torch.load(trained / f"{name}.pt", weights_only=True)
    if name != "user":
        want = reference_run(ModelConfig(), STEPS, N, SEED, clip_grad_norm=0.5 if name == "clip" else None).state_dict
    else:
        want = reference_run(payload_model.Config(rows=4), STEPS, N, SEED, payload_model.SPEC).state_dict
    assert_same_parameters(saved, want, f"tawpipe_dp ({name})")
