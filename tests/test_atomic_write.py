"""Every file pipec writes is written whole or not at all, through one writer (``compiler.atomic_write``).

A write that fails midway (the producer raises, the rename fails, the folder
is missing) leaves the old file as it was and no temporary file behind; and
no module of pipec opens a file for writing except that writer (an AST walk
over the source tree).
"""
from __future__ import annotations

import ast
import json
import os
import pathlib
import stat

import pytest
import torch

from pipec.cli import main
from pipec.commands._common import atomic_output, write_output
from pipec.compiler import atomic_write
from pipec.compiler.atomic_write import atomic_writer, check_writable, write_atomically
from pipec.errors import UsageError
from pipec.runtime.trace import write_chrome_trace

ROOT = pathlib.Path(__file__).resolve().parent.parent
OLD = "the old content\n"


def _old_file(tmp_path, name="out.txt"):
    path = tmp_path / name
    path.write_text(OLD)
    return path


def _left_in(folder) -> list[str]:
    return sorted(os.listdir(folder))


def test_a_write_replaces_the_file_whole_with_a_plain_files_mode(tmp_path):
    path = _old_file(tmp_path)
    os.chmod(path, 0o640)
    write_atomically(str(path), "new\n")
    assert path.read_text() == "new\n"
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o640  # the old file's permissions kept
    fresh = tmp_path / "fresh.bin"
    write_atomically(str(fresh), b"\x00\x01")
    assert fresh.read_bytes() == b"\x00\x01"
    umask = os.umask(0)
    os.umask(umask)
    assert stat.S_IMODE(os.stat(fresh).st_mode) == 0o666 & ~umask  # not mkstemp's 0600
    assert _left_in(tmp_path) == ["fresh.bin", "out.txt"]


def test_a_producer_that_raises_midway_leaves_the_old_file_and_no_temporary(tmp_path):
    path = _old_file(tmp_path)
    with pytest.raises(RuntimeError, match="producer failed"):
        with atomic_writer(str(path)) as out:
            out.write("half of the new ")
            raise RuntimeError("producer failed")
    assert path.read_text() == OLD
    assert _left_in(tmp_path) == ["out.txt"]


def test_a_failed_rename_is_a_usage_error_and_leaves_the_old_file(tmp_path, monkeypatch):
    path = _old_file(tmp_path)

    def no_room(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(atomic_write.os, "replace", no_room)
    with pytest.raises(UsageError, match=r"cannot write the trace '.*out.txt': No space left on device"):
        write_atomically(str(path), "new\n", what="the trace")
    assert path.read_text() == OLD
    assert _left_in(tmp_path) == ["out.txt"]


def test_a_full_disk_while_writing_is_a_usage_error_and_leaves_the_old_file(tmp_path, monkeypatch):
    path = _old_file(tmp_path)
    real_fdopen = os.fdopen

    class Full:
        """A file on a full disk: every write fails."""

        def __init__(self, handle):
            self.handle = handle

        def write(self, text):
            raise OSError(28, "No space left on device")

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.handle.close()

        def __getattr__(self, name):
            return getattr(self.handle, name)

    def full_fdopen(fd, mode="r", **kwargs):
        return Full(real_fdopen(fd, mode, **kwargs))

    monkeypatch.setattr(atomic_write.os, "fdopen", full_fdopen)
    with pytest.raises(UsageError, match="No space left on device"):
        write_output("new", str(path))
    assert path.read_text() == OLD
    assert _left_in(tmp_path) == ["out.txt"]


def test_a_missing_or_read_only_folder_is_a_usage_error(tmp_path):
    with pytest.raises(UsageError, match=r"cannot write '.*gone/out.txt'"):
        write_output("x", str(tmp_path / "gone" / "out.txt"))
    with pytest.raises(UsageError, match="does not exist"):
        check_writable(str(tmp_path / "gone" / "model.pt"), "the saved model (--save)")
    with pytest.raises(UsageError, match="it is a folder"):
        check_writable(str(tmp_path))
    check_writable(str(tmp_path / "ok.json"))
    assert _left_in(tmp_path) == []  # the probe is gone
    if os.geteuid() != 0:  # root writes into a read-only folder anyway
        locked = tmp_path / "locked"
        locked.mkdir()
        os.chmod(locked, 0o500)
        try:
            with pytest.raises(UsageError, match="Permission denied"):
                write_atomically(str(locked / "out.txt"), "x")
        finally:
            os.chmod(locked, 0o700)


def test_a_planted_link_is_replaced_not_followed(tmp_path):
    victim = _old_file(tmp_path, "victim.txt")
    link = tmp_path / "out.txt"
    link.symlink_to(victim)
    write_atomically(str(link), "new\n")
    assert victim.read_text() == OLD
    assert not link.is_symlink() and link.read_text() == "new\n"


def test_streamed_compile_output_that_fails_midway_leaves_the_old_file(tmp_path, monkeypatch, capsys):
    from pipec.compiler.emit import json_program

    path = _old_file(tmp_path, "program.json")

    def half_then_fail(program, out):
        out.write('{"format": "pipec-program", ')
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(json_program, "write_program_json", half_then_fail)
    assert main(["compile", "1f1b", "-D", "P=2", "-D", "N=2", "-o", str(path)]) == 1
    assert "cannot write" in capsys.readouterr().err
    assert path.read_text() == OLD
    assert _left_in(tmp_path) == ["program.json"]
    monkeypatch.undo()
    assert main(["compile", "1f1b", "-D", "P=2", "-D", "N=2", "-o", str(path)]) == 0
    assert json.loads(path.read_text())["format"] == "pipec-program"


def test_atomic_output_streams_to_stdout_without_a_path(capsys):
    with atomic_output("-") as out:
        out.write("to stdout\n")
    assert capsys.readouterr().out == "to stdout\n"


def test_the_trace_and_the_saved_model_go_through_the_writer(tmp_path):
    trace = _old_file(tmp_path, "run.json")
    with pytest.raises(UsageError, match="cannot write the trace"):
        write_chrome_trace(str(tmp_path / "gone" / "run.json"), [[]])
    write_chrome_trace(str(trace), [[], []], {"schedule": "x"})
    assert json.loads(trace.read_text())["otherData"]["schedule"] == "x"
    saved = tmp_path / "model.pt"
    with atomic_writer(str(saved), binary=True) as out:  # as the worker's --save does
        torch.save({"w": torch.ones(2)}, out)
    assert torch.equal(torch.load(saved)["w"], torch.ones(2))


# ------------------------------------------------------------- one writer only

_WRITER = ROOT / "compiler" / "atomic_write.py"
_WRITE_MODES = set("wax+")


def _writes(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, what) of every call in ``tree`` that opens or writes a file by itself."""
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""
        owner = ast.unparse(func.value) if isinstance(func, ast.Attribute) else ""
        if node.args and ast.unparse(node.args[0]) == "os.devnull":
            continue  # the null device (pipec.cli's standard output once it failed) is no file pipec writes
        if name in ("open", "fdopen") and owner in ("", "io", "os", "codecs", "builtins"):
            mode = _mode_of(node, 1)
            if name == "open" and owner == "os":
                flags = ast.unparse(node.args[1]) if len(node.args) > 1 else ""
                if any(flag in flags for flag in ("WRONLY", "RDWR", "CREAT", "APPEND", "TRUNC")):
                    found.append((node.lineno, f"os.open(..., {flags})"))
            elif mode is None or set(mode) & _WRITE_MODES:
                found.append((node.lineno, f"{ast.unparse(func)}(..., {mode!r})"))
        elif name == "open" and owner:  # Path(...).open(mode)
            mode = _mode_of(node, 0)
            if mode is not None and set(mode) & _WRITE_MODES:
                found.append((node.lineno, f"{ast.unparse(func)}({mode!r})"))
        elif name in ("write_text", "write_bytes"):
            found.append((node.lineno, name))
        elif name == "save" and owner == "torch":
            target = node.args[1] if len(node.args) > 1 else next((k.value for k in node.keywords if k.arg == "f"), None)
            if not (isinstance(target, ast.Name) and target.id == "out"):  # a stream from atomic_writer
                found.append((node.lineno, "torch.save to a path"))
        elif name in ("mkstemp", "NamedTemporaryFile", "TemporaryFile"):
            found.append((node.lineno, name))
    return found


def _mode_of(call: ast.Call, position: int) -> str | None:
    """The literal mode of an open() call: "r" when absent, None when not a literal."""
    node = call.args[position] if len(call.args) > position else next(
        (k.value for k in call.keywords if k.arg == "mode"), None)
    if node is None:
        return "r"
    return node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) else None


def _open_for_reading_only(tree: ast.AST) -> None:
    """Sanity of the walk itself: it tells reads from writes."""
    assert not _writes(ast.parse("open(p, encoding='utf-8'); open(p, 'rb'); Path(p).open(); os.open(p, os.O_RDONLY)"))
    assert len(_writes(ast.parse("open(p, 'w'); open(p, mode='ab'); p.write_text('x'); torch.save(s, p); "
                                 "os.open(p, os.O_WRONLY | os.O_CREAT)"))) == 5


def test_no_module_but_the_writer_writes_a_file():
    _open_for_reading_only(None)
    offenders = []
    for folder in ("compiler", "runtime", "pipec", "dsl", "examples"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            if path == _WRITER:
                continue
            for line, what in _writes(ast.parse(path.read_text(encoding="utf-8"), str(path))):
                offenders.append(f"{path.relative_to(ROOT)}:{line}: {what}")
    assert not offenders, "write through pipec.compiler.atomic_write instead:\n" + "\n".join(offenders)
