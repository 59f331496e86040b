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
the rename swaps the directory entry. An existing target that is neither a
regular file nor a link (a FIFO, a device node such as ``/dev/null``, a
socket) is refused before anything is written: the rename would replace the
node with a regular file, and writing through it would block on a FIFO with
no reader or lose the output in a device, neither of which ``-o`` promises
(standard output is ``-o -``, or no ``-o``).

The temporary name fits the folder's longest name (``NAME_MAX``, 255 bytes
on Linux): the target's name is cut in it as far as needed, so any legal
name can be written.

No other module opens a file for writing (``tests/test_atomic_write.py``
checks it over the source tree).
"""
from __future__ import annotations

import contextlib
import os
import stat
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
    _refuse_special(path, name)
    partial = None
    try:
        handle, partial = tempfile.mkstemp(dir=folder, prefix=_partial_prefix(path, folder), suffix=PARTIAL_SUFFIX)
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
    if not path:
        raise UsageError(f"cannot write {what or 'a file'}: the file name is empty")
    folder = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        raise UsageError(f"cannot write {name}: it is a folder")
    if not os.path.isdir(folder):
        raise UsageError(f"cannot write {name}: the folder '{folder}' does not exist")
    _refuse_special(path, name)
    try:
        handle, probe = tempfile.mkstemp(dir=folder, prefix=_partial_prefix(path, folder), suffix=PARTIAL_SUFFIX)
    except OSError as error:
        raise UsageError(f"cannot write {name}: {error.strerror or error}") from None
    os.close(handle)
    with contextlib.suppress(OSError):
        os.unlink(probe)


# mkstemp's random part of a temporary name, in characters.
_RANDOM_CHARS = 8
# A folder's longest name where the system does not say (POSIX's NAME_MAX on Linux and macOS).
_DEFAULT_NAME_MAX = 255
# What an existing target may be other than a regular file or a link, as messages name it.
_SPECIAL = ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
            (stat.S_ISSOCK, "a socket"), (stat.S_ISDIR, "a folder"))


def _refuse_special(path: str, name: str) -> None:
    """Refuse an existing ``path`` that is no regular file or link (see the module docstring)."""
    try:
        mode = os.lstat(path).st_mode
    except (OSError, ValueError):
        return  # no such file yet (or a name the system refuses: the write itself says so)
    for is_kind, kind in _SPECIAL:
        if is_kind(mode):
            raise UsageError(f"cannot write {name}: it is {kind}, not a regular file; pipec writes only regular "
                             "files (give another path, or no -o for standard output)")


def _partial_prefix(path: str, folder: str) -> str:
    """``.NAME.`` for the temporary file of ``path``, NAME cut so the whole temporary name
    (prefix, mkstemp's random part, ``PARTIAL_SUFFIX``) fits the folder's ``NAME_MAX`` bytes."""
    try:
        name_max = os.pathconf(folder, "PC_NAME_MAX")
    except (OSError, ValueError, AttributeError):
        name_max = _DEFAULT_NAME_MAX
    room = max(0, min(name_max, _DEFAULT_NAME_MAX) - 2 - _RANDOM_CHARS - len(PARTIAL_SUFFIX))
    encoded = os.fsencode(os.path.basename(path))[:room]
    # a cut inside a multi-byte character leaves its lead bytes, which surrogateescape keeps as they are
    return f".{os.fsdecode(encoded)}."


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
