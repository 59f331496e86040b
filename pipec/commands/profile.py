"""``pipec profile --model SPEC -o COSTS.json``: measure a model layer by layer, for ``pipec partition``.

For each layer of the spec's ``layers(config, seed)`` (the built-in model's: the embedding,
each decoder layer, the norm and head) the median forward and backward time in ms, the bytes
of its output for one microbatch and of its parameters (``runtime.profile``), on this
machine's CPU, or its GPU when torch sees one. It prints them in a table, with the layers'
summed forward and backward beside the whole model's, timed as one autograd pass; ``-o``
writes them as a cost file's ``layers`` (docs/costs.md).
"""
from __future__ import annotations

from pipec.commands._common import dump_json, human_bytes, write_output
from pipec.errors import printable_name


def register(sub) -> None:
    from pipec.compiler.guarded_read import positive_count_arg, seconds_arg
    from pipec.runtime.config import DEFAULT_PROFILE_TIMEOUT_S, DEFAULT_REPEATS  # not runtime.profile: torch
    from pipec.runtime.worker import add_model_arguments

    parser = sub.add_parser(
        "profile",
        help="measure a model's layers (forward, backward, activation and parameter bytes) into a cost file",
        description="Time every layer of a model spec's layers(config, seed) on one microbatch, forward and "
                    "backward, and write them as a cost file's \"layers\" for `pipec partition`.",
    )
    add_model_arguments(parser, defaults=True)
    parser.add_argument("-o", dest="output", metavar="FILE",
                        help="write the cost file here (default: only print the table)")
    parser.add_argument("--repeats", type=positive_count_arg, default=DEFAULT_REPEATS, metavar="N",
                        help=f"measured passes each median is over (default {DEFAULT_REPEATS}, after a warm-up)")
    parser.add_argument("--timeout", type=seconds_arg, default=DEFAULT_PROFILE_TIMEOUT_S, metavar="SECONDS",
                        help="the longest one layer's forward or backward may take; past it the profile stops "
                             f"naming the layer (default {DEFAULT_PROFILE_TIMEOUT_S:g})")
    parser.set_defaults(func=run)


def run(args) -> int:
    from pipec.compiler.costs import costs_from_json
    from pipec.compiler.measured_costs import UNIT
    from pipec.compiler.spread import load_average
    from pipec.runtime.model import load_model_spec
    from pipec.runtime.profile import profile_layers
    from pipec.runtime.worker import DEFAULT_SEED, override_config

    spec = load_model_spec(args.model)
    config = override_config(spec.config, args.config)
    load = load_average()  # before measuring: this process's own work is not the machine's load
    measured = profile_layers(spec, config, DEFAULT_SEED, repeats=args.repeats, name=args.model, timeout=args.timeout)
    data = measured.cost_data()
    costs_from_json(data, "the measured layers")  # what pipec writes, pipec reads: a bad layer name fails here
    if args.output:
        write_output(dump_json(data), args.output)
    names = [printable_name(layer.name) for layer in measured.layers]  # a user model's module names
    width = max(len("layer"), *(len(name) for name in names))
    lines = [f"{args.model} on {measured.device}, one microbatch, median of {measured.repeats} passes, {UNIT}:",
             f"  {'layer':<{width}} {'F':>9} {'B':>9}  {'activation':>11} {'parameters':>11}"]
    for index, layer in enumerate(measured.layers):
        lines.append(f"  {names[index]:<{width}} {layer.F:>9.4f} {layer.B:>9.4f}  {human_bytes(layer.activation):>11} "
                     f"{human_bytes(layer.parameters):>11}")
    lines.append(f"  layers' F + B summed: {measured.layer_sum:.4f} {UNIT}; the whole model's forward and backward: "
                 f"{measured.whole:.4f} {UNIT} (sum / whole {measured.layer_sum / measured.whole:.3f})")
    lines.append(f"  spread of the repeats (F + B): whole model {measured.spreads['whole model'].text()}; "
                 + _widest_layer(measured.spreads))
    lines.append(f"wrote {args.output}" if args.output else "(-o FILE writes them as a cost file)")
    write_output("\n".join(lines), None)
    _warn_noise(measured.spreads, load)
    return 0


def _widest_layer(spreads) -> str:
    """The layer whose repeats spread most: ``widest layer0, min ... (spread 12%)``."""
    name, spread = max(((name, spread) for name, spread in spreads.items() if name != "whole model"),
                       key=lambda item: item[1].relative)
    return f"widest {name}, {spread.text()}"


def _warn_noise(spreads, load) -> None:
    """On stderr, what made the profile noise: a busy machine, or repeats spread wide."""
    import sys

    from pipec.compiler.spread import noise_warnings

    for warning in noise_warnings(spreads, 1, load=load):
        sys.stderr.write(f"warning: {warning}\n")
