"""The one guarded reader (``compiler.guarded_read``): every file, JSON document
and number pipec takes from a user, however hostile, is refused quickly, with
exit 1 (argparse's usage errors included: pipec's parser exits 1), a message
naming the file and the limit, and never a traceback."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from pipec.cli import main
from pipec.compiler import guarded_read
from pipec.compiler.guarded_read import (COSTS, TORCH_CSV, is_plain_int, parse_json_text, plain_int, quote,
                                         read_text)
from pipec.errors import CostFileError, UsageError

# Every hostile input is answered within this many seconds (in-process): refused before work in proportion to
# it (each takes well under a second), so only a hang passes this, not a loaded machine (the suite runs on two
# workers).
QUICK_S = 30.0
ESC = "\x1b[31m"


def cli(capsys, *argv: str) -> tuple[int, str, str]:
    """(status, stdout, stderr) of ``pipec ARGV``; argparse's SystemExit counts as a status."""
    start = time.monotonic()
    try:
        status = main(list(argv))
    except SystemExit as done:
        status = done.code
    elapsed = time.monotonic() - start
    out, err = capsys.readouterr()
    assert elapsed < QUICK_S, f"took {elapsed:.1f} s"
    assert "Traceback" not in err
    return status, out, err


def refused(capsys, *argv: str) -> str:
    status, _, err = cli(capsys, *argv)
    assert status == 1, err
    assert err.strip()
    return err


# ----------------------------------------------------------------- files that are not files


def test_dev_zero_as_a_cost_file_is_refused_at_once(capsys):
    err = refused(capsys, "check", "1f1b", "--costs", "/dev/zero")
    assert "/dev/zero" in err and "not a regular file" in err


def test_a_folder_is_refused_as_every_kind_of_input(tmp_path, capsys):
    assert "a folder" in refused(capsys, "check", "1f1b", "--costs", str(tmp_path))
    assert "a folder" in refused(capsys, "costs", "--trace", str(tmp_path))
    assert "a folder" in refused(capsys, "import-torch", str(tmp_path))


def test_a_fifo_as_a_target_never_blocks(tmp_path, capsys):
    fifo = tmp_path / "schedule.pipe"
    os.mkfifo(fifo)
    done = subprocess.run([sys.executable, "-m", "pipec", "check", str(fifo)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 1 and "not a regular file" in done.stderr and "Traceback" not in done.stderr
    previous = signal.signal(signal.SIGALRM, lambda *_: pytest.fail("reading a FIFO blocked"))
    signal.alarm(20)
    try:
        for argv in (["import-torch", str(fifo)], ["check", "1f1b", "--costs", str(fifo)], ["costs", "--trace", str(fifo)]):
            err = refused(capsys, *argv)
            assert str(fifo) in err and "not a regular file" in err
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def test_a_file_over_its_kinds_limit_is_refused_naming_the_limit(tmp_path, capsys):
    big = tmp_path / "big.json"
    with open(big, "wb") as handle:  # sparse: no time spent writing it
        handle.truncate(COSTS.limit + 1)
    err = refused(capsys, "check", "1f1b", "--costs", str(big))
    assert "big.json" in err and "16 MiB limit for a cost file" in err
    csv_file = tmp_path / "big.csv"
    with open(csv_file, "wb") as handle:
        handle.truncate(TORCH_CSV.limit + 1)
    assert "64 MiB limit for a torch schedule CSV" in refused(capsys, "import-torch", str(csv_file))


def test_every_kind_states_its_limit():
    for kind in (guarded_read.SOURCE, guarded_read.COSTS, guarded_read.PROGRAM, guarded_read.TRACE, guarded_read.TORCH_CSV,
                 guarded_read.TOKENS, guarded_read.TEXT):
        assert kind.limit > 0 and kind.limit_text.endswith("iB")


def test_bytes_that_are_not_utf8_are_located(tmp_path):
    path = tmp_path / "x.pipe"
    path.write_bytes(b"schedule s() {\n  \xff }\n")
    with pytest.raises(UsageError, match=r"x.pipe:2:3: the .pipe source is not UTF-8"):
        read_text(str(path), guarded_read.SOURCE)


# ----------------------------------------------------------------- JSON


def test_json_nested_100000_deep_is_a_located_error(tmp_path, capsys):
    deep = tmp_path / "deep.json"
    deep.write_text("[" * 100_000)
    err = refused(capsys, "check", "1f1b", "--costs", str(deep))
    assert "deep.json:1:" in err and "nested deeper than" in err
    err = refused(capsys, "costs", "--trace", str(deep))
    assert "deep.json:1:" in err and "nested deeper than" in err


@pytest.mark.parametrize("text, words", [
    ('{"compute": {"F": 1e999}}', ["costs.json: compute.F: the number 1e999 overflows to infinity (line 1, column 19)"]),
    ('{"compute": {"F": -1E400}}', ["compute.F", "overflows to infinity"]),
    ('{"compute": {"F": Infinity}}', ["compute.F", "Infinity is not a number"]),
    ('{"compute": {"B": NaN}}', ["compute.B", "NaN is not a number"]),
    ('{"links": {"latency": ' + "9" * 5000 + "}}", ["links.latency", "(5000 digits)", "outside pipec's range"]),
    ('{"sizes": {"weight": 123456789012345678901234}}', ["sizes.weight", "outside pipec's range"]),
])
def test_numbers_json_cannot_hold_are_located_errors(tmp_path, capsys, text, words):
    path = tmp_path / "costs.json"
    path.write_text(text)
    err = refused(capsys, "simulate", "1f1b", "--costs", str(path))
    for word in words:
        assert word in err, err


def test_a_trace_with_nan_is_a_located_error(tmp_path, capsys):
    path = tmp_path / "run.json"
    path.write_text('{"traceEvents": [{"ph": "X", "ts": 0, "dur": NaN}]}')
    err = refused(capsys, "costs", "--trace", str(path), "1f1b")
    assert "run.json: traceEvents[0].dur: NaN" in err and "(line 1, column " in err


def test_parse_json_text_keeps_ordinary_numbers():
    assert parse_json_text('{"a": [1, -2, 3.5e10, 1e-400, 9223372036854775807]}', "x") == \
        {"a": [1, -2, 3.5e10, 0.0, 9223372036854775807]}
    with pytest.raises(UsageError, match="outside pipec's range"):
        parse_json_text("[9223372036854775808]", "x")
    with pytest.raises(CostFileError, match=r"x:2:1: not valid JSON"):
        parse_json_text("{\n]", "x", CostFileError)


# ----------------------------------------------------------------- integers written as text


@pytest.mark.parametrize("value", ["1_000", "٣", "³", "0x10", "1e3", "4.0", "", "--1"])
def test_plain_int_takes_ascii_digits_only(value):
    assert not is_plain_int(value)
    with pytest.raises(UsageError, match="ASCII digits"):
        plain_int(value, "x")


def test_plain_int_bounds_digits_and_range():
    assert plain_int(" +42 ", "x") == 42 and plain_int("-7", "x", low=-7) == -7
    for text in ("9" * 5000, str(2**63)):
        with pytest.raises(UsageError, match="outside pipec's integer range"):
            plain_int(text, "x")
    with pytest.raises(UsageError, match="at least 0"):
        plain_int("-1", "x", low=0)


@pytest.mark.parametrize("value", ["1_000", "٣", "³", "4.0", "0x4", "four"])
def test_a_define_must_be_an_ascii_integer_or_a_bool(capsys, value):
    err = refused(capsys, "check", "1f1b", "-D", f"P={value}")
    assert "-D P: the value must be an integer in ASCII digits" in err and "true/false" in err


def test_defines_that_are_plain_still_work(capsys):
    status, out, err = cli(capsys, "check", "1f1b", "-D", "P=+3", "-D", "N= 6 ")
    assert status == 0, err
    assert "P=3, N=6" in out


@pytest.mark.parametrize("key", ["٣", "³", "1_000", "99999999999999999999999"])
def test_cost_file_chunk_keys_are_ascii_integers(tmp_path, capsys, key):
    path = tmp_path / "costs.json"
    path.write_text(json.dumps({"compute": {"per_chunk": {key: {"F": 2}}}}))
    err = refused(capsys, "check", "1f1b", "--costs", str(path))
    assert "costs.json" in err and "compute.per_chunk" in err


def test_cost_file_pair_keys_are_ascii_integers(tmp_path, capsys):
    path = tmp_path / "costs.json"
    path.write_text(json.dumps({"links": {"pairs": {"0-٣": {"latency": 1}}}}))
    assert "ASCII digits" in refused(capsys, "check", "1f1b", "--costs", str(path))


# ----------------------------------------------------------------- torch CSV


@pytest.mark.parametrize("text, words", [
    ("0F1000000000000,0B1000000000000\n", ["microbatch 1000000000000", "2 compute action"]),
    ("1000000000000F0,1000000000000B0\n", ["stage 1000000000000", "2 compute action"]),
    ("0F0,0B0\n" + "9" * 5000 + "F0\n", ["(5000 characters)", "outside pipec's integer range"]),
    ("0F0,0B0\n٣F0\n", ["is not a torch.distributed.pipelining action"]),
    ('0F0,0B0\n"' + "x" * 200_000 + '"\n', ["big.csv:", "field larger than field limit"]),
])
def test_hostile_torch_csvs_are_refused_quickly(tmp_path, capsys, text, words):
    path = tmp_path / "big.csv"
    path.write_text(text)
    err = refused(capsys, "import-torch", str(path))
    for word in words:
        assert word in err, err


def test_a_csv_cell_with_control_characters_is_escaped(tmp_path, capsys):
    path = tmp_path / "evil.csv"
    path.write_text(f"0F0,0B0\n1F0,{ESC}boom,1B0\n")
    err = refused(capsys, "import-torch", str(path))
    assert "\x1b" not in err and "\\x1b" in err


# ----------------------------------------------------------------- command-line numbers


@pytest.mark.parametrize("argv, option", [
    (["check", "1f1b", "--budget", "-1"], "--budget"),
    (["check", "1f1b", "--budget", "٣"], "--budget"),
    (["render", "1f1b", "-o", "x.svg", "--budget", "1_0"], "--budget"),
    (["render", "1f1b", "-o", "x.svg", "--step", "0"], "--step"),
    (["run", "1f1b", "--timeout", "inf"], "--timeout"),
    (["run", "1f1b", "--timeout", "nan"], "--timeout"),
    (["run", "1f1b", "--timeout", "-1"], "--timeout"),
    (["run", "1f1b", "--timeout", "0"], "--timeout"),
    (["run", "1f1b", "--timeout", "1e308"], "--timeout"),
    (["run", "1f1b", "--steps", "-2"], "--steps"),
    (["run", "1f1b", "--nproc", "0"], "--nproc"),
    (["run", "1f1b", "--seed", "1_000"], "--seed"),
])
def test_numeric_options_take_sensible_values_only(capsys, argv, option):
    err = refused(capsys, *argv)
    assert f"argument {option}:" in err


def test_the_worker_refuses_the_same_numbers():
    from pipec.runtime.worker import build_parser

    args = build_parser().parse_args(["1f1b", "--timeout", "2.5", "--steps", "3"])
    assert args.timeout == 2.5 and args.steps == 3
    for bad in (["--timeout", "inf"], ["--timeout", "nan"], ["--steps", "-1"]):
        with pytest.raises(SystemExit):
            build_parser().parse_args(["1f1b", *bad])


# ----------------------------------------------------------------- compiled programs as targets


@pytest.fixture
def program_json(tmp_path, capsys):
    path = tmp_path / "prog.txt"  # recognised by content, not by suffix
    status, out, _ = cli(capsys, "compile", "1f1b", "-D", "P=4", "-D", "N=8", "--format", "json")
    assert status == 0
    path.write_text(out)
    return path


def test_check_accepts_a_compiled_program_with_the_same_line(capsys, program_json):
    status, from_source, _ = cli(capsys, "check", "1f1b", "-D", "P=4", "-D", "N=8")
    assert status == 0
    status, from_program, err = cli(capsys, "check", str(program_json))
    assert status == 0, err
    assert from_program == from_source


def test_a_compiled_program_is_named_where_a_pipe_file_is_needed(capsys, program_json):
    err = refused(capsys, "simulate", str(program_json))
    assert "is JSON" in err and "not a .pipe schedule" in err and "{" not in err.splitlines()[0][:3]
    assert "-D sets parameters" in refused(capsys, "check", str(program_json), "-D", "P=2")


def test_json_that_is_not_a_program_says_what_it_found(tmp_path, capsys):
    path = tmp_path / "other.json"
    path.write_text(json.dumps({"format": ESC + "other"}))
    err = refused(capsys, "check", str(path))
    assert "not a pipec program" in err and "\x1b" not in err
    path.write_text("[1, 2]")
    assert "not a pipec program" in refused(capsys, "check", str(path))


# ----------------------------------------------------------------- untrusted text in messages


def test_quote_escapes_and_shortens():
    assert quote("a\x1bb\u202e") == "'a\\x1bb\\u202e'"
    long = quote("x" * 1000)
    assert len(long) < 100 and "1000 characters" in long
    assert "items" in quote(list(range(10_000)))


def test_a_trace_naming_a_hostile_target_is_escaped(tmp_path, capsys):
    path = tmp_path / "run.json"
    path.write_text(json.dumps({"traceEvents": [], "otherData": {"schedule": ESC + "s", "target": ESC + "t"}}))
    err = refused(capsys, "costs", "--trace", str(path))
    assert "\x1b" not in err and "\\x1b" in err


def test_a_hostile_cost_key_is_escaped(tmp_path, capsys):
    path = tmp_path / "costs.json"
    path.write_text(json.dumps({"compute": {ESC: 1}}))
    err = refused(capsys, "check", "1f1b", "--costs", str(path))
    assert "\x1b" not in err and "\\x1b" in err


def test_byte_budgets_are_bounded_numbers(tmp_path, capsys):
    path = tmp_path / "costs.json"
    path.write_text('{"sizes": {"activation": 4}}')
    err = refused(capsys, "check", "1f1b", "--costs", str(path), "--budget-bytes", "activation=" + "9" * 5000)
    assert "outside pipec's integer range" in err
    err = refused(capsys, "check", "1f1b", "--costs", str(path), "--budget-bytes", "activation=1" + "0" * 400 + ".5")
    assert "write at most 40" in err


def test_a_long_string_is_quoted_with_both_ends():
    """A path's end names its file: a long one keeps it, with its length said."""
    path = "/tmp/" + "a" * 200 + "/schedule.csv"
    shown = guarded_read.quote(path)
    assert shown.startswith("'/tmp/aaa") and shown.endswith("/schedule.csv' (218 characters)") and len(shown) < 100
    long_path = "/tmp/" + "b" * 600 + "/c.json"
    shown = guarded_read.shown_path(long_path)
    assert shown.startswith("/tmp/bbb") and shown.endswith("bbb/c.json") and "...(612 characters)..." in shown
    assert len(shown) < 420
