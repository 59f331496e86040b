"""PP x CP, compiler side: `context over AXIS ring "TARGET"`, its proofs, its simulation and its refusals.

A composition whose stages split their sequences over a context axis
(docs/compose.md, "PP x CP"): the language names every mistake at its place;
the shipped 1f1b_cp and interleaved_1f1b_cp are ``place_on_mesh`` of their
pipelines with the zigzag ring; the prover proves every compute of a stage a
meeting of its group (crossing ring exchanges named as their cycle), a
hand-off kept at its cp coordinate, and the stage ring itself; members hold
1/C of a stage's activations; the simulator prices each F and B with the
ring's halves on the group's real links, and the traffic count shows the
ring's KV.
"""
from __future__ import annotations

from dataclasses import replace
from fractions import Fraction
from pathlib import Path

import pytest

from pipec.cli import main
from pipec.compiler import ops
from pipec.compiler.checks import check_all
from pipec.compiler.costs import CostModel, Link
from pipec.compiler.driver import compile_target, lower_spec, resolve_target
from pipec.compiler.emit.torch_csv import write_torch_csv
from pipec.compiler.ir import SEQUENCE_SHARE, Mesh
from pipec.compiler.memory_counts import peak_bytes
from pipec.compiler.mesh_placement import ContextParallel, place_on_mesh
from pipec.compiler.simulate import simulate
from pipec.compiler.stage_ring import ring_halves, split_ring
from pipec.errors import (EvalError, MatchError, RequireError, ResolveError, ScheduleError, SourceErrors,
                          UsageError)

COMPOSITION = """\
schedule cp(P: int = 2, C: int = 2, N: microbatches = 4) {
  mesh pp = P, cp = C
  pipeline one_f_one_b(P = P, N = N) from "1f1b"
  POLICY
}
"""


def compose(folder: Path, policy: str, **params):
    """The composed program of COMPOSITION with ``policy``, compiled and checked."""
    path = folder / "cp.pipe"
    path.write_text(COMPOSITION.replace("POLICY", policy))
    return compile_target(str(path), params).program


def refusal(folder: Path, policy: str, **params) -> str:
    """The located error (its rendering, first line) the composition with ``policy`` raises."""
    with pytest.raises((ResolveError, EvalError, RequireError, SourceErrors)) as caught:
        compose(folder, policy, **params)
    return str(caught.value).splitlines()[0]


# ------------------------------------------------------------------ language

@pytest.mark.parametrize("policy,params,where,words", [
    ('context over cp ring "1f1b"', {}, "4:24", "one_f_one_b in '1f1b' is not a sequence-ring schedule"),
    ('context over dp ring "zigzag_ring"', {}, "4:16", "dp is not an axis of the mesh (line 2: pp, cp)"),
    ('context over pp ring "zigzag_ring"', {}, "4:16", "the context axis cannot be the pipeline's axis, pp"),
    ('context over cp ring "zigzag_ring"\n  replicate over cp', {}, "4:3",
     "PP x CP x DP is not built: a composition splits its stages over one axis, by sequence (`context over`) "
     "or by rows (`replicate over` at line 5); drop one"),
    ('context over cp ring "zigzag_ring"\n  context over cp ring "tasp"', {}, "5:3",
     "a composition has one `context over`; another is at line 4"),
    ('context over cp ring "1f1b"', {"C": 1}, "4:24", "one_f_one_b in '1f1b' is not a sequence-ring schedule"),
    ('context over cp ring "zigzag_ring"', {"C": 1000}, "4:3",
     "the ring zigzag_ring on axis cp (1000 ranks): the sequence is cut into 2,000 chunks; pipec's limit is 1,000"),
    ('context over cp ring zigzag_ring(P = 1) from "zigzag_ring"', {"C": 1}, "4:36",
     "P is the ring's ranks: the size of axis cp, given by the mesh; leave it out"),
    ('context over cp ring tasp_rails(M = 2) from "tasp"', {}, "4:3",
     "the ring tasp_rails on axis cp (2 ranks): requirement failed: P is the number of nodes times the ranks "
     "per node"),
    ('context over cp ring zigzag_ring(P = 4) from "zigzag_ring"', {}, "4:36",
     "P is the ring's ranks: the size of axis cp, given by the mesh; leave it out"),
    ('context over cp ring zigzag_ring(cause = false) from "zigzag_ring"', {}, "4:36",
     "schedule 'zigzag_ring' has no parameter cause"),
    ('context over cp ring nope(causal = false) from "zigzag_ring"', {}, "4:24",
     "has no schedule 'nope' (it has zigzag_ring)"),
    ('context over cp ring "no_such_ring"', {}, "4:24", "no file 'no_such_ring' beside"),
])
def test_a_mistake_in_a_context_policy_is_named_where_it_is_written(tmp_path, policy, params, where, words):
    shown = refusal(tmp_path, policy, **params)
    assert shown.startswith(f"{tmp_path / 'cp.pipe'}:{where}: ") and words in shown, shown


@pytest.mark.parametrize("name,pipeline,args", [
    ("1f1b_cp", "1f1b", {"P": 2, "N": 4}),
    ("interleaved_1f1b_cp", "interleaved_1f1b", {"P": 2, "N": 4, "v": 2}),
])
def test_a_context_axis_of_one_rank_is_the_pipeline_as_it_is(name, pipeline, args):
    """C = 1 splits no sequence: the pipeline's own program on its mesh, as a data axis of one gives (was: refused,
    "a ring needs at least two ranks", where dp = 1 and HSDP's R = 1 fall back to the smaller program)."""
    got = compile_target(name, {"C": 1}).program
    plain = compile_target(pipeline, args).program
    assert got.stage_ring is None and not got.placed_on_groups and got.num_ranks == plain.num_ranks
    assert got.ranks == plain.ranks and got.stages == plain.stages
    assert got.mesh is not None and dict(got.mesh.axes) == {"pp": 2, "cp": 1}


def test_the_ring_takes_the_axis_size_its_own_arguments_and_a_file_beside_the_composition(tmp_path):
    tasp = compose(tmp_path, 'context over cp ring "tasp"', C=4)  # TASP at 4: two of three rings, fine
    assert tasp.stage_ring.num_ranks == 4 and tasp.stage_ring.rings.transfer == "all_to_all"
    full = compose(tmp_path, 'context over cp ring zigzag_ring(causal = false) from "zigzag_ring"')
    assert full.stage_ring.rings.causal is False
    assert compose(tmp_path, 'context over cp ring "zigzag_ring"').stage_ring.rings.causal is True
    (tmp_path / "mine.pipe").write_text((Path(__file__).parents[1] / "schedules/ring_attention.pipe").read_text())
    mine = compose(tmp_path, 'context over cp ring "mine.pipe"', C=3)
    assert mine.stage_ring.name == "ring_attention" and mine.stage_ring.num_ranks == 3


@pytest.mark.parametrize("name,pipeline,args", [
    ("1f1b_cp", "1f1b", {"P": 2, "N": 4}),
    ("interleaved_1f1b_cp", "interleaved_1f1b", {"P": 2, "N": 4, "v": 2}),
])
def test_a_shipped_pp_cp_composition_is_its_pipeline_placed_with_the_zigzag_ring(name, pipeline, args):
    got = compile_target(name).program
    ring = compile_target("zigzag_ring", {"P": 2}).program
    placed = place_on_mesh(compile_target(pipeline, args).program, Mesh((("pp", 2), ("cp", 2))), "pp",
                           ContextParallel("cp", ring), name=name)
    assert got == replace(placed, params=got.params, source=got.source)
    assert {info.placement.split for info in got.stages} == {SEQUENCE_SHARE}
    spec = resolve_target(name).evaluate({})
    assert spec.params == {"P": 2, "C": 2, "N": 4, **({"v": 2} if "v" in args else {})}


def test_a_ring_splits_into_a_forward_half_that_closes_its_exchanges_and_the_rest():
    ring = compile_target("ring_attention", {"P": 4}).program
    forward, backward = split_ring(ring)
    for row, head, tail in zip(ring.ranks, forward.ranks, backward.ranks):
        assert list(head) + list(tail) == list(row)
        assert not any(a.op == "AB" for a in head) and not any(a.op == "AF" for a in tail)
        posted = {a.mb for a in head if a.op == "EXCHANGE"}
        assert posted == {a.mb for a in head if a.op == "EXCHANGE_WAIT"} and len(posted) == 3  # the KV round
    rows = [list(row) for row in ring.ranks]
    rows[0] = [a for a in rows[0] if not (a.op == "EXCHANGE_WAIT" and a.mb == 0)] + [rows[0][2]]
    with pytest.raises(UsageError, match="ring rank 0 cannot run its forward half inside a stage's forward"):
        split_ring(replace(ring, ranks=rows))


@pytest.mark.parametrize("name", ["ring_attention", "zigzag_ring", "tasp"])
def test_a_ring_read_without_its_steps_splits_as_compiled(name):
    # a program file keeps no ring steps: the cut reads the lists alone (the runtime's ``forward_end``)
    for ranks in (2, 3, 5):
        ring = compile_target(name, {"P": ranks}).program
        assert split_ring(replace(ring, rings=replace(ring.rings, steps=None))) == split_ring(ring)


def test_a_weight_passing_pipeline_with_a_context_axis_is_refused_at_the_policy(tmp_path):
    path = tmp_path / "taw.pipe"
    pipeline = 'tawpipe(P = P, G = 1, N = N) from "tawpipe"'
    path.write_text(COMPOSITION.replace('one_f_one_b(P = P, N = N) from "1f1b"', pipeline)
                    .replace("POLICY", 'context over cp ring "zigzag_ring"'))
    with pytest.raises(ScheduleError) as caught:
        lower_spec(resolve_target(str(path)).evaluate({}))
    assert (caught.value.span.line, caught.value.span.col) == (4, 3)
    assert "passes weights; a context axis composes with an activation-passing pipeline" in caught.value.message


def test_split_backward_is_refused_at_the_pipeline(tmp_path):
    path = tmp_path / "zb.pipe"
    path.write_text(COMPOSITION.replace("one_f_one_b(P = P, N = N) from \"1f1b\"", "zbv(P = P, N = N) from \"zbv\"")
                    .replace("POLICY", 'context over cp ring "zigzag_ring"'))
    with pytest.raises(Exception) as caught:
        lower_spec(resolve_target(str(path)).evaluate({}))
    assert "splits its backward (I)" in str(caught.value) and ":3:3:" in str(caught.value)


# ------------------------------------------------------------------ prover

def with_rows(program, change):
    rows = [list(row) for row in program.ranks]
    change(rows)
    return replace(program, ranks=rows)


def position(row, text: str) -> int:
    return [action.text() for action in row].index(text)


def test_cp_members_taking_microbatches_in_different_orders_are_named_at_their_first_disagreement():
    # each compute's ring runs on the stage group's communicator: rank 1's 2nd operation there is 0F2's ring,
    # rank 0's 0F1's (gloo and NCCL match a communicator's operations by issue order)
    program = compile_target("1f1b_cp").program

    def swap(rows):  # member 1 of stage 0 (rank 1) runs 0F2 where member 0 runs 0F1, and back
        i, j = position(rows[1], "0F1"), position(rows[1], "0F2")
        rows[1][i], rows[1][j] = rows[1][j], rows[1][i]

    with pytest.raises(MatchError) as caught:
        check_all(with_rows(program, swap))
    error = caught.value
    assert (error.rank, error.step) == (1, 2) and (0, 2) in error.marks
    assert error.message == (f"the 2nd collective on communicator 0 ({ops.STAGE_GROUP} 0: ranks 0, 1) is 0F2 (the "
                             "stage ring of 0F2 over its group (ranks 0, 1)) here but 0F1 (the stage ring of 0F1 over "
                             "its group (ranks 0, 1)) on rank 0 (step 2): every member must meet its collectives in "
                             "the same order")


def test_a_microbatch_handed_to_the_wrong_cp_member_is_named():
    program = compile_target("1f1b_cp").program

    def misroute(rows):
        at = position(rows[0], "0SEND_F0")
        rows[0][at] = rows[0][at]._replace(peer=3)

    with pytest.raises(MatchError) as caught:
        check_all(with_rows(program, misroute))
    assert (caught.value.rank, caught.value.step) == (0, 1)
    assert caught.value.message == ("0SEND_F0 sends rank 0's share of the activation of 0F0 to rank 3, but stage 1 "
                                    "(on ranks 2, 3) takes that share on rank 2 (rank 3 is at cp 1; the share is at "
                                    "cp 0)")


def test_the_stage_ring_is_proved_with_the_composition_and_its_errors_say_so():
    program = compile_target("1f1b_cp").program
    ring = program.stage_ring
    broken = replace(ring, ranks=[ring.ranks[0][:-1]] + [list(row) for row in ring.ranks[1:]])
    with pytest.raises(MatchError) as caught:
        check_all(replace(program, stage_ring=broken))
    assert caught.value.message.startswith("in the stage ring (zigzag_ring on 2 ranks, ring rank i = member i of "
                                           "every stage's group): ")
    assert caught.value.grid == broken.grid()


def test_tasp_inside_stages_says_when_its_rings_are_fewer_than_a_full_decomposition(tmp_path, capsys):
    """On a cp group of 4 TASP uses 2 of the 3 rings it would want (no decomposition of K*_4 exists): check and
    simulate say so for the composition as they do for the ring alone (the note was dropped when composed),
    also from its program file; zigzag inside says nothing."""
    compose(tmp_path, 'context over cp ring "tasp"', C=4)
    path, saved = tmp_path / "cp.pipe", tmp_path / "cp.json"
    assert main(["compile", str(path), "-D", "C=4", "-o", str(saved)]) == 0
    note = "note: in the stage ring: rings: K*_4 has no decomposition into 3 arc-disjoint directed Hamiltonian rings"
    for argv in (["check", str(path), "-D", "C=4"], ["simulate", str(path), "-D", "C=4"], ["check", str(saved)]):
        capsys.readouterr()
        assert main(argv) == 0
        lines = capsys.readouterr().out.splitlines()
        assert sum(line.startswith(note) for line in lines) == 1, argv
        assert lines[-1].endswith("KV uses the 2 rings found"), argv
    compose(tmp_path, 'context over cp ring "zigzag_ring"', C=4)
    capsys.readouterr()
    assert main(["check", str(path), "-D", "C=4"]) == 0 and "note" not in capsys.readouterr().out


def test_a_member_holds_one_cth_of_its_stages_activations():
    sizes = {"activation": 840}
    alone = peak_bytes(compile_target("1f1b", {"P": 2, "N": 4}).program, sizes)
    for C in (2, 4):
        program = compile_target("1f1b_cp", {"C": C}).program
        per_member = peak_bytes(program, sizes)
        for rank, peaks in enumerate(per_member):
            pp = program.mesh.coords(rank)["pp"]
            assert Fraction(peaks["activation"]) == Fraction(alone[pp]["activation"], C)


# ------------------------------------------------------------------ simulation, traffic, export

BLOCKS = (("AB", 2), ("AF", 1), ("B", 2), ("F", 1), ("I", 1), ("W", 1))


def forwards(result, ranks) -> list:
    """Each rank's first F's duration."""
    return [next(s.end - s.start for s in result.timeline[r] if not s.is_comm and s.action.op == "F") for r in ranks]


def test_zigzag_inside_balances_the_members_attention_and_ring_attention_does_not(tmp_path):
    model = CostModel(ops=BLOCKS)
    zigzag = simulate(compose(tmp_path, 'context over cp ring "zigzag_ring"', C=4), model)
    ring = simulate(compose(tmp_path, 'context over cp ring "ring_attention"', C=4), model)
    assert len(set(forwards(zigzag, range(4)))) == 1
    spread = forwards(ring, range(4))
    assert spread == sorted(spread) and spread[-1] > spread[0]  # the last member meets every block
    # a stage's F is its share of F's cost (1/4) plus the ring's forward half on the member; B likewise
    program = compose(tmp_path, 'context over cp ring "zigzag_ring"', C=4)
    halves = ring_halves(program, (0, 1, 2, 3), model, {})
    assert forwards(zigzag, [0]) == [Fraction(1, 4) + halves.forward[0]]
    backward = next(s.end - s.start for s in zigzag.timeline[0] if not s.is_comm and s.action.op == "B")
    assert backward == Fraction(2, 4) + halves.backward[0] and halves.backward[0] > halves.forward[0]


def test_the_ring_runs_on_the_groups_real_links_and_its_kv_is_traffic(tmp_path):
    program = compose(tmp_path, 'context over cp ring "zigzag_ring"', C=4)
    sizes = (("activation", 4), ("kv", 8))
    one_node = CostModel(ops=BLOCKS, link=Link(0, 8), node_size=4, value_bytes=sizes)
    split = CostModel(ops=BLOCKS, link=Link(0, 8), node_size=2, inter_node=Link(0, 1), value_bytes=sizes)
    near, far = simulate(program, one_node), simulate(program, split)
    assert near.traffic["kv"]["intra"] > 0 and near.traffic["kv"]["inter"] == 0
    assert near.traffic["dkv"]["intra"] > 0
    # nodes of 2: a cp group of 4 spans two nodes, so some ring hops cross the slower link
    assert far.traffic["kv"]["inter"] > 0
    assert forwards(far, [0])[0] > forwards(near, [0])[0]
    assert far.makespan > near.makespan


def test_tasp_inside_stages_beats_a_ring_when_kv_dominates(tmp_path):
    model = CostModel(ops=BLOCKS, link=Link(0, 1), node_size=4, contention=True, value_bytes=(("kv", 8),))
    tasp = simulate(compose(tmp_path, 'context over cp ring "tasp"', C=4), model)
    ring = simulate(compose(tmp_path, 'context over cp ring "zigzag_ring"', C=4), model)
    assert tasp.makespan < ring.makespan
    assert tasp.links["utilisation"] > ring.links["utilisation"]


@pytest.mark.parametrize("with_comms", [False, True])
def test_torch_csv_of_a_cp_composition_is_refused_with_the_reason(with_comms):
    with pytest.raises(UsageError) as caught:
        write_torch_csv(compile_target("1f1b_cp").program, with_comms)
    assert "splits its stages' sequences over a context axis (PP x CP, zigzag_ring inside every stage)" in \
        str(caught.value)


def test_the_cli_checks_simulates_renders_and_compiles_a_cp_composition(tmp_path, capsys):
    out = tmp_path / "cp.json"
    assert main(["compile", "interleaved_1f1b_cp", "-o", str(out)]) == 0
    assert main(["check", str(out)]) == 0
    assert main(["simulate", "1f1b_cp"]) == 0
    assert main(["render", "1f1b_cp", "-o", str(tmp_path / "cp.svg")]) == 0
    shown = capsys.readouterr().out
    assert "ok: interleaved_1f1b_cp" in shown and "1f1b_cp (P=2, C=2, N=4): makespan" in shown
    assert "rank 3: pp 1, cp 1" in (tmp_path / "cp.svg").read_text()


def test_a_ring_of_the_wrong_mask_is_refused_with_the_fix_in_the_compositions_own_words(tmp_path, capsys):
    """The ring is compiled by the composition's `context over` line, so the mask is an argument there: the
    refusal gives that line (was: "compile it with -D causal=true", which the composition refuses, having no
    parameter causal)."""
    pytest.importorskip("torch")
    path = tmp_path / "cp.pipe"
    path.write_text(COMPOSITION.replace("POLICY", 'context over cp ring zigzag_ring(causal = false) from "zigzag_ring"'))
    assert main(["run", str(path), "--steps", "1"]) == 1
    err = capsys.readouterr().err
    fix = 'context over cp ring zigzag_ring(causal = true) from "zigzag_ring"'
    assert "a full-mask ring cannot train it exactly" in err and fix in err and "-D causal" not in err, err
    assert "Traceback" not in err
