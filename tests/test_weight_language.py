"""The weight-passing front end: `home`, `own`, `group`, `weights`, `gradients`, `prefetch`,
`buffers` and `at step`, evaluated into a ``WeightSpec`` and per-task steps, and every
mistake reported where it is written."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from pipec.compiler.driver import task_kinds
from pipec.dsl import WeightSpec, ast, parse, resolve
from pipec.dsl import parser as parser_module
from pipec.dsl.composition import is_composition
from pipec.errors import EvalError, ParseError, ResolveError, ScheduleError, SourceErrors
from source_util import error_of, located, messages, spec_of

ROOT = Path(__file__).resolve().parents[1]


WEIPIPE = """\
schedule weipipe(P: ranks = 4, A: int = 2, N: microbatches = A * P) {
  require A >= 1 : "at least one microbatch per rank"
  stages P
  home microbatch m on rank m % P
  own layer l on rank (P - l) % P
  weights ring by 1
  gradients ring
  prefetch 0
  order rank r {
    for t in 0 .. A * P + 2 * P - 1 {
      let k = t - r
      at step t {
        if k >= P and k < A * P + P { B(P - 1 - k % P, r + (k / P - 1) * P) }
        if k >= 0 and k < A * P { F(k % P, r + k / P * P) }
      }
    }
  }
}
"""

TAWPIPE = """\
schedule tawpipe(P: ranks = 4, G: int = 2, A: int = 1, N: microbatches = A * P) {
  require P % G == 0 : "the groups split the ranks evenly"
  stages P
  home microbatch m on rank m % P
  own layer l on rank l
  group rank r in r / (P / G)
  weights staged
  prefetch 1
  buffers 2
  order rank r {
    for a in 0 .. A {
      let base = 2 * P * a
      for l in 0 .. P { at step base + l { F(l, r + a * P) } }
      for l in 0 .. P { at step base + P + l { B(P - 1 - l, r + a * P) } }
    }
  }
}
"""

FSDP = """\
schedule fsdp(P: ranks = 4, L: int = 6, N: microbatches = P) {
  stages L
  home microbatch m on rank m % P
  weights all_gather
  order rank r {
    for l in 0 .. L { at step l { for m in r .. N step P { F(l, m) } } }
    for l in 0 .. L { at step L + l { for m in r .. N step P { B(L - 1 - l, m) } } }
  }
}
"""

# A small weight-passing schedule the error tests below break one line at a time.
# Its lines: 3 home, 4 own, 5 weights, 6 order, 7 forwards, 8 backwards.
BASE = """\
schedule s(P: ranks = 4, N: microbatches = 4) {
  stages 2
  home microbatch m on rank m % P
  own layer l on rank l
  weights direct
  order rank r {
    for l in 0 .. 2 { at step l { F(l, r) } }
    for l in 0 .. 2 { at step 2 + l { B(1 - l, r) } }
  }
}
"""


def base(old: str, new: str) -> str:
    assert old in BASE
    return BASE.replace(old, new, 1)


# ------------------------------------------------------------------ evaluation


def weipipe_task(r: int, t: int, P: int, A: int) -> list[tuple[str, int, int]]:
    """WeiPipe's tasks on rank r at step t, written out in Python (stage ids: pipeline r)."""
    k = t - r
    out = []
    if P <= k < A * P + P:
        out.append(("B", r * P + P - 1 - k % P, r + (k // P - 1) * P))
    if 0 <= k < A * P:
        out.append(("F", r * P + k % P, r + k // P * P))
    return out


def test_weipipe_evaluates_to_its_weight_spec_layout_and_steps():
    spec = spec_of(WEIPIPE)
    assert spec.weights == WeightSpec(route="ring", ring_by=1, gradients="ring", owners=(0, 3, 2, 1),
                                      groups=(0, 0, 0, 0), prefetch=0, buffers=None)
    # `home`: one pipeline per rank, every stage of pipeline p on rank p, m rides pipeline m % P
    assert spec.num_pipelines == 4 and spec.num_stages == 4
    assert spec.placement == [[p] * 4 for p in range(4)]
    assert spec.mb_pipeline == [0, 1, 2, 3, 0, 1, 2, 3]
    for r in range(4):
        expected = [(task, t) for t in range(2 * 4 + 2 * 4 - 1) for task in weipipe_task(r, t, 4, 2)]
        assert spec.order[r] == [task for task, _ in expected]
        assert spec.task_steps[r] == [t for _, t in expected]
    assert spec.order[1][:6] == [("F", 4, 1), ("F", 5, 1), ("F", 6, 1), ("F", 7, 1), ("B", 7, 1), ("F", 4, 5)]
    assert spec.task_steps[1][:6] == [1, 2, 3, 4, 5, 5]


def test_weipipe_scales_with_its_parameters():
    spec = spec_of(WEIPIPE, P=3, A=3)
    assert spec.num_microbatches == 9 and spec.weights.owners == (0, 2, 1)
    assert [len(row) for row in spec.order] == [2 * 3 * 3] * 3
    assert [len(row) for row in spec.task_steps] == [2 * 3 * 3] * 3
    assert all(row == sorted(row) for row in spec.task_steps)


def test_ring_offset_is_kept_as_written():
    spec = spec_of(WEIPIPE.replace("weights ring by 1", "weights ring by -1"))
    assert spec.weights.ring_by == -1
    assert spec_of(WEIPIPE.replace("weights ring by 1", "weights ring by 5")).weights.ring_by == 5
    assert spec_of(WEIPIPE.replace("weights ring by 1", "weights ring")).weights.ring_by == 1


def test_tawpipe_groups_staged_weights_and_counts():
    spec = spec_of(TAWPIPE)
    assert spec.weights == WeightSpec(route="staged", ring_by=1, gradients="reduce", owners=(0, 1, 2, 3),
                                      groups=(0, 0, 1, 1), prefetch=1, buffers=2)
    assert spec.order[2] == [("F", 8 + l, 2) for l in range(4)] + [("B", 11 - l, 2) for l in range(4)]
    assert spec.task_steps[2] == list(range(8))
    assert spec_of(TAWPIPE, P=8, G=4, A=2).weights.groups == (0, 0, 1, 1, 2, 2, 3, 3)


def test_fsdp_has_no_owners_and_reduce_scatters():
    spec = spec_of(FSDP, P=2)
    assert spec.weights == WeightSpec(route="all_gather", ring_by=1, gradients="reduce_scatter", owners=None,
                                      groups=(0, 0), prefetch=0, buffers=None)
    assert spec.mb_pipeline == [0, 1] and spec.num_stages == 6
    assert spec.order[1][:2] == [("F", 6, 1), ("F", 7, 1)]
    assert spec.task_steps[1] == list(range(12))


@pytest.mark.parametrize("route, gradients", [("ring", "ring"), ("direct", "direct"), ("staged", "reduce")])
def test_defaults_follow_the_weight_route(route, gradients):
    spec = spec_of(base("weights direct", f"weights {route}"))
    assert spec.weights == WeightSpec(route=route, ring_by=1, gradients=gradients, owners=(0, 1),
                                      groups=(0, 0, 0, 0), prefetch=0, buffers=None)


@pytest.mark.parametrize("route, gradients", [
    ("ring", "direct"), ("ring", "reduce"), ("direct", "reduce"), ("staged", "direct"), ("direct", "direct"),
])
def test_gradient_routes_that_pair_with_a_weight_route(route, gradients):
    spec = spec_of(base("weights direct", f"weights {route}\n  gradients {gradients}"))
    assert (spec.weights.route, spec.weights.gradients) == (route, gradients)


def test_one_rank_rings_to_itself():
    spec = spec_of(base("weights direct", "weights ring by 0").replace("rank l\n", "rank l % P\n"), P=1, N=1)
    assert spec.weights.ring_by == 0 and spec.weights.owners == (0, 0)


def test_equal_steps_and_lets_and_loops_inside_a_step():
    spec = spec_of(base("for l in 0 .. 2 { at step l { F(l, r) } }",
                        "at step 0 { let first = 0\n for l in first .. 2 { if l >= 0 { F(l, r) } } }"))
    assert spec.task_steps[0] == [0, 0, 2, 3]


def test_home_without_weights_is_one_pipeline_per_rank():
    # data parallelism: home alone is an activation-passing schedule with every hand-off local
    spec = spec_of("""\
        schedule dp(P: ranks = 2, N: microbatches = 4) {
          stages 2
          home microbatch m on rank m / 2
          order rank r { for i in 0 .. 2 { F(0, 2 * r + i) F(1, 2 * r + i) B(1, 2 * r + i) B(0, 2 * r + i) } }
        }
        """)
    assert spec.weights is None and spec.task_steps is None
    assert spec.num_pipelines == 2 and spec.mb_pipeline == [0, 0, 1, 1] and spec.placement == [[0, 0], [1, 1]]
    assert spec.order[1][:2] == [("F", 2, 2), ("F", 3, 2)]


def test_shipped_schedules_have_weights_only_where_declared():
    for path in sorted((ROOT / "schedules").glob("*.pipe")):
        source = path.read_text()
        module = parse(source, str(path))
        for schedule in module.schedules:
            if is_composition(schedule):
                continue  # it places another schedule, whose declarations these are (test_compose_language.py)
            spec = resolve(schedule, str(path), source, task_kinds()).evaluate({})
            if any(isinstance(decl, ast.Weights) for decl in schedule.decls):
                assert spec.weights is not None, path.name
                assert [len(row) for row in spec.task_steps] == [len(row) for row in spec.order], path.name
            else:
                assert spec.weights is None and spec.task_steps is None, path.name


def test_documented_examples_evaluate():
    doc = (ROOT / "docs" / "language.md").read_text()
    section = doc[doc.index("## 11. Weight passing"):]
    blocks = re.findall(r"```\n(schedule .*?)```", section, re.S)
    assert len(blocks) == 3
    routes = [spec_of(block).weights.route for block in blocks]
    assert routes == ["ring", "staged", "all_gather"]


# ------------------------------------------------------------------ the words


def test_new_words_are_reserved():
    words = parser_module.keywords()
    new = ("home own layer group weights gradients prefetch buffers at by ring direct staged all_gather "
           "reduce reduce_scatter").split()
    assert set(new) <= words
    error = error_of(ParseError, base("  stages 2", "  let ring = 2\n  stages 2"))
    assert located(error, 2, 7) == "'ring' is a keyword and cannot be used as a name; pick another name"
    error = error_of(ParseError, base("own layer l", "own layer at"))
    assert "'at' is a keyword" in located(error, 4, 13)


def test_documented_reserved_words_are_the_grammars():
    doc = (ROOT / "docs" / "language.md").read_text()
    listed = re.search(r"Reserved words \(keywords\): `([^`]*)`", doc).group(1).split()
    assert set(listed) == set(parser_module.keywords())


def test_a_route_of_the_other_kind_is_unexpected_not_a_name():
    error = error_of(ParseError, base("weights direct", "weights direct\n  gradients staged"))
    assert located(error, 6, 13) == ("unexpected 'staged'; expected a gradient route (ring, direct, reduce, "
                                     "reduce_scatter)")
    error = error_of(ParseError, base("weights direct", "weights reduce"))
    assert located(error, 5, 11) == "unexpected 'reduce'; expected a weight route (ring, direct, staged, all_gather)"
    error = error_of(ParseError, base("weights direct", "weights foo"))
    assert located(error, 5, 11).startswith("unexpected 'foo'; expected a weight route")


# ------------------------------------------------------ resolve-time mistakes


def test_home_cannot_be_combined_with_pipelines_route_or_place():
    text = base("  stages 2\n", "  stages 2\n  pipelines 4\n  route microbatch m to pipeline 0\n"
                                "  place stage s on rank 0\n")
    found = messages(error_of(SourceErrors, text))
    assert [(line, col) for line, col, _ in found] == [(3, 3), (4, 3), (5, 3)]
    assert [m.split("`")[1] for _, _, m in found] == ["pipelines", "route microbatch", "place"]
    assert all("cannot be combined with `home` (line 6)" in m for _, _, m in found)


@pytest.mark.parametrize("line, word", [
    ("own layer l on rank l", "own"),
    ("group rank r in 0", "group"),
    ("gradients direct", "gradients"),
    ("prefetch 1", "prefetch"),
    ("buffers 2", "buffers"),
])
def test_weight_declarations_need_weights(line, word):
    text = base("  own layer l on rank l\n  weights direct\n", f"  {line}\n").replace("at step l { F(l, r) }", "F(l, r)")
    text = text.replace("at step 2 + l { B(1 - l, r) }", "B(1 - l, r)")
    error = error_of(ResolveError, text)
    assert located(error, 4, 3) == (f"`{word}` belongs to weight passing: it needs `weights ROUTE` (ring, direct, "
                                    "staged or all_gather)")


def test_at_step_needs_weights():
    error = error_of(SourceErrors, base("  own layer l on rank l\n  weights direct\n", ""))
    found = messages(error)
    assert [(line, col) for line, col, _ in found] == [(5, 23), (6, 23)]
    assert found[0][2] == "`at step` belongs to weight passing: it needs `weights ROUTE` (ring, direct, staged or all_gather)"


def test_weights_needs_home():
    error = error_of(ResolveError, base("  home microbatch m on rank m % P\n", "  place stage s on rank 0\n"))
    assert located(error, 5, 3).startswith("weight passing needs `home microbatch m on rank EXPR`")


@pytest.mark.parametrize("order", ["order greedy { }", "order sorted { key F(s, m) = m key B(s, m) = m }"])
def test_weights_needs_an_explicit_order(order):
    text = BASE[:BASE.index("  order")] + f"  {order}\n}}\n"
    error = error_of(ResolveError, text)
    assert located(error, 6, 3).startswith("weight passing needs an explicit order, `order rank r { at step EXPR")


def test_every_task_is_inside_a_step():
    error = error_of(ResolveError, base("at step l { F(l, r) }", "F(l, r)"))
    assert located(error, 7, 23) == ("F(...) is outside every `at step`: in a weight-passing schedule every task "
                                     "belongs to a step, `at step EXPR { ... }`")


def test_a_task_outside_a_step_is_found_even_before_weights_is_written():
    text = base("  weights direct\n", "").replace("}\n}\n", "  F(0, r)\n  }\n  weights direct\n}\n")
    error = error_of(ResolveError, text)
    assert located(error, 8, 5).startswith("F(...) is outside every `at step`")


def test_steps_do_not_nest():
    error = error_of(ResolveError, base("at step l { F(l, r) }", "at step l { at step l { F(l, r) } }"))
    assert located(error, 7, 35) == "`at step` inside `at step` (line 7): a task belongs to one step"


def test_own_is_needed_unless_all_gather_and_refused_with_it():
    error = error_of(ResolveError, base("  own layer l on rank l\n", ""))
    assert located(error, 4, 3) == ("`weights direct` needs `own layer l on rank EXPR` (the rank that keeps each "
                                    "layer's master weights)")
    error = error_of(ResolveError, base("weights direct", "weights all_gather"))
    assert located(error, 4, 3).startswith("all_gather shards every layer over every rank")


def test_by_is_only_the_rings():
    error = error_of(ResolveError, base("weights direct", "weights staged by 2"))
    assert located(error, 5, 21) == "`by` is the ring's offset; `weights staged` takes none"


@pytest.mark.parametrize("weights, gradients, message", [
    ("direct", "ring", "`gradients ring` travels with the weights' ring: it needs `weights ring`, not `weights direct`"),
    ("staged", "ring", "`gradients ring` travels with the weights' ring: it needs `weights ring`, not `weights staged`"),
    ("ring", "reduce_scatter", "`gradients reduce_scatter` scatters to the shards of `weights all_gather`; this "
                               "schedule has `weights ring`"),
    ("all_gather", "direct", "`weights all_gather` keeps no owners: its gradients are `reduce_scatter`, not `direct`"),
    ("all_gather", "ring", "`gradients ring` travels with the weights' ring: it needs `weights ring`, not "
                           "`weights all_gather`"),
    ("all_gather", "reduce", "`weights all_gather` keeps no owners: its gradients are `reduce_scatter`, not `reduce`"),
])
def test_gradient_routes_that_do_not_pair(weights, gradients, message):
    text = base("weights direct", f"weights {weights}\n  gradients {gradients}")
    if weights == "all_gather":
        text = text.replace("  own layer l on rank l\n", "  \n")  # keep the line numbers
    error = error_of(ResolveError, text)
    assert located(error, 6, 3) == message


@pytest.mark.parametrize("line, first", [
    ("home microbatch q on rank 0", 3), ("own layer q on rank 0", 4), ("weights ring", 5),
    ("group rank q in 0", 6), ("gradients direct", 6), ("prefetch 1", 6), ("buffers 1", 6),
])
def test_each_declaration_is_written_once(line, first):
    again = f"  {line}\n" * (1 if first < 6 else 2)  # those of BASE once more, the others twice
    text = base("  order rank r {", again + "  order rank r {")
    error = error_of(ResolveError, text)
    assert located(error, 6 if first < 6 else 7, 3) == f"`{line.split()[0]}` is already declared at line {first}"


def test_types_are_checked():
    error = error_of(SourceErrors, base("weights direct", "weights ring by true\n  prefetch false")
                     .replace("at step l {", "at step l == 0 {"))
    assert messages(error) == [
        (5, 19, "a ring offset must be an integer, not a boolean"),
        (6, 12, "a prefetch count must be an integer, not a boolean"),
        (8, 31, "a step must be an integer, not a boolean"),
    ]


# ------------------------------------------------------- evaluation mistakes


def test_home_out_of_range_names_the_microbatch_and_value():
    error = error_of(EvalError, base("m % P", "m + 1"))
    assert located(error, 3, 29) == "microbatch 3 has home rank 4, outside 0..3"
    error = error_of(EvalError, base("m % P", "m - 1"))
    assert located(error, 3, 29) == "microbatch 0 has home rank -1, outside 0..3"


def test_owner_and_group_out_of_range():
    error = error_of(EvalError, base("rank l\n", "rank l + 3\n"))
    assert located(error, 4, 23) == "layer 1 is owned by rank 4, outside 0..3"
    error = error_of(EvalError, base("weights direct", "group rank r in r - 1\n  weights direct"))
    assert located(error, 5, 19) == "rank 0 is in group -1, outside 0..3"
    error = error_of(EvalError, base("weights direct", "group rank r in P\n  weights direct"))
    assert located(error, 5, 19) == "rank 0 is in group 4, outside 0..3"


@pytest.mark.parametrize("by", ["0", "4", "-8"])
def test_ring_offset_a_multiple_of_the_ranks(by):
    error = error_of(EvalError, base("weights direct", f"weights ring by {by}"))
    assert located(error, 5, 19) == (f"the ring offset is {by}, a multiple of the 4 ranks: every rank would pass "
                                     "its slot to itself")


def test_prefetch_and_buffers_bounds():
    error = error_of(EvalError, base("weights direct", "weights direct\n  prefetch -1"))
    assert located(error, 6, 12) == "`prefetch` must be at least 0, got -1"
    error = error_of(EvalError, base("weights direct", "weights direct\n  buffers P - 4"))
    assert located(error, 6, 11) == "`buffers` must be at least 1, got 0"


def test_a_negative_step():
    error = error_of(EvalError, base("at step l {", "at step l - 1 {"))
    assert located(error, 7, 31) == "a step is 0 or more; this one is -1"


def test_steps_going_back_name_both_steps_and_the_rank():
    error = error_of(ScheduleError, base("at step l {", "at step 1 - l {"))
    assert located(error, 7, 39) == ("F(1, 0) is at step 0 on rank 0, after F(0, 0) at step 1: the steps of a "
                                     "rank never go back")
    # across blocks: rank 0's first backward, at step 0, comes after its forwards at steps 0 and 1
    error = error_of(ScheduleError, base("at step 2 + l", "at step l"))
    assert located(error, 8, 35) == ("B(1, 0) is at step 0 on rank 0, after F(1, 0) at step 1: the steps of a "
                                     "rank never go back")
    # on a later rank
    error = error_of(ScheduleError, base("at step 2 + l", "at step r == 2 ? 0 : 2 + l"))
    assert located(error, 8, 52) == ("B(1, 2) is at step 0 on rank 2, after F(1, 2) at step 1: the steps of a "
                                     "rank never go back")


def test_a_task_off_its_home_rank_names_the_home():
    error = error_of(ScheduleError, base("F(l, r)", "F(l, (r + 1) % P)"))
    assert located(error, 7, 35) == ("F(0, 1) runs on rank 0, but microbatch 1's home is rank 1: a microbatch's "
                                     "tasks all run on its home")


def test_a_missing_task_is_named():
    error = error_of(ScheduleError, base("for l in 0 .. 2 { at step 2 + l", "for l in 0 .. 1 { at step 2 + l"))
    assert located(error, 6, 3) == "B(0, 0) is never scheduled: rank 0, microbatch 0's home, must run it"


def test_a_task_scheduled_twice_names_its_first_step():
    error = error_of(ScheduleError, base("at step 2 + l { B(1 - l, r) }", "at step 2 + l { B(1 - l, r) F(0, r) }"))
    assert located(error, 8, 51) == "F(0, 0) is scheduled twice (first at rank 0, at step 0)"


def test_home_gives_one_pipeline_per_rank_within_the_stage_limit():
    error = error_of(EvalError, base("stages 2", "stages 1000"), P=4096, N=1)
    assert located(error, 3, 3).startswith("s at P=4096, N=1 has 4,096,000 stages in all (4,096 pipelines x 1,000 "
                                           "stages); pipec's limit is 2,000,000")
