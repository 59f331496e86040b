"""The workload families, each a module that registers its ``Family`` (``compiler/family.py``).

Importing this package registers all three; ``compiler.family``'s lookups do
so on first use.
"""
from pipec.compiler.families import activation, sequence_rings, weight_passing  # noqa: F401  (they register)
