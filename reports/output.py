"""Writing a directory of results safely: locked, staged, renamed into place.

`staged_output(DIR)` takes an exclusive lock on DIR/.gptcalc.lock (a second run on the same
directory is refused, not interleaved; the file is removed when the run ends), yields a hidden
staging directory inside DIR, and when the body finishes renames every file written there onto
its final name in DIR. An interrupted or
failed run removes the staging directory, so DIR holds either what it held before or the whole
new result, never a half-written file under a final name. A final name that is a symbolic link is
refused: the run would otherwise replace a link the user made, or, in a naive writer, write
through it.
"""

from __future__ import annotations

import dataclasses
import errno
import fcntl
import os
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from gptcalc.errors import ConfigError

LOCK_NAME = ".gptcalc.lock"


def _refuse_link(path: Path) -> None:
    if path.is_symlink():
        raise ConfigError("out", f"{path} is a symbolic link; refusing to replace it "
                                 "(remove it or choose another --out)")


@contextmanager
def staged_output(out_dir: Path) -> Iterator[Path]:
    out_dir = Path(out_dir)
    _refuse_link(out_dir / LOCK_NAME)
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        lock = os.open(out_dir / LOCK_NAME, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
    except OSError as e:
        raise ConfigError("out", f"cannot use {out_dir} as the output directory: "
                                 f"{e.strerror}") from None
    try:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise ConfigError("out", f"{out_dir} is busy: another gptcalc run is writing "
                                         "there") from None
            raise
        if not _same_file(lock, out_dir / LOCK_NAME):  # its holder removed it as we opened it
            raise ConfigError("out", f"{out_dir} is busy: another gptcalc run is writing there")
        staging = Path(tempfile.mkdtemp(prefix=".gptcalc-staging-", dir=out_dir))
        try:
            yield staging
            names = sorted(p.name for p in staging.iterdir())
            for name in names:  # every check before the first rename: all or nothing
                _refuse_link(out_dir / name)
            for name in names:
                os.replace(staging / name, out_dir / name)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
            if _same_file(lock, out_dir / LOCK_NAME):
                os.unlink(out_dir / LOCK_NAME)  # removed while held: none is left behind
    finally:
        os.close(lock)  # closing releases the lock


def _same_file(fd: int, path: Path) -> bool:
    """Whether the open file `fd` is still the file at `path` (a run removes its lock file
    while holding it; a run that opened the old one then finds it gone and stops)."""
    try:
        st, here = os.fstat(fd), os.stat(path, follow_symlinks=False)
    except FileNotFoundError:
        return False
    return (st.st_dev, st.st_ino) == (here.st_dev, here.st_ino)


def moved(obj, staging: Path, out_dir: Path):
    """`obj` (a dataclass with a `path`, e.g. a Plot) pointing at its final place in out_dir."""
    path = Path(obj.path)
    if path.parent == staging:
        return dataclasses.replace(obj, path=Path(out_dir) / path.name)
    return obj
