"""The front end: parsing, resolution, evaluation and the checks made where a task is written."""
from __future__ import annotations

import pytest

from pipec.errors import (
    EvalError,
    ParseError,
    RequireError,
    ResolveError,
    ScheduleError,
    SourceErrors,
    UsageError,
)
from source_util import error_of, spec_of


ONE_F_ONE_B = """
schedule one_f_one_b(P: ranks = 4, N: microbatches = 2 * P) {
  require N >= P : "1F1B needs at least as many microbatches as ranks"
  stages P
  place stage s on rank s
  order rank r {
    let warm = min(P - 1 - r, N)
    for m in 0 .. warm     { F(r, m) }
    for i in 0 .. N - warm { F(r, warm + i); B(r, i) }
    for m in N - warm .. N { B(r, m) }
  }
}
"""


def test_explicit_order_evaluates_per_rank():
    spec = spec_of(ONE_F_ONE_B, P=3, N=4)
    assert spec.num_ranks == 3 and spec.num_microbatches == 4 and spec.num_stages == 3
    assert spec.placement == [[0, 1, 2]]
    assert spec.order[0] == [("F", 0, 0), ("F", 0, 1), ("F", 0, 2), ("B", 0, 0), ("F", 0, 3), ("B", 0, 1), ("B", 0, 2), ("B", 0, 3)]
    assert spec.order[2] == [("F", 2, 0), ("B", 2, 0), ("F", 2, 1), ("B", 2, 1), ("F", 2, 2), ("B", 2, 2), ("F", 2, 3), ("B", 2, 3)]


def test_defaults_refer_to_earlier_parameters_and_minus_d_text_is_typed():
    spec = spec_of(ONE_F_ONE_B, P="5")
    assert spec.params == {"P": 5, "N": 10}


def test_arithmetic_has_floor_semantics_and_functions():
    spec = spec_of(
        """
        schedule s(P: ranks = 2, N: microbatches = 2, k: int = -7) {
          def half(x) = x / 2
          def pick(a, b) = a < b ? a : b
          require half(k) == -4 : "floor division"
          require k % 3 == 2 : "floor modulo"
          require pick(half(9), 1) == 1 and abs(k) == 7 and max(1, 5, 3) == 5 : "builtins and nested calls"
          require not (1 > 2) or false : "logic"
          stages P
          place stage s on rank s
          order rank r { for m in 0 .. N { F(r, m) } for m in N - 1 .. -1 step -1 { B(r, m) } }
        }
        """
    )
    assert spec.order[1][-2:] == [("B", 1, 1), ("B", 1, 0)]


def test_require_violated_names_message_and_values():
    error = error_of(RequireError, ONE_F_ONE_B, P=4, N=2)
    text = error.render()
    assert text.startswith("t.pipe:3:3: requirement failed: 1F1B needs at least as many microbatches as ranks")
    assert "P=4, N=2" in text
    assert "\n      require N >= P" in text and "\n      ^" in text


def test_parse_error_has_location_caret_and_hint():
    error = error_of(ParseError, "schedule s(P: ranks, N: microbatches) {\n  order rank r { for m in 0 to N { F(r, m) } }\n}\n")
    text = error.render()
    assert text.startswith("t.pipe:2:29: unexpected 'to'")
    assert "a .. b" in text
    lines = text.splitlines()
    assert lines[2].index("^") == lines[1].index("to")


def test_unexpected_end_of_file_and_bad_character():
    assert "unexpected end of file" in error_of(ParseError, "schedule s(P: ranks) {").render()
    assert "unexpected character '$'" in error_of(ParseError, "schedule s(P: ranks) { stages $ }").render()


def test_resolution_errors_are_collected_and_reported_together():
    error = error_of(
        SourceErrors,
        """
        schedule s(P: ranks, N: microbatches) {
          stages Q
          place stage s on rank s + true
          order rank r { if 3 { F(r, m) } }
        }
        """,
    )
    messages = [e.message for e in error.errors]
    assert any("unknown name 'Q'" in m for m in messages)
    assert any("right operand of '+' must be an integer" in m for m in messages)
    assert any("an `if` condition must be a boolean" in m for m in messages)
    assert any("unknown name 'm'" in m for m in messages)
    assert all(e.span.file == "t.pipe" for e in error.errors)


def test_shadowing_and_builtin_names_are_rejected():
    error = error_of(
        ResolveError,
        "schedule s(P: ranks, N: microbatches) { stages P place stage s on rank s order rank r { let P = 1 } }",
    )
    assert "'P' is already defined" in error.message


def test_schedule_needs_ranks_and_microbatches_parameters_and_an_order():
    error = error_of(SourceErrors, "schedule s(P: int) { stages 1 place stage s on rank 0 }")
    messages = " | ".join(e.message for e in error.errors)
    assert "`ranks`" in messages and "`microbatches`" in messages and "needs an order" in messages


def test_stage_with_two_homes_is_named():
    error = error_of(
        ScheduleError,
        """
        schedule s(P: ranks = 2, N: microbatches = 2) {
          stages 2
          place stage s on rank s
          place stage s on rank 1 - s when s == 1
          order rank r { F(r, 0) }
        }
        """,
    )
    assert "stage 1 has two homes: rank 1 (line 4) and rank 0" in error.message
    assert error.span.line == 5


def test_stage_without_home():
    error = error_of(
        ScheduleError,
        "schedule s(P: ranks = 2, N: microbatches = 2) { stages 3 place stage s on rank s when s < 2 order rank r { } }",
    )
    assert "stage 2 has no home" in error.message


def test_duplicated_task_points_at_second_occurrence():
    error = error_of(
        ScheduleError,
        """
        schedule s(P: ranks = 2, N: microbatches = 2) {
          stages P
          place stage s on rank s
          order rank r {
            for m in 0 .. N { F(r, m) }
            for m in 0 .. N { B(r, m) }
            B(r, 1)
          }
        }
        """,
    )
    assert error.message == "B(0, 1) is scheduled twice (first at rank 0, step 3)"
    assert error.span.line == 8


def test_missing_task_is_named():
    error = error_of(
        ScheduleError,
        """
        schedule s(P: ranks = 2, N: microbatches = 3) {
          stages P
          place stage s on rank s
          order rank r { for m in 0 .. N { F(r, m) } for m in 0 .. N - 1 { B(r, m) } }
        }
        """,
    )
    assert "B(0, 2) is never scheduled" in error.message


def test_task_on_wrong_rank_and_out_of_range():
    wrong = error_of(
        ScheduleError,
        "schedule s(P: ranks = 2, N: microbatches = 1) { stages P place stage s on rank s order rank r { F(0, 0) } }",
    )
    assert "F(0, 0) runs on rank 1, but stage 0 is placed on rank 0" in wrong.message
    out = error_of(
        EvalError,
        "schedule s(P: ranks = 2, N: microbatches = 1) { stages P place stage s on rank s order rank r { F(r, 5) } }",
    )
    assert "microbatch 5 is outside 0..0" in out.message


def test_division_by_zero_is_located():
    error = error_of(
        EvalError,
        "schedule s(P: ranks = 2, N: microbatches = 1, z: int = 0) { let q = P / z stages P place stage s on rank s order rank r { } }",
    )
    assert "division by zero" in error.message and error.span.col == 73  # the divisor


def test_split_backward_is_declared():
    error = error_of(
        SourceErrors,
        "schedule s(P: ranks = 1, N: microbatches = 1) { stages 1 place stage s on rank 0 order rank r { F(0, 0) I(0, 0) W(0, 0) } }",
    )
    assert [e.message.split(" ")[0] for e in error.errors] == ["I(...)", "W(...)"]
    assert all("needs `backward split`" in e.message for e in error.errors)


def test_unknown_and_ill_typed_parameters_are_usage_errors():
    with pytest.raises(UsageError, match="has no parameter Q; its parameters are P: ranks, N: microbatches"):
        spec_of(ONE_F_ONE_B, Q=1)
    with pytest.raises(UsageError, match="must be an integer"):
        spec_of(ONE_F_ONE_B, P="four")
    with pytest.raises(UsageError, match="at least 1"):
        spec_of(ONE_F_ONE_B, P=0)


def test_replicated_pipelines_route_and_device_map():
    spec = spec_of(
        """
        schedule two(P: ranks = 4, N: microbatches = 4) {
          stages 2 * P
          pipelines 2
          route microbatch m to pipeline m % P < P / 2 ? 0 : 1
          place stage s of pipeline p on rank s < P ? s : 2 * P - 1 - s when p == 0
          place stage s of pipeline p on rank s < P ? P - 1 - s : s - P when p == 1
          map rank r to device r % 2 == 0 ? r : P - r
          order greedy { prefer B, F }
        }
        """,
        P=8,
        N=8,
    )
    assert spec.mb_pipeline == [0, 0, 0, 0, 1, 1, 1, 1]
    assert spec.placement[0] == [0, 1, 2, 3, 4, 5, 6, 7, 7, 6, 5, 4, 3, 2, 1, 0]
    assert spec.placement[1] == [7, 6, 5, 4, 3, 2, 1, 0, 0, 1, 2, 3, 4, 5, 6, 7]
    assert spec.devices == [0, 7, 2, 5, 4, 3, 6, 1]


def test_device_map_must_be_a_permutation():
    error = error_of(
        EvalError,
        "schedule s(P: ranks = 2, N: microbatches = 1) { stages P place stage s on rank s map rank r to device 0 order greedy { } }",
    )
    assert "permutation" in error.message


def test_greedy_policy_values():
    spec = spec_of(
        """
        schedule g(P: ranks = 3, N: microbatches = 3) {
          stages P
          place stage s on rank s
          backward split
          order greedy {
            inflight on rank r <= P - r
            prefer I, F
            priority F(s, m) = (m, -s)
          }
        }
        """
    )
    policy = spec.policy
    assert policy.inflight == [3, 2, 1] and policy.warmup == [None, None, None]
    assert policy.prefer == ("I", "F", "B", "W")
    assert policy.priority("F", 2, 1) == (1, -2)
    assert policy.priority("W", 2, 1) == ()


DEFERRED = """
schedule g(P: ranks = 3, N: microbatches = 6) {
  stages P
  place stage s on rank s
  backward BACKWARD
  order greedy {
    inflight on rank r <= P - r
    deferred on rank r <= LIMIT
    prefer I, F, W
  }
}
"""


def test_deferred_bounds_the_weight_gradients_a_rank_leaves_waiting():
    from pipec.compiler.list_schedule import greedy_order

    def most_waiting(limit: str) -> list[int]:
        spec = spec_of(DEFERRED.replace("BACKWARD", "split").replace("LIMIT", limit))
        out = []
        for row in greedy_order(spec):
            waiting = most = 0
            for kind, _, _ in row:
                waiting += {"I": 1, "W": -1}.get(kind, 0)
                most = max(most, waiting)
            out.append(most)
        return out

    assert spec_of(DEFERRED.replace("BACKWARD", "split").replace("LIMIT", "r + 1")).policy.deferred == [1, 2, 3]
    assert most_waiting("1") == [1, 1, 1]
    assert most_waiting("r + 1") == [min(r + 1, w) for r, w in enumerate(most_waiting("100"))]
    assert max(most_waiting("100")) > 3  # without the limit W waits longer: the limit is what bounds it


def test_deferred_needs_split_backward_and_a_positive_limit():
    error = error_of(ResolveError, DEFERRED.replace("BACKWARD", "full").replace("LIMIT", "1"))
    assert "`deferred` bounds the W tasks that wait" in error.message and "backward split" in error.message
    error = error_of(EvalError, DEFERRED.replace("BACKWARD", "split").replace("LIMIT", "r - 1"))
    assert "the deferred of rank 0 is -1; it must be at least 1 (no I could run)" in error.message
    twice = DEFERRED.replace("BACKWARD", "split").replace("LIMIT", "1\n    deferred on rank q <= 2")
    assert "`deferred` is already given at line 8" in error_of(ResolveError, twice).message


def test_source_files_with_several_schedules_pick_by_name():
    text = ONE_F_ONE_B + "\nschedule other(P: ranks = 1, N: microbatches = 1) { stages 1 place stage s on rank 0 order rank r { F(0, 0) B(0, 0) } }\n"
    assert spec_of(text, name="other").name == "other"


def test_sorted_order_sorts_each_ranks_tasks_by_key():
    spec = spec_of(
        """
        schedule s(P: ranks = 2, N: microbatches = 3) {
          stages P
          place stage s on rank s
          order sorted {
            key F(s, m) = 2 * m + s
            key B(s, m) = (2 * m + 2 * P - s, 0)
          }
        }
        """
    )
    # rank 1: F keys 1, 3, 5; B keys 2*m + 3 -> 3, 5, 7 (ties: F before B)
    assert spec.order[1] == [("F", 1, 0), ("F", 1, 1), ("B", 1, 0), ("F", 1, 2), ("B", 1, 1), ("B", 1, 2)]


def test_sorted_order_needs_every_key():
    error = error_of(
        ResolveError,
        "schedule s(P: ranks = 2, N: microbatches = 1) { stages P place stage s on rank s order sorted { key F(s, m) = m } }",
    )
    assert "needs a key for every kind" in error.message and "key B(s, m)" in error.message


def test_a_default_refused_at_the_values_given_names_them():
    """``-D P=0`` on a composition makes ``N = 2 * P`` zero: the error names the default and P, the value to
    change (was: only "N (microbatches) must be at least 1, got 0")."""
    from pipec.compiler.driver import compile_target
    from pipec.errors import EvalError

    with pytest.raises(EvalError) as caught:
        compile_target("1f1b_dp", {"P": 0, "D": 3})
    assert caught.value.message == ("N (microbatches) must be at least 1, got 0 (its default, 2 * P, at P=0: give P "
                                    "another value, or -D N=...)")
