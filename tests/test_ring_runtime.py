"""Sequence rings on real ranks: ring attention, zigzag and TASP against one process.

Programs come from ``lower_plan(RingPlan(...))`` (proved by ``check_rings``
first), so that every route is covered whatever the schedules write, and from
the shipped ring schedules (ring_attention, zigzag_ring, tasp, tasp_rails)
compiled as ``pipec`` compiles them; they run through
``attention_checks`` (``pipec attention``'s core): P gloo worker processes
(``runtime/ring_check``, started by ``pipec run``'s launcher), every rank
drawing the same q, k, v and output gradient from the seed, one forward and
backward (``runtime/rings.run_ring_attention``), rank 0 comparing out, dq, dk
and dv with ``scaled_dot_product_attention`` and autograd in float64 on one
process. The programs of one rank count share one set of processes, and every
run has a hard limit, so a hang fails instead of stalling.

* float64, to 1e-12: zigzag (causal) at P = 2 and 3; a contiguous ring with
  full attention at P = 3; TASP (zigzag holders, the Hamiltonian rings, KV
  pieces, all_to_all) at P = 3, with kv again / dkv behind and with kv kept /
  dkv direct; dkv direct with kv kept point to point; three pieces on two
  rings (two messages to one peer in one all_to_all); the shipped
  zigzag_ring, ring_attention (full attention) and tasp at P = 3;
* float32 at P = 4, zigzag, TASP and the shipped tasp_rails (2 nodes of 2):
  within 5e-6 of the largest magnitude;
* a rank that stops answering, and one that meets an op the runtime does not
  know, end the run with the ranks' messages (the launcher's report) within
  seconds;
* ``pipec attention`` refuses a program that is not a ring, a length its
  chunks and pieces do not cut, a wrong ``--nproc`` and ``--causal`` on full
  attention, with exit status 1; with the shipped zigzag_ring it prints JSON;
* a one-rank program (no exchange) runs in this process, without a group.
"""
from __future__ import annotations

import dataclasses
import json
import re
import shutil
import time

import pytest
import torch

from pipec.cli import main
from pipec.commands.attention import AttentionJob, AttentionRunError, attention_check, attention_checks
from pipec.compiler.checks.rings import check_rings
from pipec.compiler.defines import parse_defines
from pipec.compiler.driver import compile_target, shipped_schedules
from pipec.compiler.ir import Action, RingPlan
from pipec.compiler.lower_rings import lower_plan
from pipec.compiler.rings import hamiltonian_rings
from pipec.errors import RuntimeFault, UsageError
from pipec.runtime.rings import own_chunks, run_ring_attention

# Longest wait of one instruction, and the hard limit of one set of processes.
TIMEOUT_S = 30.0
DEADLINE_S = 120.0
FIELDS = ("out", "dq", "dk", "dv")


def zigzag_holders(P: int) -> tuple[int, ...]:
    return tuple(c if c < P else 2 * P - 1 - c for c in range(2 * P))


def zigzag(P: int, causal: bool = True, **routes) -> RingPlan:
    return RingPlan(2 * P, zigzag_holders(P), 1, (tuple(range(P)),), causal, **routes)


def contiguous(P: int, causal: bool, **routes) -> RingPlan:
    return RingPlan(P, tuple(range(P)), 1, (tuple(range(P)),), causal, **routes)


def tasp(P: int, pieces: int | None = None, holders=None, causal: bool = True, **routes) -> RingPlan:
    rings = hamiltonian_rings(P).cycles
    holders = zigzag_holders(P) if holders is None else holders
    return RingPlan(len(holders), holders, pieces or len(rings), rings, causal, transfer="all_to_all", **routes)


def job(name: str, plan, dtype: str = "float64", seed: int = 0, per_piece: int = 3) -> AttentionJob:
    """A run of ``plan`` (a ``RingPlan``, lowered and proved here) or of a shipped schedule (``(target, defines)``,
    compiled and checked by the driver)."""
    if isinstance(plan, RingPlan):
        program = lower_plan(plan, name)
        check_rings(program)  # the runtime is held to programs the checker proves
    else:
        target, defines = plan
        program = compile_target(target, parse_defines(defines)).program
    rings = program.rings
    return AttentionJob(program, rings.chunks * rings.pieces * per_piece, heads=3, head_dim=8, batch=2, dtype=dtype,
                        seed=seed)


def causal_of(plan) -> bool:
    return plan.causal if isinstance(plan, RingPlan) else "causal=false" not in plan[1]


def worst(result: dict, relative: bool = False) -> tuple[str, float]:
    """The field with the largest difference (absolute, or relative to the largest magnitude), and it."""
    value = {f: result[f] / (result["scale"][f] if relative else 1.0) for f in FIELDS}
    name = max(value, key=value.get)
    return name, value[name]


# ------------------------------------------------------------------ float64


THREE_RANKS = {
    "zigzag": zigzag(3),
    "contiguous, full": contiguous(3, False),
    "tasp, kv again, dkv behind": tasp(3),
    "tasp, kv kept, dkv direct": tasp(3, kv="kept", dkv="direct"),
    "zigzag, kv kept, dkv direct, p2p": zigzag(3, kv="kept", dkv="direct"),
    "three pieces on two rings, contiguous": tasp(3, pieces=3, holders=(0, 1, 2), kv="kept", dkv="direct"),
    "shipped zigzag_ring": ("zigzag_ring", ["P=3"]),
    "shipped ring_attention, full": ("ring_attention", ["P=3", "causal=false"]),
    "shipped tasp": ("tasp", ["P=3"]),
}


@pytest.fixture(scope="module")
def three_ranks():
    names = list(THREE_RANKS)
    results = attention_checks([job(name, THREE_RANKS[name], seed=i) for i, name in enumerate(names)], 3,
                               TIMEOUT_S, deadline_s=DEADLINE_S)
    return dict(zip(names, results))


@pytest.mark.parametrize("name", list(THREE_RANKS))
def test_three_ranks_reproduce_one_process_in_float64(three_ranks, name):
    result = three_ranks[name]
    field, diff = worst(result)
    assert diff <= 1e-12, f"{name}: {field} differs by {diff:.3g}"
    assert result["program"]["causal"] == causal_of(THREE_RANKS[name])
    assert all(result["scale"][f] > 0.1 for f in FIELDS)  # the comparison is not of zeros


def test_zigzag_on_two_ranks_reproduces_one_process_in_float64():
    results = attention_checks([job("zigzag", zigzag(2)), job("zigzag, full", zigzag(2, False), seed=5)], 2,
                               TIMEOUT_S, deadline_s=DEADLINE_S)
    for result in results:
        field, diff = worst(result)
        assert diff <= 1e-12, f"{result['program']['name']}: {field} differs by {diff:.3g}"


# ------------------------------------------------------------------ float32


def test_float32_on_four_ranks_stays_within_five_millionths():
    results = attention_checks([job("zigzag", zigzag(4), "float32", per_piece=4),
                                job("tasp", tasp(4), "float32", seed=1, per_piece=4),
                                job("tasp_rails", ("tasp:tasp_rails", ["M=2", "K=2"]), "float32", seed=2, per_piece=4)],
                               4, TIMEOUT_S, deadline_s=DEADLINE_S)
    for result in results:
        field, relative = worst(result, relative=True)
        assert relative <= 5e-6, f"{result['program']['name']}: {field} is off by {relative:.3g} of its magnitude"
        assert result["dtype"] == "float32"


# ------------------------------------------------------------------ faults


def _with(program, rank: int, row: list[Action]):
    ranks = [list(r) for r in program.ranks]
    ranks[rank] = row
    return dataclasses.replace(program, ranks=ranks)


def _failure(caught) -> str:
    """The launcher's report of a failed run; the run folder it keeps for the user (the workers' logs) removed."""
    text = caught.value.render()
    assert text.startswith("pipec attention: the run failed\n"), text
    logs = re.search(r"^worker logs: (.+)$", text, re.MULTILINE)
    assert logs, text
    shutil.rmtree(logs.group(1), ignore_errors=True)
    return text


def test_a_rank_that_waits_for_a_message_never_sent_ends_the_run_at_the_timeout():
    """Rank 1 waits for a KV bundle rank 0 never sends: rank 1 stops at its timeout, and so the run, named."""
    program = lower_plan(zigzag(2), "zigzag")
    stray = Action(-1, "EXCHANGE", 99, -1, (Action(0, "RECV_KV", 0, 0),))
    broken = _with(program, 1, list(program.ranks[1]) + [stray, Action(-1, "EXCHANGE_WAIT", 99)])
    start = time.monotonic()
    with pytest.raises(AttentionRunError) as caught:
        attention_check(broken, 2, 8, 2, 4, timeout=2.0)
    seconds = time.monotonic() - start
    text = _failure(caught)
    assert "rank 1, step" in text and "EXCHANGE_WAIT99" in text, text
    assert "no answer within the timeout" in text, text
    assert seconds < 30, f"the run took {seconds:.1f} s to give up"


def test_an_op_the_runtime_does_not_know_is_named_and_the_others_stop():
    program = lower_plan(zigzag(2), "zigzag")
    broken = _with(program, 0, [Action(-1, "FROBNICATE")] + list(program.ranks[0]))
    with pytest.raises(AttentionRunError) as caught:
        attention_check(broken, 2, 8, 2, 4, timeout=5.0)
    text = _failure(caught)
    # a worker reads its program as the JSON reader reads any program: the op is refused there, by name
    assert "rank 0, step 0: unknown op 'FROBNICATE'" in text, text
    # every worker reads the whole program, so either may refuse it first; the launcher then stops the other
    assert re.search(r"^rank [01]: exited with status 1$", text, re.M) and "rank 0:" in text and "rank 1:" in text, \
        text


# ------------------------------------------------------------------ errors before any process


def test_attention_check_refuses_what_cannot_run():
    ring = lower_plan(tasp(3), "tasp")  # 6 chunks x 2 pieces
    pipeline = compile_target("gpipe", parse_defines(["P=2"])).program
    with pytest.raises(UsageError, match="not a sequence-ring schedule"):
        attention_check(pipeline, 2, 16, 2, 8)
    with pytest.raises(UsageError, match=r"--seq 30: .*6 equal chunks of 2 equal pieces.*multiple of 12"):
        attention_check(ring, 3, 30, 2, 8)
    with pytest.raises(UsageError, match="compiled for 3 ranks, but --nproc is 4"):
        attention_check(ring, 4, 24, 2, 8)
    with pytest.raises(UsageError, match="--dtype"):
        attention_check(ring, 3, 24, 2, 8, dtype="bfloat16")


def test_pipec_attention_refuses_a_pipeline_schedule(capsys):
    status = main(["attention", "gpipe", "-D", "P=2", "--nproc", "2", "--seq", "16", "--heads", "2", "--head-dim", "8"])
    err = capsys.readouterr().err
    assert status == 1
    assert "gpipe is not a sequence-ring schedule" in err and "Traceback" not in err


needs_zigzag = pytest.mark.skipif("zigzag_ring" not in shipped_schedules(),
                                  reason="schedules/zigzag_ring.pipe has not landed")


@needs_zigzag
def test_pipec_attention_refuses_a_bad_length_a_wrong_nproc_and_causal_on_full_attention(capsys):
    common = ["--heads", "2", "--head-dim", "8"]
    assert main(["attention", "zigzag_ring", "-D", "P=2", "--nproc", "2", "--seq", "10", *common]) == 1
    assert "multiple of 4" in capsys.readouterr().err
    assert main(["attention", "zigzag_ring", "-D", "P=2", "--nproc", "3", "--seq", "16", *common]) == 1
    assert "compiled for 2 ranks, but --nproc is 3" in capsys.readouterr().err
    assert main(["attention", "zigzag_ring", "-D", "P=2", "-D", "causal=false", "--causal", "--nproc", "2",
                 "--seq", "16", *common]) == 1
    err = capsys.readouterr().err
    assert "full attention" in err and "-D causal=true" in err and "Traceback" not in err


@needs_zigzag
def test_pipec_attention_prints_json_for_a_ring_schedule(capsys):
    status = main(["attention", "zigzag_ring", "-D", "P=2", "--nproc", "2", "--seq", "16", "--heads", "2",
                   "--head-dim", "4", "--batch", "2", "--causal", "--json", "--timeout", str(TIMEOUT_S)])
    out = capsys.readouterr().out
    assert status == 0
    result = json.loads(out)
    assert set(FIELDS) <= set(result) and set(result["scale"]) == set(FIELDS)
    assert result["program"]["name"] == "zigzag_ring" and result["program"]["causal"] is True
    assert max(result[f] for f in FIELDS) <= 1e-12


# ------------------------------------------------------------------ one rank, in this process


def _inputs(length: int, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    return tuple(torch.randn((2, 3, length, 8), generator=generator, dtype=torch.float64) for _ in range(4))


@pytest.mark.parametrize("causal", [True, False])
def test_one_rank_with_two_chunks_of_three_pieces_runs_without_a_process_group(causal):
    """A one-rank program has no exchange: run_ring_attention runs it here, every block split by positions."""
    program = lower_plan(RingPlan(2, (0, 0), 3, ((0,),), causal, dkv="direct"), "alone")
    q, k, v, grad = _inputs(24)
    result = run_ring_attention(program, 0, *(own_chunks(program.rings, 0, t) for t in (q, k, v, grad)),
                                timeout=5.0)
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
    out = torch.nn.functional.scaled_dot_product_attention(*leaves, is_causal=causal)
    out.backward(grad)
    for name, want in zip(FIELDS, (out.detach(), *(t.grad for t in leaves))):
        assert (result.local(name) - want).abs().max().item() <= 1e-12, name


def test_the_runtime_names_what_it_cannot_run():
    program = lower_plan(RingPlan(2, (0, 0), 1, ((0,),), True, dkv="direct"), "alone")
    q, k, v, grad = _inputs(8)
    strange = dataclasses.replace(program, ranks=[[Action(-1, "FROBNICATE")] + list(program.ranks[0])])
    with pytest.raises(RuntimeFault, match=r"rank 0, step 0 \(FROBNICATE\): .*no instruction 'FROBNICATE'"):
        run_ring_attention(strange, 0, q, k, v, grad, timeout=5.0)
    lonely = dataclasses.replace(program, ranks=[[Action(-1, "EXCHANGE", 0, -1, ())] + list(program.ranks[0])])
    with pytest.raises(RuntimeFault, match="none is joined"):
        run_ring_attention(lonely, 0, q, k, v, grad, timeout=5.0)
    with pytest.raises(UsageError, match="not a sequence-ring program"):
        run_ring_attention(compile_target("gpipe", parse_defines(["P=2"])).program, 0, q, k, v, grad, timeout=5.0)


@needs_zigzag
def test_pipec_attention_reads_a_compiled_program_and_refuses_defines_for_it(capsys, tmp_path):
    from pipec.compiler.emit.json_program import write_program_json

    path = tmp_path / "zigzag.json"
    with open(path, "w", encoding="utf-8") as out:
        write_program_json(compile_target("zigzag_ring", parse_defines(["P=2"])).program, out)
    common = ["--seq", "16", "--heads", "2", "--head-dim", "8"]
    assert main(["attention", str(path), "-D", "P=3", "--nproc", "2", *common]) == 1
    assert "-D sets parameters of a .pipe schedule" in capsys.readouterr().err
    assert main(["attention", str(path), "--nproc", "3", *common]) == 1  # read, checked, and its 2 ranks known
    assert "compiled for 2 ranks, but --nproc is 3" in capsys.readouterr().err
