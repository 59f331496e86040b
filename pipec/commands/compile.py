"""``pipec compile``: emit the per-rank instruction lists."""
from __future__ import annotations

import sys

from pipec.commands._common import add_target_arguments, atomic_output, compile_from_args

FORMATS = ("json", "torch-csv", "torch-csv-comms", "text")


def register(sub) -> None:
    parser = sub.add_parser("compile", help="compile a schedule into per-rank instruction lists")
    add_target_arguments(parser)
    parser.add_argument(
        "--format",
        choices=FORMATS,
        default="json",
        help="json: pipec's program (compact); torch-csv: compute actions as torch's CSV; "
        "torch-csv-comms: with sends and receives, and the REDUCE_GRAD/UNSHARD/RESHARD actions "
        "the installed torch's _PipelineScheduleRuntime needs (trains exactly on torch 2.10 to 2.13; "
        "a warning says what differs on an older torch); text: a readable grid",
    )
    parser.add_argument("-o", dest="output", metavar="FILE",
                        help="write here (atomically: the old file stays whole until the new one is) "
                             "instead of standard output")
    parser.set_defaults(func=run)


def run(args) -> int:
    program = compile_from_args(args).program
    if args.format == "json":
        from pipec.compiler.emit.json_program import write_program_json

        # streamed: a large program's JSON is never held whole
        with atomic_output(args.output) as out:
            write_program_json(program, out)
        return 0
    text = _text_of(program, args.format)
    with atomic_output(args.output) as out:
        out.write(text if text.endswith("\n") else text + "\n")
    return 0


def _text_of(program, form: str) -> str:
    """The program in one of the text formats (everything but json)."""
    from pipec.compiler.emit import format_text_grid, write_torch_csv

    if form == "torch-csv":
        return write_torch_csv(program, with_comms=False)
    if form == "torch-csv-comms":
        return _torch_comms_csv(program)
    return format_text_grid(program)


def _torch_comms_csv(program) -> str:
    """The comms CSV for the installed torch's runtime; a note on stderr where that runtime would not run it exactly."""
    from pipec.compiler.emit.torch_csv import NEWEST_TORCH, installed_torch_runtime, runtime_caveats, write_torch_csv

    runtime = installed_torch_runtime()
    # without a torch here that could load it, the form the newest accepted torch runs exactly
    target = runtime if runtime is not None and runtime.loads_comms else NEWEST_TORCH
    text = write_torch_csv(program, with_comms=True, for_torch=target)
    for caveat in runtime_caveats(program, runtime):
        sys.stderr.write(f"warning: {caveat}\n")
    return text
