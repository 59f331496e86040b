"""The sequence-ring front end: `sequence chunks`, `hold`, `mask`, `rings`, `pieces`, `kv`, `dkv`
and `transfer`, evaluated into a ``RingSpec`` (and the ``ScheduleSpec`` around it), and every
mistake reported where it is written."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from pipec.cli import main
from pipec.compiler.driver import task_kinds
from pipec.dsl import RingSpec, ast, parse, resolve
from pipec.dsl import parser as parser_module
from pipec.dsl.composition import is_composition
from pipec.dsl.limits import MAX_CHUNKS, MAX_RING_BLOCKS, MAX_TASKS, RING_LIMIT_TEXT
from pipec.errors import EvalError, ParseError, ResolveError, SourceErrors
from source_util import error_of, located, messages, spec_of

ROOT = Path(__file__).resolve().parents[1]


ZIGZAG = """\
schedule zigzag_ring(P: ranks = 4, causal: bool = true) {
  require P >= 2 : "a ring needs at least two ranks"
  sequence chunks 2 * P
  hold chunk c on rank c < P ? c : 2 * P - 1 - c
  mask causal when causal
  rings shift 1
  pieces 1
  kv again
  dkv behind
  transfer p2p
}
"""

TASP = """\
schedule tasp(P: ranks = 8) {
  sequence chunks 2 * P
  hold chunk c on rank c < P ? c : 2 * P - 1 - c
  mask causal
  rings hamilton
  transfer all_to_all
}
"""

# A small ring the error tests below break one line at a time.
# Its lines: 2 sequence, 3 hold, 4 mask, 5 rings.
BASE = """\
schedule s(P: ranks = 4) {
  sequence chunks 2 * P
  hold chunk c on rank c % P
  mask causal
  rings shift 1
}
"""


def base(old: str, new: str) -> str:
    assert old in BASE
    return BASE.replace(old, new, 1)


def zigzag(P: int) -> tuple[int, ...]:
    return tuple(c if c < P else 2 * P - 1 - c for c in range(2 * P))


# ------------------------------------------------------------------ evaluation


def test_zigzag_evaluates_to_its_ring_spec_and_layout():
    spec = spec_of(ZIGZAG)
    assert spec.rings == RingSpec(chunks=8, holders=(0, 1, 2, 3, 3, 2, 1, 0), causal=True, rings="shift",
                                  ring_args=(1,), pieces=1, kv="again", dkv="behind", transfer="p2p")
    # one stage per chunk (its queries) on the chunk's holder, one pipeline, one microbatch, no order
    assert (spec.num_ranks, spec.num_stages, spec.num_pipelines, spec.num_microbatches) == (4, 8, 1, 1)
    assert spec.placement == [[0, 1, 2, 3, 3, 2, 1, 0]] and spec.mb_pipeline == [0]
    assert spec.order is None and spec.policy is None and spec.task_steps is None and spec.weights is None
    assert not spec.split_backward and spec.devices is None
    assert (spec.order_span.line, spec.order_span.col) == (3, 3)  # `sequence`: the order derives from it


def test_zigzag_scales_with_its_parameters_and_the_mask_follows_its_condition():
    spec = spec_of(ZIGZAG, P=3, causal="false")
    assert spec.rings == RingSpec(chunks=6, holders=zigzag(3), causal=False, rings="shift", ring_args=(1,),
                                  pieces=1)
    assert spec.placement == [list(zigzag(3))] and spec.params == {"P": 3, "causal": False}


def test_tasp_evaluates_to_hamilton_rings_and_all_to_all():
    spec = spec_of(TASP)
    assert spec.rings == RingSpec(chunks=16, holders=zigzag(8), causal=True, rings="hamilton", ring_args=(),
                                  pieces=None, kv="again", dkv="behind", transfer="all_to_all")


def test_defaults_and_every_mode():
    assert spec_of(BASE).rings == RingSpec(chunks=8, holders=(0, 1, 2, 3) * 2, causal=True, rings="shift",
                                           ring_args=(1,), pieces=None, kv="again", dkv="behind", transfer="p2p")
    spec = spec_of(base("  rings shift 1\n", "  rings shift 1\n  kv kept\n  dkv direct\n  transfer all_to_all\n"
                                             "  pieces 3\n"))
    assert (spec.rings.kv, spec.rings.dkv, spec.rings.transfer, spec.rings.pieces) == ("kept", "direct",
                                                                                       "all_to_all", 3)


@pytest.mark.parametrize("mask, causal", [("mask full", False), ("mask causal", True),
                                          ("mask causal when P > 2", True), ("mask causal when P > 4", False)])
def test_masks(mask, causal):
    assert spec_of(base("mask causal", mask)).rings.causal is causal


@pytest.mark.parametrize("rings, kind, args", [
    ("rings shift 1", "shift", (1,)), ("rings shift -1", "shift", (-1,)), ("rings shift 7", "shift", (7,)),
    ("rings hamilton", "hamilton", ()), ("rings rails 2, 2", "rails", (2, 2)), ("rings rails 1, P", "rails", (1, 4)),
])
def test_rings_keep_their_values_as_written(rings, kind, args):
    spec = spec_of(base("rings shift 1", rings))
    assert (spec.rings.rings, spec.rings.ring_args) == (kind, args)


def test_one_rank_is_a_ring_to_itself():
    spec = spec_of(base("rings shift 1", "rings shift 0"), P=1)
    assert spec.rings.holders == (0, 0) and spec.rings.ring_args == (0,)


def test_declarations_come_in_any_order_with_lets_requires_functions_and_a_device_map():
    spec = spec_of("""\
        schedule s(P: ranks = 4, half: int = 2) {
          rings rails P / half, half
          def far(c) = 2 * P - 1 - c
          let C = 2 * P
          hold chunk c on rank c < P ? c : far(c)
          require C % P == 0 : "equal shares"
          transfer all_to_all
          mask full
          map rank r to device P - 1 - r
          sequence chunks C
        }
        """)
    assert spec.rings == RingSpec(chunks=8, holders=zigzag(4), causal=False, rings="rails", ring_args=(2, 2),
                                  transfer="all_to_all")
    assert spec.devices == [3, 2, 1, 0]


def test_a_microbatches_parameter_is_allowed_and_counts():
    spec = spec_of(base("(P: ranks = 4)", "(P: ranks = 4, N: microbatches = 3)"))
    assert spec.num_microbatches == 3 and spec.mb_pipeline == [0, 0, 0]


def test_a_ranks_parameter_is_still_needed():
    error = error_of(ResolveError, base("(P: ranks = 4)", "(P: int = 4)"))
    assert located(error, 1, 1) == "a schedule needs one parameter of type `ranks`"


def test_shipped_schedules_are_rings_exactly_where_they_declare_sequence():
    for path in sorted((ROOT / "schedules").glob("*.pipe")):
        source = path.read_text()
        for schedule in parse(source, str(path)).schedules:
            if is_composition(schedule):
                continue  # it places another schedule, whose declarations these are (test_compose_language.py)
            spec = resolve(schedule, str(path), source, task_kinds()).evaluate({})
            if any(isinstance(decl, ast.Sequence) for decl in schedule.decls):
                assert spec.rings is not None and spec.order is None and spec.policy is None, path.name
                assert spec.placement == [list(spec.rings.holders)], path.name
            else:
                assert spec.rings is None, path.name


# ------------------------------------------------------------------ the words


def test_new_words_are_reserved_but_the_words_after_them_are_not():
    words = parser_module.keywords()
    assert set("sequence hold chunk mask rings pieces kv dkv transfer chunks".split()) <= words
    assert not set("causal shift hamilton rails again kept behind p2p".split()) & words
    error = error_of(ParseError, base("  mask causal\n", "  let chunk = 1\n  mask causal\n"))
    assert located(error, 4, 7) == "'chunk' is a keyword and cannot be used as a name; pick another name"
    # `causal`, `shift`, ... name parameters and values; they are words only after their keyword
    spec = spec_of(base("(P: ranks = 4)", "(P: ranks = 4, causal: bool = false, shift: int = 3)")
                   .replace("mask causal", "mask causal when causal").replace("shift 1", "shift shift"))
    assert spec.rings.causal is False and spec.rings.ring_args == (3,)


def test_chunks_is_both_a_parameter_type_and_the_word_after_sequence():
    spec = spec_of(base("(P: ranks = 4)", "(P: ranks = 4, v: chunks = 3)").replace("2 * P", "v * P"))
    assert spec.rings.chunks == 12 and spec.params["v"] == 3


@pytest.mark.parametrize("old, new, line, col, message", [
    ("mask causal", "mask foo", 4, 8, "unexpected 'foo'; expected a mask (full, causal)"),
    ("mask causal", "mask split", 4, 8, "unexpected 'split'; expected a mask (full, causal)"),
    ("mask causal", "mask", 5, 3, "unexpected 'rings'; expected a mask (full, causal)"),
    ("rings shift 1", "rings shifty 1", 5, 9, "unexpected 'shifty'; expected rings (shift, hamilton, rails, cycle)"),
    ("rings shift 1", "rings shift1", 5, 9, "unexpected 'shift1'; expected rings (shift, hamilton, rails, cycle)"),
    ("sequence chunks", "sequence", 2, 12, "unexpected '2'; expected 'chunks'"),
    ("rings shift 1", "rings shift 1\n  kv gone", 6, 6, "unexpected 'gone'; expected a KV route (again, kept)"),
    ("rings shift 1", "rings shift 1\n  dkv again", 6, 7, "unexpected 'again'; expected a dKV route (behind, direct)"),
    ("rings shift 1", "rings shift 1\n  transfer ring", 6, 12,
     "unexpected 'ring'; expected a transfer (p2p, all_to_all)"),
])
def test_a_word_of_the_wrong_kind_is_unexpected(old, new, line, col, message):
    assert located(error_of(ParseError, base(old, new)), line, col) == message


# ------------------------------------------------------ resolve-time mistakes


@pytest.mark.parametrize("line, word", [
    ("hold chunk c on rank 0", "hold"), ("mask full", "mask"), ("rings hamilton", "rings"), ("pieces 2", "pieces"),
    ("kv kept", "kv"), ("dkv direct", "dkv"), ("transfer all_to_all", "transfer"),
])
def test_ring_declarations_need_sequence(line, word):
    text = f"""\
schedule s(P: ranks = 2, N: microbatches = 1) {{
  stages 1
  {line}
  place stage s on rank 0
  order rank r {{ if r == 0 {{ F(0, 0) B(0, 0) }} }}
}}
"""
    error = error_of(ResolveError, text)
    assert located(error, 3, 3) == (f"`{word}` belongs to sequence rings: it needs `sequence chunks EXPR` (the "
                                    "chunks the sequence is cut into)")


OTHER = [
    ("stages 2", "stages"), ("pipelines 2", "pipelines"), ("route microbatch m to pipeline 0", "route microbatch"),
    ("place stage s on rank 0", "place"), ("backward split", "backward"),
    ("home microbatch m on rank 0", "home"), ("own layer l on rank 0", "own"), ("group rank r in 0", "group"),
    ("weights ring", "weights"), ("gradients ring", "gradients"), ("prefetch 1", "prefetch"),
    ("buffers 1", "buffers"),
]


@pytest.mark.parametrize("line, word", OTHER)
def test_a_ring_holds_no_declaration_of_the_other_families(line, word):
    error = error_of(ResolveError, base("  mask causal\n", f"  mask causal\n  {line}\n"))
    assert located(error, 5, 3) == (f"`{word}` cannot be written in a sequence ring (`sequence` at line 2): the "
                                    "sequence ring family derives its order (the compiler computes each rank's "
                                    "order of attention blocks: at each step, every visible block of the rank's "
                                    "queries with the KV it holds then) and its layout (`hold`)")


@pytest.mark.parametrize("line, word", [
    ("order greedy { }", "order greedy"), ("order sorted { key F(s, m) = m key B(s, m) = m }", "order sorted"),
])
def test_a_ring_orders_no_policy_and_no_keys(line, word):
    # its order is derived, or written block by block (`order rank r`: tests/test_ring_order.py)
    error = error_of(ResolveError, base("  mask causal\n", f"  mask causal\n  {line}\n"))
    assert located(error, 5, 3) == (f"`{word}` cannot be written in a sequence ring (`sequence` at line 2): the "
                                    "compiler derives its order (each rank's attention blocks: at each step, every "
                                    "visible block of the rank's queries with the KV it holds then), or `order rank "
                                    "r { at step EXPR { AF(q, kv) ... } }` writes it block by block")


def test_only_the_first_declaration_of_another_family_is_reported():
    text = base("  rings shift 1\n", "  rings shift 1\n  stages 2\n  place stage s on rank 0\n  order greedy { }\n")
    assert [(line, col) for line, col, _ in messages(error_of(ResolveError, text))] == [(6, 3)]
    # written before `sequence`, still refused
    text = "schedule s(P: ranks = 4) {\n  stages 2\n" + BASE.split("\n", 1)[1]
    error = error_of(ResolveError, text)
    assert located(error, 2, 3).startswith("`stages` cannot be written in a sequence ring (`sequence` at line 3)")


@pytest.mark.parametrize("drop, message", [
    ("  hold chunk c on rank c % P\n", "a sequence ring needs `hold chunk c on rank EXPR` (the rank that holds each "
                                       "chunk's queries, keys and values)"),
    ("  mask causal\n", "a sequence ring needs its mask written, `mask full`, `mask causal` or `mask causal when "
                        "EXPR`: none is assumed, so that no schedule gets full attention by accident"),
    ("  rings shift 1\n", "a sequence ring needs `rings shift EXPR`, `rings hamilton`, `rings rails EXPR, EXPR` or "
                          "`rings cycle (EXPR, ...)` (the rings KV travels on)"),
])
def test_sequence_needs_hold_mask_and_rings(drop, message):
    assert located(error_of(ResolveError, base(drop, "")), 2, 3) == message


def test_every_missing_declaration_is_reported_at_once():
    error = error_of(SourceErrors, "schedule s(P: ranks = 4) {\n  sequence chunks P\n}\n")
    assert [(line, col) for line, col, _ in messages(error)] == [(2, 3)] * 3


@pytest.mark.parametrize("line, first", [
    ("sequence chunks P", 2), ("hold chunk d on rank 0", 3), ("mask full", 4), ("rings hamilton", 5),
])
def test_each_declaration_is_written_once(line, first):
    error = error_of(ResolveError, BASE.replace("}\n", f"  {line}\n}}\n"))
    assert located(error, 6, 3) == f"`{line.split()[0]}` is already declared at line {first}"


@pytest.mark.parametrize("line", ["pieces 2", "kv kept", "dkv direct", "transfer p2p"])
def test_each_optional_declaration_is_written_once(line):
    error = error_of(ResolveError, BASE.replace("}\n", f"  {line}\n  {line}\n}}\n"))
    assert located(error, 7, 3) == f"`{line.split()[0]}` is already declared at line 6"


@pytest.mark.parametrize("rings, col, message", [
    ("rings shift", 3, "`rings shift` takes one or more values, one ring's offset each: `rings shift EXPR, ...`"),
    ("rings hamilton 3", 18, "`rings hamilton` takes no value: its rings are the arc-disjoint Hamiltonian rings "
                             "of the ranks"),
    ("rings rails 4", 3, "`rings rails` takes two values, the nodes and the ranks per node: `rings rails EXPR, "
                         "EXPR`"),
    ("rings rails 1, 2, 2", 21, "`rings rails` takes two values, the nodes and the ranks per node: `rings rails "
                                "EXPR, EXPR`"),
])
def test_each_kind_of_ring_takes_its_values(rings, col, message):
    assert located(error_of(ResolveError, base("rings shift 1", rings)), 5, col) == message


def test_a_full_mask_takes_no_condition():
    error = error_of(ResolveError, base("mask causal", "mask full when P > 2"))
    assert located(error, 4, 18) == ("`when` says where the mask is causal: write `mask causal when EXPR`; "
                                     "`mask full` takes no condition")


def test_types_are_checked():
    text = (base("2 * P", "P > 1").replace("rank c % P", "rank c > 0").replace("mask causal", "mask causal when P")
            .replace("shift 1", "shift true") + "")
    text = text.replace("}\n", "  pieces false\n}\n")
    assert messages(error_of(SourceErrors, text)) == [
        (2, 19, "a number of chunks must be an integer, not a boolean"),
        (3, 24, "a holder rank must be an integer, not a boolean"),
        (4, 20, "a `when` condition must be a boolean, not an integer"),
        (5, 15, "a ring offset must be an integer, not a boolean"),
        (6, 10, "a number of pieces must be an integer, not a boolean"),
    ]


def test_names_are_resolved_in_a_ring():
    error = error_of(SourceErrors, base("rank c % P", "rank d % Q"))
    assert [m for _, _, m in messages(error)] == ["unknown name 'd'", "unknown name 'Q'"]


# ------------------------------------------------------- evaluation mistakes


@pytest.mark.parametrize("chunks, message", [
    ("0", "the sequence is cut into at least 1 chunk, not 0"),
    ("-8", "the sequence is cut into at least 1 chunk, not -8"),
    ("6", "6 chunks cannot be shared equally by 4 ranks: ring attention gives every rank the same share of the "
          "sequence"),
    ("2", "2 chunks cannot be shared equally by 4 ranks: ring attention gives every rank the same share of the "
          "sequence"),
    ("1004", "the sequence is cut into 1,004 chunks; pipec's limit is 1,000 (a rank runs a forward and a backward "
             "for every pair of a query chunk and a KV chunk it sees)"),
])
def test_chunks_are_a_positive_multiple_of_the_ranks_within_the_limit(chunks, message):
    assert located(error_of(EvalError, base("2 * P", chunks)), 2, 19) == message


def test_holders_are_ranks():
    error = error_of(EvalError, base("c % P", "c % P + c / 4"))
    assert located(error, 3, 24) == "chunk 7 is held by rank 4, outside 0..3"
    error = error_of(EvalError, base("c % P", "c - 1"))
    assert located(error, 3, 24) == "chunk 0 is held by rank -1, outside 0..3"


def test_every_rank_holds_the_same_share():
    error = error_of(EvalError, base("c % P", "c % 3"))
    assert located(error, 3, 24) == ("rank 0 holds 3 chunks and rank 3 holds 0 chunks: ring attention gives every "
                                     "rank the same share of the sequence (2 chunks each)")
    error = error_of(EvalError, base("2 * P", "P").replace("c % P", "c < 2 ? 0 : c"))
    assert located(error, 3, 24) == ("rank 0 holds 2 chunks and rank 1 holds 0 chunks: ring attention gives every "
                                     "rank the same share of the sequence (1 chunk each)")


@pytest.mark.parametrize("by, P, message", [
    ("2", 4, "the ring offset 2 shares the factor 2 with the 4 ranks: the ring r -> r + 2 would visit only 2 of "
             "them; pick an offset coprime with 4"),
    ("-3", 6, "the ring offset -3 shares the factor 3 with the 6 ranks: the ring r -> r + -3 would visit only 2 "
              "of them; pick an offset coprime with 6"),
    ("0", 4, "the ring offset is 0, a multiple of the 4 ranks: every rank would pass its KV to itself"),
    ("-8", 4, "the ring offset is -8, a multiple of the 4 ranks: every rank would pass its KV to itself"),
])
def test_a_shift_is_coprime_with_the_ranks(by, P, message):
    assert located(error_of(EvalError, base("shift 1", f"shift {by}"), P=P), 5, 15) == message


def test_rails_make_the_ranks():
    error = error_of(EvalError, base("shift 1", "rails 2, 3"))
    assert located(error, 5, 15) == "rails of 2 nodes x 3 ranks per node are 6 ranks, not the ring's 4"
    assert (error.span.end_line, error.span.end_col) == (5, 19)  # the caret spans both values
    error = error_of(EvalError, base("shift 1", "rails 0, 4"))
    assert located(error, 5, 15) == "rails have at least 1 node, not 0"
    error = error_of(EvalError, base("shift 1", "rails 4, P - 4"))
    assert located(error, 5, 18) == "rails have at least 1 rank per node, not 0"


def test_hamilton_rings_need_two_ranks():
    error = error_of(EvalError, base("shift 1", "hamilton"), P=1)
    assert located(error, 5, 3) == ("`rings hamilton` needs at least 2 ranks (its rings run over the links between "
                                    "them), not 1")


@pytest.mark.parametrize("pieces", ["0", "-3", "-9223372036854775807"])
def test_pieces_are_at_least_one(pieces):
    error = error_of(EvalError, BASE.replace("}\n", f"  pieces {pieces}\n}}\n"))
    assert located(error, 6, 10) == f"`pieces` must be at least 1, got {pieces}"


def test_attention_tasks_are_bounded():
    error = error_of(EvalError, BASE.replace("}\n", "  pieces 100000\n}\n"))
    assert located(error, 6, 10) == ("s at P=4 has 7,200,000 attention tasks, a forward and a backward for each of "
                                     "3,600,000 blocks (36 pairs of chunks under the causal mask x 100,000 KV "
                                     "pieces); pipec's limit is 2,000,000 tasks (about 1.3 KiB each to compile "
                                     "and simulate)")
    # without `pieces`, one per ring: P - 1 Hamiltonian rings, at `sequence`
    error = error_of(EvalError, base("2 * P", "1000").replace("shift 1", "hamilton"))
    assert located(error, 2, 19) == ("s at P=4 has 3,003,000 attention tasks, a forward and a backward for each of "
                                     "1,501,500 blocks (500,500 pairs of chunks under the causal mask x 3 KV "
                                     "pieces, one per ring); pipec's limit is 2,000,000 tasks (about 1.3 KiB each "
                                     "to compile and simulate)")


def test_the_largest_sequence_fits_the_task_limit():
    # the most chunks fit the task limit; their blocks under a full mask are past the blocks' limit (issue 24,
    # item 4: a ring program is refused up front rather than simulated past 120 s), which names itself
    assert 2 * MAX_CHUNKS * MAX_CHUNKS <= MAX_TASKS
    error = error_of(EvalError, base("2 * P", f"{MAX_CHUNKS}").replace("mask causal", "mask full"))
    assert located(error, 2, 19) == (f"s at P=4 has {MAX_CHUNKS ** 2:,} attention blocks; pipec's limit for a "
                                     f"sequence ring is {MAX_RING_BLOCKS:,} blocks ({RING_LIMIT_TEXT})")
    chunks = 500  # 500 x 501 / 2 blocks under the causal mask: within it
    assert spec_of(base("2 * P", f"{chunks}")).rings.chunks == chunks


# ------------------------------------------------------------------ hostile


def check(tmp_path: Path, capsys, text: str, *defines: str) -> tuple[int, str]:
    """``pipec check`` on ``text``: exit status and stderr; never a traceback (the language's limits bound
    the work: docs/language.md, limits)."""
    path = tmp_path / "hostile.pipe"
    path.write_text(text)
    argv = ["check", str(path)]
    for define in defines:
        argv += ["-D", define]
    status = main(argv)
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return status, err


@pytest.mark.parametrize("text, where", [
    (base("2 * P", "9223372036854775807"), "hostile.pipe:2:19: the sequence is cut into 9,223,372,036,854,775,807"),
    (base("2 * P", "P * P * P * P * P * P * P * P"), "hostile.pipe:2:19: the sequence is cut into"),
    (BASE.replace("}\n", "  pieces -9223372036854775807\n}\n"), "hostile.pipe:6:10: `pieces` must be at least 1"),
    (BASE.replace("}\n", "  pieces 9223372036854775807\n}\n"), "hostile.pipe:6:10: s at P=4 has"),
    (base("shift 1", "shift 9223372036854775806"), "hostile.pipe:5:15: the ring offset 9223372036854775806 shares"),
    (base("shift 1", "rails 9223372036854775807, 9223372036854775807"), "hostile.pipe:5:15: rails of"),
    (base("c % P", "c * 9223372036854775807"), "hostile.pipe:3:24: chunk 1 is held by rank"),
])
def test_hostile_values_are_located_errors(tmp_path, capsys, text, where):
    status, err = check(tmp_path, capsys, text)
    assert status == 1 and re.match(rf"^\S*{re.escape(where)}", err), err
    assert "^" in err  # the source line and a caret


def test_hostile_ranks_are_refused(tmp_path, capsys):
    status, err = check(tmp_path, capsys, BASE, "P=1000000")
    assert status == 1 and "pipec's limit is 4,096 ranks" in err
    status, err = check(tmp_path, capsys, base("2 * P", "P"), "P=4096")
    assert status == 1 and "hostile.pipe:2:19: the sequence is cut into 4,096 chunks" in err


# ------------------------------------------------------------------ the page


def _page_examples() -> list[str]:
    doc = (ROOT / "docs" / "language.md").read_text()
    section = doc[doc.index("## 12. Sequence rings"):doc.index("## 13. Tensor parallelism")]
    return re.findall(r"```\n(# [^\n]*\nschedule .*?)```", section, re.S)


def test_documented_examples_evaluate():
    specs = [spec_of(block) for block in _page_examples()]
    assert [spec.name for spec in specs] == ["zigzag_ring", "tasp", "ring_attention"]
    assert specs[0].rings == spec_of(ZIGZAG).rings
    assert specs[1].rings == spec_of(TASP).rings
    assert specs[2].rings == RingSpec(chunks=4, holders=(0, 1, 2, 3), causal=True, rings="shift", ring_args=(1,))


def test_documented_error_is_the_one_pipec_prints(tmp_path, capsys, monkeypatch):
    doc = (ROOT / "docs" / "language.md").read_text()
    section = doc[doc.index("## 12. Sequence rings"):]
    shown = re.search(r"```\n\$ pipec check zigzag\.pipe -D P=4\n(.*?)```", section, re.S).group(1)
    (tmp_path / "zigzag.pipe").write_text(base("c % P", "c % 3"))
    monkeypatch.chdir(tmp_path)
    assert main(["check", "zigzag.pipe", "-D", "P=4"]) == 1
    assert capsys.readouterr().err.strip("\n") == shown.strip("\n")
