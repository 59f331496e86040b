"""What every shipped schedule's commands print, held to one golden file.

The engine is being reshaped (families as modules, one prover, one
interpreter); none of that may change what a user sees. For every shipped
schedule at three sizes, and at two values of each of its own parameters
(recompute, BitPipe's bound, Chimera's doubling, interleaving depth, 2BW's
minibatch, FSDP's chunks, TawPipe's groups, causal or full attention), the
golden file keeps `pipec check`'s line whole and a hash of each of
`pipec compile --format text`, `--format json`, `--format torch-csv`,
`--format torch-csv-comms` and `pipec simulate --json`. A configuration
the schedule refuses keeps its error's first line instead: refusals are
behaviour too.

Regenerate (only for a change meant to alter what a command prints, and say
why in the commit) with
``PIPEC_UPDATE_GOLDEN=1 python -m pytest tests/test_behaviour_golden.py``.
"""
from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
from pathlib import Path

import pytest

from pipec.cli import main

GOLDEN = Path(__file__).parent / "golden" / "behaviour.json"

_SIZES = ((4, 8), (6, 12), (8, 16))
_ACTIVATION = ("1f1b", "gpipe", "zb_h1", "zbv", "interleaved_1f1b", "bitpipe", "chimera", "pipedream",
               "pipedream_2bw")
# One more value of each schedule's own parameters, at P = 4, N = 8.
_VARIANTS = {
    "1f1b": ("remat=true",), "gpipe": ("remat=true",), "zb_h1": ("remat=true",), "zbv": ("remat=true",),
    "interleaved_1f1b": ("v=3", "remat=true"), "bitpipe": ("bounded=true", "remat=true"),
    "chimera": ("double=true", "remat=true"), "pipedream_2bw": ("M=8",),
}


def configurations() -> list[tuple[str, tuple[str, ...]]]:
    """(target, defines) for every configuration the golden file holds, in a fixed order."""
    out: list[tuple[str, tuple[str, ...]]] = []
    for name in _ACTIVATION + ("weipipe", "fsdp", "tawpipe"):
        out += [(name, (f"P={P}", f"N={N}")) for P, N in _SIZES]
        out += [(name, ("P=4", "N=8", extra)) for extra in _VARIANTS.get(name, ())]
    out += [("fsdp", ("P=4", "N=8", "L=8")), ("tawpipe", ("P=8", "N=8", "G=4")), ("tawpipe", ("P=4", "N=4", "G=1"))]
    for name in ("ring_attention", "zigzag_ring", "tasp"):
        out += [(name, (f"P={P}",)) for P in (4, 6, 8)]
        out += [(name, ("P=5", "causal=false"))]
    out += [("tasp:tasp_rails", ()), ("tasp:tasp_rails", ("M=4", "K=2", "P=8"))]
    return out


def _command(argv: list[str]) -> str:
    """What ``pipec ARGV`` prints: standard output and then standard error (a note, a warning), or
    standard error's first line on a refusal."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        status = main(argv)
    if status != 0:
        return "error: " + err.getvalue().splitlines()[0]
    return out.getvalue() + err.getvalue()


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:20]


def record(target: str, defines: tuple[str, ...]) -> dict:
    """The golden entry of one configuration."""
    flags = [part for define in defines for part in ("-D", define)]
    entry = {"check": _command(["check", target, *flags]).rstrip("\n")}
    if entry["check"].startswith("error: "):
        return entry
    for form in ("text", "json", "torch-csv", "torch-csv-comms"):
        printed = _command(["compile", target, *flags, "--format", form])
        entry[form] = printed if printed.startswith("error: ") else _digest(printed)
    entry["simulate"] = _digest(_command(["simulate", target, *flags, "--json"]))
    return entry


def _key(target: str, defines: tuple[str, ...]) -> str:
    return " ".join((target, *defines))


@pytest.fixture(scope="module")
def golden() -> dict:
    if os.environ.get("PIPEC_UPDATE_GOLDEN") == "1":
        now = {_key(t, d): record(t, d) for t, d in configurations()}
        GOLDEN.write_text(json.dumps(now, indent=1) + "\n")
    return json.loads(GOLDEN.read_text())


def test_the_golden_file_holds_every_configuration(golden):
    assert list(golden) == [_key(t, d) for t, d in configurations()]
    refused = [key for key, entry in golden.items() if entry["check"].startswith("error: ")]
    assert len(refused) < len(golden) // 4, refused  # the file holds programs, not mostly refusals


@pytest.mark.parametrize("target,defines", configurations(), ids=[_key(t, d) for t, d in configurations()])
def test_commands_print_what_they_printed(golden, target, defines):
    assert record(target, defines) == golden[_key(target, defines)]
