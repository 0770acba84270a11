"""Files the user names.

Outputs (`export -o`, `sass -o`, `bench --out`, `table build -o`, `tune --table`): checked before the work that
produces them, written whole or not at all, and every failure one UsageError line. Only an ordinary file is
written or replaced: never a device, a FIFO, a socket or a symbolic link (replacing one would destroy what it
is), never a file inside a run folder (a run is written by its own search only) nor inside the compile cache.

Inputs (space files, shapes files, bench records, tables, run records): read_input reads a regular file with a
bound on its bytes that does not trust `stat` (a /proc file says 0), and never opens a FIFO or a device to read.
"""

from __future__ import annotations

import errno
import os
import stat
import uuid
from pathlib import Path

from .errors import EvotuneError, UsageError
from .paths import cache_root, runs_root

# Failures of the machine rather than of the path the user gave.
_NOT_THE_PATH = (errno.ENOSPC, errno.EIO, getattr(errno, "EDQUOT", errno.ENOSPC))

# A folder holding any of these is a run folder (records/runs.py writes them; `evotune runs` lists such folders).
RUN_MARKERS = ("trials.jsonl", "trials.jsonl.gz", "study.journal", "study.journal.gz", "study.db")

# Bounds on what a command reads from a file the user names (or a run folder holds).
MAX_JSON_BYTES = 64 << 20       # a bench record, a tuning table, a shapes file
MAX_META_BYTES = 16 << 20       # a run's meta.json, best.json, ...
MAX_RECORDS_BYTES = 2 << 30     # a run's trials.jsonl (an exhaustive search of 114,080 configs is ~250 MB)


def file_kind(mode: int) -> str:
    """What a non-regular file is, in words."""
    for test, name in ((stat.S_ISDIR, "a folder"), (stat.S_ISLNK, "a symbolic link"),
                       (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
                       (stat.S_ISFIFO, "a FIFO (named pipe)"), (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return name
    return "not a regular file"


def _inside(path: Path, folder: Path) -> bool:
    try:
        path.relative_to(folder)
        return True
    except ValueError:
        return False


def protected_place(target: Path) -> str | None:
    """Why evotune writes nothing at `target` (a run folder, the compile cache), or None."""
    parent = target.absolute().parent.resolve()
    runs = runs_root()
    if runs is not None:
        runs = runs.absolute().resolve()
        if _inside(parent, runs) and parent != runs:
            run = runs / parent.relative_to(runs).parts[0]
            return f"{run} is a run folder; a run is written only by its own search"
    for folder in (parent, *parent.parents):
        if any((folder / marker).exists() for marker in RUN_MARKERS):
            return f"{folder} is a run folder; a run is written only by its own search"
    cache = cache_root().absolute().resolve()
    if _inside(parent, cache) and parent != cache:
        return f"{parent} is inside evotune's cache ({cache}); write the file elsewhere"
    return None


def check_output_path(path: str, option: str, create_parents: bool = False) -> Path:
    """The file `path` names, if a file can be written there; UsageError saying why not otherwise.
    With `create_parents`, missing folders are allowed (write_output makes them)."""
    if not path or not path.strip():
        raise UsageError(f"{option}: empty file name")
    target = Path(path)
    if path.endswith(os.sep) or target.is_dir():
        raise UsageError(f"{option} {path}: is a folder; give a file name")
    try:
        mode = target.lstat().st_mode
    except (FileNotFoundError, NotADirectoryError):  # a new file (or a path through a file: said below)
        mode = None
    except OSError as e:
        raise UsageError(f"{option} {path}: cannot write there ({e.strerror})") from None
    if mode is not None and not stat.S_ISREG(mode):
        raise UsageError(f"{option} {path}: is {file_kind(mode)}; evotune writes only regular files (give a new "
                         f"or an ordinary file's name)")
    parent = target.absolute().parent
    existing = parent
    while not existing.exists():
        if not create_parents:
            raise UsageError(f"{option}: folder {parent} does not exist")
        existing = existing.parent
    if not existing.is_dir():
        raise UsageError(f"{option} {path}: {existing} is not a folder")
    why = protected_place(target)
    if why:
        raise UsageError(f"{option} {path}: {why}")
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


def read_input(path: str | os.PathLike, what: str, max_bytes: int, error: type[UsageError] = UsageError) -> bytes:
    """The bytes of the regular file `path` (`what` names it in messages: "space file"), at most `max_bytes`.
    `error` (UsageError or a subclass) says, in one line, why not: missing, not a regular file (a FIFO is never
    opened to wait for a writer, a device never read), larger than the bound (counted as read, not as `stat`
    says), or unreadable. FileNotFoundError is `error` too; callers that treat a missing file apart check first."""
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        raise error(f"{path}: no such file") from None
    except OSError as e:
        raise error(f"{path}: cannot read it ({e.strerror})") from None
    if not stat.S_ISREG(mode):
        raise error(f"{path}: is {file_kind(mode)}; a {what} must be a regular file")
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_NOCTTY", 0))
    except OSError as e:
        raise error(f"{path}: cannot read it ({e.strerror})") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):  # replaced between the stat and the open
            raise error(f"{path}: is {file_kind(st.st_mode)}; a {what} must be a regular file")
        chunks, total = [], 0
        while True:
            chunk = os.read(fd, min(1 << 20, max_bytes + 1 - total))
            if not chunk:
                break
            chunks.append(chunk)
            total += len(chunk)
            if total > max_bytes:  # the size stat gives where it is the truth, else what was read
                size = f"{st.st_size}" if st.st_size >= total else f"more than {max_bytes}"
                raise error(f"{path}: {size} bytes; a {what} is at most {max_bytes} bytes")
    except OSError as e:
        raise error(f"{path}: cannot read it ({e.strerror})") from None
    finally:
        os.close(fd)
    return b"".join(chunks)
