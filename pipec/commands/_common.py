"""Arguments and helpers shared by the commands that take a schedule target."""
from __future__ import annotations

import argparse
import json
import sys

from pipec.compiler.defines import parse_defines  # one definition, shared with the runtime's worker
from pipec.compiler.trace_events import recorded
from pipec.errors import UsageError


def add_target_arguments(parser: argparse.ArgumentParser, costs: bool = True) -> None:
    parser.add_argument("target", metavar="TARGET", help="a .pipe file, or a shipped schedule's name (see `pipec list`)")
    parser.add_argument(
        "-D", dest="defines", action="append", default=[], metavar="NAME=VALUE", help="set a schedule parameter (repeatable)"
    )
    if costs:
        parser.add_argument("--costs", metavar="FILE", help="a JSON cost file (default: unit costs F=1 B=2 I=W=1)")
    parser.add_argument("--budget", type=int, metavar="N", help="fail if a rank holds more than N chunk activations")


def load_costs(args):
    if not getattr(args, "costs", None):
        return None
    from pipec.compiler.costs import load_costs as load

    return load(args.costs)


def compile_from_args(args):
    from pipec.compiler.driver import compile_target

    return compile_target(
        args.target, parse_defines(args.defines), costs=load_costs(args), memory_budget=getattr(args, "budget", None)
    )


def write_output(text: str, path: str | None) -> None:
    if path in (None, "-"):
        sys.stdout.write(text if text.endswith("\n") else text + "\n")
        return
    try:
        with open(path, "w", encoding="utf-8") as handle:
            handle.write(text if text.endswith("\n") else text + "\n")
    except OSError as error:
        raise UsageError(f"cannot write '{path}': {error}") from None


def dump_json(data) -> str:
    return json.dumps(data, indent=2)


def describe_params(params: dict) -> str:
    return ", ".join(f"{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in params.items())


def target_of_run(args, trace, command: str) -> tuple[str, dict[str, str]]:
    """TARGET and the -D values; without TARGET, what the trace of a run (``pipec run --trace``) records:
    its target (a file's absolute path, or a shipped name) and parameters, -D values on top."""
    defines = parse_defines(args.defines)
    if args.target is not None:
        return args.target, defines
    if trace is None:
        raise UsageError(f"{command} needs TARGET (a .pipe file, a shipped schedule or a program .json)")
    name = recorded(trace, "schedule")
    if name is None:
        raise UsageError(f"'{args.trace}' does not name its schedule; give TARGET")
    params = recorded(trace, "params", dict) or {}
    merged = {str(key): str(value) for key, value in params.items()}
    merged.update(defines)
    ran = recorded(trace, "target")  # written since traces record it; older ones name the schedule only
    if ran is None:
        return _shipped_target_named(name, args.trace), merged
    from pipec.compiler.driver import load_target

    try:
        load_target(ran)
    except UsageError as error:
        raise UsageError(f"'{args.trace}' ran '{ran}', which cannot be read now ({error}); give TARGET") from None
    return ran, merged


def _shipped_target_named(name: str, trace_path: str) -> str:
    """The shipped target that defines schedule ``name`` (a file stem, or ``path:name``)."""
    from pipec.compiler.driver import load_target, shipped_schedules
    from pipec.dsl import parse

    shipped = shipped_schedules()
    if name in shipped:
        return name
    for stem, file in shipped.items():
        path, source, _ = load_target(stem)
        if parse(source, path).schedule(name) is not None:
            return f"{file}:{name}"
    raise UsageError(f"'{trace_path}' ran schedule '{name}', which no shipped file defines; give TARGET")


def read_json(path: str, what: str):
    """The parsed JSON file ``path``; a UsageError naming it as ``what`` when it cannot be read or parsed."""
    try:
        with open(path, encoding="utf-8") as handle:
            return json.load(handle)
    except OSError as error:
        raise UsageError(f"cannot read {what} '{path}': {error}") from None
    except (ValueError, UnicodeDecodeError) as error:
        raise UsageError(f"{what} '{path}' is not JSON: {error}") from None
