"""Hostile ``.pipe`` files: every one is refused (or compiled) quickly, with a located
message and exit status 1, never a traceback, never a pickle loaded from a shared folder.

Each class is bounded once, at its root (``pipec.dsl.limits``): the parser bounds
the file's length, nesting and literals and refuses keywords as names and a
schedule defined twice; the resolver bounds function expansion and refuses
recursion; the evaluator bounds every integer, the loops, the task grid and
the ranks before anything is built.
"""
from __future__ import annotations

import pickle
import re
import tempfile
import time
from pathlib import Path

import pytest

from pipec.cli import main
from pipec.dsl import parse
from pipec.dsl import parser as parser_module
from pipec.dsl.limits import MAX_NESTING, MAX_RANKS, MAX_TASKS

# Refused before work in proportion to the input: each case takes well under a second, so only a hang passes
# this bound, not a loaded machine (the suite runs on two workers).
SECONDS = 30.0


def wrap(pre: str = "", rank: str = "s", body: str | None = None, params: str = "") -> str:
    body = body or "for m in 0 .. N { F(r, m) } for m in 0 .. N { B(r, m) }"
    return (
        f"schedule s(P: ranks = 2, N: microbatches = 2{params}) {{\n{pre}\n  stages P\n"
        f"  place stage s on rank {rank}\n  order rank r {{ {body} }}\n}}\n"
    )


def check(tmp_path: Path, capsys, text: str, *defines: str) -> tuple[int, str, float]:
    """``pipec check`` on ``text``: exit status, stderr, seconds."""
    path = tmp_path / "hostile.pipe"
    path.write_text(text)
    argv = ["check", str(path)]
    for define in defines:
        argv += ["-D", define]
    start = time.perf_counter()
    status = main(argv)
    elapsed = time.perf_counter() - start
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert elapsed < SECONDS, f"took {elapsed:.1f} s"
    return status, err, elapsed


def refused(tmp_path: Path, capsys, text: str, *defines: str, located: bool = True) -> str:
    status, err, _ = check(tmp_path, capsys, text, *defines)
    assert status == 1, err
    if located:
        assert re.match(r"^\S*hostile\.pipe:\d+:\d+: ", err), err
        assert "^" in err  # the source line and a caret
    return err


# ---------------------------------------------------------------- parser cache


def test_parsing_never_reads_or_writes_a_pickle_in_the_temp_folder(tmp_path, monkeypatch):
    shared = tmp_path / "shared-tmp"
    shared.mkdir()
    planted = shared / ".lark_cache_planted.tmp"
    planted.write_bytes(b"not a pickle")
    monkeypatch.setattr(tempfile, "gettempdir", lambda: str(shared))
    monkeypatch.setenv("TMPDIR", str(shared))

    def refuse(*args, **kwargs):
        raise AssertionError("pipec must not unpickle anything to parse")

    monkeypatch.setattr(pickle, "load", refuse)
    monkeypatch.setattr(pickle, "loads", refuse)
    parser_module._parser.cache_clear()  # build the tables now, under the patched temp folder
    try:
        module = parse(wrap(), "t.pipe")
    finally:
        parser_module._parser.cache_clear()
    assert module.schedules[0].name == "s"
    assert sorted(p.name for p in shared.iterdir()) == [planted.name]
    assert planted.read_bytes() == b"not a pickle"


# ---------------------------------------------------------------- nesting


def _shapes(n: int) -> dict[str, str]:
    even = n - n % 2
    return {
        "sum": wrap(rank="s + " + " + ".join(["0"] * n)),
        "product": wrap(rank="s * " + " * ".join(["1"] * n)),
        "minus": wrap(rank="-" * even + "s"),
        "minus_spaced": wrap(rank="- " * even + "s"),
        "not": wrap(rank="(" + "not " * even + "true) ? s : s"),
        "and": wrap(rank="(" + " and ".join(["true"] * n) + ") ? s : s"),
        "or": wrap(rank="(" + " or ".join(["false"] * n) + " or true) ? s : s"),
        "conditional": wrap(rank="true ? " * n + "s" + " : s" * n),
        "min": wrap(rank="min(" * n + "s" + ", s)" * n),
        "if": wrap(body="for m in 0 .. N { " + "if true { " * n + "F(r, m)" + " }" * n + " } for m in 0 .. N { B(r, m) }"),
        "parentheses": wrap(rank="(" * n + "s" + ")" * n),
    }


@pytest.mark.parametrize("shape", sorted(_shapes(1)))
def test_deep_and_long_expressions_are_bounded(tmp_path, capsys, shape):
    status, err, _ = check(tmp_path, capsys, _shapes(10)[shape])
    assert status == 0, err
    # Refused before parsing: past the token limit (or, for the largest, the loader's size limit).
    err = refused(tmp_path, capsys, _shapes(100_000)[shape], located=False)
    assert "limit" in err
    status, err, _ = check(tmp_path, capsys, _shapes(1000)[shape])
    if shape == "parentheses":  # parentheses add no level: 1000 of them are fine
        assert status == 0, err
    else:
        assert status == 1 and re.match(r"^\S*hostile\.pipe:\d+:\d+: nested deeper than 200 levels", err), err


def test_nesting_up_to_the_limit_evaluates(tmp_path, capsys):
    """Just under the limit, in blocks and in expressions at once, the evaluator does not recurse too deep."""
    blocks = MAX_NESTING // 2
    terms = MAX_NESTING // 2 - 10
    body = ("for m in 0 .. N { " + "if true { " * blocks + "F(r, m + " + " + ".join(["0"] * terms) + ")"
            + " }" * blocks + " } for m in 0 .. N { B(r, m) }")
    status, err, _ = check(tmp_path, capsys, wrap(body=body))
    assert status == 0, err


@pytest.mark.parametrize(
    "pre, rank",
    [
        ("  let a = " + " + ".join(["1"] * (MAX_NESTING - 1)), "s"),  # the let, then 199 levels of +
        ("  def f(x) = " + " + ".join(["x"] * (MAX_NESTING - 2)) + "\n  let a = f(P)\n  let b = f(P + 1)", "s"),
        ("", "(" + "not " * (MAX_NESTING - 4) + "true) ? s : s"),
    ],
)
def test_expressions_at_the_limit_resolve_and_evaluate(tmp_path, capsys, pre, rank):
    status, err, _ = check(tmp_path, capsys, wrap(pre, rank=rank))
    assert status == 0, err


def test_one_level_past_the_limit_is_refused_at_the_expression(tmp_path, capsys):
    err = refused(tmp_path, capsys, wrap("  let a = " + " + ".join(["1"] * MAX_NESTING)))
    assert re.match(r"^\S*hostile\.pipe:2:11: nested deeper than 200 levels", err), err


def test_a_function_cannot_call_itself(tmp_path, capsys):
    err = refused(tmp_path, capsys, wrap("  def f(x) = x == 0 ? 0 : f(x - 1)\n  let y = f(3)"))
    assert "function f calls itself (f -> f): recursion is not allowed" in err


def test_functions_cannot_call_each_other_in_a_cycle(tmp_path, capsys):
    err = refused(tmp_path, capsys, wrap("  def f(x) = g(x)\n  def g(x) = f(x)\n  let y = f(1)"))
    assert "function f calls g, defined later (line 3)" in err


@pytest.mark.parametrize("call", ["f{j}(x + 1) + f{j}(x + 2)", "f{j}(x) + f{j}(x)", "f{j}(f{j}(x))"])
def test_functions_that_double_at_each_level_are_bounded(tmp_path, capsys, call):
    defs = "  def f0(x) = x + 1\n" + "".join(f"  def f{i}(x) = {call.format(j=i - 1)}\n" for i in range(1, 40))
    err = refused(tmp_path, capsys, wrap(defs + "  let y = f39(P)"))
    assert "operations (pipec's limit)" in err


def test_calls_cannot_nest_past_the_limit(tmp_path, capsys):
    defs = "  def f0(x) = " + " + ".join(["x"] * 150) + "\n" + "".join(
        f"  def f{i}(x) = 1 + 1 + 1 + 1 + 1 + 1 + 1 + 1 + 1 + 1 + f{i - 1}(x)\n" for i in range(1, 40))
    err = refused(tmp_path, capsys, wrap(defs + "  let y = f39(P)"))
    assert f"pipec's limit is {MAX_NESTING}" in err


BIG_FUNCTION = "  def f(x) = " + " + ".join(["x"] * 150)  # 299 operations: called, not inlined


@pytest.mark.parametrize(
    "text, where",
    [
        (wrap(BIG_FUNCTION, body="for i in 0 .. 10000000 { let y = f(i) } for m in 0 .. N { F(r, m) } "
                                 "for m in 0 .. N { B(r, m) }"), "the loops run more than"),
        (wrap(BIG_FUNCTION + "\n  pipelines 1\n  route microbatch m to pipeline f(m) * 0").replace(
            "N: microbatches = 2", "N: microbatches = 1000000").replace("stages P", "stages 1").replace(
            "rank s", "rank 0"), "the route of each microbatch"),
        (wrap(BIG_FUNCTION).replace("stages P", "stages 1000000").replace("rank s", "rank f(s) * 0").replace(
            "N: microbatches = 2", "N: microbatches = 1"), "the places of each stage"),
    ],
)
def test_evaluation_work_is_bounded_before_it_runs(tmp_path, capsys, text, where):
    err = refused(tmp_path, capsys, text)
    assert where in err and "operations" in err


def test_a_huge_file_is_refused_before_parsing(tmp_path, capsys):
    err = refused(tmp_path, capsys, wrap(body="for m in 0 .. N { F(r, m) } " + "; " * 200_000 + " for m in 0 .. N { B(r, m) }"))
    assert "tokens" in err


# ---------------------------------------------------------------- integers


def test_integer_literals_are_bounded(tmp_path, capsys):
    err = refused(tmp_path, capsys, wrap("  let x = " + "9" * 5000))
    assert "(5000 digits) exceeds pipec's integer limit 2^63" in err
    err = refused(tmp_path, capsys, wrap("  let x = 9223372036854775808"))
    assert "exceeds pipec's integer limit 2^63" in err
    status, err, _ = check(tmp_path, capsys, wrap("  let x = 9223372036854775807"))
    assert status == 0, err


@pytest.mark.parametrize(
    "pre",
    [
        "  let a0 = 10\n" + "".join(f"  let a{i} = a{i - 1} * a{i - 1}\n" for i in range(1, 31)),
        "  let a = 4611686018427387904\n  let b = a + a",
        "  let a = -4611686018427387904\n  let b = a - 4611686018427387904",
        "  def sq(x) = x * x\n  let b = sq(sq(sq(sq(sq(sq(sq(P)))))))",
    ],
)
def test_values_past_the_integer_limit_are_located_errors(tmp_path, capsys, pre):
    err = refused(tmp_path, capsys, wrap(pre))
    assert "the value of this expression exceeds pipec's integer limit 2^63" in err


@pytest.mark.parametrize("bounds", ["0 .. big", "-big .. big", "big .. -big step -1"])
def test_a_loop_bound_past_the_c_range_is_a_located_error(tmp_path, capsys, bounds):
    body = f"for i in {bounds} {{ }} for m in 0 .. N {{ F(r, m) }} for m in 0 .. N {{ B(r, m) }}"
    err = refused(tmp_path, capsys, wrap("  let big = 3000000000 * 3000000000", body=body))
    assert "the loops run more than" in err


def test_a_define_past_the_integer_limit_is_refused(tmp_path, capsys):
    for value in ("9" * 5000, "-9223372036854775808", str(2**70)):
        err = refused(tmp_path, capsys, wrap(params=", k: int = 1"), f"k={value}", located=False)
        assert "k exceeds pipec's integer limit 2^63" in err


# ---------------------------------------------------------------- resources


def test_a_task_grid_past_the_limit_fails_at_once(capsys):
    start = time.perf_counter()
    assert main(["check", "1f1b", "-D", "P=64", "-D", "N=100000"]) == 1
    err = capsys.readouterr().err
    assert time.perf_counter() - start < SECONDS
    assert re.match(r"^\S*1f1b\.pipe:\d+:\d+: ", err), err
    assert ("P=64, N=100000, remat=false has 12,800,000 tasks (2 per stage and microbatch: F, B; x 64 stages x 100,000 "
            f"microbatches); pipec's limit is {MAX_TASKS:,} tasks") in err


def test_ranks_past_the_limit_fail_at_once(capsys):
    start = time.perf_counter()
    assert main(["check", "1f1b", "-D", "P=1000000", "-D", "N=1"]) == 1
    err = capsys.readouterr().err
    assert time.perf_counter() - start < SECONDS
    assert f"P (ranks) is 1,000,000; pipec's limit is {MAX_RANKS:,} ranks" in err


def test_ranks_past_the_limit_in_a_default_are_located(tmp_path, capsys):
    err = refused(tmp_path, capsys, wrap().replace("P: ranks = 2", "P: ranks = 5000"))
    assert f"pipec's limit is {MAX_RANKS:,} ranks" in err


def test_many_pipelines_of_few_tasks_are_bounded(tmp_path, capsys):
    text = wrap("  pipelines 100000000\n  route microbatch m to pipeline 0").replace("stages P", "stages 100")
    err = refused(tmp_path, capsys, text)
    assert "stages in all" in err


# ---------------------------------------------------------------- the language


KEYWORD_USES = {
    "let": "  let {kw} = 1",
    "def": "  def {kw}(x) = x",
    "def parameter": "  def f({kw}) = 1",
}


@pytest.mark.parametrize("keyword", ["for", "step", "key", "int", "ranks", "full", "rank", "true", "schedule"])
@pytest.mark.parametrize("use", sorted(KEYWORD_USES))
def test_keywords_are_not_names(tmp_path, capsys, keyword, use):
    err = refused(tmp_path, capsys, wrap(KEYWORD_USES[use].format(kw=keyword)))
    assert f"'{keyword}' is a keyword and cannot be used as a name" in err


@pytest.mark.parametrize(
    "text",
    [
        wrap(params=", in: int = 1"),
        wrap(body="for in in 0 .. N { F(r, in) } for m in 0 .. N { B(r, m) }"),
        wrap().replace("place stage s on rank s", "place stage of on rank 0"),
        wrap().replace("order rank r", "order rank stage"),
        wrap().replace("schedule s(", "schedule for("),
    ],
)
def test_keywords_are_not_names_anywhere(tmp_path, capsys, text):
    err = refused(tmp_path, capsys, text)
    assert "is a keyword and cannot be used as a name" in err


def test_keywords_come_from_the_grammar():
    words = parser_module.keywords()
    documented = ("schedule require let def stages pipelines route microbatch to pipeline place stage of on rank "
                  "when map device backward full split order greedy inflight deferred warmup priority prefer for "
                  "in step if else and or not true false sorted key ranks microbatches chunks int bool").split()
    assert set(documented) <= set(words)
    assert all(re.fullmatch(r"[a-z_]+", word) for word in words)
    assert not {"F", "B", "min", "max", "P", "N"} & set(words)


def test_a_schedule_name_given_twice_is_an_error(tmp_path, capsys):
    err = refused(tmp_path, capsys, wrap() + wrap())
    assert re.match(r"^\S*hostile\.pipe:7:10: schedule 's' is already defined at line 1", err), err


def test_a_long_source_line_is_quoted_around_the_caret_only(tmp_path, capsys):
    # a generated or hostile line of thousands of characters: the message stays a few short lines
    message = refused(tmp_path, capsys, wrap(pre="let x = " + "-" * 3000 + "1"))
    quoted, caret = message.splitlines()[1:3]
    assert len(quoted) < 140 and quoted.strip().startswith("...") and quoted.endswith("...")
    assert caret.strip().startswith("^") and len(caret) <= len(quoted)
