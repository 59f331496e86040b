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
    program = compile_from_args(args)
    if args.format == "json":
        # streamed: a large program's JSON is never held whole
        with atomic_output(args.output) as out:
            program.write_json(out)
        return 0
    text = _text_of(program, args.format)
    with atomic_output(args.output) as out:
        out.write(text if text.endswith("\n") else text + "\n")
    return 0


def _text_of(program, form: str) -> str:
    """The program (a ``pipec.api.Program``) in one of the text formats (everything but json); for
    torch-csv-comms, a note on stderr where the installed torch's runtime would not run it exactly."""
    if form == "torch-csv":
        return program.to_torch_csv(comms=False)
    if form == "torch-csv-comms":
        text = program.to_torch_csv(comms=True)
        for caveat in program.torch_caveats():
            sys.stderr.write(f"warning: {caveat}\n")
        return text
    return program.to_text()
