"""Crash-safe file writes shared by sites and the coordinator.

``atomic_write`` writes a temporary file beside the target, flushes and fsyncs it, renames it
over the target with ``os.replace`` and fsyncs the folder: after a crash at any moment the
target holds either the old content or the new one, never a mix. ``make_dirs`` creates a
folder so that it survives power loss (each new folder's parent is fsync'ed), and
``fsync_dir`` makes a new or renamed file in a folder durable.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import BinaryIO

__all__ = ["atomic_write", "fsync_dir", "locked", "make_dirs"]


def fsync_dir(folder: Path) -> None:
    """Make a rename or a new file in ``folder`` durable."""
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def make_dirs(folder: Path) -> None:
    """Create ``folder`` and any missing parents, durably: each new folder's parent is fsync'ed.

    A folder that already exists is left as it is (no fsync).
    """
    missing = []
    current = folder
    while not current.exists():
        missing.append(current)
        if current.parent == current:
            break
        current = current.parent
    folder.mkdir(parents=True, exist_ok=True)
    for created in reversed(missing):
        fsync_dir(created.parent)


def atomic_write(
    path: Path,
    write: Callable[[BinaryIO], object],
    *,
    before_replace: Callable[[], None] | None = None,
    mode: int | None = None,
) -> None:
    """Replace ``path`` atomically with what ``write`` writes to a binary file object.

    Args:
        path: the target file; its folder must exist.
        write: writes the new content to the file object it is given.
        before_replace: called after the temporary file is durable and before the rename
            (a test hook for crashes between the two).
        mode: the file's permission bits (e.g. ``0o600`` for private data), set on the
            temporary file before anything is written to it; default: the process umask.
    """
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        if mode is not None:
            with contextlib.suppress(FileNotFoundError):
                tmp.unlink()  # a stale file of a crashed writer keeps its own mode
            os.close(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode))
            os.chmod(tmp, mode)  # exactly ``mode``, whatever the umask
        with tmp.open("wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        if before_replace is not None:
            before_replace()
        os.replace(tmp, path)
    finally:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
    fsync_dir(path.parent)


@contextlib.contextmanager
def locked(path: Path) -> Iterator[None]:
    """Hold an exclusive ``flock`` on ``path`` (created if missing) for the block.

    Two processes working for the same site (a re-delivered message while the first attempt
    still runs) then take turns, so the second sees what the first stored.
    """
    with path.open("a") as f:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)
