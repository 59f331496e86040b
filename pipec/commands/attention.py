"""``pipec attention``: run a sequence-ring schedule's attention on P CPU processes and hold it to one process.

    pipec attention TARGET [-D NAME=VALUE ...] --nproc P --seq S --heads H --head-dim D
                    [--batch B] [--causal] [--dtype float32|float64] [--seed N] [--json] [--timeout SECONDS]

Why: the ring checks prove a program's routes and coverage symbolically; this
proves its numbers. TARGET is compiled and checked as every command does it
(``load_target_program``), or read and checked when it is a compiled program,
and must be a sequence-ring schedule. P workers (``runtime/ring_check.py``,
started through ``pipec run``'s launcher) run one forward and backward of
attention on a gloo group, every rank drawing the same random inputs from the
seed and keeping its own chunks; rank 0 gathers the results with
``torch.distributed`` messages, never a shared file, and compares them with one
process (float64 SDPA, its gradients by autograd, the program's mask).

The answer is the largest absolute difference of out, dq, dk and dv with the
largest magnitude of each, as text or ``--json``. The status is 0 when the run
finished (the numbers are for the user to judge), 1 on any error, raised before
a process starts where it can be (``check_job``); a worker that fails or waits
past ``--timeout`` ends the run with the launcher's report, never a hang.
docs/rings.md, section 6, describes the run and its measured agreement.
``attention_check(program, ...)`` is the same run for a compiled ``Program``;
``attention_checks`` runs several programs of one rank count in one set of
processes.
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile

from pipec.compiler.family import families_of
from pipec.compiler.guarded_read import count_arg, positive_count_arg, seconds_arg
from pipec.compiler.ops import SEQUENCE_RING
from pipec.errors import PipecError, UsageError, printable_name
from pipec.runtime.ring_check import (ANSWER_PREFIX, DTYPES, FIELDS, JOBS_FILE, AttentionJob, job_inputs,
                                      jobs_to_json, reference)

DEFAULT_TIMEOUT_S = 60.0
# The worker: ``python -m pipec.runtime.ring_check JOBS``.
WORKER_MODULE = "pipec.runtime.ring_check"
# The most elements one tensor of a run may hold (inputs, or the reference's scores): 2^27 float64 values
# are 1 GiB, and a run holds a few such tensors per process; the numbers the check is for show at any size.
MAX_ATTENTION_ELEMENTS = 2 ** 27
MAX_ATTENTION_TEXT = "2^27, 1 GiB of float64 per tensor"
# What the run is called in the launcher's messages and report.
COMMAND = "pipec attention"


class AttentionRunError(PipecError):
    """The multi-process run did not finish: a worker failed, waited past its timeout, or never answered."""


def register(sub) -> None:
    parser = sub.add_parser(
        "attention",
        help="run a sequence-ring schedule's attention (ring, zigzag, TASP) on P CPU processes and compare it "
             "with one process",
    )
    parser.add_argument("target", metavar="TARGET",
                        help="a .pipe file, a shipped schedule's name (see `pipec list`), or a compiled program .json")
    parser.add_argument("-D", dest="defines", action="append", default=[], metavar="NAME=VALUE",
                        help="set a schedule parameter (repeatable)")
    parser.add_argument("--nproc", type=positive_count_arg, required=True, metavar="P",
                        help="worker processes: the program's rank count")
    parser.add_argument("--seq", type=positive_count_arg, required=True, metavar="S",
                        help="sequence length, a multiple of chunks x pieces")
    parser.add_argument("--heads", type=positive_count_arg, required=True, metavar="H", help="attention heads")
    parser.add_argument("--head-dim", dest="head_dim", type=positive_count_arg, required=True, metavar="D",
                        help="head dimension")
    parser.add_argument("--batch", type=positive_count_arg, default=1, metavar="B", help="batch size (default 1)")
    parser.add_argument("--causal", action="store_true",
                        help="require the causal mask (an error for a program with full attention)")
    parser.add_argument("--dtype", choices=DTYPES, default="float64", help="the inputs' dtype (default float64)")
    parser.add_argument("--seed", type=count_arg, default=0, metavar="N", help="seed of the random inputs (default 0)")
    parser.add_argument("--json", action="store_true", help="print JSON")
    parser.add_argument("--timeout", type=seconds_arg, default=DEFAULT_TIMEOUT_S, metavar="SECONDS",
                        help=f"longest wait of one instruction (default {DEFAULT_TIMEOUT_S:g})")
    parser.set_defaults(func=run)


def run(args) -> int:
    from pipec.commands._common import dump_json, write_output

    program = load_target_program(args.target, args.defines)
    require_ring(program, args.target)
    if args.causal and not ring_plan(program).causal:
        raise UsageError(f"--causal: {args.target} compiles to full attention; pass -D causal=true if the schedule "
                         "has that parameter, or use a causal schedule (without --causal the program's own mask is "
                         "used)")
    result = attention_check(program, args.nproc, args.seq, args.heads, args.head_dim, args.batch, args.dtype,
                             args.seed, args.timeout)
    write_output(dump_json(result) if args.json else describe(result), None)
    return 0


# ------------------------------------------------------------------ checks


def load_target_program(target: str, defines: list[str]):
    """The checked program of TARGET: a ``.pipe`` file or shipped schedule compiled with its ``-D`` values,
    or a compiled program (``pipec compile --format json``) read and checked as ``pipec check`` does."""
    from pipec.commands._common import parse_defines
    from pipec.compiler.guarded_read import looks_like_program

    if looks_like_program(target):
        from pipec.compiler.checks import check_all
        from pipec.compiler.guarded_read import read_program

        if defines:
            raise UsageError(f"-D sets parameters of a .pipe schedule; the compiled program '{target}' has its own")
        program = read_program(target)
        check_all(program, semantics="rendezvous")
        return program
    from pipec.compiler.driver import compile_target

    return compile_target(target, parse_defines(defines)).program


def ring_plan(program):
    """The sequence-ring plan of ``program``, as its family holds it, or None when it is no sequence ring."""
    return next((family.plan_of(program) for family in families_of(program) if family.name == SEQUENCE_RING), None)


def require_ring(program, target: str | None = None) -> None:
    """Raise UsageError unless ``program`` is a sequence-ring program."""
    if ring_plan(program) is None:
        what = target or program.name or "the program"
        family = families_of(program)[0].name
        raise UsageError(f"{what} is not a sequence-ring schedule (it is {family}): `pipec attention` runs ring, "
                         "zigzag and TASP attention schedules, whose `sequence chunks` declare how the sequence is cut")


def check_job(job: AttentionJob, nproc: int) -> None:
    """Everything about a run that can be wrong before a process starts.

    Raises:
        UsageError: not a ring program, ``nproc`` other than its ranks, a length
            that its chunks and pieces do not cut evenly, a size below 1, a dtype
            other than float32 or float64.
    """
    program = job.program
    require_ring(program)
    if nproc != program.num_ranks:
        raise UsageError(f"{program.name or 'the program'} was compiled for {program.num_ranks} ranks, but --nproc "
                         f"is {nproc}: pass --nproc {program.num_ranks}, or compile it for {nproc} ranks (its ranks "
                         f"parameter, e.g. -D P={nproc})")
    plan = ring_plan(program)
    cut = plan.chunks * plan.pieces
    if not isinstance(job.seq, int) or job.seq < 1 or job.seq % cut:  # as runtime.rings.chunk_length, without torch
        cutting = f"{plan.chunks} equal chunks" + (f" of {plan.pieces} equal pieces" if plan.pieces > 1 else "")
        near = max(1, round(job.seq / cut) if isinstance(job.seq, int) else 1) * cut
        raise UsageError(f"--seq {job.seq}: the program cuts the sequence into {cutting}, so its length must be a "
                         f"multiple of {cut} (e.g. {near})")
    for name, value in (("--heads", job.heads), ("--head-dim", job.head_dim), ("--batch", job.batch)):
        if not isinstance(value, int) or value < 1:
            raise UsageError(f"{name} must be an integer >= 1, got {value!r}")
    _check_size(job)
    if _dtype_name(job.dtype) not in DTYPES:
        raise UsageError(f"--dtype must be one of {', '.join(DTYPES)}, got {job.dtype!r}")


def _check_size(job: AttentionJob) -> None:
    """Refuse, before any process starts, a run whose tensors pass ``MAX_ATTENTION_ELEMENTS``: the inputs
    (batch x heads x seq x head dim, each of q, k, v and their gradients) and the one-process reference's
    attention scores (batch x heads x seq x seq), which are held whole."""
    sizes = (("inputs (--batch x --heads x --seq x --head-dim)", job.batch * job.heads * job.seq * job.head_dim),
             ("reference's attention scores (--batch x --heads x --seq x --seq)", job.batch * job.heads * job.seq ** 2))
    for what, elements in sizes:
        if elements > MAX_ATTENTION_ELEMENTS:
            raise UsageError(f"the run's {what} would hold {elements:,} elements; pipec attention's limit is "
                             f"{MAX_ATTENTION_ELEMENTS:,} ({MAX_ATTENTION_TEXT}): a smaller size checks the same "
                             "program")


def _dtype_name(dtype) -> str:
    return str(dtype).replace("torch.", "")


def attention_check(program, nproc: int, seq: int, heads: int, head_dim: int, batch: int = 1, dtype="float64",
                    seed: int = 0, timeout: float = DEFAULT_TIMEOUT_S) -> dict:
    """Run a compiled ring program's attention on ``nproc`` CPU processes and compare it with one process.

    Args:
        program: a sequence-ring ``Program``.
        nproc: worker processes; the program's rank count.
        seq, heads, head_dim, batch: the inputs' shape (batch, heads, seq, head_dim).
        dtype: ``"float32"`` or ``"float64"`` (or the torch dtype).
        seed: the inputs' seed.
        timeout: the longest wait of one instruction, seconds.
    Returns:
        ``{"out", "dq", "dk", "dv"}``: the largest absolute differences from
        one process (float64 SDPA and autograd); ``"scale"``: the largest
        magnitude of each; ``"program"``: what ran; and the inputs' shape.
    Raises:
        UsageError: the run cannot be made (``check_job``).
        AttentionRunError: a worker failed, or waited past ``timeout``.
    """
    job = AttentionJob(program, seq, heads, head_dim, batch, _dtype_name(dtype), seed)
    return attention_checks([job], nproc, timeout)[0]


def attention_checks(jobs: list[AttentionJob], nproc: int, timeout: float = DEFAULT_TIMEOUT_S,
                     deadline_s: float | None = None) -> list[dict]:
    """``attention_check`` of several runs of one rank count, one after the other in one set of processes.

    Args:
        deadline_s: the limit of the whole run, past which every worker ends
            itself (and the launcher stops the others); by default every
            wait's timeout, added up, and allowances to start and compute
            (``_deadline_s``).
    """
    jobs = [job._replace(dtype=_dtype_name(job.dtype)) for job in jobs]
    if not jobs:
        return []
    for job in jobs:
        check_job(job, nproc)
    if not timeout > 0:
        raise UsageError(f"--timeout must be a positive number of seconds, got {timeout}")
    deadline_s = _deadline_s(jobs, timeout) if deadline_s is None else deadline_s
    if not deadline_s > 0:
        raise UsageError(f"the run's deadline must be a positive number of seconds, got {deadline_s}")
    return _launch(jobs, nproc, timeout, deadline_s)


# ------------------------------------------------------------------ output


def describe(result: dict) -> str:
    """The text answer: what ran, then per tensor its largest difference and largest magnitude."""
    info = result["program"]
    pieces = f"{info['pieces']} piece{'s' if info['pieces'] > 1 else ''}"
    rings = f"{len(info['rings'])} ring{'s' if len(info['rings']) > 1 else ''}"
    lines = [
        f"{printable_name(info['name']) or 'ring program'}: {info['ranks']} ranks, {info['chunks']} chunks (holders "
        f"{' '.join(map(str, info['holders']))}) of {pieces}, {rings}, "
        f"{'causal' if info['causal'] else 'full attention'}, kv {info['kv']}, dkv {info['dkv']}, {info['transfer']}",
        f"inputs: seq {result['seq']}, batch {result['batch']}, heads {result['heads']}, "
        f"head dim {result['head_dim']}, {result['dtype']}, seed {result['seed']}",
        "largest |ring - one process| (reference: float64 SDPA and autograd), and largest |reference|:",
    ]
    for name in FIELDS:
        diff, scale = result[name], result["scale"][name]
        relative = f"  ({diff / scale:.2e} relative)" if scale > 0 else ""
        lines.append(f"  {name:<3} {diff:.3e}  of {scale:.4g}{relative}")
    return "\n".join(lines)


# ------------------------------------------------------------------ the launch


def _deadline_s(jobs: list[AttentionJob], timeout: float) -> float:
    """The run's last resort (each worker ends itself past it): joining the group, every wait of every job
    at its full timeout, and time to compute.

    A worker's waits end at ``timeout`` and a failed worker ends its process,
    so a failure normally ends the run at once; this only bounds a run that
    stops answering altogether.
    """
    from pipec.runtime.worker import JOIN_ALLOWANCE_S

    waits = sum(max(sum(1 for a in row if a.op == "EXCHANGE_WAIT") for row in job.program.ranks) + 3 for job in jobs)
    return JOIN_ALLOWANCE_S + timeout * waits + 300.0


def _launch(jobs: list[AttentionJob], nproc: int, timeout: float, deadline_s: float) -> list[dict]:
    """Write the programs and the jobs into a new run folder, launch ``nproc`` workers and take rank 0's answer.

    Raises:
        AttentionRunError: the launcher's report of a failed run (the folder, with the workers' logs, is kept),
            or a run that ended without rank 0's answer.
    """
    from pipec.commands.run import launch

    run_dir = tempfile.mkdtemp(prefix="pipec-attention-")
    try:
        jobs_path = _write_jobs(jobs, run_dir, timeout, deadline_s)
    except BaseException:
        shutil.rmtree(run_dir, ignore_errors=True)
        raise
    answers: list[str] = []

    def on_line(rank: int, line: str) -> None:
        if rank == 0 and line.startswith(ANSWER_PREFIX):
            answers.append(line[len(ANSWER_PREFIX):])

    env = None if "OMP_NUM_THREADS" in os.environ else {"OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // nproc))}
    result = launch(["-m", WORKER_MODULE, jobs_path], nproc, on_line=on_line, echo=False, env=env, run_dir=run_dir,
                    command=COMMAND)
    if not result.ok:
        raise AttentionRunError(result.report.rstrip("\n"))
    try:
        parsed = json.loads(answers[-1]) if answers else None
    except ValueError:
        parsed = None
    if not (isinstance(parsed, list) and len(parsed) == len(jobs) and all(isinstance(a, dict) for a in parsed)):
        raise AttentionRunError(f"{COMMAND}: the workers ended, but rank 0 gave no answer for the "
                                f"{len(jobs)} job{'s' if len(jobs) > 1 else ''}")
    return parsed


def _write_jobs(jobs: list[AttentionJob], folder: str, timeout: float, deadline_s: float) -> str:
    """Write each distinct program (``pipec run``'s ``write_program``) and the jobs (``JOBS_FILE``) into
    ``folder``, atomically; returns the jobs' file."""
    from pipec.commands.run import write_program
    from pipec.compiler.atomic_write import write_atomically

    files: dict[int, str] = {}
    for job in jobs:
        if id(job.program) not in files:
            name = f"program-{len(files)}.json"
            write_program(job.program, folder, name)
            files[id(job.program)] = name
    path = os.path.join(folder, JOBS_FILE)
    data = jobs_to_json(jobs, [files[id(job.program)] for job in jobs], timeout, deadline_s)
    write_atomically(path, json.dumps(data), what="the attention jobs")
    return path


__all__ = ["AttentionJob", "AttentionRunError", "attention_check", "attention_checks", "check_job", "describe",
           "job_inputs", "reference", "register", "require_ring", "ring_plan", "run"]
