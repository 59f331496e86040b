"""``pipec compile``: emit the per-rank instruction lists."""
from __future__ import annotations

from pipec.commands._common import add_target_arguments, compile_from_args, dump_json, write_output

FORMATS = ("json", "torch-csv", "torch-csv-comms", "text")


def register(sub) -> None:
    parser = sub.add_parser("compile", help="compile a schedule into per-rank instruction lists")
    add_target_arguments(parser)
    parser.add_argument(
        "--format",
        choices=FORMATS,
        default="json",
        help="json: pipec's program; torch-csv: compute actions as torch's CSV; "
        "torch-csv-comms: with sends and receives; text: a readable grid",
    )
    parser.add_argument("-o", dest="output", metavar="FILE", help="write here instead of standard output")
    parser.set_defaults(func=run)


def run(args) -> int:
    from pipec.compiler.emit import format_text_grid, program_to_json, write_torch_csv

    compiled = compile_from_args(args)
    program = compiled.program
    if args.format == "json":
        text = dump_json(program_to_json(program))
    elif args.format == "torch-csv":
        text = write_torch_csv(program, with_comms=False)
    elif args.format == "torch-csv-comms":
        text = write_torch_csv(program, with_comms=True)
    else:
        text = format_text_grid(program)
    write_output(text, args.output)
    return 0
