"""``pipec list``: the shipped schedules, their parameters and defaults."""
from __future__ import annotations

from pipec.commands._common import dump_json, write_output


def register(sub) -> None:
    parser = sub.add_parser("list", help="list the shipped schedules with their parameters")
    parser.add_argument("--json", action="store_true", help="print JSON")
    parser.set_defaults(func=run)


def run(args) -> int:
    from pipec.compiler.driver import load_target, resolve_target, shipped_schedules
    from pipec.dsl import parse

    rows = []
    for name in shipped_schedules():
        path, source, _ = load_target(name)
        # a file's first schedule goes by the file's name, the others by FILE:NAME (tasp:tasp_rails)
        for index, schedule in enumerate(parse(source, path).schedules):
            target = name if index == 0 else f"{name}:{schedule.name}"
            resolved = resolve_target(target)
            rows.append({"name": target, "schedule": resolved.node.name, "params": resolved.describe_params()})
    if args.json:
        write_output(dump_json(rows), None)
        return 0
    width = max((len(r["name"]) for r in rows), default=4)
    lines = []
    for row in rows:
        params = ", ".join(
            f"{p['name']}: {p['type']}" + (f" = {p['default']}" if p["default"] is not None else "") for p in row["params"]
        )
        lines.append(f"{row['name']:<{width}}  ({params})")
    write_output("\n".join(lines), None)
    return 0
