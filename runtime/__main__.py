"""``python -m pipec.runtime TARGET ...``: one worker of a pipelined run (see ``worker``)."""
from pipec.runtime.worker import end_process, main

end_process(main())
