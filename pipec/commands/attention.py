"""``pipec attention``: run a sequence-ring schedule's attention on P CPU processes and hold it to one process.

    pipec attention TARGET [-D NAME=VALUE ...] --nproc P --seq S --heads H --head-dim D
                    [--batch B] [--causal] [--dtype float32|float64] [--seed N] [--json] [--timeout SECONDS]

TARGET (a ``.pipe`` file or a shipped schedule) is compiled as every command
compiles it, or read and checked when it is a compiled program (``pipec
compile --format json``), and must be a sequence-ring schedule (ring, zigzag,
TASP attention). P worker processes (``python -m pipec.commands.attention``, each
given its orders as JSON through a pipe this process made, one OpenMP thread
per core share unless OMP_NUM_THREADS says otherwise) join a gloo group on
this machine and run one forward and backward of attention over a sequence of
S tokens (``runtime/rings.run_ring_attention``), every rank drawing the same
random q, k, v and output gradient (B, H, S, D) from the seed and keeping its
own chunks. Rank 0 gathers the results (``torch.distributed`` messages, never
a shared file), compares them with one process and answers through its own
pipe:
``torch.nn.functional.scaled_dot_product_attention`` over the whole sequence
in float64, its gradients by autograd, the mask the program's.

The answer is the largest absolute difference of out, dq, dk and dv with the
largest magnitude of each (so that a relative error can be read), as text or,
with ``--json``, ``{"out", "dq", "dk", "dv", "scale": {...}, "program": {...}, ...}``.
The status is 0 when the run finished (the numbers are for the user to
judge), 1 on any error: a target that is not a ring schedule, a length the
chunks and pieces do not cut evenly, ``--nproc`` other than the program's
ranks, ``--causal`` for a program with full attention, or a worker that
failed or waited past ``--timeout`` (the run then ends with the workers'
messages, never a hang).

``attention_check(program, ...)`` is the same run for a compiled ``Program``
(``compiler/lower_rings.lower_plan``'s, say); ``attention_checks`` runs
several programs of one rank count in one set of processes.
"""
from __future__ import annotations

import json
import os
import selectors
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from typing import NamedTuple

from pipec.compiler.guarded_read import count_arg, positive_count_arg, seconds_arg
from pipec.errors import PipecError, RuntimeFault, UsageError

DEFAULT_TIMEOUT_S = 60.0
DTYPES = ("float32", "float64")
# Starting a worker (importing torch) and joining the group: its own allowance, apart from --timeout.
JOIN_ALLOWANCE_S = 120.0
# After the first worker fails, how long the others may take to report their own failure before they are killed.
_GRACE_S = 3.0
_POLL_S = 0.2
_RESULT_TAG = 7
_FIELDS = ("out", "dq", "dk", "dv")
# What a worker's store says when the free port was taken between the probe and its bind.
_PORT_TAKEN = "address already in use"
# How much of a worker's own output a failure without an answer shows.
_TAIL_LINES = 12


class AttentionRunError(PipecError):
    """The multi-process run did not finish: a worker failed, waited past its timeout, or never answered."""


class AttentionJob(NamedTuple):
    """One attention run: a ring program and the inputs drawn for it."""

    program: object
    seq: int
    heads: int
    head_dim: int
    batch: int = 1
    dtype: str = "float64"
    seed: int = 0


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
    if args.causal and not program.rings.causal:
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


def require_ring(program, target: str | None = None) -> None:
    """Raise UsageError unless ``program`` is a sequence-ring program."""
    if getattr(program, "rings", None) is None:
        what = target or program.name or "the program"
        family = "weight passing" if getattr(program, "weights", None) is not None else "activation passing"
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
    plan = program.rings
    cut = plan.chunks * plan.pieces
    if not isinstance(job.seq, int) or job.seq < 1 or job.seq % cut:  # as runtime.rings.chunk_length, without torch
        cutting = f"{plan.chunks} equal chunks" + (f" of {plan.pieces} equal pieces" if plan.pieces > 1 else "")
        near = max(1, round(job.seq / cut) if isinstance(job.seq, int) else 1) * cut
        raise UsageError(f"--seq {job.seq}: the program cuts the sequence into {cutting}, so its length must be a "
                         f"multiple of {cut} (e.g. {near})")
    for name, value in (("--heads", job.heads), ("--head-dim", job.head_dim), ("--batch", job.batch)):
        if not isinstance(value, int) or value < 1:
            raise UsageError(f"{name} must be an integer >= 1, got {value!r}")
    if _dtype_name(job.dtype) not in DTYPES:
        raise UsageError(f"--dtype must be one of {', '.join(DTYPES)}, got {job.dtype!r}")


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
        deadline_s: the parent's limit for the whole run, past which every
            worker is killed; by default every wait's timeout, added up, and
            allowances to start and compute (``_deadline_s``).
    """
    jobs = [job._replace(dtype=_dtype_name(job.dtype)) for job in jobs]
    if not jobs:
        return []
    for job in jobs:
        check_job(job, nproc)
    if not timeout > 0:
        raise UsageError(f"--timeout must be a positive number of seconds, got {timeout}")
    deadline_s = _deadline_s(jobs, timeout) if deadline_s is None else deadline_s
    try:
        return _launch(jobs, nproc, timeout, deadline_s)
    except AttentionRunError as error:
        if _PORT_TAKEN not in str(error).lower():
            raise
        return _launch(jobs, nproc, timeout, deadline_s)  # another process took the free port first: once more


# ------------------------------------------------------------------ output


def program_info(program) -> dict:
    plan = program.rings
    return {
        "name": program.name, "params": dict(program.params), "ranks": program.num_ranks, "chunks": plan.chunks,
        "holders": list(plan.holders), "pieces": plan.pieces, "rings": [list(ring) for ring in plan.rings],
        "causal": plan.causal, "kv": plan.kv, "dkv": plan.dkv, "transfer": plan.transfer,
    }


def describe(result: dict) -> str:
    """The text answer: what ran, then per tensor its largest difference and largest magnitude."""
    info = result["program"]
    pieces = f"{info['pieces']} piece{'s' if info['pieces'] > 1 else ''}"
    rings = f"{len(info['rings'])} ring{'s' if len(info['rings']) > 1 else ''}"
    lines = [
        f"{info['name'] or 'ring program'}: {info['ranks']} ranks, {info['chunks']} chunks (holders "
        f"{' '.join(map(str, info['holders']))}) of {pieces}, {rings}, "
        f"{'causal' if info['causal'] else 'full attention'}, kv {info['kv']}, dkv {info['dkv']}, {info['transfer']}",
        f"inputs: seq {result['seq']}, batch {result['batch']}, heads {result['heads']}, "
        f"head dim {result['head_dim']}, {result['dtype']}, seed {result['seed']}",
        "largest |ring - one process| (reference: float64 SDPA and autograd), and largest |reference|:",
    ]
    for name in _FIELDS:
        diff, scale = result[name], result["scale"][name]
        relative = f"  ({diff / scale:.2e} relative)" if scale > 0 else ""
        lines.append(f"  {name:<3} {diff:.3e}  of {scale:.4g}{relative}")
    return "\n".join(lines)


# ------------------------------------------------------------------ the workers


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


def _worker_main(argv: list[str]) -> None:
    """One rank (``python -m pipec.commands.attention JOB_FD ANSWER_FD``): its orders come as JSON through the
    pipe the parent made (JOB_FD); it joins the group, runs every job (rank 0 compares) and answers, as JSON,
    through the parent's other pipe (ANSWER_FD): ``("ok", answers or None)`` or ``("error", message)``."""
    _die_with_parent()
    job_fd, answer_fd = int(argv[0]), int(argv[1])
    status, rank = 1, "?"
    try:
        with os.fdopen(job_fd, "rb") as orders:
            rank, nproc, port, jobs, timeout = _orders_from_json(json.load(orders))
        message = ("ok", _worker(rank, nproc, port, jobs, timeout))
        status = 0
    except RuntimeFault as fault:  # renders as "rank R, step S (INSTR): ..."
        message = ("error", fault.render())
    except PipecError as error:
        message = ("error", f"rank {rank}: {error.render()}")
    except BaseException as error:  # a bug, or the backend's own failure: say what and where
        text = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        message = ("error", f"rank {rank}: {type(error).__name__}: {text}\n{traceback.format_exc()}")
    try:
        with os.fdopen(answer_fd, "w", encoding="utf-8") as answer:
            json.dump(list(message), answer)
    except OSError:
        status = 1  # the parent is gone
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)  # no teardown of a group whose peers may be gone: it can hang


def _orders_to_json(rank: int, nproc: int, port: int, jobs: list[AttentionJob], timeout: float) -> list:
    """A worker's orders as plain JSON data (the programs as ``pipec compile --format json`` writes them)."""
    from pipec.compiler.emit.json_program import program_to_json

    return [rank, nproc, port, [{**job._asdict(), "program": program_to_json(job.program)} for job in jobs], timeout]


def _orders_from_json(data: list) -> tuple:
    """The orders ``_orders_to_json`` wrote (from the parent, through a pipe only it and this worker hold)."""
    from pipec.compiler.emit.json_program import program_from_json

    rank, nproc, port, jobs, timeout = data
    return rank, nproc, port, [AttentionJob(**{**job, "program": program_from_json(job["program"])})
                               for job in jobs], timeout


def _die_with_parent() -> None:
    """On Linux, have the kernel SIGKILL this worker when the parent dies, so that none is left behind."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL))  # 1 = PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass  # not Linux: the parent's own shutdown still stops the workers


def _worker(rank: int, nproc: int, port: int, jobs: list[AttentionJob], timeout: float) -> list[dict] | None:
    import torch.distributed as dist
    from datetime import timedelta

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=nproc,
                            timeout=timedelta(seconds=max(timeout, JOIN_ALLOWANCE_S)))
    gathered = [_run_job(job, rank, nproc, timeout) for job in jobs]
    _bounded_barrier(rank, nproc, timeout)
    # the references after every rank is done: none of the others' waits counts rank 0's reference
    return [compare(job, whole) for job, whole in zip(jobs, gathered)] if rank == 0 else None


def _bounded_barrier(rank: int, nproc: int, timeout: float, what: str = "the closing barrier") -> None:
    import torch.distributed as dist

    from pipec.runtime import comm
    from pipec.runtime.rings import wait_within

    work = dist.barrier(async_op=True)
    others = tuple(r for r in range(nproc) if r != rank)
    wait_within([work], timeout, comm.Site(rank, -1, what, others, 1))


def _run_job(job: AttentionJob, rank: int, nproc: int, timeout: float) -> dict | None:
    """This rank's run of one job; on rank 0 every rank's results put together (``_FIELDS`` -> whole
    sequence), elsewhere None."""
    import torch
    import torch.distributed as dist

    from pipec.runtime import comm
    from pipec.runtime.rings import own_chunks, run_ring_attention, wait_within

    program = job.program
    plan = program.rings
    q, k, v, grad_out = job_inputs(job)
    mine = [own_chunks(plan, rank, t) for t in (q, k, v, grad_out)]
    _bounded_barrier(rank, nproc, timeout, "the barrier before the run")  # no rank's waits count another's drawing
    result = run_ring_attention(program, rank, *mine, timeout=timeout)
    if rank != 0:
        flat = torch.cat([getattr(result, name)[c].reshape(-1) for c in result.chunks for name in _FIELDS])
        work = dist.isend(flat.contiguous(), 0, tag=_RESULT_TAG)
        site = comm.Site(rank, len(program.ranks[rank]), "sending the results to rank 0", (0,), 1)
        wait_within([work], timeout, site)
        return None
    size = job.seq // plan.chunks
    wide = result.out[result.chunks[0]].dtype
    whole = {name: torch.zeros(q.shape, dtype=wide) for name in _FIELDS}
    for c in result.chunks:
        for name in _FIELDS:
            whole[name][..., c * size:(c + 1) * size, :] = getattr(result, name)[c]
    shape = (job.batch, job.heads, size, job.head_dim)
    buffers = {other: torch.empty(len(plan.chunks_of(other)) * len(_FIELDS) * _numel(shape), dtype=wide)
               for other in range(1, nproc)}
    works = [dist.irecv(buffer, other, tag=_RESULT_TAG) for other, buffer in buffers.items()]  # all posted at once
    site = comm.Site(0, len(program.ranks[0]), "gathering the results", tuple(buffers), 1)
    wait_within(works, timeout, site)
    for other, buffer in buffers.items():
        pieces = iter(buffer.split(_numel(shape)))
        for c in plan.chunks_of(other):
            for name in _FIELDS:
                whole[name][..., c * size:(c + 1) * size, :] = next(pieces).view(shape)
    return whole


def _numel(shape: tuple[int, ...]) -> int:
    count = 1
    for size in shape:
        count *= size
    return count


def compare(job: AttentionJob, whole: dict) -> dict:
    """The answer for one job: ``whole`` (out, dq, dk, dv over the sequence) against ``reference``."""
    import torch

    program = job.program
    want = dict(zip(_FIELDS, reference(*job_inputs(job), program.rings.causal)))
    answer = {name: (whole[name].to(torch.float64) - want[name]).abs().max().item() for name in _FIELDS}
    answer["scale"] = {name: want[name].abs().max().item() for name in _FIELDS}
    answer["program"] = program_info(program)
    answer.update(seq=job.seq, batch=job.batch, heads=job.heads, head_dim=job.head_dim, dtype=job.dtype,
                  seed=job.seed, reference="float64, one process (scaled_dot_product_attention, autograd)")
    return answer


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _deadline_s(jobs: list[AttentionJob], timeout: float) -> float:
    """The parent's last resort: every wait of every job at its full timeout, and time to compute.

    A worker's waits end at ``timeout`` and a failed worker ends its process,
    so the parent normally learns of a failure from a worker's exit; this only
    bounds a run that stops answering altogether.
    """
    waits = sum(max(sum(1 for a in row if a.op == "EXCHANGE_WAIT") for row in job.program.ranks) + 3 for job in jobs)
    return JOIN_ALLOWANCE_S + timeout * waits + 300.0


def _launch(jobs: list[AttentionJob], nproc: int, timeout: float, deadline_s: float) -> list[dict]:
    """Start ``nproc`` workers (``python -m pipec.commands.attention``), collect their answers; on the first
    failure give the others ``_GRACE_S`` to report theirs, then kill every one still running."""
    port = _free_port()
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    workers: list[_Worker] = []
    start = time.monotonic()
    deadline = start + deadline_s
    failed_at = None
    selector = selectors.DefaultSelector()
    try:
        for rank in range(nproc):
            workers.append(_Worker.start(rank, (rank, nproc, port, jobs, timeout), env, selector))
        while True:
            if all(w.answer is not None and w.answer[0] == "ok" for w in workers):
                break
            failed = any(w.answer is not None and w.answer[0] != "ok" for w in workers)
            if failed and failed_at is None:
                failed_at = time.monotonic()
            finished = all(w.answer is not None for w in workers)
            if finished or (failed_at is not None and time.monotonic() - failed_at > _GRACE_S):
                break
            if time.monotonic() > deadline:
                break
            for key, _ in selector.select(timeout=_POLL_S):
                worker = key.data
                chunk = os.read(worker.answer_fd, 1 << 16)
                if chunk:
                    worker.received += chunk
                else:
                    selector.unregister(worker.answer_fd)
                    worker.finish()
    finally:
        for worker in workers:
            worker.stop()
        selector.close()
    if all(w.answer is not None and w.answer[0] == "ok" for w in workers):
        return workers[0].answer[1]
    raise AttentionRunError(_failure_text(workers, time.monotonic() - start, time.monotonic() > deadline))


class _Worker:
    """One worker process, the pipes the parent made for it, and what it answered."""

    def __init__(self, rank: int, proc, answer_fd: int, stderr):
        self.rank, self.proc, self.answer_fd, self.stderr = rank, proc, answer_fd, stderr
        self.received = b""
        self.answer: tuple | None = None  # ("ok", ...), ("error", text) or ("gone", None)
        self.exitcode: int | None = None
        self.tail: list[str] = []  # the last lines it wrote, read when it is stopped

    @classmethod
    def start(cls, rank: int, orders: tuple, env: dict, selector) -> "_Worker":
        job_read, job_write = os.pipe()
        answer_read, answer_write = os.pipe()
        stderr = tempfile.TemporaryFile()
        try:
            proc = subprocess.Popen(
                [sys.executable, "-m", "pipec.commands.attention", str(job_read), str(answer_write)],
                pass_fds=(job_read, answer_write), stdin=subprocess.DEVNULL, stdout=stderr, stderr=stderr,
                env=env, start_new_session=True)
        except OSError as error:
            for fd in (job_read, job_write, answer_read, answer_write):
                os.close(fd)
            stderr.close()
            raise AttentionRunError(f"cannot start worker {rank}: {error}") from None
        os.close(job_read)
        os.close(answer_write)
        worker = cls(rank, proc, answer_read, stderr)
        selector.register(answer_read, selectors.EVENT_READ, worker)
        data = json.dumps(_orders_to_json(*orders)).encode()
        threading.Thread(target=_feed, args=(job_write, data), daemon=True).start()  # a pipe holds 64 KiB
        return worker

    def finish(self) -> None:
        """The answer pipe closed: the worker has answered (or died); take its answer and its status."""
        try:
            self.answer = tuple(json.loads(self.received)) if self.received else ("gone", None)
        except Exception:  # a worker cut off mid-answer
            self.answer = ("gone", None)
        if not (isinstance(self.answer, tuple) and len(self.answer) == 2 and self.answer[0] in ("ok", "error", "gone")):
            self.answer = ("error", f"rank {self.rank}: an unexpected answer")
        try:
            self.exitcode = self.proc.wait(timeout=_GRACE_S)
        except subprocess.TimeoutExpired:
            pass

    def stop(self) -> None:
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        code = self.proc.wait()
        if self.exitcode is None and self.answer is not None:
            self.exitcode = code
        try:
            os.close(self.answer_fd)
        except OSError:
            pass
        try:
            self.stderr.seek(0)
            text = self.stderr.read().decode("utf-8", "replace")
            self.tail = [line for line in text.strip().splitlines() if line.strip()][-_TAIL_LINES:]
        except (OSError, ValueError):
            pass
        finally:
            self.stderr.close()


def _feed(fd: int, data: bytes) -> None:
    try:
        with os.fdopen(fd, "wb") as pipe:
            pipe.write(data)
    except OSError:
        pass  # the worker died before reading its orders: its exit says so


def _failure_text(workers: list[_Worker], seconds: float, timed_out: bool) -> str:
    """Every worker's failure, causes first: its own errors, then deaths without an answer, then the waits
    that ran out (usually another rank's consequence), then the ranks stopped because of them."""
    causes, deaths, waits, stopped = [], [], [], []
    for worker in workers:
        kind, text = worker.answer if worker.answer is not None else ("", None)
        if kind == "ok":
            continue
        if kind == "error":
            text = text.rstrip()
            (waits if "): waited " in text.split("\n", 1)[0] else causes).append(text)
        elif worker.answer is None:  # still running when the run was given up: killed then
            stopped.append(f"rank {worker.rank}: no answer; stopped" if timed_out else
                           f"rank {worker.rank}: stopped after another rank failed")
        else:
            code = worker.exitcode
            how = (f"killed by signal {_signal_name(-code)}" if code is not None and code < 0 else
                   f"exited with status {code}" if code is not None else "closed its answer pipe")
            deaths.append("\n".join([f"rank {worker.rank}: {how} without an answer" + (":" if worker.tail else "")]
                                    + [f"  {line}" for line in worker.tail]))
    head = ("the ring attention run did not finish within its deadline" if timed_out and not (causes or waits)
            else "the ring attention run failed")
    return "\n".join([f"{head} ({seconds:.1f} s):"] + [f"  {line}" for text in causes + deaths + waits + stopped
                                                         for line in text.splitlines()])


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return str(number)


__all__ = ["AttentionJob", "AttentionRunError", "attention_check", "attention_checks", "check_job", "describe",
           "job_inputs", "reference", "register", "require_ring", "run"]


if __name__ == "__main__":
    _worker_main(sys.argv[1:])
