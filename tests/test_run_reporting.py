"""``pipec run`` reports as it goes: its phases, every step's speed and memory, workers' stderr live,
``--log-format json``, ``--log-dir``; ``--model`` finds a module in the current directory.

The real runs are small (2 or 4 gloo ranks, the built-in model) under a hard deadline; content is
asserted, never a time. The reporter itself is also fed events directly, without processes.
"""
from __future__ import annotations

import json
import os
import re

import pytest

from pipec.commands.run_report import Console, RunReport
from pipec.runtime.report import EVENT_PREFIX, batch_size
from test_multinode import describe, pipec_nodes, run_nodes
from test_run_cli import losses_of, run_pipec

# A run of 4 workers that import torch on a loaded machine: generous.
DEADLINE_S = 240
# The README's line, `pipec run zb_h1 -D P=4 -D N=8 --steps 5 --trace run.json --save model.pt`, with 3 steps.
README_ZB_H1 = ["run", "zb_h1", "-D", "P=4", "-D", "N=8", "--steps", "3", "--trace", "run.json", "--save", "model.pt"]
# A model file in the run's folder (not on any path): the built-in model, saying on stderr what it builds.
STDERR_MODEL = '''
import dataclasses
import sys

from pipec.runtime.model import LLAMA


def build_chunk(config, chunk, num_chunks, seed):
    print(f"building chunk {chunk}", file=sys.stderr, flush=True)
    return LLAMA.build_chunk(config, chunk, num_chunks, seed)


SPEC = dataclasses.replace(LLAMA, build_chunk=build_chunk)
'''
STEP_STATS = re.compile(r" \| step \d+\.\d{3} s \| [\d,]+\.\d samples/s \| [\d,]+\.\d tokens/s \| peak memory "
                        r"(r\d \d+ MB(, )?)+ \| (\d+)/(\d+), eta \S+")


def _phases(stdout: str) -> list[str]:
    return re.findall(r"^pipec run(?: \[node \d+\])?: (\w+): ", stdout, re.M)


@pytest.fixture(scope="module")
def readme_run(tmp_path_factory):
    folder = tmp_path_factory.mktemp("zb_h1")
    done = run_pipec(*README_ZB_H1, "--log-dir", "logs", cwd=folder, deadline_s=DEADLINE_S)
    return folder, done


def test_the_readme_zb_h1_run_shows_its_phases_in_order(readme_run):
    _, done = readme_run
    assert done.status == 0 and not done.survivors, done.describe()
    phases = _phases(done.stdout)
    # one join per rank; the others once for the node, in the order they happen
    assert phases.count("join") == 4, done.stdout
    assert [p for i, p in enumerate(phases) if p not in phases[:i]] == [
        "compile", "check", "launch", "load", "join", "build", "end"], done.stdout
    assert phases.index("build") > max(i for i, p in enumerate(phases) if p == "join"), done.stdout
    assert done.stdout.splitlines()[0].startswith("pipec run: compile: zb_h1 P=4 N=8 "), done.stdout
    assert sorted(re.findall(r"^pipec run: join: rank (\d) joined", done.stdout, re.M)) == ["0", "1", "2", "3"]
    assert "launch: starting 4 workers (ranks 0-3)" in done.stdout


def test_every_step_line_has_loss_step_time_rates_memory_per_rank_and_eta(readme_run):
    _, done = readme_run
    lines = [line for line in done.stdout.splitlines() if line.startswith("step ")]
    assert len(lines) == 3 and len(losses_of(done.stdout)) == 3, done.stdout
    for number, line in enumerate(lines, 1):
        stats = STEP_STATS.search(line)
        assert stats, line
        assert (stats.group(3), stats.group(4)) == (str(number), "3"), line
        assert all(f"r{rank} " in line for rank in range(4)), line
    # every step line comes after the build, before the end
    build = done.stdout.index("pipec run: build: ")
    assert build < done.stdout.index(lines[0]) and done.stdout.index(lines[-1]) < done.stdout.index("pipec run: end: ")
    assert "[" not in done.stdout.replace("[rank", ""), "no progress bar off a terminal"


def test_log_dir_keeps_every_ranks_logs_after_a_successful_run(readme_run):
    folder, done = readme_run
    kept = re.search(r"^pipec run: end: done after .*; worker logs: (\S+)$", done.stdout, re.M)
    assert kept, done.stdout
    logs = folder / kept.group(1)
    assert logs.parent == folder / "logs" and (logs / "program.json").is_file()
    files = {(os.path.basename(root), name) for root, _, names in os.walk(logs) for name in names}
    assert {(str(rank), name) for rank in range(4) for name in ("stdout.log", "stderr.log")} <= files
    [rank_0] = [os.path.join(root, "stdout.log") for root, _, names in os.walk(logs)
                if os.path.basename(root) == "0" and "stdout.log" in names]
    with open(rank_0, encoding="utf-8") as handle:
        steps = [line for line in handle if line.startswith(EVENT_PREFIX) and '"event":"step"' in line]
    assert len(steps) == 3


def test_without_log_dir_the_run_folder_is_removed(tmp_path):
    done = run_pipec("run", "1f1b", "-D", "P=2", "-D", "N=2", "--steps", "1", cwd=tmp_path, deadline_s=DEADLINE_S)
    assert done.status == 0, done.describe()
    assert re.search(r"^pipec run: end: done after \S+ s$", done.stdout, re.M), done.stdout


@pytest.fixture(scope="module")
def json_run(tmp_path_factory):
    folder = tmp_path_factory.mktemp("json")
    (folder / "stderr_model.py").write_text(STDERR_MODEL)
    env_path = os.environ.pop("PYTHONPATH", None)  # the module is found in the current directory only
    try:
        done = run_pipec("run", "1f1b", "-D", "P=2", "-D", "N=2", "--steps", "2", "--model", "stderr_model:SPEC",
                         "--log-format", "json", cwd=folder, deadline_s=DEADLINE_S)
    finally:
        if env_path is not None:
            os.environ["PYTHONPATH"] = env_path
    return done


def test_a_model_file_in_the_current_directory_imports(json_run):
    assert json_run.status == 0, json_run.describe()
    assert "No module named" not in json_run.stderr


def test_json_lines_parse_and_carry_the_phases_and_step_fields(json_run):
    events = [json.loads(line) for line in json_run.stdout.splitlines()]
    kinds = [event["event"] for event in events]
    assert kinds[:3] == ["compile", "check", "launch"] and kinds[-1] == "end", kinds
    assert all(isinstance(event["time"], float | int) and event["node"] == 0 for event in events)
    assert sorted(event["rank"] for event in events if event["event"] == "join") == [0, 1]
    steps = [event for event in events if event["event"] == "step"]
    assert [step["step"] for step in steps] == [1, 2] and all(step["steps"] == 2 for step in steps)
    for step in steps:
        assert isinstance(step["loss"], float) and step["step_s"] > 0
        assert step["samples_per_s"] > 0 and step["tokens_per_s"] == pytest.approx(16 * step["samples_per_s"])
        assert set(step["memory_bytes"]) == {"0", "1"} and all(v > 0 for v in step["memory_bytes"].values())
        assert step["memory_kind"] == "rss peak" and step["eta_s"] >= 0
    assert events[-1]["ok"] is True


def test_worker_stderr_is_shown_live_behind_its_rank(json_run):
    events = [json.loads(line) for line in json_run.stdout.splitlines()]
    said = [(index, event) for index, event in enumerate(events)
            if event["event"] == "output" and event["stream"] == "stderr" and "building chunk" in event["line"]]
    assert {(event["rank"], event["line"]) for _, event in said} == {(0, "building chunk 0"), (1, "building chunk 1")}
    first_step = next(index for index, event in enumerate(events) if event["event"] == "step")
    assert all(index < first_step for index, _ in said), "shown while the run went on, not held until its end"


def test_a_two_node_run_on_one_machine_prints_each_nodes_joins_and_status(tmp_path):
    schedule = ["1f1b", "-D", "P=2", "-D", "N=2", "--steps", "2"]
    nodes = run_nodes(pipec_nodes([schedule, schedule], nproc=1), tmp_path, deadline_s=DEADLINE_S)
    assert all(node.status == 0 for node in nodes), describe(nodes)
    for index, node in enumerate(nodes):
        prefix = f"pipec run [node {index}]: "
        assert f"{prefix}launch: starting 1 worker (rank {index}); waiting for the other nodes at 127.0.0.1:" \
            in node.stdout, describe(nodes)
        assert f"{prefix}join: all 2 nodes met; rank {index} started" in node.stdout, describe(nodes)
        assert f"{prefix}join: rank {index} joined the process group" in node.stdout, describe(nodes)
        assert f"{prefix}end: done after" in node.stdout, describe(nodes)
    assert len(losses_of(nodes[0].stdout)) == 2 and "loss" not in nodes[1].stdout, describe(nodes)
    assert len(re.findall(r"^pipec run \[node 1\]: step: \d of 2 done on rank 1 \| step ", nodes[1].stdout,
                          re.M)) == 2, describe(nodes)


# ------------------------------------------------------------ the reporter, fed directly


class _Lines(Console):
    def __init__(self):
        super().__init__(bar=False)
        self.out_lines: list[str] = []
        self.err_lines: list[str] = []

    def out(self, line: str) -> None:
        self.out_lines.append(line)

    def err(self, line: str) -> None:
        self.err_lines.append(line)


def _event(kind: str, **fields) -> str:
    return EVENT_PREFIX + json.dumps({"event": kind, "seconds": 0.5, **fields})


def _step(step: int, memory: int, loss=None) -> str:
    return _event("step", step=step, steps=4, step_s=0.5, loss=loss, grad_norm=None, samples=8, tokens=128,
                  memory_bytes=memory, memory_kind="rss peak")


def test_a_step_is_shown_once_every_local_rank_reported_it():
    console = _Lines()
    report = RunReport(console=console)
    report.launching(2, 0, None)
    console.out_lines.clear()  # the launch line
    report.on_stdout(0, _step(1, 2**20, loss=2.5))
    assert not console.out_lines  # rank 1 has not finished step 1
    report.on_stdout(1, _step(1, 3 * 2**20))
    [line] = console.out_lines
    assert line.startswith("step 1 loss 2.500000 | step 0.500 s | 16.0 samples/s | 256.0 tokens/s | "
                           "peak memory r0 1 MB, r1 3 MB | 1/4, eta 2 s"), line


def test_plain_lines_stderr_and_a_broken_event_are_shown_as_output():
    console = _Lines()
    report = RunReport(console=console)
    report.launching(2, 0, None)
    console.out_lines.clear()  # the launch line
    report.on_stdout(0, "saved: model.pt")
    report.on_stdout(1, EVENT_PREFIX + "{not json")
    report.on_stderr(1, "a warning")
    assert console.out_lines == ["saved: model.pt", f"[rank 1] {EVENT_PREFIX}{{not json"]
    assert console.err_lines == ["[rank 1] a warning"]


def test_a_failed_run_still_shows_the_steps_some_ranks_finished():
    console = _Lines()
    report = RunReport(log_format="json", console=console)
    report.launching(2, 0, None)
    console.out_lines.clear()  # the launch line
    report.on_stdout(0, _step(1, 2**20, loss=1.0))
    report.finished(False, "/tmp/x")
    step, end = (json.loads(line) for line in console.out_lines)
    assert step["event"] == "step" and step["memory_bytes"] == {"0": 2**20} and step["loss"] == 1.0
    assert end["event"] == "end" and end["ok"] is False and end["logs"] == "/tmp/x"


def test_samples_and_tokens_come_from_the_config_when_it_says():
    from pipec.runtime.model import ModelConfig

    assert batch_size(ModelConfig(microbatch_size=2, seq_len=16), 8) == (16, 256)
    assert batch_size(object(), 8) == (None, None)
    assert batch_size(object(), 4, rows_per_microbatch=3) == (12, None)


def test_the_progress_bar_is_drawn_only_on_a_terminal_outside_ci(capsys, monkeypatch):
    from pipec.commands.run_report import shows_bar

    assert not shows_bar("text")  # captured: not a terminal

    class Terminal:
        def isatty(self):
            return True

    monkeypatch.setattr("sys.stdout", Terminal())
    monkeypatch.delenv("CI", raising=False)
    monkeypatch.setenv("TERM", "xterm")
    assert shows_bar("text") and not shows_bar("json")
    monkeypatch.setenv("CI", "true")
    assert not shows_bar("text")


def test_the_bar_is_erased_before_a_line_and_drawn_again_after_it(capsys):
    console = Console(bar=True)
    console.progress("[##..] step 1/2")
    console.out("a line")
    console.close()
    assert capsys.readouterr().out == ("\r\x1b[K[##..] step 1/2" "\r\x1b[K" "a line\n" "[##..] step 1/2" "\r\x1b[K")


def test_a_diverged_loss_is_still_a_step_line():
    from pipec.runtime.report import json_number

    console = _Lines()
    report = RunReport(console=console)
    report.launching(1, 0, None)
    console.out_lines.clear()
    report.on_stdout(0, _event("step", step=1, steps=1, step_s=0.5, loss=json_number(float("nan")), grad_norm=None,
                               samples=None, tokens=None, memory_bytes=None, memory_kind="rss peak"))
    [line] = console.out_lines
    assert line.startswith("step 1 loss nan | step 0.500 s | - samples/s | - tokens/s | peak memory r0 ? | 1/1"), line


def test_names_from_a_program_file_and_the_log_dir_reach_the_terminal_escaped(tmp_path):
    """A program file's name and parameter names, and ``--log-dir``, are the user's text: ``pipec run``'s own
    lines show their escape sequences escaped, as ``pipec check`` does (were written raw: a name could clear
    the screen or colour every line after it)."""
    from pipec.cli import main

    program = tmp_path / "p.json"
    assert main(["compile", "1f1b", "-D", "P=2", "-D", "N=2", "--format", "json", "-o", str(program)]) == 0
    data = json.loads(program.read_text())
    data["name"], data["params"] = "evil\x1b[31mRED", {"P\x1b[2J": 2, "N": 2}
    program.write_text(json.dumps(data))
    logs = tmp_path / "lo\x1bgs"
    logs.mkdir()
    done = run_pipec("run", str(program), "--steps", "1", "--log-dir", str(logs))
    assert done.status == 0, done.describe()
    assert "\x1b" not in done.stdout + done.stderr, done.describe()
    assert "compile: evil\\x1b[31mRED P\\x1b[2J=2 N=2 compiled" in done.stdout, done.describe()
    assert "worker logs: " + str(tmp_path / "lo\\x1bgs") in done.stdout + done.stderr, done.describe()
