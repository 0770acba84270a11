"""A run's source archive: the exact CUDA source of each trial it measured, so that replay, export, bench and
verify of an old run compile what the run measured, whatever today's template says (Triton's cache key holds the
kernel's own hash for the same reason). The kernel text may then change freely: a recorded trial whose source
today's template no longer gives is still the code its record describes.

    runs/<run>/sources/<digest>.cu.gz      a whole source, gzipped (`zcat` gives the code NVRTC compiled)
    runs/<run>/sources/<digest>.delta.gz   a source as line ranges of one whole source in the same folder plus
                                           the lines it adds (gzipped JSON: {"base": digest, "ops": [...]})

Content-addressed: <digest> is KernelSource.digest (the first 16 hex digits of the code's SHA-256), the digest a
trial record keeps as `source_digest`; reading checks that the code hashes to its name. Why deltas: sources of
one template differ in a few hundred lines of ~3000 (the flagged lines a config keeps, its instantiation block):
a whole source is ~28 KB gzipped, a delta ~0.4 KB, so a search's 2,586 counted trials cost ~1 MB, not 72 MB.
A delta's base is always a whole source (one step to rebuild), and a delta no smaller than a quarter of a
whole one is written whole instead (the next base).

The entry point is not stored: it is the family's `entry_name` (a class constant of the problem); reading checks
that the code defines it. Launch geometry, signature and the reference come from today's problem, as they do for
a config: the archive holds the code, not the launcher.

Writing (`archive_source`) is the search's, into its own run folder only (and tools/archive_sources.py's, which
backfills committed runs): a temporary file, then a hard link to the final name, so a file is whole or absent,
never replaced (append-only), and two agents writing one digest at once leave one file. Reading
(`read_source`) writes nothing, reads regular files only, and bounds both the gzipped and the unpacked bytes.
"""

from __future__ import annotations

import errno
import gzip
import hashlib
import json
import os
import re
import uuid
import zlib
from pathlib import Path

from ..build.template import KernelSource
from ..errors import UsageError
from ..outputs import read_input

SOURCES_DIR = "sources"
WHOLE = ".cu.gz"
DELTA = ".delta.gz"
MAX_PACKED_BYTES = 4 << 20    # one gzipped file of the archive (a whole attention source is ~28 KB)
MAX_SOURCE_BYTES = 16 << 20   # its unpacked code (~117 KB today)
DELTA_BASES = 8               # whole sources a new one is compared with (the run's first ones)
DELTA_WORTH = 0.25            # a delta is kept where it is smaller than this fraction of the whole source gzipped

_DIGEST = re.compile(r"^[0-9a-f]{16}$")


class DamagedSource(UsageError):
    """An archived source that cannot be read as evotune writes it: the message names the file and what is wrong."""


def digest_of(code: str) -> str:
    """The digest KernelSource gives `code` (its archive name)."""
    return hashlib.sha256(code.encode()).hexdigest()[:16]


def is_digest(value) -> bool:
    """Whether `value` is a source digest as records keep it (it becomes a file name only then)."""
    return isinstance(value, str) and bool(_DIGEST.match(value))


def sources_dir(run_path) -> Path:
    return Path(run_path) / SOURCES_DIR


def archived_digests(run_path) -> set[str]:
    """The digests the run's archive holds (whole or as a delta)."""
    folder = sources_dir(run_path)
    if not folder.is_dir():
        return set()
    out = set()
    for p in folder.iterdir():
        for suffix in (WHOLE, DELTA):
            if p.name.endswith(suffix) and is_digest(p.name[:-len(suffix)]):
                out.add(p.name[:-len(suffix)])
    return out


def has_source(run_path, digest) -> bool:
    folder = sources_dir(run_path)
    return is_digest(digest) and any(os.path.lexists(folder / (digest + s)) for s in (WHOLE, DELTA))


# --------------------------------------------------------------------------- writing

def _pack(data: bytes) -> bytes:
    """gzip at level 6 with no time or name in the header: one code, one byte string, on every host. Level 9 cost
    a search ~9 ms a trial on the whole source (1.4 s of a 60-trial first search on the H100) for ~5% fewer bytes."""
    return gzip.compress(data, compresslevel=6, mtime=0)


def _line_delta(base: list[str], target: list[str]) -> list:
    """`target` as ops on `base`: [start, end] copies base[start:end], a string adds itself. Greedy on a map of base
    lines: a run of equal lines is extended while it can, else restarted at the occurrence of the line that gives the
    longest run (any choice rebuilds `target` exactly; the longest keeps the delta small). Linear in practice."""
    where: dict[str, list[int]] = {}
    for i, line in enumerate(base):
        where.setdefault(line, []).append(i)
    ops: list = []
    i, n = 0, len(target)
    while i < n:
        best_at, best_len = -1, 0
        for at in where.get(target[i], ())[:64]:
            length = 0
            while i + length < n and at + length < len(base) and base[at + length] == target[i + length]:
                length += 1
            if length > best_len:
                best_at, best_len = at, length
        if best_len >= 2 or (best_len == 1 and len(target[i]) > 24):
            ops.append([best_at, best_at + best_len])
            i += best_len
        else:
            if ops and isinstance(ops[-1], str):
                ops[-1] += target[i]
            else:
                ops.append(target[i])
            i += 1
    return ops


def _apply_delta(base: list[str], ops) -> str:
    parts = []
    for op in ops:
        if isinstance(op, str):
            parts.append(op)
        elif (isinstance(op, list) and len(op) == 2 and all(isinstance(x, int) and not isinstance(x, bool) for x in op)
              and 0 <= op[0] <= op[1] <= len(base)):
            parts.extend(base[op[0]:op[1]])
        else:
            raise ValueError(f"op {str(op)[:40]} is neither a line range of the base nor text")
    return "".join(parts)


# The delta bases of the archives this process writes to: {folder: {digest: lines}}. Listed and read once per
# folder (a search records thousands of trials; listing a folder of as many files for each would be quadratic), then
# kept up to date with the whole sources this process adds; another agent's later whole sources are only not used
# as bases here (any base rebuilds exactly).
_BASES: dict[str, dict[str, list[str]]] = {}


def _bases(folder: Path, entry: str) -> dict[str, list[str]]:
    key = str(folder.resolve())
    if key not in _BASES:
        names = sorted(p.name[:-len(WHOLE)] for p in folder.iterdir() if p.name.endswith(WHOLE)
                       and is_digest(p.name[:-len(WHOLE)]))
        found = {}
        for digest in names[:DELTA_BASES]:
            try:
                found[digest] = read_source(folder.parent, digest, entry).code.splitlines(keepends=True)
            except DamagedSource:
                continue
        _BASES[key] = found
    return _BASES[key]


def _link_into_place(folder: Path, name: str, data: bytes) -> bool:
    """Write `data` as folder/name whole, never over an existing file; False where the name was already there."""
    final = folder / name
    if os.path.lexists(final):
        return False
    tmp = folder / f".{name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp"
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        try:
            os.link(tmp, final)
        except FileExistsError:
            return False
        except OSError as e:  # a file system without hard links: a rename, checked first (a race leaves one whole file)
            if e.errno not in (errno.EPERM, errno.EOPNOTSUPP, errno.ENOTSUP, errno.EMLINK):
                raise
            if os.path.lexists(final):
                return False
            os.replace(tmp, final)
        return True
    finally:
        tmp.unlink(missing_ok=True)


def archive_source(run_path, source: KernelSource) -> bool:
    """Add `source` to the run's archive (a delta where one of the archive's first whole sources makes it small,
    else whole); True where it was written, False where the archive already held its digest. The caller is the
    run's own search (or the backfill tool): nothing else writes into a run folder."""
    digest = source.digest
    folder = sources_dir(run_path)
    if has_source(run_path, digest):
        return False
    folder.mkdir(exist_ok=True)
    whole = _pack(source.code.encode())
    target = source.code.splitlines(keepends=True)
    best = None
    bases = _bases(folder, source.entry)
    for gone in [d for d in bases if not os.path.lexists(folder / (d + WHOLE))]:  # a folder removed and made again
        del bases[gone]
    for base_digest, base in bases.items():  # the smallest delta by its text; only that one is gzipped
        text = json.dumps({"base": base_digest, "ops": _line_delta(base, target)}, separators=(",", ":"))
        if best is None or len(text) < len(best):
            best = text
    best = _pack(best.encode()) if best is not None else None
    if best is not None and len(best) < DELTA_WORTH * len(whole):
        return _link_into_place(folder, digest + DELTA, best)
    written = _link_into_place(folder, digest + WHOLE, whole)
    if written and len(bases) < DELTA_BASES:
        bases[digest] = target
    return written


# --------------------------------------------------------------------------- reading

def _unpack(path: Path) -> bytes:
    packed = read_input(path, "archived source", MAX_PACKED_BYTES, DamagedSource)
    try:
        inflate = zlib.decompressobj(wbits=31)  # gzip
        data = inflate.decompress(packed, MAX_SOURCE_BYTES + 1)
        if len(data) > MAX_SOURCE_BYTES:
            raise DamagedSource(f"{path}: unpacks to more than {MAX_SOURCE_BYTES} bytes")
        if not inflate.eof:
            raise DamagedSource(f"{path}: cannot unpack it (the gzip stream is cut off)")
    except zlib.error as e:
        raise DamagedSource(f"{path}: cannot unpack it ({e})") from None
    return data


def _read_code(folder: Path, digest: str, depth: int = 0) -> str | None:
    whole, delta = folder / (digest + WHOLE), folder / (digest + DELTA)
    if os.path.lexists(whole):
        path = whole
        try:
            code = _unpack(whole).decode()
        except UnicodeDecodeError:
            raise DamagedSource(f"{whole}: not UTF-8 text") from None
    elif os.path.lexists(delta):
        path = delta
        try:
            obj = json.loads(_unpack(delta))
            base_digest, ops = obj["base"], obj["ops"]
            if not is_digest(base_digest) or not isinstance(ops, list) or depth > 0:
                raise ValueError("not a delta on a whole source of the archive")
            base = _read_code(folder, base_digest, depth + 1)
            if base is None:
                raise ValueError(f"its base {base_digest} is not in the archive")
            code = _apply_delta(base.splitlines(keepends=True), ops)
        except DamagedSource:
            raise
        except (ValueError, KeyError, TypeError, RecursionError) as e:
            raise DamagedSource(f"{delta}: not a source delta ({e})") from None
    else:
        return None
    if digest_of(code) != digest:
        raise DamagedSource(f"{path}: its code hashes to {digest_of(code)}, not to its name {digest}")
    return code


def read_source(run_path, digest, entry: str, family: str = "") -> KernelSource | None:
    """The archived source of `digest` in the run at `run_path` (None where the archive does not hold it, or
    `digest` is not a digest); DamagedSource naming the file where it is there but unreadable, does not hash to
    its name, or does not define `entry`. Writes nothing."""
    if not is_digest(digest):
        return None
    folder = sources_dir(run_path)
    code = _read_code(folder, digest)
    if code is None:
        return None
    if not re.search(r"\b" + re.escape(entry) + r"\s*\(", code):
        raise DamagedSource(f"{folder}/{digest}: the archived source does not define the entry point {entry}")
    return KernelSource(family=family, entry=entry, code=code, template_path=str(folder / digest))


def archive_bytes(run_path) -> int:
    """What the run's archive takes on disk (the sum of its files' sizes)."""
    folder = sources_dir(run_path)
    return sum(p.stat().st_size for p in folder.iterdir() if p.is_file()) if folder.is_dir() else 0


# --------------------------------------------------------------------------- a trial's source

class TrialSource:
    """The source a command compiles for one of a run's trials, where it came from, and the line to say about it
    (None where there is nothing to say)."""

    __slots__ = ("source", "origin", "note")

    def __init__(self, source: KernelSource, origin: str, note: str | None = None):
        self.source, self.origin, self.note = source, origin, note

    @property
    def archived(self) -> bool:
        return self.origin == "archive"

    @property
    def changed(self) -> bool:
        """Whether the code compiled is not the code the trial measured (today's template gives other code)."""
        return self.origin == "today-changed"


def changed_note(run_id: str, number, recorded: str, now: str) -> str:
    return (f"the kernel template changed since trial {number} of run {run_id} was recorded (source {recorded} then, "
            f"{now} now) and the run archives no source for it: measuring today's source")


def trial_source(run, rec: dict, problem, config, shape, own_shape: bool = True) -> TrialSource:
    """What to compile for trial record `rec` of `run` on `shape`: the run's archived source of the trial's
    `source_digest` where it holds one and `shape` is the run's own (`own_shape`; on another shape the source may
    differ); else today's instantiation, with a note where its digest is not the one recorded."""
    from ..build.template import instantiate

    recorded = rec.get("source_digest")
    if own_shape and is_digest(recorded):
        src = read_source(run.path, recorded, problem.entry_name, problem.family)
        if src is not None:
            return TrialSource(src, "archive")
    today = instantiate(problem, config, shape)
    if own_shape and isinstance(recorded, str) and recorded and recorded != today.digest:
        return TrialSource(today, "today-changed", changed_note(run.run_id, rec.get("number"), recorded, today.digest))
    return TrialSource(today, "today")
