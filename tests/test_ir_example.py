"""docs/ir.md's worked example holds: a task kind is one rule plus its runtime handler.

The test takes the rule, the schedule and the handler from docs/ir.md itself
(the blocks after ``<!-- rule``, ``<!-- pipe`` and ``<!-- handler``), adds the
rule to a copy of the rule table in fresh processes (nothing else of pipec is
changed), and proves that the schedule compiles, checks and simulates, and that
training with it on gloo ranks ends with the parameters of one process.
"""
from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pipec.runtime.model import ModelConfig
from pipec.runtime.reference import reference_run
from added_rule import ADD_RULE
from runtime_util import _launch

DOC = Path(__file__).resolve().parents[1] / "docs" / "ir.md"
STEPS, SEED, TOLERANCE = 2, 3, 1e-5

# Run in a fresh process: add the documented rule to the table before any pass
# imports it, add the documented handler to the interpreter, then do the job.
BOOTSTRAP = ADD_RULE + r'''
if sys.argv[2] == "compile":
    from pipec.compiler.checks import peak_activations
    from pipec.compiler.driver import compile_target
    from pipec.compiler.simulate import simulate
    compiled = compile_target(example["pipe_path"], {"P": 4, "N": 8})
    result = simulate(compiled.program)
    plain = compile_target("1f1b", {"P": 4, "N": 8}).program
    print(json.dumps({"rows": [[a.text() for a in row] for row in compiled.program.ranks],
                      "plain": [[a.text() for a in row] for row in plain.ranks],
                      "makespan": result.makespan, "bubble": str(result.bubble_fraction()),
                      "peaks": peak_activations(compiled.program)}))
else:
    from pipec.runtime import interpreter
    exec(compile(example["handler"], "docs/ir.md", "exec"), interpreter.__dict__)
    from pipec.runtime.worker import end_process, main
    end_process(main(sys.argv[3:]))
'''


def _blocks() -> dict[str, str]:
    """The fenced block after each ``<!-- NAME: ... -->`` marker of docs/ir.md."""
    text = DOC.read_text(encoding="utf-8")
    found = dict(re.findall(r"<!-- (\w+):[^>]*-->\s*```\w*\n(.*?)```", text, re.S))
    assert set(found) >= {"rule", "pipe", "handler"}, f"docs/ir.md lost a marked block: {sorted(found)}"
    return found


@pytest.fixture(scope="module")
def example(tmp_path_factory):
    folder = tmp_path_factory.mktemp("ir_example")
    blocks = _blocks()
    pipe = folder / "checked.pipe"
    pipe.write_text(blocks["pipe"])
    spec = folder / "example.json"
    spec.write_text(json.dumps({"rules": [blocks["rule"].strip()], "handler": blocks["handler"], "pipe_path": str(pipe)}))
    script = folder / "bootstrap.py"
    script.write_text(BOOTSTRAP)
    return folder, script, spec, pipe


def test_the_documented_task_compiles_checks_and_simulates(example):
    _, script, spec, _ = example
    done = subprocess.run([sys.executable, str(script), str(spec), "compile"], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)
    for rank, row in enumerate(out["rows"]):
        computes = [token for token in row if re.fullmatch(rf"{rank}[FVB]\d+", token)]
        for m in range(8):
            f, v, b = (computes.index(f"{rank}{op}{m}") for op in "FVB")
            assert f < v < b, f"rank {rank}: V of microbatch {m} must sit between its F and its B"
    # V adds only itself: the other computes, the frees and the messages are plain 1F1B's, in the same order
    # on every rank (V sits between an F and what follows, so a batch around it may come apart)
    def unbatched(row):
        return [part for token in row for part in re.sub(r"^\((.*)\)BATCH$", r"\1", token).split(";")
                if not re.fullmatch(r"\d+V\d+", part)]
    assert [unbatched(row) for row in out["rows"]] == [unbatched(row) for row in out["plain"]]
    # every rank is busy 8 * (F + V + B) = 32, and idles 1F1B's (P - 1)(F + B) = 9: the activation
    # leaves right after F, so V never delays the next stage
    assert out["makespan"] == 41 and out["bubble"] == "9/41"
    assert out["peaks"] == [4, 3, 2, 1]  # V changes no count: 1F1B's peaks


def test_the_documented_task_trains_like_one_process(example):
    folder, script, spec, pipe = example
    save = folder / "trained.pt"
    args = [str(pipe), "-D", "P=2", "-D", "N=4", "--steps", str(STEPS), "--seed", str(SEED), "--timeout", "60",
            "--save", str(save)]
    run = _launch([sys.executable, str(script), str(spec), "run", *args], 2, 180.0, None)
    assert run.ok, run.describe()
    got = torch.load(save, weights_only=True)
    want = reference_run(ModelConfig(), STEPS, 4, SEED).state_dict
    assert sorted(got) == sorted(want)
    worst = max(abs(got[name] - want[name]).max().item() for name in want)
    assert worst <= TOLERANCE, f"the checked schedule differs from one process by {worst:.3g}"
