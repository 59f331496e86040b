"""One worker of ``pipec attention``: ``python -m pipec.runtime.ring_check JOBS``.

``pipec attention`` (``pipec/commands/attention.py``) writes into its run
folder each compiled program (``program-N.json``, as ``pipec compile --format
json`` writes it) and the jobs (``jobs.json``: which program, the inputs'
shape, dtype and seed, the timeout; ``jobs_to_json``), then starts P of these
through ``pipec run``'s launcher (``pipec.commands.run.launch``: torch's
elastic launcher, whose RANK, WORLD_SIZE, MASTER_ADDR, ... this reads as
``pipec.runtime.worker`` does). Each worker reads the jobs and the programs
through the guarded reader (``read_jobs``, ``guarded_read.read_program``),
joins the gloo group and runs every job, rank 0 comparing each with one
process and printing the answers (``main`` says how).

A fault (a wait past the timeout, a failed peer, an op the runtime does not
know) prints ``rank R, step S (INSTR): ...`` to stderr and ends the process
with status 1 (``worker.fatal_errors``); the launcher then stops the others
and reports. A worker still running at the jobs' deadline (a run that stopped
answering altogether) ends itself the same way.

Nothing here imports torch at module level: ``pipec attention`` imports this
module for the jobs' format and its names before any worker starts.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import signal
import sys
import threading
from typing import NamedTuple

from pipec.compiler.guarded_read import Kind, read_json, read_program
from pipec.errors import PipecError, UsageError
from pipec.runtime import worker  # loads no torch either

FIELDS = ("out", "dq", "dk", "dv")
DTYPES = ("float32", "float64")
# Rank 0's answer line on stdout: this prefix, then the answers as JSON (one object per job).
ANSWER_PREFIX = "pipec-attention-answer: "
# The jobs' file in the run folder, and its format tag.
JOBS_FILE = "jobs.json"
JOBS_FORMAT = "pipec-attention-jobs"
# A few lines per job: 1 MiB holds thousands.
JOBS = Kind("attention jobs", "the attention jobs", 1 << 20, "1 MiB")
REFERENCE = "float64, one process (scaled_dot_product_attention, autograd)"
_RESULT_TAG = 7
_JOB_INTS = ("seq", "heads", "head_dim", "batch", "seed")


class AttentionJob(NamedTuple):
    """One attention run: a ring program and the inputs drawn for it."""

    program: object
    seq: int
    heads: int
    head_dim: int
    batch: int = 1
    dtype: str = "float64"
    seed: int = 0


# ------------------------------------------------------------------ the jobs' file


def jobs_to_json(jobs: list[AttentionJob], program_files: list[str], timeout: float, deadline_s: float) -> dict:
    """The jobs as ``read_jobs`` reads them; ``program_files[i]``: the file of job i's program, a name in the
    jobs' folder."""
    return {
        "format": JOBS_FORMAT, "timeout": timeout, "deadline_s": deadline_s,
        "jobs": [{**{name: getattr(job, name) for name in _JOB_INTS}, "dtype": job.dtype, "program": file}
                 for job, file in zip(jobs, program_files)],
    }


def read_jobs(path: str) -> tuple[list[AttentionJob], float, float]:
    """The jobs ``jobs_to_json`` wrote to ``path``, their programs read from the same folder.

    Returns:
        (the jobs, the timeout of one wait, the deadline of the whole run), seconds.
    Raises:
        UsageError: a file that cannot be read or is not what the parent writes (``read_json``,
            ``read_program``).
        ImportError_: a program whose content is invalid (an op no family has, say).
    """
    data = read_json(path, JOBS)
    if not isinstance(data, dict) or data.get("format") != JOBS_FORMAT or not isinstance(data.get("jobs"), list):
        raise UsageError(f"{path}: not the jobs of `pipec attention` (format {JOBS_FORMAT!r})")
    timeout, deadline_s = data.get("timeout"), data.get("deadline_s")
    if not all(_positive_number(value) for value in (timeout, deadline_s)):
        raise UsageError(f"{path}: the timeout and the deadline must be positive numbers of seconds")
    folder = os.path.dirname(os.path.abspath(path))
    programs: dict[str, object] = {}
    jobs = []
    for index, raw in enumerate(data["jobs"]):
        file = raw.get("program") if isinstance(raw, dict) else None
        if (not isinstance(file, str) or os.path.basename(file) != file or raw.get("dtype") not in DTYPES
                or not all(type(raw.get(name)) is int for name in _JOB_INTS)
                or not all(raw[name] >= 1 for name in _JOB_INTS[:-1])):
            raise UsageError(f"{path}: job {index} is not a program file name in this folder, the integers "
                             f"{', '.join(_JOB_INTS[:-1])} (at least 1) and seed, and a dtype ({', '.join(DTYPES)})")
        if file not in programs:
            programs[file] = read_program(os.path.join(folder, file))
        jobs.append(AttentionJob(programs[file], *(raw[name] for name in _JOB_INTS[:-1]), raw["dtype"], raw["seed"]))
    return jobs, float(timeout), float(deadline_s)


def _positive_number(value) -> bool:
    return type(value) in (int, float) and math.isfinite(value) and value > 0


# ------------------------------------------------------------------ inputs, reference, answer


def job_inputs(job: AttentionJob):
    """The whole-sequence q, k, v, grad_out of a run: the same on every rank (drawn from the seed)."""
    import torch

    generator = torch.Generator().manual_seed(job.seed)
    shape = (job.batch, job.heads, job.seq, job.head_dim)
    dtype = getattr(torch, job.dtype)
    return tuple(torch.randn(shape, generator=generator, dtype=dtype) for _ in range(4))


def reference(q, k, v, grad_out, causal: bool):
    """One process's out, dq, dk, dv in float64: SDPA over the whole sequence, autograd."""
    import torch
    import torch.nn.functional as F

    leaves = [t.detach().to(torch.float64).requires_grad_(True) for t in (q, k, v)]
    out = F.scaled_dot_product_attention(*leaves, is_causal=causal)
    out.backward(grad_out.to(torch.float64))
    return (out.detach(), *(t.grad for t in leaves))


def program_info(program) -> dict:
    """What ran: the program's name, parameters and ring plan."""
    plan = program.rings
    return {
        "name": program.name, "params": dict(program.params), "ranks": program.num_ranks, "chunks": plan.chunks,
        "holders": list(plan.holders), "pieces": plan.pieces, "rings": [list(ring) for ring in plan.rings],
        "causal": plan.causal, "kv": plan.kv, "dkv": plan.dkv, "transfer": plan.transfer,
    }


def compare(job: AttentionJob, whole: dict) -> dict:
    """The answer for one job: ``whole`` (out, dq, dk, dv over the sequence) against ``reference``.

    Returns:
        ``{"out", "dq", "dk", "dv"}``: the largest absolute differences;
        ``"scale"``: the reference's largest magnitude of each; ``"program"``
        (``program_info``); the inputs' shape, dtype and seed; ``"reference"``.
    """
    import torch

    program = job.program
    want = dict(zip(FIELDS, reference(*job_inputs(job), program.rings.causal)))
    answer = {name: (whole[name].to(torch.float64) - want[name]).abs().max().item() for name in FIELDS}
    answer["scale"] = {name: want[name].abs().max().item() for name in FIELDS}
    answer["program"] = program_info(program)
    answer.update(seq=job.seq, batch=job.batch, heads=job.heads, head_dim=job.head_dim, dtype=job.dtype,
                  seed=job.seed, reference=REFERENCE)
    return answer


# ------------------------------------------------------------------ the worker


def main(argv: list[str] | None = None) -> int:
    """Run this rank's share of every job; returns the exit status (a fault ends the process itself).

    A worker joins the gloo group (``worker.join_group``) and, for every job in turn:

    * draws the whole-sequence q, k, v and output gradient (B, H, S, D) from the
      job's seed, the same on every rank (``job_inputs``), and keeps its chunks;
    * meets the others at a barrier (no rank's waits count another's drawing),
      runs its list (``runtime.rings.run_ring_attention``, every wait within the
      timeout) and sends its out, dq, dk, dv to rank 0 as one tensor
      (``torch.distributed``, never a file); rank 0 puts the sequence together.

    After a closing barrier (so that rank 0's reference counts against no one's
    timeout) the others end and rank 0 compares every job with one process
    (``compare``: float64 ``scaled_dot_product_attention`` over the whole
    sequence, gradients by autograd, the program's mask) and prints one line on
    stdout, ``ANSWER_PREFIX`` and the answers as JSON, which the parent's
    ``on_line`` picks up.
    """
    parser = argparse.ArgumentParser(prog="python -m pipec.runtime.ring_check",
                                     description="One worker of `pipec attention` (started by it).")
    parser.add_argument("jobs", metavar="JOBS", help=f"the jobs' file ({JOBS_FILE} in the run folder)")
    args = parser.parse_args(argv)
    worker.die_with_launcher()
    try:
        rank, world, local_rank = worker.launch_environment()
        jobs, timeout, deadline_s = read_jobs(args.jobs)
        for job in jobs:
            if job.program.rings is None or job.program.num_ranks != world:
                raise UsageError(f"{job.program.name or 'a program'} is not a sequence-ring program of {world} "
                                 "ranks, the launch's size")
    except PipecError as error:  # every rank reads the same files: the same message from each, no fault
        sys.stderr.write(error.render().rstrip("\n") + "\n")
        return 1
    signal.signal(signal.SIGTERM,
                  lambda *_: worker.die(f"rank {rank}: stopped by the launcher (another worker failed)"))
    # the last resort against a run that stops answering altogether: every wait has its own timeout
    watchdog = threading.Timer(deadline_s, worker.die, (f"rank {rank}: still running at the run's deadline "
                                                  f"({deadline_s:g} s); stopped",))
    watchdog.daemon = True
    watchdog.start()
    with worker.fatal_errors(rank):
        worker.join_group("gloo", rank, world, local_rank, timeout)
        gathered = [_run_job(job, rank, world, timeout) for job in jobs]
        # the references after every rank is done: none of the others' waits counts rank 0's reference
        _bounded_barrier(rank, world, timeout, "the closing barrier")
        if rank == 0:
            answers = [compare(job, whole) for job, whole in zip(jobs, gathered)]
            sys.stdout.write(ANSWER_PREFIX + json.dumps(answers) + "\n")
    return 0


def _bounded_barrier(rank: int, world: int, timeout: float, what: str) -> None:
    import torch.distributed as dist

    from pipec.runtime import comm
    from pipec.runtime.rings import wait_within

    work = dist.barrier(async_op=True)
    others = tuple(r for r in range(world) if r != rank)
    wait_within([work], timeout, comm.Site(rank, -1, what, others, 1))


def _run_job(job: AttentionJob, rank: int, world: int, timeout: float) -> dict | None:
    """This rank's run of one job; on rank 0 every rank's results put together (``FIELDS`` -> whole
    sequence, the accumulating dtype), elsewhere None."""
    import torch
    import torch.distributed as dist

    from pipec.runtime import comm
    from pipec.runtime.rings import own_chunks, run_ring_attention, wait_within

    program = job.program
    plan = program.rings
    q, k, v, grad_out = job_inputs(job)
    mine = [own_chunks(plan, rank, t) for t in (q, k, v, grad_out)]
    _bounded_barrier(rank, world, timeout, "the barrier before the run")  # no rank's waits count another's drawing
    result = run_ring_attention(program, rank, *mine, timeout=timeout)
    if rank != 0:
        flat = torch.cat([getattr(result, name)[c].reshape(-1) for c in result.chunks for name in FIELDS])
        work = dist.isend(flat.contiguous(), 0, tag=_RESULT_TAG)
        site = comm.Site(rank, len(program.ranks[rank]), "sending the results to rank 0", (0,), 1)
        wait_within([work], timeout, site)
        return None
    size = job.seq // plan.chunks
    wide = result.out[result.chunks[0]].dtype
    whole = {name: torch.zeros(q.shape, dtype=wide) for name in FIELDS}
    for c in result.chunks:
        for name in FIELDS:
            whole[name][..., c * size:(c + 1) * size, :] = getattr(result, name)[c]
    shape = (job.batch, job.heads, size, job.head_dim)
    numel = math.prod(shape)
    buffers = {other: torch.empty(len(plan.chunks_of(other)) * len(FIELDS) * numel, dtype=wide)
               for other in range(1, world)}
    works = [dist.irecv(buffer, other, tag=_RESULT_TAG) for other, buffer in buffers.items()]  # all posted at once
    site = comm.Site(0, len(program.ranks[0]), "gathering the results", tuple(buffers), 1)
    wait_within(works, timeout, site)
    for other, buffer in buffers.items():
        pieces = iter(buffer.split(numel))
        for c in plan.chunks_of(other):
            for name in FIELDS:
                whole[name][..., c * size:(c + 1) * size, :] = next(pieces).view(shape)
    return whole


__all__ = ["ANSWER_PREFIX", "AttentionJob", "DTYPES", "FIELDS", "JOBS_FILE", "compare", "job_inputs", "jobs_to_json",
           "main", "program_info", "read_jobs", "reference"]


if __name__ == "__main__":
    worker.end_process(main())
