"""``python -m pipec.runtime TARGET ...``: one worker of a pipelined run (see ``worker``)."""
import sys

from pipec.runtime.worker import main

sys.exit(main())
