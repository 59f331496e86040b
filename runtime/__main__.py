"""``python -m pipec.runtime TARGET ...``: one worker of a pipelined run (see ``worker``).

The worker ends with ``os._exit`` once ``main`` has returned: it has left the
process group and its files are written, and the interpreter's own
finalization only adds risk. It destroys what is left (tensors, gloo's works
and threads) in no set order after Python is half torn down, and now and then
that aborts the process (``terminate called without an active exception``,
status -6) after a run that succeeded.
"""
import os
import sys

from pipec.runtime.worker import main

status = main()
sys.stdout.flush()
sys.stderr.flush()
os._exit(status)
