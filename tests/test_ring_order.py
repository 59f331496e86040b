"""A sequence ring's order written in the language: `order rank r { at step t { AF(q, kv[, p]) ... } }`.

The derived order stays the default; a written one compiles to a step's blocks exactly as written,
with the derived order's exchanges. What the front end knows (chunks, pieces, holders, steps, the
ring's task kinds) is checked where it is written; what the rings decide (which KV a rank holds at a
step, every visible block once each way, every dK, dV home) is the ring check's to prove.
"""
from __future__ import annotations

import re
import textwrap
from pathlib import Path

import pytest

from pipec.cli import main
from pipec.compiler.driver import compile_target
from pipec.compiler.ir import Action
from pipec.compiler.lower_rings import lower_plan, ring_plan, written_steps
from pipec.errors import CoverageError, EvalError, ParseError, ResolveError, RouteError, ScheduleError, UsageError
from source_util import error_of, located, spec_of

ROOT = Path(__file__).resolve().parents[1]


def _documented() -> str:
    doc = (ROOT / "docs" / "language.md").read_text()
    section = doc[doc.index("## 12. Sequence rings"):]
    return re.search(r"```\n(# Zigzag ring attention, its order written.*?)```", section, re.S).group(1)


# The documented example (docs/language.md, section 12): zigzag, its order written.
ZIGZAG = _documented()
BLOCK = "if t < P { AF(q, k) } else { AB(q, k) }"
assert BLOCK in ZIGZAG and "let h = (r - t) % P" in ZIGZAG


def variant(old: str, new: str, text: str = ZIGZAG) -> str:
    assert old in text, old
    return text.replace(old, new, 1)


def without_order(text: str) -> str:
    """The schedule with its order left out: the compiler derives it."""
    return text[:text.index("  order rank r")] + "}\n"


def compiled(tmp_path: Path, text: str, **params):
    path = tmp_path / "written.pipe"
    path.write_text(text)
    return compile_target(str(path), params)


def line_of(text: str, needle: str) -> int:
    return next(i for i, line in enumerate(text.splitlines(), 1) if needle in line)


# ------------------------------------------------------------- the written order


@pytest.mark.parametrize("P", [2, 3, 4, 5])
def test_written_zigzag_is_the_derived_program(tmp_path, P):
    written = compiled(tmp_path, ZIGZAG, P=P).program
    derived = compile_target("zigzag_ring", {"P": P}).program
    assert written.ranks == derived.ranks
    assert written.rings == derived.rings


def test_evaluation_fills_the_order_and_its_steps():
    spec = spec_of(ZIGZAG, P=2)
    assert spec.rings is not None and spec.policy is None
    # rank 0 holds chunks 0 and 3, rank 1 chunks 1 and 2; one piece: a block is its KV chunk
    assert spec.order == [
        [("AF", 0, 0), ("AF", 3, 0), ("AF", 3, 3), ("AF", 3, 1), ("AF", 3, 2),
         ("AB", 0, 0), ("AB", 3, 0), ("AB", 3, 3), ("AB", 3, 1), ("AB", 3, 2)],
        [("AF", 1, 1), ("AF", 2, 1), ("AF", 2, 2), ("AF", 1, 0), ("AF", 2, 0),
         ("AB", 1, 1), ("AB", 2, 1), ("AB", 2, 2), ("AB", 1, 0), ("AB", 2, 0)],
    ]
    assert spec.task_steps == [[0, 0, 0, 1, 1, 2, 2, 2, 3, 3]] * 2
    assert (spec.order_span.line, spec.order_span.col) == (line_of(ZIGZAG, "order rank r"), 3)


def test_without_an_order_the_ring_is_derived_as_before():
    derived = spec_of(without_order(ZIGZAG), P=4)
    assert derived.order is None and derived.task_steps is None
    assert (derived.order_span.line, derived.order_span.col) == (line_of(ZIGZAG, "sequence chunks"), 3)


def test_three_argument_blocks_name_their_piece(tmp_path):
    # two pieces on the one ring: piece p of KV chunk k is block 2k + p
    text = variant("  rings shift 1\n", "  rings shift 1\n  pieces 2\n")
    # the compiler's order within a step: query chunk, then piece, then KV chunk
    text = variant("for j in 0 .. 2 {", "for pj in 0 .. 4 {\n            let p = pj / 2\n            let j = pj % 2", text)
    text = variant(BLOCK, "if t < P { AF(q, k, p) } else { AB(q, k, p) }", text)
    assert compiled(tmp_path, text, P=3).program.ranks == compiled(tmp_path, without_order(text), P=3).program.ranks
    spec = spec_of(text, P=2)
    assert spec.order[0][:4] == [("AF", 0, 0), ("AF", 0, 1), ("AF", 3, 0), ("AF", 3, 6)]
    # `AF(q, k)` is piece 0: the same blocks as `AF(q, k, 0)`
    only_first = variant("if t < P { AF(q, k, p) }", "if t < P { if p == 0 { AF(q, k) } else { AF(q, k, 1) } }",
                         text)
    assert spec_of(only_first, P=2).order == spec.order


def test_a_step_may_run_its_blocks_in_another_order(tmp_path):
    # the backward steps' blocks reversed within each step: another program, proven all the same
    text = variant("let q = i == 0 ? r : 2 * P - 1 - r", "let q = (i == 0) == (t < P) ? r : 2 * P - 1 - r")
    text = variant("let k = j == 0 ? h : 2 * P - 1 - h", "let k = (j == 0) == (t < P) ? h : 2 * P - 1 - h", text)
    written = compiled(tmp_path, text, P=4).program
    derived = compile_target("zigzag_ring", {"P": 4}).program
    assert written.ranks != derived.ranks
    assert [sorted(map(str, row)) for row in written.ranks] == [sorted(map(str, row)) for row in derived.ranks]
    for mine, theirs in zip(written.ranks, derived.ranks):  # the forward is untouched
        first_ab = next(i for i, action in enumerate(theirs) if action.op == "AB")
        assert mine[:first_ab] == theirs[:first_ab]


@pytest.mark.parametrize("dkv", ["behind", "direct"])
def test_kept_kv_lets_the_backward_run_in_one_step(tmp_path, dkv):
    # under `kv kept` every bundle forward brought stays: each rank runs its whole backward at step P
    text = variant("  rings shift 1\n", f"  rings shift 1\n  kv kept\n  dkv {dkv}\n")
    text = variant("at step t {", "at step t < P ? t : P {", text)
    program = compiled(tmp_path, text, P=4).program
    derived = compiled(tmp_path, without_order(text), P=4).program
    # behind: the dK, dV partials move between backward steps, now after all of them; direct: only at the end
    assert (program.ranks != derived.ranks) == (dkv == "behind")
    for row in program.ranks:  # each rank's backward blocks run at one step, one after another
        at = [i for i, action in enumerate(row) if action.op == "AB"]
        assert at == list(range(at[0], at[0] + len(at)))


# ------------------------------------------------------------ what the check proves


PLANTED = [
    # a backward block left out
    ("skipped", BLOCK, "if t < P { AF(q, k) } else if not (r == 0 and q == 0) { AB(q, k) }", CoverageError,
     "the block (query chunk 0, kv chunk 0, piece 0) is never computed backward"),
    # a forward block left out: named as never computed at its query chunk's first backward
    ("forward skipped", BLOCK, "if t < P { if q != 0 { AF(q, k) } } else { AB(q, k) }", CoverageError,
     "0AB0: the block (query chunk 0, kv chunk 0, piece 0) is never computed forward (1 visible block of chunk 0 "
     "missing), and the block (query chunk 0, kv chunk 0, piece 0) needs its queries' global output and "
     "log-sum-exp"),
    ("twice", BLOCK, "if t < P { AF(q, k) if t == 1 { AF(q, k) } } else { AB(q, k) }", CoverageError,
     "is computed twice forward"),
    ("masked", "if k <= q {", "if true {", CoverageError, "is masked out entirely; it must not be computed"),
    # KV taken from the wrong side of the ring: a bundle the rank does not hold at that step
    ("not held", "let h = (r - t) % P", "let h = (r + t) % P", RouteError,
     "3AF0: the block (query chunk 3, kv chunk 0, piece 0) needs rank 0's KV bundle of piece 0, which this rank "
     "does not hold now"),
    # the backward one step late: its KV has moved on
    ("late", "let h = (r - t) % P", "let h = (r - (t < P ? t : t - 1)) % P", RouteError,
     "which this rank does not hold now"),
]


@pytest.mark.parametrize("name, old, new, error, message", PLANTED, ids=[p[0] for p in PLANTED])
def test_planted_orders_are_refused_by_the_ring_check(tmp_path, capsys, name, old, new, error, message):
    text = variant(old, new)
    with pytest.raises(error) as info:
        compiled(tmp_path, text, P=4)
    assert message in str(info.value)
    path = tmp_path / "planted.pipe"
    path.write_text(text)
    assert main(["check", str(path), "-D", "P=4"]) == 1
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_documented_check_error_is_the_one_pipec_prints(tmp_path, capsys, monkeypatch):
    doc = (ROOT / "docs" / "language.md").read_text()
    shown = re.search(r"```\n\$ pipec check zigzag_written\.pipe -D P=4\n(.*?)```", doc, re.S).group(1)
    (tmp_path / "zigzag_written.pipe").write_text(variant("let h = (r - t) % P", "let h = (r + t) % P"))
    monkeypatch.chdir(tmp_path)
    assert main(["check", "zigzag_written.pipe", "-D", "P=4"]) == 1
    assert capsys.readouterr().err.splitlines()[0] == shown.strip("\n")


def test_a_written_order_under_hamilton_rings_is_proven_too(tmp_path):
    # P = 3: the two Hamiltonian rings of 3 ranks run opposite ways; piece 0 on r -> r + 1, piece 1 on r -> r - 1
    text = textwrap.dedent("""\
        schedule tasp_written(P: ranks = 3) {
          sequence chunks P
          hold chunk c on rank c
          mask full
          rings hamilton
          pieces 2
          order rank r {
            for t in 0 .. 2 * P {
              at step t {
                for p in 0 .. 2 {
                  let k = p == 0 ? (r - t) % P : (r + t) % P
                  if t < P { AF(r, k, p) } else { AB(r, k, p) }
                }
              }
            }
          }
        }
        """)
    program = compiled(tmp_path, text).program
    derived = compiled(tmp_path, without_order(text)).program
    assert program.rings.rings == ((0, 1, 2), (0, 2, 1))
    assert program.ranks == derived.ranks


# ------------------------------------------------------------ where the front end stops


def test_a_block_outside_every_step_is_refused():
    text = variant("      at step t {", "      AF(r, r)\n      at step t {")
    line = line_of(text, "AF(r, r)")
    assert located(error_of(ResolveError, text), line, 7) == (
        "AF(...) is outside every `at step`: in a sequence ring's order every block belongs to a step, "
        "`at step EXPR { ... }` (0..P-1 forward, P..2P-1 backward)")


def test_only_the_rings_tasks_are_written():
    text = variant(BLOCK, "if t < P { F(q, k) } else { AB(q, k) }")
    assert located(error_of(ResolveError, text), line_of(text, "F(q, k)"), 26) == (
        "there is no task F(...) in a sequence ring: its order writes attention blocks, AF(q, kv[, piece]) forward "
        "and AB(q, kv[, piece]) backward")


@pytest.mark.parametrize("old, new, col, message", [
    ("for t in 0 .. 2 * P", "for t in 0 .. 2 * P + 1", 0,
     "step 8 is past a sequence ring's last on 4 rank(s): its steps are 0..3 forward and 4..7 backward (every ring "
     "visits every rank once a pass)"),
    (BLOCK, "if t < P { AF(q + 2 * P, k) } else { AB(q, k) }", 29, "AF(8, 0): query chunk 8 is outside 0..7"),
    (BLOCK, "if t < P { AF(q, k - 1) } else { AB(q, k) }", 32, "AF(0, -1): KV chunk -1 is outside 0..7"),
    (BLOCK, "if t < P { AF(q, k, 1) } else { AB(q, k) }", 35,
     "AF(0, 0, 1): piece 1 is outside 0..0 (one ring: one piece per chunk unless `pieces` says more)"),
])
def test_values_out_of_range_are_located(old, new, col, message):
    text = variant(old, new)
    line = line_of(text, new) if col else line_of(text, "at step t {")  # a step: at its `at step`
    assert located(error_of(EvalError, text), line, col or 15) == message


def test_a_piece_out_of_the_written_pieces():
    text = variant("  rings shift 1\n", "  rings shift 1\n  pieces 2\n")
    text = variant(BLOCK, "if t < P { AF(q, k, 2) } else { AB(q, k) }", text)
    assert located(error_of(EvalError, text), line_of(text, "AF(q, k, 2)"), 35) == (
        "AF(0, 0, 2): piece 2 is outside 0..1")


@pytest.mark.parametrize("new, col, message", [
    ("if t < P { AB(q, k) } else { AB(q, k) }", 26,
     "AB(0, 0) is at step 0, a forward step (0..3 on 4 rank(s)): AB is a backward block, written at steps 4..7, "
     "after every forward block"),
    ("if t < P { AF(q, k) } else { AF(q, k) }", 44,
     "AF(0, 0) is at step 4, a backward step (4..7 on 4 rank(s)): AF is a forward block, written at steps 0..3"),
])
def test_each_pass_writes_its_own_blocks(new, col, message):
    text = variant(BLOCK, new)
    assert located(error_of(ScheduleError, text), line_of(text, new), col) == message


def test_a_block_runs_where_its_queries_are():
    text = variant(BLOCK, "if t < P { AF((q + 1) % (2 * P), k) } else { AB(q, k) }")
    assert located(error_of(ScheduleError, text), line_of(text, "AF((q"), 26) == (
        "AF(1, 0) runs on rank 0, but chunk 1 is held by rank 1: a block runs on the rank that holds its queries")


def test_steps_that_go_back_are_named():
    text = variant("    for t in 0 .. 2 * P {", "    for u in 0 .. 2 * P {\n      let t = u < P ? P - 1 - u : u")
    assert located(error_of(ScheduleError, text), line_of(text, BLOCK), 26) == (
        "AF(7, 2) is at step 2 on rank 0, after AF(7, 6) at step 3: the steps of a rank never go back")


def test_hamilton_and_rails_orders_need_their_pieces():
    text = variant("  rings shift 1\n", "  rings hamilton\n")
    assert located(error_of(ResolveError, text), line_of(text, "order rank r"), 3) == (
        f"an order written block by block needs `pieces EXPR` under `rings hamilton` (line "
        f"{line_of(text, 'rings hamilton')}): its default, one piece per ring, depends on the rings the compiler "
        "finds, and a block names its piece")
    text = variant("  rings shift 1\n", "  rings rails 2, P / 2\n")
    assert "under `rings rails`" in error_of(ResolveError, text).message
    spec_of(variant("  rings shift 1\n", "  rings hamilton\n  pieces 3\n"), P=4)  # written: fine


def test_a_ring_has_one_order():
    text = ZIGZAG[:ZIGZAG.rindex("}")] + "  order rank s { }\n}\n"
    assert located(error_of(ResolveError, text), line_of(text, "order rank s"), 3) == (
        f"a schedule has one order; another is at line {line_of(text, 'order rank r')}")


def test_a_third_argument_is_only_for_a_ring():
    text = textwrap.dedent("""\
        schedule s(P: ranks = 1, N: microbatches = 1) {
          stages 1
          place stage s on rank 0
          order rank r { F(0, 0, 1) B(0, 0) }
        }
        """)
    assert located(error_of(ResolveError, text), 4, 26) == (
        "F(...) takes two arguments, a stage and a microbatch; a third, a KV piece, is for a sequence ring's AF "
        "and AB")
    text = text.replace("F(0, 0, 1)", "AF(0, 0)")
    assert located(error_of(ResolveError, text), 4, 18) == (
        "AF(...) is a sequence ring's task (an attention block): it needs `sequence chunks EXPR`")


def test_four_arguments_do_not_parse():
    text = variant(BLOCK, "if t < P { AF(q, k, 0, 0) } else { AB(q, k) }")
    line = line_of(text, "AF(q, k, 0, 0)")
    assert located(error_of(ParseError, text), line, 36).startswith("unexpected ','; expected ')'")
    # where the parser's state is the examples' (parser.py), the hint says what a task takes
    error = error_of(ParseError, "schedule s(P: ranks) { order rank r { F(r, 0, 1, 2) } }")
    assert error.message.endswith("(a task is `F(stage, microbatch)` (also B, I, W), or in a sequence ring "
                                  "`AF(q, kv)` or `AF(q, kv, piece)` (also AB))")


# ------------------------------------------------------------ the lowering's guard


def test_lowering_refuses_an_order_of_another_shape():
    spec = spec_of(ZIGZAG, P=2)
    plan = ring_plan(spec.rings, 2)
    with pytest.raises(UsageError, match="outside 0..3"):
        written_steps(plan, spec.order, [[4] + steps[1:] for steps in spec.task_steps])
    with pytest.raises(UsageError, match="steps 0..1 run AF, its steps 2..3 AB"):
        written_steps(plan, [[("AB", 0, 0)], []], [[0], []])
    with pytest.raises(UsageError, match="for each of its 2 ranks"):
        written_steps(plan, spec.order, None)
    # lower_plan is pure: the same written steps, the same program, twice
    steps = written_steps(plan, spec.order, spec.task_steps)
    assert lower_plan(plan, written=steps).ranks == lower_plan(plan, written=steps).ranks
    assert steps[0][0] == [Action(0, "AF", 0), Action(3, "AF", 0), Action(3, "AF", 3)]
