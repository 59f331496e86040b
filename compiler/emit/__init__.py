"""Emitters: a ``Program`` as JSON (for the runtime), as torch's schedule CSV, as a text grid; a simulated timeline as text."""
from pipec.compiler.emit.ascii_timeline import format_timeline
from pipec.compiler.emit.json_program import program_from_json, program_to_json
from pipec.compiler.emit.text_grid import format_text_grid
from pipec.compiler.emit.torch_csv import write_torch_csv

__all__ = ["format_timeline", "program_to_json", "program_from_json", "write_torch_csv", "format_text_grid"]
