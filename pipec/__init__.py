"""pipec: a compiler for distributed-training schedules.

Write a schedule as a ``.pipe`` program; pipec parses it, compiles it into one
instruction list per rank, proves the lists safe, simulates and draws their
timeline, and runs them under torchrun.
"""
from pipec.errors import PipecError

__version__ = "0.1.0"
__all__ = ["PipecError", "__version__"]
