"""pipec: a compiler for distributed-training schedules.

Write a schedule as a ``.pipe`` program; pipec parses it, compiles it into one
instruction list per rank, proves the lists safe, simulates and draws their
timeline, and runs them under torchrun.

The Python API (docs/api.md)::

    import pipec
    program = pipec.compile("1f1b", {"P": 4, "N": 8})
    print(program.simulate().makespan)

``compile``, ``load``, ``Program`` and ``Simulation`` are loaded on first use
(PEP 562), so ``import pipec`` costs what ``pipec.errors`` costs: the command
line imports this package for every command, and neither imports torch.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from pipec.errors import PipecError

if TYPE_CHECKING:  # what type checkers and editors see; at run time, __getattr__ below
    from pipec.api import Program, compile, load
    from pipec.simulation import Simulation

__version__ = "0.1.0"
__all__ = ["PipecError", "Program", "Simulation", "__version__", "compile", "load"]

# name -> the module that defines it
_LAZY = {"compile": "pipec.api", "load": "pipec.api", "Program": "pipec.api", "Simulation": "pipec.simulation"}


def __getattr__(name: str) -> Any:
    import importlib

    if name == "torch":  # the submodule pipec.torch (it imports torch when its helper is called)
        return importlib.import_module("pipec.torch")
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'pipec' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # once: later look-ups find it without this hook
    return value
