"""``pipec list``: the shipped schedules, their parameters and defaults."""
from __future__ import annotations

from pipec.commands._common import dump_json, write_output


def register(sub) -> None:
    parser = sub.add_parser("list", help="list the shipped schedules with their parameters")
    parser.add_argument("--json", action="store_true", help="print JSON")
    parser.set_defaults(func=run)


def run(args) -> int:
    from pipec.compiler.driver import resolve_target, shipped_schedules

    rows = []
    for name in shipped_schedules():
        resolved = resolve_target(name)
        rows.append({"name": name, "schedule": resolved.node.name, "params": resolved.describe_params()})
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
