"""Every interpretation has a rule for every op of the rule table (``compiler/ops.py``).

An interpretation of the ops (the prover's semantics, a cost, an emitter, a
runtime handler, a trace category, a drawing) registers the ops it handles
with ``ops.declare_pass`` when it is imported, from its own dispatch or
derived tables, and the categories it leaves alone by design; adding an op to
``ops.RULES`` without teaching every interpretation about it fails here,
naming the ones that lack it. A fresh process adds throw-away ops to the
table before anything imports it, so an interpretation that claimed every op
wholesale would be caught (``test_a_throw_away_op_is_missing_from_every_interpretation``).
"""
from __future__ import annotations

import importlib
import json
import subprocess
import sys

import pytest

from added_rule import ADD_RULE
from pipec.compiler import ops

# Every module that declares an interpretation.
PASS_MODULES = (
    "pipec.compiler.simulate",
    "pipec.compiler.liveness",
    "pipec.compiler.traffic",
    "pipec.compiler.checks",
    "pipec.compiler.checks.wellformed",
    "pipec.compiler.checks.matching",
    "pipec.compiler.checks.deadlock",
    "pipec.compiler.checks.conflict",
    "pipec.compiler.checks.memory",
    "pipec.compiler.render.graph",
    "pipec.compiler.render.style",
    "pipec.compiler.emit.json_program",
    "pipec.compiler.emit.torch_csv",
    "pipec.compiler.costs",
    "pipec.runtime.trace",
)
# Modules that need torch; skipped where torch cannot be imported.
TORCH_PASS_MODULES = ("pipec.runtime.interpreter",)

# The interpretations these modules declare. A family's lowering (lower_comms,
# lower_weights, lower_rings) emits its own ops and interprets none, so it is
# not one of them.
PASSES = (
    "well-formed",
    "matching",
    "deadlock",
    "conflict",
    "memory",
    "simulate",
    "liveness",
    "traffic",
    "task graph",
    "drawing style",
    "json program",
    "torch csv",
    "cost model",
    "runtime trace",
    "prover",
)
TORCH_PASSES = ("runtime interpreter",)


def _torch_available() -> bool:
    try:
        import torch  # noqa: F401
    except Exception:  # a broken install fails in ways other than ImportError
        return False
    return True


def _import_passes() -> tuple[str, ...]:
    """Import every pass module; returns the pass names expected to be declared."""
    for name in PASS_MODULES:
        importlib.import_module(name)
    expected = PASSES
    if _torch_available():
        for name in TORCH_PASS_MODULES:
            importlib.import_module(name)
        expected += TORCH_PASSES
    return expected


# Two throw-away ops, added to the table in a fresh process before any
# interpretation imports it: a compute and a collective part of an exchange.
THROW_AWAY = (
    'OpRule("ZZ", COMPUTE, ACTIVATION_PASSING, reads=(Use("saved"),), trace="compute", unit_cost=1, optional=True,'
    ' doc="a throw-away compute")',
    'OpRule("QQ", PART_COLLECTIVE, WEIGHT_PASSING, fields=("stage", "mb"), doc="a throw-away exchange part")',
)
# In that process: import every interpretation, report what each lacks, then, for each
# interpretation in turn, teach every other one the new ops and report again.
COVERAGE = ADD_RULE + r'''
import importlib
from pipec.compiler import ops
for name in example["modules"]:
    importlib.import_module(name)
declared = ops.declared_passes()
report = {"declared": declared, "missing": ops.passes_missing_rules(),
          "leaves": {name: sorted(ops._PASS_RULES[name][1]) for name in declared}, "alone": {}}
tables = dict(ops._PASS_RULES)
for lacking in declared:
    for name, (handled, left) in tables.items():
        ops._PASS_RULES[name] = (handled | ({"ZZ", "QQ"} if name != lacking else set()), left)
    report["alone"][lacking] = ops.passes_missing_rules()
print(json.dumps(report))
'''


# Which interpretations must name each throw-away op. A compute's rule says its dataflow, cost,
# fields, trace category and torch actions, which the other interpretations derive their tables
# from; its runtime handler and its colour are code of their own. An exchange part's rule says
# its category and fields; its price, its traffic, its runtime handler and what the one prover
# (checks/symbolic.py, its family's semantics) does with it are code of their own.
NEEDS_CODE = {
    "ZZ": {"runtime interpreter", "drawing style"},
    "QQ": {"runtime interpreter", "simulate", "traffic", "prover"},
}


def test_a_throw_away_op_is_missing_from_every_interpretation(tmp_path):
    """No interpretation claims an op it has no code for: each that needs code of its own names the
    new ops as missing, and the test fails for each such interpretation alone."""
    modules = PASS_MODULES + (TORCH_PASS_MODULES if _torch_available() else ())
    spec = tmp_path / "added.json"
    spec.write_text(json.dumps({"rules": list(THROW_AWAY), "modules": list(modules)}))
    script = tmp_path / "coverage.py"
    script.write_text(COVERAGE)
    done = subprocess.run([sys.executable, str(script), str(spec)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert set(report["declared"]) >= set(_import_passes())
    expected = {name: [op for op in ("ZZ", "QQ") if name in NEEDS_CODE[op]] for name in report["declared"]}
    expected = {name: lacking for name, lacking in expected.items() if lacking}
    assert report["missing"] == expected
    for name in report["declared"]:
        assert report["alone"][name] == ({name: expected[name]} if name in expected else {}), name


def test_every_pass_has_a_rule_for_every_op():
    _import_passes()
    assert ops.passes_missing_rules() == {}


def test_every_pass_declares_itself():
    expected = _import_passes()
    declared = set(ops.declared_passes())
    assert [name for name in expected if name not in declared] == []


def test_a_new_op_is_missing_from_every_pass(monkeypatch):
    _import_passes()
    declared = ops.declared_passes()
    assert declared
    # a copy of the table with one more op, which no pass has a rule for
    monkeypatch.setattr(ops, "OPS", ops.OPS + ("V",))
    missing = ops.passes_missing_rules()
    assert sorted(missing) == declared
    assert all(names == ["V"] for names in missing.values())


def test_an_op_a_pass_forgets_is_named(monkeypatch):
    _import_passes()
    rules = dict(ops._PASS_RULES)
    monkeypatch.setattr(ops, "_PASS_RULES", rules)
    ops.declare_pass("task graph", [op for op in ops.OPS if op != ops.W])
    assert ops.passes_missing_rules() == {"task graph": [ops.W]}


# The activation-passing ops, as the passes spelled them out before reading the table.
_TODAY = ("F", "B", "I", "W", "SEND_F", "RECV_F", "SEND_B", "RECV_B", "BATCH", "FREE_F", "ALLREDUCE_GRAD",
          "ALLREDUCE_WAIT")
_COMMS = ("SEND_F", "RECV_F", "SEND_B", "RECV_B")
_COLLECTIVES = ("ALLREDUCE_GRAD", "ALLREDUCE_WAIT")


def _today(table: dict) -> dict:
    """``table`` restricted to today's ops (an op added later has its own entry)."""
    return {op: value for op, value in table.items() if op in _TODAY}


def test_the_tables_derived_from_the_rules_are_the_ones_spelled_out_before():
    from pipec.compiler import costs, import_torch
    from pipec.compiler.emit import json_program, torch_csv
    from pipec.compiler.render import graph
    from pipec.runtime import trace

    fields = _today(json_program._REQUIRED_FIELDS)
    assert fields == {**dict.fromkeys("FBIW", ("stage", "mb")), **dict.fromkeys(_COMMS, ("stage", "mb", "peer")),
                      "FREE_F": ("stage", "mb"), **dict.fromkeys(_COLLECTIVES, ("stage",)), "BATCH": ("parts",)}
    # the order the "unknown op" message lists them in
    assert list(fields) == ["F", "B", "I", "W", *_COMMS, "FREE_F", *_COLLECTIVES, "BATCH"]
    assert _today(torch_csv._COMPUTE_ONLY) == {**dict.fromkeys("FBIW", "keep"), **dict.fromkeys(
        _COMMS + ("BATCH", "FREE_F") + _COLLECTIVES, "drop")}
    assert _today(torch_csv._WITH_COMMS) == {**dict.fromkeys(("F", "B", "I", "W") + _COMMS, "keep"),
                                             "BATCH": "expand", **dict.fromkeys(("FREE_F",) + _COLLECTIVES, "drop")}
    assert _today(import_torch._NEIGHBOUR) == {"SEND_F": +1, "RECV_F": -1, "SEND_B": -1, "RECV_B": +1}
    for token in ("F", "I", "B", "W", "UNSHARD", "RESHARD", "REDUCE_GRAD") + _COMMS:
        assert import_torch._TOKEN.fullmatch(f"3{token}1").groups() == ("3", token, "1")
        assert import_torch._TOKEN.fullmatch(f"12{token}").groups() == ("12", token, "")
    for other in ("3FREE_F1", "3BATCH1", "3ALLREDUCE_GRAD", "3OVERLAP_F_B1"):
        assert import_torch._TOKEN.fullmatch(other) is None
    assert _today(trace._CATEGORY) == {**dict.fromkeys("FBIW", "compute"), "FREE_F": "memory",
                                       **dict.fromkeys(_COMMS + ("BATCH",) + _COLLECTIVES, "comm")}
    assert _today(graph._NODE_OF) == {**dict.fromkeys("FBIW", "compute"), "FREE_F": None,
                                      **dict.fromkeys(_COMMS + ("BATCH",) + _COLLECTIVES, "comm")}
    assert costs.SPLITS == {"B": ("I", "W")}
    assert costs.MESSAGE_KINDS == ("act", "grad")
    assert set(costs.UNIT_COMPUTE) == set(ops.COMPUTE_OPS)
    # what the task graph's data edges follow (it spelled these out as _READS), among today's ops
    reads = {op: [(tuple(made for made in d.made_by if made in _TODAY), d.where) for d in deps]
             for op, deps in _today(ops.DEPENDENCIES).items()}
    assert reads == {"F": [(("F",), "prev")], "B": [(("F",), "self"), (("B", "I"), "next")],
                     "I": [(("F",), "self"), (("B", "I"), "next")], "W": [(("I",), "self")]}


def test_recomputation_is_a_second_forward_alternative_of_the_table():
    """FC and R: the forward task set's second alternative, chosen per stage; each makes what the plain
    forward makes between them, and the passes' tables follow (a forward's activation is F's or FC's,
    a backward's saved activation F's or R's)."""
    from pipec.compiler import costs, import_torch
    from pipec.compiler.emit import torch_csv

    forward = ops.FAMILY_TASKS[ops.ACTIVATION_PASSING][0]
    assert forward.alternatives == (("F",), ("FC", "R")) and forward.per_stage
    assert ops.CHECKPOINTS == {"F": ("FC", "R")} and ops.RECOMPUTE_BEFORE == {"R": ("B", "I")}
    deps = {op: [(d.kind, d.made_by, d.where) for d in ops.DEPENDENCIES[op]] for op in ("F", "FC", "R", "B")}
    assert deps["FC"] == deps["F"] == [("act", ("F", "FC"), "prev")]
    assert deps["R"] == [("kept", ("FC",), "self")]
    assert deps["B"][0] == ("saved", ("F", "R"), "self")
    assert ops.MESSAGE_READERS["act"] == ("F", "FC")
    assert ops.memory_deltas("activations") == {"F": 1, "B": -1, "I": -1, "R": 1}
    assert ops.memory_deltas("kept_inputs") == {"FC": 1, "R": -1}
    assert ops.VALUE_KINDS["kept"].size_class == "boundary" and ops.VALUE_KINDS["saved"].size_class == "activation"
    assert ops.UNIT_COSTS["FC"] == ops.UNIT_COSTS["R"] == ops.UNIT_COSTS["F"] == 1
    assert costs.SPLITS == {"B": ("I", "W")}  # a recompute is no split of a forward's work
    assert costs.PRICED_LIKE == {"FC": "F", "R": "F"}
    assert (torch_csv._COMPUTE_ONLY["FC"], torch_csv._TORCH_TOKEN["FC"], torch_csv._COMPUTE_ONLY["R"]) == (
        "keep", "F", "drop")
    assert import_torch._TOKEN.fullmatch("3FC1") is None and import_torch._TOKEN.fullmatch("3R1") is None


@pytest.mark.skipif(not _torch_available(), reason="needs torch")
def test_the_interpreters_message_rules_are_todays():
    from pipec.runtime import interpreter

    assert (interpreter.ACT, interpreter.GRAD) == (0, 1)
    # kind code and "where" of each send and receive, as the interpreter spelled them out
    assert {op: (rule.is_send, rule.code, rule.where) for op, rule in _today(ops.PART_RULES).items()} == {
        "SEND_F": (True, interpreter.ACT, "self"), "RECV_F": (False, interpreter.ACT, "prev"),
        "SEND_B": (True, interpreter.GRAD, "self"), "RECV_B": (False, interpreter.GRAD, "next")}
