"""The one writer of every file pipec writes: whole or not at all.

Every output (``pipec compile -o``, ``pipec render -o``, ``pipec costs -o``,
``pipec run --trace`` and ``--save``, the demo's files, the run folder's
program) goes through ``atomic_writer``: the content goes to a new temporary
file in the target's own folder (same file system, so the rename is atomic),
created with ``O_EXCL`` (never through a planted link), and is renamed onto
the target only once it is complete and flushed. A full disk, an error in the
code producing the content, or a kill before the rename leaves the old file,
if any, as it was, and no temporary file behind (but for a kill, which leaves
a hidden ``.NAME.XXXX.partial`` that the next write does not mistake for
anything).

A target that is a symbolic link is replaced by the new file, not followed:
the rename swaps the directory entry.

No other module opens a file for writing (``tests/test_atomic_write.py``
checks it over the source tree).
"""
from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator
from typing import IO

from pipec.errors import UsageError

PARTIAL_SUFFIX = ".partial"


@contextlib.contextmanager
def atomic_writer(path: str, *, binary: bool = False, what: str = "") -> Iterator[IO]:
    """A stream whose content replaces ``path`` atomically when the block ends without an error.

    Args:
        path: the file to (re)place.
        binary: yield a binary stream (``torch.save``, PNG bytes); else UTF-8 text
            with newlines written as they are.
        what: how messages name the file (``"the trace"``); default just its path.
    Yields:
        the open stream, a temporary file next to ``path``.
    Raises:
        UsageError: the file cannot be written (a missing or read-only folder, a
            full disk; an OSError inside the block is taken as one too):
            ``cannot write [WHAT ]'PATH': REASON``. The old file is left as it
            was and the temporary file removed. Any other exception raised
            inside the block also removes the temporary file, and propagates.
    """
    folder = os.path.dirname(os.path.abspath(path))
    name = f"{what} '{path}'" if what else f"'{path}'"
    partial = None
    try:
        handle, partial = tempfile.mkstemp(dir=folder, prefix=f".{os.path.basename(path)}.", suffix=PARTIAL_SUFFIX)
        with os.fdopen(handle, "wb" if binary else "w", **({} if binary else {"encoding": "utf-8", "newline": ""})) as out:
            yield out
            out.flush()
            os.fsync(out.fileno())
        _keep_mode(path, partial)
        os.replace(partial, path)
        partial = None
    except OSError as error:
        raise UsageError(f"cannot write {name}: {error.strerror or error}") from None
    finally:
        if partial is not None:  # an error or an interrupt before the rename
            with contextlib.suppress(OSError):
                os.unlink(partial)


def write_atomically(path: str, content: str | bytes, *, what: str = "") -> None:
    """Write ``content`` (text, or bytes) to ``path`` through ``atomic_writer``.

    Raises:
        UsageError: as ``atomic_writer``.
    """
    with atomic_writer(path, binary=isinstance(content, bytes), what=what) as out:
        out.write(content)


def check_writable(path: str, what: str = "") -> None:
    """Check, before long work, that ``atomic_writer(path)`` will be able to write: the folder exists
    and a file can be made in it, and ``path`` is not a folder.

    Raises:
        UsageError: ``cannot write [WHAT ]'PATH': REASON``.
    """
    name = f"{what} '{path}'" if what else f"'{path}'"
    folder = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        raise UsageError(f"cannot write {name}: it is a folder")
    if not os.path.isdir(folder):
        raise UsageError(f"cannot write {name}: the folder '{folder}' does not exist")
    try:
        handle, probe = tempfile.mkstemp(dir=folder, prefix=f".{os.path.basename(path)}.", suffix=PARTIAL_SUFFIX)
    except OSError as error:
        raise UsageError(f"cannot write {name}: {error.strerror or error}") from None
    os.close(handle)
    with contextlib.suppress(OSError):
        os.unlink(probe)


def _keep_mode(path: str, partial: str) -> None:
    """Give the new file the old one's permissions, or a plain new file's (mkstemp makes it 0600)."""
    try:
        mode = os.stat(path, follow_symlinks=False).st_mode & 0o7777
        if os.path.islink(path):
            raise FileNotFoundError
    except FileNotFoundError:
        umask = os.umask(0)
        os.umask(umask)
        mode = 0o666 & ~umask
    os.chmod(partial, mode)


__all__ = ["atomic_writer", "check_writable", "write_atomically"]
