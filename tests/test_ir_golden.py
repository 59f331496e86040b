"""What every shipped schedule compiles to, held to golden files.

The IR is shared by every family; changing how it is written down (values,
rule tables, routes, communicators) must not change what a shipped schedule
compiles to. For each shipped schedule at (P, N) = (4, 8), (6, 12), (8, 16)
the golden file records the per-rank compute order, the whole lowered program
(its text, hashed), the simulated makespan and bubble, the peak activations and
waiting weight gradients per rank, both torch CSV exports (hashed) and what
importing the compute-only CSV again simulates to.

Regenerate (only for a change meant to alter compiled programs, and say why
in the commit) with ``PIPEC_UPDATE_GOLDEN=1 python -m pytest tests/test_ir_golden.py``.
"""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import pytest

from pipec.compiler import ops

from pipec.compiler.checks import peak_activations
from pipec.compiler.checks.memory import peak_waiting_w
from pipec.compiler.driver import compile_target, resolve_target, shipped_schedules
from pipec.compiler.emit import write_torch_csv
from pipec.compiler.import_torch import prepare_imported, read_torch_csv
from pipec.compiler.simulate import simulate
from pipec.errors import PipecError

GOLDEN = Path(__file__).parent / "golden"
SIZES = ((4, 8), (6, 12), (8, 16))
COMPUTE = frozenset(ops.COMPUTE_OPS)  # F, B, I, W; AF, AB


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:20]


def _record(name: str, P: int, N: int) -> dict:
    declared = {param.name for param, _, _ in resolve_target(name).params}
    defines = {key: value for key, value in (("P", P), ("N", N)) if key in declared}  # rings have no N
    try:
        compiled = compile_target(name, defines)
    except PipecError as error:
        return {"error": str(error).splitlines()[0]}
    program = compiled.program
    result = simulate(program)
    record = {
        "compute_order": [" ".join(a.text() for a in row if a.op in COMPUTE) for row in program.ranks],
        "program": _digest("\n".join(" ".join(a.text() for a in row) for row in program.ranks)),
        "instructions": program.instruction_count(),
        "makespan": result.makespan if isinstance(result.makespan, int) else str(result.makespan),
        "bubble": str(result.bubble_fraction()),
        "peak_activations": peak_activations(program),
        "peak_waiting_w": [peak_waiting_w(row) for row in program.ranks],
    }
    if len(program.pipelines) == 1:  # torch's CSV holds one chain of stages
        try:
            compute_csv = write_torch_csv(program, with_comms=False)
        except PipecError as error:  # a family it has no form for (tensor parallelism) says so
            record["torch_csv"] = f"error: {str(error).splitlines()[0]}"
            return record
        imported, had_comms = read_torch_csv(compute_csv, "golden.csv")
        record["torch_csv"] = _digest(compute_csv)
        record["torch_csv_comms"] = _digest(write_torch_csv(program, with_comms=True))
        record["imported_makespan"] = simulate(prepare_imported(imported, had_comms)).makespan
    return record


def _golden_of(name: str) -> dict:
    return {f"P={P},N={N}": _record(name, P, N) for P, N in SIZES}


@pytest.mark.parametrize("name", sorted(shipped_schedules()))
def test_shipped_schedule_compiles_to_its_golden_file(name):
    path = GOLDEN / f"{name}.json"
    now = _golden_of(name)
    if os.environ.get("PIPEC_UPDATE_GOLDEN") == "1":
        path.write_text(json.dumps(now, indent=1) + "\n")
    expected = json.loads(path.read_text())
    assert set(now) == set(expected)
    for size in expected:
        assert now[size] == expected[size], f"{name} at {size} changed"
