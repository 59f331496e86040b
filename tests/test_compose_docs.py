"""docs/compose.md, section 7, runs as written: compositions no shipped file or other test holds.

Each of the page's ```pipe blocks (interleaved 1F1B with ZeRO-2 stages; GPipe
with TASP inside its stages) and its ```json cost file are written to an empty
folder; each ``$ pipec ...`` line of the ```console block after it runs
there through the installed command line and prints exactly the lines the
page shows after it; ``pipec run`` (which the page shows without its output)
trains on 4 gloo processes and its saved parameters are those of one process
with the same N, seed and steps. The
page's traffic table and memory figures for the shipped compositions are
checked against the simulator here too.
"""
from __future__ import annotations

import os
import shlex
import subprocess
import sys

import pytest

from pipec.compiler.driver import compile_target
from pipec.compiler.memory_counts import peak_bytes
from pipec.compiler.simulate import simulate
from pipec.compiler.costs import costs_from_json
from test_docs_api import DEADLINE_S, blocks

SIZES = {"activation": 1000, "weight": 4000}


def _commands(console: str) -> list[tuple[str, list[str]]]:
    """A console block's ``$`` lines, each with the output lines the page shows after it."""
    commands: list[tuple[str, list[str]]] = []
    for line in console.splitlines():
        if line.startswith("$ "):
            commands.append((line[2:], []))
        else:
            commands[-1][1].append(line)
    return commands


def _pipec(line: str, cwd) -> subprocess.CompletedProcess:
    argv = shlex.split(line)
    assert argv[0] == "pipec", line
    return subprocess.run([sys.executable, "-m", "pipec", *argv[1:]], cwd=cwd, capture_output=True, text=True,
                          timeout=DEADLINE_S, env={**os.environ, "OMP_NUM_THREADS": "1"})


# Section 7's compositions, in the page's order: the file each ```pipe block is saved as and the state its run saves.
OWN = [("interleaved_zero2.pipe", "zero2.pt"), ("gpipe_tasp.pipe", "tasp.pt")]


@pytest.mark.parametrize("index", range(len(OWN)), ids=[name for name, _ in OWN])
def test_the_pages_own_compositions_check_simulate_and_train_as_shown(tmp_path, index):
    torch = pytest.importorskip("torch")
    from pipec.runtime.config import DEFAULT_SEED
    from pipec.runtime.model import ModelConfig
    from pipec.runtime.reference import reference_run
    from runtime_util import assert_same_parameters

    name, saved_as = OWN[index]
    pipes, consoles = blocks("compose.md", "pipe"), blocks("compose.md", "console")
    assert len(pipes) == len(consoles) == len(OWN)
    (tmp_path / name).write_text(pipes[index])
    (tmp_path / "costs.json").write_text(blocks("compose.md", "json")[0])
    commands = _commands(consoles[index])
    assert [line.split()[1:3] for line, _ in commands] == [[verb, name] for verb in ("check", "simulate", "run")]
    for line, shown in commands:
        done = _pipec(line, tmp_path)
        assert done.returncode == 0, f"{line}: {done.stderr}"
        if shown:
            assert done.stdout.splitlines() == shown, line
    saved = torch.load(tmp_path / saved_as)
    want = reference_run(ModelConfig(), 3, 4, DEFAULT_SEED).state_dict
    assert_same_parameters(saved, want, f"docs/compose.md's {name}")


def test_the_pages_traffic_table_and_memory_figures_are_the_simulators():
    costs = costs_from_json({"sizes": SIZES})
    want = {"1f1b_dp": {"act": 4000, "grad": 4000, "wgrad": 16000},
            "1f1b_zero2": {"act": 4000, "grad": 4000, "wgrad": 8000, "weight": 8000},
            "1f1b_fsdp": {"act": 4000, "grad": 4000, "wgrad": 8000, "weight": 16000}}
    for name, volumes in want.items():
        program = compile_target(name, {}).program
        traffic = simulate(program, costs).traffic
        assert {kind: sum(links.values()) for kind, links in traffic.items()} == volumes, name
    # 1f1b_fsdp's rank 0: two half activations, one stage's whole weights, its shard
    assert peak_bytes(compile_target("1f1b_fsdp", {}).program, SIZES)[0] == {
        "activation": 1000, "weight": 4000, "shard": 2000}
    # under unit costs, half the plain pipeline's makespan with the same bubble
    plain, composed = simulate(compile_target("1f1b", {"P": 2, "N": 4}).program), simulate(
        compile_target("1f1b_dp", {}).program)
    assert (plain.makespan, composed.makespan) == (15, 7.5)
    assert plain.bubble_ratio == pytest.approx(composed.bubble_ratio) == 0.2


def test_the_pages_hsdp_runs_pass_every_check_before_launch_and_fail_without_their_rows():
    """Section 9's `pipec run 1f1b_hsdp ...` lines compile and pass every check ``pipec run`` makes before a
    worker starts (the built-in model's 4 rows split over a stage's 4 members); with ``--config
    microbatch_size=2`` its 2 rows are refused there, naming the fix."""
    from pipec.cli import build_parser
    from pipec.commands.run import check_before_launch
    from pipec.errors import PipecError

    text = open(os.path.join(os.path.dirname(__file__), "..", "docs", "compose.md")).read()
    lines = [line.strip() for line in text.splitlines() if line.strip().startswith("pipec run 1f1b_hsdp")]
    assert len(lines) == 2
    for line in lines:
        argv = shlex.split(line)[1:]
        program, nproc = check_before_launch(build_parser().parse_args(argv))
        assert nproc == program.num_ranks == (4 if "P=1" in line else 8)
        with pytest.raises(PipecError) as caught:
            check_before_launch(build_parser().parse_args([*argv, "--config", "microbatch_size=2"]))
        assert "2 rows, which do not split into the 4 equal shares" in str(caught.value)
        assert "--config microbatch_size=" in str(caught.value)
