"""The workload families, each a module that registers its ``Family`` (``compiler/family.py``).

Importing this package registers all four; ``compiler.family``'s lookups do
so on first use. The order is the order families are asked to read a program
file's header (``Family.plan_from_json``): weight passing's checks come first.
"""
# they register, in this order
from pipec.compiler.families import activation, weight_passing, sequence_rings, tensor_parallel  # noqa: F401,I001
