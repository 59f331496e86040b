"""The command line: outputs other tools depend on, exit statuses, and no traceback ever."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from pipec.cli import main
from pipec.compiler.driver import shipped_schedules


def run(capsys, *argv: str) -> tuple[int, str, str]:
    status = main(list(argv))
    out, err = capsys.readouterr()
    return status, out, err


def test_list_shows_every_shipped_schedule_with_parameters(capsys):
    status, out, _ = run(capsys, "list")
    assert status == 0
    for name in ("gpipe", "1f1b", "interleaved_1f1b", "zb_h1", "zbv", "chimera", "bitpipe"):
        assert name in shipped_schedules()
        assert any(line.startswith(name + " ") for line in out.splitlines())
    assert "v: chunks = 2" in out
    status, out, _ = run(capsys, "list", "--json")
    rows = {row["name"]: row for row in json.loads(out)}
    assert {"name": "P", "type": "ranks", "default": "4"} in rows["1f1b"]["params"]


def test_check_prints_one_line_and_exits_zero(capsys):
    status, out, err = run(capsys, "check", "1f1b", "-D", "P=4", "-D", "N=8")
    assert status == 0 and err == ""
    assert out.count("\n") == 1 and out.startswith("ok: 1f1b (P=4, N=8, remat=false)")


def test_compile_json_has_ranks_of_instructions_with_op_and_text(capsys):
    status, out, _ = run(capsys, "compile", "1f1b", "-D", "P=2", "-D", "N=2", "--format", "json")
    assert status == 0
    data = json.loads(out)
    assert isinstance(data["ranks"], list) and len(data["ranks"]) == 2
    for row in data["ranks"]:
        for instruction in row:
            assert "op" in instruction and "text" in instruction
    texts = [i["text"] for i in data["ranks"][1]]
    assert "1F0" in texts and "1B1" in texts


def test_compile_torch_csv_has_one_row_per_rank(capsys, tmp_path):
    target = tmp_path / "out.csv"
    status, _, _ = run(capsys, "compile", "interleaved_1f1b", "-D", "P=4", "-D", "N=4", "--format", "torch-csv", "-o", str(target))
    assert status == 0
    rows = target.read_text().strip().splitlines()
    assert len(rows) == 4 and rows[0].split(",")[0] == "0F0"


def test_simulate_json_keys_and_exact_bubble(capsys):
    status, out, _ = run(capsys, "simulate", "1f1b", "-D", "P=4", "-D", "N=8", "--json")
    assert status == 0
    data = json.loads(out)
    assert data["makespan"] == 33
    assert abs(data["bubble_ratio"] - 3 / 11) < 1e-12
    assert [r["peak_activations"] for r in data["ranks"]] == [4, 3, 2, 1]
    assert {"busy", "idle", "peak_activations"} <= set(data["ranks"][0])


def test_simulate_text_shows_fraction(capsys):
    status, out, _ = run(capsys, "simulate", "zb_h1", "-D", "P=4", "-D", "N=8")
    assert status == 0 and "bubble ratio 1/9" in out


def test_source_error_exits_one_with_location_and_caret(capsys, tmp_path):
    path = tmp_path / "bad.pipe"
    path.write_text("schedule s(P: ranks, N: microbatches) {\n  stages P\n  place stage s on rank s\n  order rank r { F(r, 0) B(r, 0) Q }\n}\n")
    status, out, err = run(capsys, "check", str(path), "-D", "P=2", "-D", "N=1")
    assert status == 1 and out == ""
    first = err.splitlines()[0]
    assert first.startswith(f"{path}:4:") or first.startswith("bad.pipe:4:") or ":4:" in first.split(" ")[0]
    assert "^" in err and "Traceback" not in err


def test_require_violated_exits_one(capsys):
    status, _, err = run(capsys, "check", "interleaved_1f1b", "-D", "P=4", "-D", "N=6", "-D", "G=0")
    assert status == 1
    assert "requirement failed: a microbatch group holds at least min(P, N) microbatches" in err
    assert "schedules/interleaved_1f1b.pipe:" in err.splitlines()[0]


def test_budget_violation_is_a_program_error(capsys):
    status, _, err = run(capsys, "check", "gpipe", "-D", "P=2", "-D", "N=4", "--budget", "3")
    assert status == 1 and err.startswith("rank 0, step ")
    assert "[0F3]" in err


def test_usage_errors_exit_one(capsys):
    assert run(capsys, "check", "no_such_schedule")[0] == 1
    assert run(capsys, "check", "1f1b", "-D", "P")[0] == 1
    assert run(capsys, "check", "1f1b", "-D", "Q=3")[0] == 1
    with pytest.raises(SystemExit) as info:
        main(["frobnicate"])
    assert info.value.code == 1


def test_console_script_exits_one_without_traceback(tmp_path):
    path = tmp_path / "x.pipe"
    path.write_text("schedule")
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    proc = subprocess.run([sys.executable, "-m", "pipec", "check", str(path)], capture_output=True, text=True, env=env, timeout=60)
    assert proc.returncode == 1
    assert "unexpected end of file" in proc.stderr and "Traceback" not in proc.stderr


def test_file_with_several_schedules_is_addressed_by_name(capsys, tmp_path):
    path = tmp_path / "two.pipe"
    path.write_text(
        textwrap.dedent(
            """
            schedule a(P: ranks = 1, N: microbatches = 1) { stages 1 place stage s on rank 0 order rank r { F(0, 0) B(0, 0) } }
            schedule b(P: ranks = 2, N: microbatches = 1) { stages 2 place stage s on rank s order rank r { F(r, 0) B(r, 0) } }
            """
        )
    )
    status, out, _ = run(capsys, "check", f"{path}:b")
    assert status == 0 and out.startswith("ok: b (P=2, N=1): 2 ranks")
    assert run(capsys, "check", f"{path}:c")[0] == 1


@pytest.mark.parametrize("command", [["check"], ["simulate"], ["render", "-o", "out.svg"]])
def test_a_text_that_starts_with_a_digit_is_no_torch_csv_to_any_command(capsys, tmp_path, monkeypatch, command):
    """Every command takes a file for a torch CSV by its name (``*.csv``) or by a first cell that is a torch
    action, so a note starting with a digit is read as a ``.pipe`` source (located, with a caret) by each
    alike (was: ``simulate`` and ``render`` took any file whose first character is a digit for a CSV)."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "notes.txt").write_text("1. my notes\n")
    status, _, err = run(capsys, command[0], "notes.txt", *command[1:])
    assert status == 1 and err.startswith("notes.txt:1:1: unexpected '1'; expected 'schedule'"), err
    assert not (tmp_path / "out.svg").exists()


@pytest.mark.parametrize("first", ["0F0,0F1,0B0,0B1", "(0F0;1B1)OVERLAP_F_B,0F1"])
def test_a_torch_csv_with_another_name_is_still_known_by_its_first_action(capsys, tmp_path, first):
    path = tmp_path / "schedule.dat"
    path.write_text(first + "\n1F0,1B0,1F1,1B1\n")
    _, out, err = run(capsys, "simulate", str(path))
    # read as a CSV: simulated, or refused in the CSV's terms (rank, step, the grid), never parsed as a .pipe
    assert "(a torch schedule CSV): makespan" in out or err.startswith("rank "), (out, err)


def test_a_count_of_one_is_singular_in_every_summary(capsys):
    """``1 rank, 1 stage, 1 microbatch`` (was ``1 ranks, 1 stages, 1 microbatches``), in check's line and the grid's."""
    status, out, _ = run(capsys, "check", "1f1b", "-D", "P=1", "-D", "N=1")
    assert status == 0 and out.startswith("ok: 1f1b (P=1, N=1, remat=false): 1 rank, 1 stage, 1 microbatch, 3 "
                                          "instructions;"), out
    status, out, _ = run(capsys, "compile", "megatron_mlp", "-D", "L=1", "-D", "N=1", "--format", "text")
    assert status == 0 and "2 ranks, 1 layer split across every rank, 1 microbatch, 8 instructions" in out, out
    status, out, _ = run(capsys, "check", "tasp", "-D", "P=2")
    assert status == 0 and "2 ranks, 4 chunks of 1 KV piece on 1 ring, 36 instructions" in out, out


@pytest.mark.parametrize("flags", [["--memory", "٣"], ["--memory", "1_0"], ["--time-limit", "٣"], ["--time-limit", "inf"],
                                   ["--time-limit", "nan"], ["--workers", "٢"], ["--workers", "0"], ["--seed", "1_0"],
                                   ["--evaluations", "١٠"], ["--candidates", "1_0"]])
def test_search_reads_numbers_as_every_command_does(capsys, tmp_path, flags):
    """ASCII digits only, in range, for every number ``pipec search`` takes (was: Python's int() and float(),
    which take ``٣``, ``1_0``, ``inf`` and ``nan``), refused before any search with exit status 1."""
    out = tmp_path / "s.pipe"
    try:
        status = main(["search", "1f1b", "-D", "P=2", "-D", "N=2", "--method", "heuristic", *flags, "-o", str(out)])
    except SystemExit as exit_:  # an option's type refused by the parser
        status = exit_.code
    err = capsys.readouterr().err
    assert status == 1 and flags[0] in err and not out.exists(), err
    assert "Traceback" not in err


def test_search_refuses_an_empty_output_name_and_its_own_target_before_searching(capsys, tmp_path):
    """``-o ''`` wrote nothing and said nothing; ``-o`` naming TARGET replaced the user's schedule with the
    searched order. Both are refused before the search, and TARGET is left as it was."""
    mine = tmp_path / "mine.pipe"
    text = (Path(__file__).resolve().parents[1] / "schedules" / "1f1b.pipe").read_text()
    mine.write_text(text)
    common = ["search", str(mine), "-D", "P=2", "-D", "N=2", "--method", "heuristic"]
    status, out, err = run(capsys, *common, "-o", "")
    assert status == 1 and "cannot write the searched order (-o): the file name is empty" in err and not out, err
    status, out, err = run(capsys, *common, "-o", str(tmp_path / "." / "mine.pipe"))
    assert status == 1 and "is TARGET itself" in err and mine.read_text() == text, err
