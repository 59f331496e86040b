"""pipec's Python API (pipec/api.py, docs/api.md): what it returns is what the command line prints, and every
mistake is one of pipec's errors, never a ValueError or a TypeError from inside."""
from __future__ import annotations

import contextlib
import gc
import io
import json

import pytest

import pipec
from pipec.cli import main
from pipec.errors import CostFileError, PipecError, ProgramError, UsageError


def cli(argv: list[str]) -> str:
    """What ``pipec ARGV`` prints (it must succeed)."""
    out = io.StringIO()
    collecting = gc.isenabled()
    try:
        with contextlib.redirect_stdout(out):
            assert main(argv) == 0
    finally:
        if collecting:  # main turns the collector off for its short process; this one goes on
            gc.enable()
    return out.getvalue()


@pytest.mark.parametrize("target, params", [
    ("1f1b", {"P": 4, "N": 8}), ("zbv", {"P": 2, "N": 4}), ("pipedream", {"P": 4, "N": 8}), ("weipipe", {"P": 4, "N": 8}),
])
def test_the_api_and_the_command_line_agree(target, params):
    program = pipec.compile(target, params)
    defines = [arg for name, value in params.items() for arg in ("-D", f"{name}={value}")]
    assert cli(["compile", target, *defines, "--format", "json"]) == program.to_json()
    assert json.loads(cli(["simulate", target, *defines, "--json"])) == program.simulate().to_json()
    assert cli(["compile", target, *defines, "--format", "text"]) == program.to_text()


def test_an_asynchronous_schedule_reports_its_versions():
    step = pipec.compile("pipedream", {"P": 4, "N": 8}).simulate()
    assert step.versions is not None and step.flushed_makespan > step.makespan
    assert pipec.compile("1f1b", {"P": 4, "N": 8}).simulate().versions is None


def test_costs_as_a_file_a_dict_or_a_model_are_one(tmp_path):
    data = {"compute": {"F": 3, "B": 5}}
    (tmp_path / "costs.json").write_text(json.dumps(data))
    model = pipec.api.cost_model(data)
    spans = {pipec.compile("1f1b", {"P": 4, "N": 8}, costs=costs).simulate().makespan
             for costs in (str(tmp_path / "costs.json"), tmp_path / "costs.json", data, model)}
    assert spans == {(8 + 3) * 8}  # (N + P - 1) steps of F + B


def test_a_loaded_program_is_checked_unless_asked_not_to(tmp_path):
    data = json.loads(pipec.compile("1f1b", {"P": 2, "N": 2}).to_json())
    data["ranks"][1] = data["ranks"][1][::-1]  # rank 1's list reversed: a backward before its forward
    edited = json.dumps(data)
    with pytest.raises(ProgramError):
        pipec.load(edited)
    assert pipec.load(edited, check=False).num_ranks == 2
    (tmp_path / "edited.json").write_text(edited)
    with pytest.raises(ProgramError):
        pipec.load(tmp_path / "edited.json")


@pytest.mark.parametrize("call, error, message", [
    (lambda: pipec.compile("1f1b", {"P": 4.5}), UsageError, "params: 'P'"),
    (lambda: pipec.compile("1f1b", [("P", 4)]), UsageError, "params: expected a mapping"),
    (lambda: pipec.compile("no_such_schedule"), UsageError, "no file or shipped schedule named 'no_such_schedule'"),
    (lambda: pipec.compile("1f1b", costs=42), CostFileError, "costs: expected"),
    (lambda: pipec.compile("1f1b", costs={"compute": {"F": -1}}), CostFileError, "compute"),
    (lambda: pipec.compile("1f1b", costs={"compute": {"F": float("nan")}}), CostFileError, "not what a JSON cost file"),
    (lambda: pipec.compile("1f1b", costs={"compute": {1: 2}}), CostFileError, "a key that is not text"),
    (lambda: pipec.compile("1f1b", costs={"compute": {"F": 10**30}}), CostFileError, "outside pipec's range"),
    (lambda: pipec.compile("1f1b", memory_budget=-1), UsageError, "memory_budget: expected a count"),
    (lambda: pipec.compile("1f1b", memory_budget=True), UsageError, "memory_budget: expected a count"),
    (lambda: pipec.compile("1f1b", byte_budget={"activation": 10}), UsageError, "byte_budget activation: needs its size"),
    (lambda: pipec.compile("1f1b", byte_budget={"activations": 10}), UsageError, "unknown size class 'activations'"),
    (lambda: pipec.compile("1f1b", costs={"sizes": {"activation": 1}}, byte_budget={"activation": float("inf")}),
     UsageError, "byte_budget activation: expected a number"),
    (lambda: pipec.compile(4), UsageError, "target: expected a path or a name, got int"),
    (lambda: pipec.load(None), UsageError, "load: expected a path or a name, got NoneType"),
    (lambda: pipec.load("{not json"), UsageError, "<program text>"),
    (lambda: pipec.load('{"format": "pipec-program"}'), PipecError, ""),
    (lambda: pipec.load("[1, 2]"), UsageError, ""),
    (lambda: pipec.load("no/such/file.json"), UsageError, "no/such/file.json"),
    (lambda: pipec.compile("1f1b", {"P": 2}).stages_on(2), UsageError, "rank 2 is out of range"),
    (lambda: pipec.compile("1f1b", {"P": 2}).render("timeline.txt"), UsageError, "cannot tell what to draw"),
    (lambda: pipec.compile("weipipe", {"P": 4}).to_torch_csv(), UsageError, ""),
])
def test_a_mistake_is_a_pipec_error(call, error, message):
    with pytest.raises(error) as raised:
        call()
    assert message in str(raised.value)


def test_check_takes_other_budgets():
    program = pipec.compile("1f1b", {"P": 4, "N": 8})
    program.check(memory_budget=4)
    with pytest.raises(ProgramError, match="over the budget of 2"):
        program.check(memory_budget=2)


def test_a_file_with_several_mistakes_is_a_source_error_located_at_the_first(tmp_path):
    """Every resolution error of a file is raised at once (``SourceErrors``), and it is a ``SourceError``: an API
    user catching source errors catches a file with several mistakes too, located at the first of them."""
    from pipec.errors import SourceError, SourceErrors

    path = tmp_path / "two.pipe"
    path.write_text("schedule s(P: int) {\n  stages 1\n  place stage s on rank 0\n}\n")
    with pytest.raises(SourceError) as caught:
        pipec.compile(path)
    error = caught.value
    assert isinstance(error, SourceErrors) and len(error.errors) >= 2, error.render()
    assert (error.span.line, error.span.col) == (error.errors[0].span.line, error.errors[0].span.col)
    assert str(error) == error.render() == "\n".join(each.render() for each in error.errors)
    assert all(f"{path}:" in each.render() for each in error.errors), error.render()


@pytest.mark.parametrize("value", ["٤", "1_0", "³", "0x4", "4.0"])
def test_the_api_reads_a_parameter_as_minus_d_does(value):
    """A parameter given as text is read as ``-D`` reads it: ASCII digits (was: int(), which takes ``٤`` and
    ``1_0``)."""
    with pytest.raises(UsageError, match=r"P \(ranks\) must be an integer"):
        pipec.compile("1f1b", {"P": value})


@pytest.mark.parametrize("rank, message", [("0", "rank: expected an int, got str '0'"),
                                           (True, "rank: expected an int, got bool True"),
                                           (2, "rank 2 is out of range: 1f1b has 2 ranks")])
def test_a_rank_of_the_wrong_type_is_named_as_such(rank, message):
    """A rank given as text is a rank of the wrong type (was: "rank 0 is out of range", for a program with rank 0)."""
    program = pipec.compile("1f1b", {"P": 2, "N": 2})
    with pytest.raises(UsageError) as caught:
        program.stages_on(rank)
    assert str(caught.value) == message
