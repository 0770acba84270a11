"""The run's own study storage: Optuna's JournalStorage over an append-only file in the run folder.

Why a journal and not the SQLite file of earlier runs: JournalStorage keeps the study in memory and
writes one line per operation, so an ask reads no trial back from disk. With SQLite every ask re-read
the unfinished trials (those asked ahead) through the ORM: `python tools/loop_cost.py` (300 trials, the
full attention space, 2-CPU machine) measured 48.5 ms per ask on SQLite against 9.0 ms on the journal,
77 against 15 ms of loop per candidate. It is Optuna's documented storage for several processes on one host.

The file backend is evotune's, not Optuna's JournalFileBackend, for the guarantees the run folder gives:
- The lock is a flock on the journal itself: the kernel drops it when its holder dies, so a kill -9
  stalls no other agent (Optuna's lock files wait out a 30 s grace period).
- Each append is one write() of whole lines on an O_APPEND descriptor under that lock, then fsync (as
  Optuna's backend does): a reader without the lock may see the newest line half written and stops
  before it; a killed writer can leave at most that half line.
- A half line at the end (a writer that died in the write, or a power loss) is cut off by the next
  append, under the lock, before it writes: the journal stays a sequence of whole lines. A whole line
  that is not JSON is damage, named with its line number; reading never repairs it.

A run committed to the repository keeps its journal gzipped (study.journal.gz; Optuna's JSON lines shrink some
25-fold, and an exhaustive mission search's journal is 10 MB): opening the study unpacks it beside, once. Only the
run's own search opens its study (or appends to trials.jsonl, likewise unpacked first); every other command reads
a gzipped file in memory (read_archived) and writes nothing into the run folder.
"""

from __future__ import annotations

import contextlib
import gzip
import json
import os
import shutil
import stat
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from optuna.storages.journal import BaseJournalBackend

try:
    import fcntl
except ImportError:  # not POSIX: no lock (one agent per run there)
    fcntl = None

from ..errors import UsageError


class DamagedJournal(UsageError):
    """A whole line of the journal that is not an Optuna journal entry."""


class RunJournal(BaseJournalBackend):
    def __init__(self, path: Path):
        self.path = Path(path)
        self.path.touch(exist_ok=True)
        self._read = (0, 0)  # (entries read, byte offset after them): where the next read starts

    @contextlib.contextmanager
    def _locked(self) -> Iterator[int]:
        fd = os.open(self.path, os.O_RDWR | os.O_APPEND)
        try:
            if fcntl is not None:
                fcntl.flock(fd, fcntl.LOCK_EX)  # released by close(), or by the kernel if this process dies
            yield fd
        finally:
            os.close(fd)

    def read_logs(self, log_number_from: int) -> Iterator[dict[str, Any]]:
        # JournalStorage asks from the count of entries it has read, which is where the last read stopped;
        # any other start is read from the beginning.
        number, offset = self._read if self._read[0] <= log_number_from else (0, 0)
        with open(self.path, "rb") as f:
            f.seek(offset)
            for line in f:
                if not line.endswith(b"\n"):
                    return  # being written by another agent now, or a torn tail the next append cuts off
                try:
                    entry = json.loads(line)
                except ValueError:
                    raise DamagedJournal(f"{self.path}: line {number + 1} is not a journal entry: the run's "
                                         f"study is damaged (its records, trials.jsonl, are a separate file)") from None
                offset += len(line)
                number += 1
                self._read = (number, offset)
                if number > log_number_from:
                    yield entry

    def append_logs(self, logs: list[dict[str, Any]]) -> None:
        data = "".join(json.dumps(log, separators=(",", ":")) + "\n" for log in logs).encode()
        with self._locked() as fd:
            _cut_torn_tail(fd)
            os.write(fd, data)
            if not all(log.get("op_code") in _UNSYNCED_OPS for log in logs):
                os.fsync(fd)


def _unsynced_ops() -> frozenset:
    """Journal operations appended without an fsync: a trial's parameters, written one log per knob as it is asked
    (25 fsyncs an ask on the full attention space, ~12 ms on a 2-core machine). They describe the trial in flight,
    which a crash loses anyway, and the fsync of that trial's next state or value (every other operation) writes
    them to disk with it: an fsync flushes the whole file."""
    try:
        from optuna.storages.journal._storage import JournalOperation
    except ImportError:  # another Optuna layout: fsync everything, as before
        return frozenset()
    return frozenset({int(JournalOperation.SET_TRIAL_PARAM)})


_UNSYNCED_OPS = _unsynced_ops()


def _cut_torn_tail(fd: int) -> None:
    """Truncate a last line without its newline (its writer died mid-write; the lock is ours, so no one
    is writing it now)."""
    size = os.fstat(fd).st_size
    if size == 0 or os.pread(fd, 1, size - 1) == b"\n":
        return
    end = size
    while end > 0:
        start = max(0, end - 65536)
        cut = os.pread(fd, end - start, start).rfind(b"\n")
        if cut >= 0:
            os.ftruncate(fd, start + cut + 1)
            return
        end = start
    os.ftruncate(fd, 0)


def journal_storage(path: Path):
    """Optuna's JournalStorage over the run's journal file (unpacked first where the run keeps it gzipped)."""
    from optuna.storages.journal import JournalStorage

    unpack_archived(Path(path))
    return JournalStorage(RunJournal(path))


def archived_name(path: Path) -> Path:
    """Where a committed run keeps the file `path` (its journal, or its trials.jsonl) gzipped: `path`.gz beside it."""
    return path.with_name(path.name + ".gz")


def read_archived(packed: Path, max_bytes: int, error: type[UsageError] = UsageError) -> bytes:
    """The unpacked bytes of the gzipped file `packed`, read in memory (nothing is written), at most `max_bytes` of
    them; `error` names the file where it is not a regular file, not gzip, or unpacks to more."""
    from ..outputs import file_kind

    try:
        mode = os.stat(packed).st_mode
        if not stat.S_ISREG(mode):
            raise error(f"{packed}: is {file_kind(mode)}, not a gzipped file")
        chunks, total = [], 0
        with gzip.open(packed, "rb") as src:
            while True:
                chunk = src.read(min(1 << 20, max_bytes + 1 - total))
                if not chunk:
                    break
                chunks.append(chunk)
                total += len(chunk)
                if total > max_bytes:
                    raise error(f"{packed}: unpacks to more than {max_bytes} bytes")
    except (OSError, EOFError, zlib.error) as e:
        raise error(f"{packed}: cannot unpack it ({e})") from None
    return b"".join(chunks)


def unpack_archived(path: Path) -> None:
    """Unpack the gzipped file beside `path` (a run's journal or trials.jsonl: the large files of a committed run, kept
    gzipped so that the repository stays within what the GPU machine takes) to `path` if only the archive is there.
    Written under a temporary
    name and hard-linked into place: a killed unpack leaves no half journal, and of two processes unpacking at once
    the second's link fails and it uses the first's file (which may already hold appends: never replaced)."""
    packed = archived_name(path)
    if path.exists() or not packed.exists():
        return
    tmp = path.with_name(f".{path.name}.unpack-{os.getpid()}")
    try:
        with gzip.open(packed, "rb") as src, open(tmp, "wb") as dst:
            shutil.copyfileobj(src, dst)
            dst.flush()
            os.fsync(dst.fileno())
        with contextlib.suppress(FileExistsError):
            os.link(tmp, path)
    except (OSError, EOFError, zlib.error) as e:
        raise UsageError(f"{packed}: cannot unpack the run's archived {'journal' if 'journal' in path.name else 'records'} "
                         f"({e})") from None
    finally:
        tmp.unlink(missing_ok=True)
