"""``pipec partition --costs COSTS.json -D P=4``: cut a profiled model's layers into pipeline stages.

PipeDream's dynamic program (``compiler.partition``) over the cost file's ``layers``
(``pipec profile`` measures them): the slowest stage as fast as it can be, the cuts'
communication counted, under ``--memory`` bytes per rank, stages replicated over several
ranks with ``--replicate``. It prints the stage -> layers map, each stage's replicas, ranks,
time and memory, and the predicted time per microbatch (``--json``: the partition file).

``-o`` writes the partition file (``pipec run --partition`` reads it), ``--schedule-out`` a
``.pipe`` schedule that runs it (``compiler.partition_schedule``), and ``--costs-out`` the cost
file priced per chunk of it (``costs.rolled_up``), so that

    pipec simulate FILE.pipe --costs CHUNKS.json

predicts the partitioned pipeline on this machine's times.
"""
from __future__ import annotations

from pipec.commands._common import dump_json, human_bytes, number_text, write_output
from pipec.compiler.atomic_write import check_writable
from pipec.compiler.guarded_read import count_arg
from pipec.errors import UsageError, printable_name


def register(sub) -> None:
    parser = sub.add_parser(
        "partition",
        help="cut a profiled model's layers into balanced pipeline stages (PipeDream's partitioner)",
        description="Cut the layers of a cost file (`pipec profile -o`) into stages over P ranks, the slowest stage "
                    "as fast as it can be.",
    )
    parser.add_argument("--costs", metavar="FILE", required=True,
                        help="a cost file with \"layers\" (`pipec profile` writes one); its \"links\" price the cuts, "
                             "its \"allreduce\" the replicas' gradient sync (default: free)")
    parser.add_argument("-D", dest="defines", action="append", default=[], metavar="P=RANKS",
                        help="the ranks to partition over, every one used (required)")
    parser.add_argument("--link", metavar="LATENCY,BANDWIDTH",
                        help="the link between ranks: latency in the cost file's time unit (ms for `pipec profile`) "
                             "and bandwidth in bytes per that unit; sets the cost file's \"links\" (and --costs-out's)")
    parser.add_argument("--allreduce", metavar="LATENCY,BANDWIDTH",
                        help="the replicas' gradient all-reduce link, in the same units; sets \"allreduce\"")
    parser.add_argument("--memory", type=count_arg, metavar="BYTES",
                        help="the most bytes a rank may hold: its stage's weights and gradients and the activations "
                             "of the microbatches it keeps (default: no limit)")
    parser.add_argument("--replicate", action="store_true",
                        help="let a stage run on several ranks, data parallel inside the pipeline")
    parser.add_argument("--json", action="store_true", help="print the partition file instead of the table")
    parser.add_argument("-o", dest="output", metavar="FILE", help="write the partition file (JSON)")
    parser.add_argument("--schedule-out", dest="schedule_out", metavar="FILE.pipe",
                        help="write a .pipe schedule that runs the partition")
    parser.add_argument("--costs-out", dest="costs_out", metavar="FILE",
                        help="write the cost file priced per chunk of the partition, for `pipec simulate` of "
                             "--schedule-out's schedule")
    parser.set_defaults(func=run)


def run(args) -> int:
    from pipec.compiler.costs import costs_from_json, rolled_up
    from pipec.compiler.guarded_read import COSTS, read_json
    from pipec.compiler.partition import partition, partition_to_json
    from pipec.compiler.partition_schedule import schedule_source
    from pipec.errors import CostFileError

    ranks = _ranks(args.defines)
    outputs = [(path, what) for path, what in ((args.output, "the partition file (-o)"),
                                               (args.schedule_out, "the schedule (--schedule-out)"),
                                               (args.costs_out, "the chunk cost file (--costs-out)"))
               if path is not None]
    for path, what in outputs:  # every output checked writable before any is written (or the work is done)
        check_writable(path, what)
    data = read_json(args.costs, COSTS, CostFileError)  # kept: --costs-out writes it back, rolled up
    data = _with_links(data, args)
    costs = costs_from_json(data, args.costs)
    if not costs.layers:
        raise CostFileError(f'{args.costs}: no "layers" to partition (`pipec profile --model SPEC -o FILE` '
                            "measures them; docs/costs.md gives the format)")
    part = partition(costs.layers, ranks, costs, memory_limit=args.memory, replicate=args.replicate)
    document = dump_json(partition_to_json(part), "the partition file")
    # every output made before any is written: a refusal (a chunk's summed costs past the limit) writes none
    chunk_costs = (dump_json(rolled_up(data, part.cut, args.costs), "the chunk cost file")
                   if args.costs_out is not None else None)
    if args.output is not None:
        write_output(document, args.output)
    if args.schedule_out is not None:
        write_output(schedule_source(part), args.schedule_out)
    if chunk_costs is not None:
        write_output(chunk_costs, args.costs_out)
    write_output(document if args.json else _table(part, args), None)
    if args.replicate and "allreduce" not in data:
        import sys

        sys.stderr.write("warning: no all-reduce cost (--allreduce or the cost file's \"allreduce\"): replicas sync "
                         "their gradients for free, so replicating looks free\n")
    return 0


def _with_links(data, args):
    """The cost file with ``--link`` and ``--allreduce`` set in it (a copy; the file's own values replaced)."""
    data = dict(data)
    for option, key in (("link", "links"), ("allreduce", "allreduce")):
        text = getattr(args, option)
        if text is None:
            continue
        latency, bandwidth = _link(text, f"--{option}")
        data[key] = {**(data.get(key) or {}), "latency": latency, "bandwidth": bandwidth}
    return data


def _link(text: str, option: str) -> tuple[float, float]:
    """``LATENCY,BANDWIDTH`` as two numbers (the cost file's reader judges their range).

    Raises:
        UsageError: not two plain non-negative numbers.
    """
    from pipec.compiler.guarded_read import plain_float

    parts = text.split(",")
    if len(parts) != 2:
        raise UsageError(f"{option} expects LATENCY,BANDWIDTH (two numbers: ms and bytes per ms), got '{text}'")
    return plain_float(parts[0].strip(), f"{option} latency"), plain_float(parts[1].strip(), f"{option} bandwidth")


def _ranks(defines: list[str]) -> int:
    """P from ``-D P=RANKS``, the only parameter ``pipec partition`` takes.

    Raises:
        UsageError: no ``-D P``, another name, or a value that is not an integer >= 1.
    """
    from pipec.compiler.defines import parse_defines
    from pipec.compiler.guarded_read import plain_int

    given = parse_defines(defines)
    stray = [name for name in given if name != "P"]
    if stray:
        raise UsageError(f"-D {stray[0]}: pipec partition takes one parameter, P (the ranks)")
    if "P" not in given:
        raise UsageError("pipec partition needs the ranks to partition over: -D P=RANKS")
    return plain_int(given["P"], "-D P", low=1)


def _table(part, args) -> str:
    """The stage -> layers map, one stage a line, under a line with the predicted time per microbatch."""
    replication = ", stages replicated" if args.replicate else ""
    limit = f", at most {human_bytes(args.memory)} a rank" if args.memory is not None else ""
    lines = [f"{part.layers} layers over {part.ranks} ranks ({args.costs}{replication}{limit}): {len(part.stages)} "
             f"stages, predicted time per microbatch {number_text(part.time_per_microbatch)}",
             f"  {'stage':>5}  {'layers':<32} {'replicas':>8}  {'ranks':<9} {'time':>9}  memory"]
    for index, stage in enumerate(part.stages):
        last = stage.stop - 1
        first, final = printable_name(part.names[stage.first]), printable_name(part.names[last])  # the cost file's
        names = first if last == stage.first else f"{first} .. {final}"
        span = f"{stage.first}" if last == stage.first else f"{stage.first}..{last}"
        ranks = f"{stage.ranks[0]}" if stage.replicas == 1 else f"{stage.ranks[0]}..{stage.ranks[-1]}"
        slowest = "  <- slowest" if stage.time == part.time_per_microbatch else ""
        lines.append(f"  {index:>5}  {span + ' ' + names:<32} {stage.replicas:>8}  {ranks:<9} "
                     f"{number_text(stage.time):>9}  {human_bytes(stage.memory)}{slowest}")
    return "\n".join(lines)
