"""Files a command writes where the user says (`export -o`, `sass -o`, `bench --out`): checked before
the work that produces them, written whole or not at all, and every failure one UsageError line.
"""

from __future__ import annotations

import errno
import os
import uuid
from pathlib import Path

from .errors import EvotuneError, UsageError

# Failures of the machine rather than of the path the user gave.
_NOT_THE_PATH = (errno.ENOSPC, errno.EIO, getattr(errno, "EDQUOT", errno.ENOSPC))


def check_output_path(path: str, option: str, create_parents: bool = False) -> Path:
    """The file `path` names, if a file can be written there; UsageError saying why not otherwise.
    With `create_parents`, missing folders are allowed (write_output makes them)."""
    if not path or not path.strip():
        raise UsageError(f"{option}: empty file name")
    target = Path(path)
    if path.endswith(os.sep) or target.is_dir():
        raise UsageError(f"{option} {path}: is a folder; give a file name")
    parent = target.absolute().parent
    existing = parent
    while not existing.exists():
        if not create_parents:
            raise UsageError(f"{option}: folder {parent} does not exist")
        existing = existing.parent
    if not existing.is_dir():
        raise UsageError(f"{option} {path}: {existing} is not a folder")
    if not os.access(existing, os.W_OK | os.X_OK) or (target.exists() and not os.access(target, os.W_OK)):
        raise UsageError(f"{option} {path}: no permission to write there")
    return target


def write_output(path: str | Path, text: str, option: str, create_parents: bool = False) -> Path:
    """Write `text` to `path` whole: a temporary file beside it, then a rename, so that a failed write
    leaves no half file. An OSError is one line: UsageError for the path, EvotuneError for a full disk."""
    target = check_output_path(str(path), option, create_parents)
    tmp = target.with_name(f".{target.name}.{uuid.uuid4().hex[:8]}.tmp")
    try:
        if create_parents:
            target.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(text)
        os.replace(tmp, target)
    except OSError as e:
        kind = EvotuneError if e.errno in _NOT_THE_PATH else UsageError
        raise kind(f"{option} {path}: cannot write it ({e.strerror or e})") from None
    finally:
        try:
            tmp.unlink(missing_ok=True)
        except OSError:
            pass
    return target
