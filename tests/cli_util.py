"""Run the command line in the test's own process: the helper the edge-case tests share."""
from __future__ import annotations

from pipec.cli import main


def cli(capsys, *argv: str) -> tuple[int, str, str]:
    """(status, stdout, stderr) of ``pipec ARGV`` in process; argparse's SystemExit counts as a status.
    No run of the command line may end in a traceback."""
    try:
        status = main(list(argv))
    except SystemExit as done:
        status = done.code
    out, err = capsys.readouterr()
    assert "Traceback" not in err
    return status, out, err
