"""Hostile cases on the compile side (issue 24, round 2): names with terminal escapes, a trace that names
another file, outputs that are no regular file or have long names, program files and attention runs of
hostile sizes, plain integers on the command line, and the size table's errors. Each one ends in a
located pipec error (exit 1, no traceback) or the right answer."""
from __future__ import annotations

import json
import os
import stat

import pytest

from pipec.compiler.atomic_write import check_writable, write_atomically
from pipec.compiler.driver import compile_target
from pipec.compiler.emit import json_program
from pipec.compiler.emit.json_program import program_from_json, program_to_json
from pipec.compiler.memory_counts import check_sizes
from pipec.errors import CostFileError, ImportError_, UsageError, printable_name

from cli_util import cli

ESCAPES = "\x1b[2J\x1b]0;owned\x07\r\nfake: ok\t\u202e\u2066\x7f\x9b"


def raw_controls(text: str) -> list[str]:
    """The characters of ``text`` a terminal would act on, newlines between lines aside."""
    return [c for c in text if (ord(c) < 0x20 and c != "\n") or 0x7f <= ord(c) <= 0x9f or 0x202a <= ord(c) <= 0x202e
            or 0x2066 <= ord(c) <= 0x2069]


# ----------------------------------------------------------------- names with escapes


def test_printable_name_escapes_every_control_and_keeps_a_name_on_one_line():
    shown = printable_name(ESCAPES)
    assert raw_controls(shown) == [] and "\n" not in shown
    assert "\\x1b" in shown and "\\n" in shown and "\\u202e" in shown and "\\t" in shown
    assert printable_name("zb_h1") == "zb_h1"


def test_a_program_files_name_and_parameters_are_escaped_by_check(tmp_path, capsys):
    data = program_to_json(compile_target("zigzag_ring", {"P": "2"}).program)
    data["name"] = "ring" + ESCAPES
    data["params"] = {"P" + ESCAPES: 2}
    path = tmp_path / "evil.json"
    path.write_text(json.dumps(data, ensure_ascii=False), encoding="utf-8")
    status, out, err = cli(capsys, "check", str(path))
    assert status == 0, err
    assert out.count("\n") == 1 and raw_controls(out) == []
    assert out.startswith("ok: ring\\x1b[2J") and "P\\x1b[2J" in out


def test_an_attention_answer_escapes_the_programs_name():
    from pipec.commands.attention import describe

    info = {"name": "zz" + ESCAPES, "pieces": 1, "rings": [[0, 1]], "ranks": 2, "chunks": 4, "holders": [0, 1, 1, 0],
            "causal": True, "kv": "ring", "dkv": "ring", "transfer": "p2p"}
    result = {"program": info, "seq": 8, "batch": 1, "heads": 1, "head_dim": 2, "dtype": "float64", "seed": 0,
              **{k: 0.0 for k in ("out", "dq", "dk", "dv")}, "scale": {k: 1.0 for k in ("out", "dq", "dk", "dv")}}
    text = describe(result)
    assert raw_controls(text) == [] and text.splitlines()[0].startswith("zz\\x1b[2J")


# ----------------------------------------------------------------- a trace naming another file


@pytest.mark.parametrize("command", [["costs"], ["render", "-o", "OUT.svg"]])
def test_a_trace_naming_another_file_prints_no_line_of_it(tmp_path, capsys, command):
    secret = tmp_path / "secret.pipe"
    secret.write_text("root:SECRETLINE:0:0:root:/root:/bin/bash\n")
    trace = tmp_path / "run.json"
    trace.write_text(json.dumps({"traceEvents": [], "otherData": {"schedule": "x", "target": str(secret),
                                                                  "params": {}}}))
    argv = [arg.replace("OUT", str(tmp_path / "out")) for arg in command]
    status, out, err = cli(capsys, *argv, "--trace", str(trace))
    assert status == 1
    assert "SECRETLINE" not in out + err and "/bin/bash" not in out + err
    assert "secret.pipe:1:1" in err and "give TARGET" in err and "run.json" in err


def test_a_target_given_on_the_command_line_still_shows_its_line(tmp_path, capsys):
    bad = tmp_path / "bad.pipe"
    bad.write_text("schedule oops {\n")
    status, _, err = cli(capsys, "check", str(bad))
    assert status == 1 and "schedule oops {" in err  # the file the user named is quoted, as always


# ----------------------------------------------------------------- outputs


def test_a_fifo_target_is_refused_and_left_a_fifo(tmp_path, capsys):
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    status, _, err = cli(capsys, "compile", "1f1b", "-o", str(fifo))
    assert status == 1 and "it is a FIFO, not a regular file" in err
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode)
    with pytest.raises(UsageError, match="FIFO"):
        check_writable(str(fifo))
    assert sorted(os.listdir(tmp_path)) == ["pipe"]  # no temporary left


@pytest.mark.skipif(not os.path.exists("/dev/null"), reason="needs /dev/null")
def test_a_device_target_is_refused_and_left_a_device():
    with pytest.raises(UsageError, match="character device"):
        write_atomically("/dev/null", "x")
    with pytest.raises(UsageError, match="character device"):
        check_writable("/dev/null")
    assert stat.S_ISCHR(os.stat("/dev/null").st_mode)


@pytest.mark.parametrize("name", ["a" * 250, "é" * 127, "b" * 255])
def test_a_legal_long_file_name_is_written(tmp_path, name):
    target = tmp_path / name
    check_writable(str(target))
    write_atomically(str(target), "whole\n")
    write_atomically(str(target), "again\n")  # over an existing file too
    assert target.read_text() == "again\n"
    assert os.listdir(tmp_path) == [name]


# ----------------------------------------------------------------- program files of hostile sizes


def _program_data() -> dict:
    return program_to_json(compile_target("1f1b", {"P": "2", "N": "2"}).program)


def test_a_25_million_microbatch_program_is_refused_by_its_limit():
    data = _program_data()
    data["num_microbatches"] = 25_000_000
    with pytest.raises(ImportError_, match="num_microbatches.*25,000,000.*limit of 2,000,000 tasks"):
        program_from_json(data)


def test_a_program_past_the_rank_limit_is_refused():
    data = _program_data()
    data["num_ranks"] = 5000
    with pytest.raises(ImportError_, match="num_ranks.*limit of 4,096 ranks"):
        program_from_json(data)


def test_a_program_past_the_instruction_limit_is_refused_before_decoding(monkeypatch):
    data = _program_data()
    monkeypatch.setattr(json_program, "MAX_PROGRAM_INSTRUCTIONS", 3)
    with pytest.raises(ImportError_, match="instructions, past pipec's limit of 3"):
        program_from_json(data)


def test_a_25_million_microbatch_program_file_exits_1(tmp_path, capsys):
    data = _program_data()
    data["num_microbatches"] = 25_000_000
    path = tmp_path / "huge.json"
    path.write_text(json.dumps(data))
    status, _, err = cli(capsys, "check", str(path))
    assert status == 1 and "limit of 2,000,000" in err


@pytest.mark.parametrize("devices, words", [([0, 0], "permutation"), ([0, 2**62], "in 0..1"), ([0, -1], "in 0..1")])
def test_program_devices_duplicate_or_huge_are_refused(devices, words):
    data = _program_data()
    data["devices"] = devices
    with pytest.raises(ImportError_, match=words):
        program_from_json(data)


# ----------------------------------------------------------------- attention at a huge size


def test_attention_at_a_huge_size_is_refused_before_any_process(capsys):
    status, _, err = cli(capsys, "attention", "zigzag_ring", "-D", "P=2", "--nproc", "2", "--seq", "4000000000",
                         "--heads", "2", "--head-dim", "8")
    assert status == 1 and "limit is 134,217,728" in err and "--seq" in err
    status, _, err = cli(capsys, "attention", "zigzag_ring", "-D", "P=2", "--nproc", "2", "--seq", "65536",
                         "--heads", "1", "--head-dim", "1")
    assert status == 1 and "attention scores" in err


# ----------------------------------------------------------------- plain integers


@pytest.mark.parametrize("argv", [
    ["demo", "--steps", "-1"], ["demo", "--steps", "1_0"], ["demo", "--steps", "\u0663"],
    ["rings", "1_0"], ["rings", "\u0667"], ["rings", "-7"],
])
def test_integers_on_the_command_line_are_plain_ascii(capsys, argv):
    status, out, err = cli(capsys, *argv)
    assert status == 1 and out == "" and "error" in err


def test_config_integers_are_plain_ascii():
    import dataclasses

    from pipec.runtime.worker import override_config

    @dataclasses.dataclass
    class Config:
        layers: int = 1

    assert override_config(Config(), ["layers=12"]).layers == 12
    for text in ("1_0", "\u0663", "\u00b3", " 1 0"):
        with pytest.raises(UsageError):
            override_config(Config(), [f"layers={text}"])


# ----------------------------------------------------------------- the size table


def test_a_bad_size_table_is_a_pipec_error():
    with pytest.raises(CostFileError, match="unknown size class"):
        check_sizes({"activations": 1})
    for bad in (-1, float("nan"), "3", True):
        with pytest.raises(CostFileError, match="not a non-negative number"):
            check_sizes({"activation": bad})
    check_sizes({"activation": 0, "weight": 2.5})


# ----------------------------------------------------------------- large programs (issue 24, item 4)


@pytest.mark.parametrize("argv, blocks", [(["zigzag_ring", "-D", "P=500"], "500,500"), (["tasp", "-D", "P=79"], "979,758")])
def test_a_sequence_ring_past_the_block_limit_is_refused_up_front(capsys, argv, blocks):
    from pipec.dsl.limits import MAX_RING_BLOCKS

    status, out, err = cli(capsys, "simulate", *argv, "--json")
    assert status == 1 and out == ""
    assert f"has {blocks} attention blocks; pipec's limit for a sequence ring is {MAX_RING_BLOCKS:,} blocks" in err
    assert err.splitlines()[0].startswith("schedules/") or ".pipe:" in err.splitlines()[0]  # located


@pytest.mark.parametrize("argv", [["weipipe", "-D", "P=700"], ["tawpipe", "-D", "P=700"], ["fsdp", "-D", "P=4096"],
                                  ["fsdp", "-D", "P=200"]])
def test_a_large_weight_passing_program_is_refused_naming_the_limit(capsys, argv):
    from pipec.dsl.limits import MAX_PASSING_STEP_CELLS, MAX_TASKS

    status, out, err = cli(capsys, "simulate", *argv, "--json")
    assert status == 1 and out == "" and ".pipe:" in err.splitlines()[0]
    assert f"limit of {MAX_PASSING_STEP_CELLS:,}" in err or f"limit is {MAX_TASKS:,} tasks" in err


def test_weight_passing_within_the_limit_still_compiles():
    program = compile_target("weipipe", {"P": "16", "N": "256"}).program
    assert program.num_ranks == 16 and program.instruction_count() > 0
