"""Replicas of one model chunk on one rank: the simulator matches the runtime.

Two pipelines that place a stage on the same rank (PipeDream-style
replication, one replica per pipeline) share one module there: the runtime
needs no all-reduce for it, and the program's communicator for that chunk has
a single member. The simulator used to count replicas by stage and waited
for a second member that never joined ("simulation stuck ... which not every
replica joins"); it now meets on the communicator's ranks.
"""
from __future__ import annotations

import pytest

from pipec.cli import main
from pipec.compiler.costs import costs_from_json
from pipec.compiler.driver import compile_target
from pipec.compiler.ir import ALLREDUCE_GRAD
from pipec.compiler.simulate import simulate

# Chunk 0 has both replicas on rank 0, chunk 1 both on rank 1, chunk 2 one on each rank.
MIXED = """
schedule mixed(P: ranks = 2, N: microbatches = 4) {
  stages 3
  pipelines 2
  route microbatch m to pipeline m % 2
  place stage s of pipeline p on rank s == 2 ? 1 - p : s
  order greedy { }
}
"""
# Every replica of every chunk on one rank: nothing is reduced at all.
SAME_RANKS = """
schedule same(P: ranks = 3, N: microbatches = 6) {
  stages P
  pipelines 2
  route microbatch m to pipeline m % 2
  place stage s of pipeline p on rank s
  order greedy { inflight on rank r <= P }
}
"""
ALLREDUCE = {"allreduce": {"latency": 5}}


def _write(tmp_path, text: str, name: str) -> str:
    path = tmp_path / f"{name}.pipe"
    path.write_text(text)
    return str(path)


def test_a_chunk_whose_replicas_share_a_rank_is_not_reduced_and_the_others_are(tmp_path):
    compiled = compile_target(_write(tmp_path, MIXED, "mixed"), {})
    program = compiled.program
    assert [c.ranks for c in program.communicators] == [(0,), (1,), (0, 1)]
    plain = simulate(program)
    priced = simulate(program, costs_from_json(ALLREDUCE))
    # only chunk 2 meets across ranks: its all-reduce (2 members, 2 (n-1) latency = 10) is the only one priced
    reduces = [slot for lane in priced.timeline for slot in lane if slot.is_comm and slot.action.op == ALLREDUCE_GRAD]
    assert len(reduces) == 2 and {program.stages[slot.action.stage].chunk for slot in reduces} == {2}
    assert all(slot.end - slot.start == 10 for slot in reduces)
    assert priced.makespan >= plain.makespan


def test_replicas_all_on_their_own_ranks_simulate_like_one_pipeline_of_the_ranks(tmp_path):
    path = _write(tmp_path, SAME_RANKS, "same")
    program = compile_target(path, {}).program
    assert all(len(c.ranks) == 1 for c in program.communicators)
    result = simulate(program, costs_from_json(ALLREDUCE))
    assert not any(slot.is_comm for lane in result.timeline for slot in lane)  # nothing reduced, nothing priced
    assert result.makespan == simulate(program).makespan


@pytest.mark.parametrize("text,name", [(MIXED, "mixed"), (SAME_RANKS, "same")])
def test_check_simulate_and_render_agree(tmp_path, capsys, text, name):
    path = _write(tmp_path, text, name)
    assert main(["check", path]) == 0
    assert main(["simulate", path]) == 0
    for suffix in (".svg", ".html", ".json"):
        assert main(["render", path, "-o", str(tmp_path / f"t{suffix}")]) == 0
    err = capsys.readouterr().err
    assert "stuck" not in err and "Traceback" not in err
