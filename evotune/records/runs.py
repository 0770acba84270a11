"""Run folders: runs/<run-id>/ with meta.json, trials.jsonl (one line per finished
trial, flushed as it happens), the Optuna study (study.journal), pareto.json and best.json.

Records are append-only: a killed run loses at most the trial in flight, and
`--resume` continues from what trials.jsonl and the study hold.

Several search agents (processes, one per GPU) may share a run: each appends its own lines to
trials.jsonl under an exclusive flock, one write() per line, so lines never interleave; readers
skip a torn line (a writer killed mid-write). pareto.json and best.json are replaced atomically
(a uniquely named temporary file, then os.replace). The study may live in the run's journal file
(the default: one host; journal.py), in an RDB server named by URL (several hosts; meta.json records the
URL with its password hidden), or, for runs made before the journal, in the run's SQLite file (study.db).
"""

from __future__ import annotations

import contextlib
import datetime as dt
import json
import math
import os
import re
import subprocess
import sys
import uuid
from pathlib import Path

try:
    import fcntl
except ImportError:  # not POSIX: appends are not locked (one agent per run there)
    fcntl = None

from .. import __version__
from ..errors import EvotuneError, UsageError
from ..build.template import REPO_ROOT
from .best import best_record, final_best, ok_records, read_beside  # noqa: F401 (best_record: re-exported)
from ..outputs import MAX_META_BYTES, MAX_RECORDS_BYTES, read_input
from ..paths import runs_root
from .journal import archived_name, read_archived, unpack_archived

_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,99}$")


class DamagedRun(UsageError):
    """A run folder whose meta.json or trials.jsonl cannot be read as evotune writes them; the message
    names the file (and line) and what is wrong. Reading never repairs it: the records are the user's."""


def runs_dir() -> Path:
    """Where runs live: $EVOTUNE_RUNS, else ./runs in the current folder (never beside the installed package)."""
    root = runs_root()
    if root is None:  # the current folder was removed under us
        raise UsageError("the current folder no longer exists: cd to a folder, or set EVOTUNE_RUNS")
    return root


def check_name(name: str) -> None:
    """UsageError unless `name` is a plain run name (it becomes a folder name and a study name)."""
    if not _NAME_RE.match(name):
        shown = repr(name) if len(name) <= 40 else f"{name[:40]!r}... ({len(name)} characters)"
        raise UsageError(f"run name {shown}: use letters, digits, '.', '_' and '-' (at most 100, "
                         f"starting with a letter or digit)")


def git_sha() -> str:
    """Short sha of the checkout (with -dirty); EVOTUNE_GIT_SHA names it where the tree has no .git (a copied tree)."""
    if os.environ.get("EVOTUNE_GIT_SHA"):
        return os.environ["EVOTUNE_GIT_SHA"]
    try:
        out = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], cwd=REPO_ROOT, capture_output=True,
                             text=True, timeout=10)
        sha = out.stdout.strip() if out.returncode == 0 else "unknown"
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO_ROOT,
                               capture_output=True, text=True, timeout=10).stdout.strip()
        return sha + ("-dirty" if dirty and sha != "unknown" else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def new_run_id(shape_spec: str) -> str:
    stamp = dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    return f"{stamp}-{re.sub(r'[^A-Za-z0-9]+', '-', shape_spec).strip('-')}"


# Runs made before the journal keep their study in the run folder's SQLite file. Several processes on one
# host can share it: SQLite's locks are the kernel's, released when a process dies (a kill -9 stalls nobody
# and a hot journal is rolled back), and writers wait for each other up to this many seconds.
SQLITE_TIMEOUT_S = 60
DEFAULT_STUDY = "evotune"  # the study's name in a run's own study file
JOURNAL_NAME = "study.journal"  # the run's own study (journal.py says why a journal)


def redact_url(url: str) -> str:
    """A storage URL as meta.json and messages show it: the password replaced by ***."""
    try:
        from sqlalchemy.engine import make_url

        return make_url(url).render_as_string(hide_password=True)
    except Exception:
        return re.sub(r"(://[^:/@]*:)[^@]*@", r"\1***@", url)


def _sqlite_wal(storage) -> None:
    """Put the run's SQLite study in WAL mode with synchronous=NORMAL on every connection.

    Every ask and tell is several commits; with SQLite's default rollback journal each one
    fsyncs. In WAL mode with NORMAL, a commit survives a killed process (kill -9 included)
    and only a power loss can take the last ones, which the run's trials.jsonl and --resume
    tolerate. Measured: 112 -> 51 ms per TPE ask+tell at 300 trials on the CPU machine.
    """
    from sqlalchemy import event

    def on_connect(dbapi_connection, _record):
        cursor = dbapi_connection.cursor()
        cursor.execute("PRAGMA journal_mode=WAL")
        cursor.execute("PRAGMA synchronous=NORMAL")
        cursor.close()

    storage.engine.dispose()  # connections opened while Optuna set up the schema predate the listener
    event.listen(storage.engine, "connect", on_connect)


def _with_driver(url: str) -> str:
    """A postgresql:// URL with the driver that is installed: SQLAlchemy 2.0 defaults to psycopg2 and 2.1 to
    psycopg (3); the `postgres` extra installs psycopg2."""
    if not url.startswith("postgresql://"):
        return url
    import importlib.util

    for module, scheme in (("psycopg2", "postgresql+psycopg2://"), ("psycopg", "postgresql+psycopg://")):
        if importlib.util.find_spec(module) is not None:
            return scheme + url[len("postgresql://"):]
    return url


def open_storage(url: str | None, journal: Path, run_id: str):
    """The Optuna storage of a run's study: the journal file `journal` when `url` is None, else the RDB at `url`
    (SQLite waits for other writers instead of failing). Bad URLs and unreachable servers are one-line errors."""
    import optuna

    if url is None:
        from .journal import journal_storage

        return journal_storage(journal)
    if "***" in url:
        raise UsageError(f"run {run_id!r} keeps its study in {url}: give the password with --storage URL "
                         f"(or in ~/.pgpass or PGPASSWORD, and a URL without it)")
    kwargs = {"connect_args": {"timeout": SQLITE_TIMEOUT_S}} if url.startswith("sqlite") else {}
    try:
        storage = optuna.storages.RDBStorage(_with_driver(url), engine_kwargs=kwargs)
        if url.startswith("sqlite"):
            _sqlite_wal(storage)
        return storage
    except ImportError as e:
        raise UsageError(f"storage {redact_url(url)}: {e} (for PostgreSQL: pip install 'evotune[postgres]')") from None
    except Exception as e:  # SQLAlchemy's OperationalError and kin: no server, refused, no such database
        if type(e).__module__.split(".")[0] not in ("sqlalchemy", "psycopg2", "psycopg", "sqlite3"):
            raise
        why = str(getattr(e, "orig", None) or e).strip().splitlines()
        raise EvotuneError(f"storage {redact_url(url)}: cannot open it: {why[0] if why else type(e).__name__}") from None


class Run:
    def __init__(self, path: Path, storage: str | None = None):
        self.path = Path(path)
        self._storage = storage  # an RDB URL with its password, given on the command line (None: meta.json's)

    @property
    def run_id(self) -> str:
        return self.path.name

    def use_storage(self, url: str | None) -> "Run":
        """Use this study storage URL (as typed, password included) instead of what meta.json records."""
        self._storage = url
        return self

    @property
    def storage_url(self) -> str | None:
        """The RDB URL of the run's study: a server's (meta.json names it), or the SQLite file that runs made
        before the journal (study.db); None for the run's own journal file (study.journal, the default)."""
        if self._storage:
            return self._storage
        recorded = self._meta_field("storage")
        if recorded:
            return recorded
        legacy = self.path / "study.db"
        return f"sqlite:///{legacy}" if legacy.exists() else None

    @property
    def study_place(self) -> str:
        """Where the study lives, as messages show it (a server's password hidden)."""
        url = self.storage_url
        return redact_url(url) if url else str(self.path / JOURNAL_NAME)

    @property
    def study_name(self) -> str:
        """The study's name in its storage: "evotune" in the run's own file; the run id in a shared RDB,
        so that one database holds many runs."""
        return self._meta_field("study_name") or DEFAULT_STUDY

    def storage(self):
        """The Optuna storage object for the run's study: the journal, or an RDB (open_storage)."""
        return open_storage(self.storage_url, self.path / JOURNAL_NAME, self.run_id)

    def _meta_field(self, key: str):
        try:
            return json.loads(read_input(self.path / "meta.json", "run's meta.json", MAX_META_BYTES)).get(key)
        except (UsageError, ValueError, AttributeError, RecursionError):
            return None

    @property
    def trials_path(self) -> Path:
        """trials.jsonl to append to, unpacked first where a committed run keeps it gzipped (trials.jsonl.gz): for
        the run's own search only. Readers call trials(), which reads the archive where it is and writes nothing."""
        path = self.path / "trials.jsonl"
        unpack_archived(path)
        return path

    def _records_bytes(self) -> tuple[bytes, Path]:
        """(the bytes of trials.jsonl, or of trials.jsonl.gz where only that is there, read in memory; the file
        read). Bounded, regular files only; DamagedRun names the file that cannot be read."""
        plain = self.path / "trials.jsonl"
        packed = archived_name(plain)
        if os.path.lexists(plain):
            return read_input(plain, "run's trials.jsonl", MAX_RECORDS_BYTES, DamagedRun), plain
        if os.path.lexists(packed):
            return read_archived(packed, MAX_RECORDS_BYTES, DamagedRun), packed
        return b"", plain

    # ---------------------------------------------------------------- create / open
    @classmethod
    def create(cls, name: str | None, meta: dict) -> "Run":
        if name is None:
            name = new_run_id(meta.get("shape_spec", "run"))
        path = cls.check_new_name(name)
        if meta.get("storage") and not meta.get("study_name"):
            meta = {**meta, "study_name": name}  # a shared database holds many runs' studies: name it after the run
        path.mkdir(parents=True)
        run = cls(path)
        run.write_json("meta.json", {**meta, "run_id": name, "created": dt.datetime.now().isoformat(timespec="seconds"),
                                     "log_id": uuid.uuid4().hex[:12]})
        run.trials_path.touch()
        return run

    @property
    def log_id(self) -> str:
        """Names this folder's trials.jsonl among the folders that share a study (one per host): the agents
        writing to it tag their trials with it, so each agent knows which records its own log holds."""
        recorded = self._meta_field("log_id")
        if recorded:
            return recorded
        import hashlib
        import socket

        return hashlib.sha1(f"{socket.gethostname()}:{self.path.resolve()}".encode()).hexdigest()[:12]

    def share_meta(self) -> None:
        """Create the run's study and keep meta.json in it, so that agents on other hosts can join the run
        (`Run.join`) from the storage alone."""
        import optuna

        optuna.logging.set_verbosity(optuna.logging.WARNING)
        study = optuna.create_study(study_name=self.study_name, storage=self.storage(), load_if_exists=True,
                                    directions=["minimize", "minimize"])
        study.set_user_attr("meta", self.meta())

    @classmethod
    def join(cls, name: str, storage: str, extra: dict | None = None) -> "Run":
        """This host's folder for run `name` whose study another host created in `storage` (an RDB URL):
        meta.json comes from the study, and trials.jsonl fills with the run's records as the search goes."""
        import optuna

        path = cls.check_new_name(name)
        optuna.logging.set_verbosity(optuna.logging.WARNING)
        store = Run(path, storage).storage()
        if name not in optuna.study.get_all_study_names(storage=store):
            raise UsageError(f"no run {name!r} in {runs_dir()}, and no study {name!r} in {redact_url(storage)} to join")
        meta = optuna.load_study(study_name=name, storage=store).user_attrs.get("meta")
        if not isinstance(meta, dict):
            raise UsageError(f"study {name!r} in {redact_url(storage)} was not made by `evotune search`: nothing to join")
        path.mkdir(parents=True)
        run = cls(path, storage)
        run.write_json("meta.json", {**meta, **(extra or {}), "log_id": uuid.uuid4().hex[:12]})
        run.trials_path.touch()
        return run

    @staticmethod
    def check_study_free(name: str, storage: str) -> None:
        """UsageError if `storage` already holds a study named `name` (a new run would mix with it)."""
        import optuna

        optuna.logging.set_verbosity(optuna.logging.WARNING)
        store = Run(runs_dir() / name, storage).storage()
        if name in optuna.study.get_all_study_names(storage=store):
            raise UsageError(f"{redact_url(storage)} already has a study {name!r}: join it with "
                             f"`--run {name} --resume`, or pick another --run")

    @staticmethod
    def check_new_name(name: str) -> Path:
        """The folder a new run of this name would get; UsageError if the name is bad or taken."""
        check_name(name)
        path = runs_dir() / name
        if path.exists():
            raise UsageError(f"run {name!r} already exists in {runs_dir()}; use --resume to continue it or pick another --run")
        return path

    @classmethod
    def open(cls, name: str | None) -> "Run":
        """An existing run by name; None or 'latest' is the most recently changed one."""
        root = runs_dir()
        if name in (None, "latest"):
            candidates = [p for p in root.glob("*/meta.json")] if root.exists() else []
            if not candidates:
                raise UsageError(f"no runs in {root}; start one with `evotune search`")
            return cls(max(candidates, key=lambda p: (p.parent / "trials.jsonl").stat().st_mtime
                           if (p.parent / "trials.jsonl").exists() else p.stat().st_mtime).parent)
        check_name(name)
        path = root / name
        if path.is_dir() and any((path / f).exists() for f in ("trials.jsonl", "trials.jsonl.gz")) \
                and not (path / "meta.json").exists():
            raise DamagedRun(f"run {name!r} is damaged: {path / 'meta.json'}: missing")
        if not (path / "meta.json").exists():
            known = sorted(p.parent.name for p in root.glob("*/meta.json")) if root.exists() else []
            hint = f"; known: {', '.join(known[-8:])}" if known else ""
            raise UsageError(f"no run named {name!r} in {root}{hint}")
        return cls(path)

    # ---------------------------------------------------------------- records
    def meta(self) -> dict:
        """meta.json as a dict; DamagedRun if it is not a JSON object."""
        meta = self.read_json("meta.json")
        if not isinstance(meta, dict):
            raise DamagedRun(f"{self.path / 'meta.json'}: not a JSON object (a {_json_kind(meta)})")
        return meta

    def problem_and_shape(self):
        """(problem, shape) the run searched, from meta.json; DamagedRun naming the field that is wrong."""
        from ..problems import get_problem

        meta, where = self.meta(), self.path / "meta.json"
        why = meta_fault(meta)
        if why:
            raise DamagedRun(f"{where}: {why}")
        problem, shape = get_problem(meta["family"]), meta["shape"]
        try:
            return problem, problem.shape_from_dict(shape)
        except KeyError as e:
            raise DamagedRun(f"{where}: 'shape' has no {e.args[0]!r}") from None
        except (TypeError, ValueError, UsageError) as e:  # a field of the wrong type or out of range
            raise DamagedRun(f"{where}: 'shape': {e}") from None

    def write_json(self, filename: str, obj) -> None:
        # A temporary name of its own: agents sharing the run may write the same file at once.
        tmp = self.path / f".{filename}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp"
        try:
            tmp.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n")
            os.replace(tmp, self.path / filename)  # never a half-written file
        finally:
            tmp.unlink(missing_ok=True)

    def read_json(self, filename: str):
        path = self.path / filename
        if not os.path.lexists(path):
            raise DamagedRun(f"{path}: missing")
        data = read_input(path, f"run's {filename}", MAX_META_BYTES, DamagedRun)
        try:
            return json.loads(data)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise DamagedRun(f"{path}: not valid JSON ({e})") from None
        except RecursionError:
            raise DamagedRun(f"{path}: not valid JSON (nested too deeply)") from None

    def append_trial(self, record: dict) -> None:
        with self._log_locked() as f:
            _append_line(f, record)

    @contextlib.contextmanager
    def _log_locked(self):
        """trials.jsonl opened for appending, under an exclusive lock that other agents' appends respect."""
        with open(self.trials_path, "ab+", buffering=0) as f:
            if fcntl is not None:
                fcntl.flock(f.fileno(), fcntl.LOCK_EX)  # released when the file closes, or the process dies
            yield f

    def tail(self) -> "TrialTail":
        """A reader of the records appended since it last read (by this process or any other)."""
        return TrialTail(self.trials_path)

    def append_missing(self, records: list[dict], tail: "TrialTail", known: set[int]) -> list[dict]:
        """Under the log's lock, read what was appended since `tail` last read, then append those of `records`
        whose trial number is neither in `known` nor among the lines just read. Returns both: the lines read,
        then the ones appended. (How an agent copies other hosts' records into this host's log exactly once.)"""
        with self._log_locked() as f:
            new = tail.read()
            have = set(known) | {r.get("number") for r in new}
            added = [r for r in records if r.get("number") not in have]
            for r in added:
                _append_line(f, r)
                have.add(r.get("number"))
        return new + added

    @contextlib.contextmanager
    def lock(self, name: str = "ask"):
        """An exclusive lock shared by the agents of this run on this host (a flock on .NAME.lock in the folder)."""
        with open(self.path / f".{name}.lock", "a+b") as f:
            if fcntl is not None:
                fcntl.flock(f.fileno(), fcntl.LOCK_EX)
            yield

    def trials(self) -> list[dict]:
        """Every recorded trial. A line that starts a JSON object but breaks off is a torn write (a writer
        killed mid-line) and is skipped; any other line that is not a trial record is damage: DamagedRun
        names its line."""
        data, where = self._records_bytes()
        out = []
        for number, line in enumerate(data.split(b"\n"), start=1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except (ValueError, RecursionError):
                if line.lstrip().startswith(b"{"):  # torn: every record is written as one line starting with {
                    continue
                raise DamagedRun(f"{where}:{number}: not JSON") from None
            why = record_fault(rec)
            if why:
                raise DamagedRun(f"{where}:{number}: {why}")
            out.append(rec)
        return out

    def update_summary(self, records: list[dict] | None = None) -> dict | None:
        """Rewrite pareto.json and best.json from `records` (default: all of trials.jsonl); return the best or None."""
        if records is None:
            records = self.trials()
        front = pareto_front(records)
        self.write_json("pareto.json", front)
        top = final_best(records, read_beside(self.path))
        if top is not None:
            self.write_json("best.json", top)
        return top

    def best(self) -> dict:
        """The run's best (best.final_best: its closing re-timing's winner, else the fastest recorded trial)."""
        top = final_best(self.trials(), read_beside(self.path))
        if top is None:
            raise EvotuneError(f"run {self.run_id!r} has no trial that passed the correctness gate")
        return top

    def trial(self, number: int) -> dict:
        for rec in self.trials():
            if rec.get("number") == number:
                return rec
        raise UsageError(f"run {self.run_id!r} has no trial number {number}")

    def config_of(self, rec: dict, problem):
        """The Config of record `rec` (a trial of this run), once its knobs are `problem`'s, with values its
        template accepts; DamagedRun naming the trial and the knob otherwise (nothing is compiled or written)."""
        from ..space.searchspace import Config, config_fault

        why = config_fault(rec["config"], problem.knob_domains())
        if why:
            raise DamagedRun(f"run {self.run_id!r}, trial {rec['number']}: its config is not one of "
                             f"{problem.family}: {why}")
        return Config.from_dict(rec["config"])

    def select(self, which: str, purpose: str, require_pass: bool = True, hint: str = "") -> dict:
        """The record `which` names ('best' or a trial number), for `purpose` (a command's name). With
        `require_pass`, a trial that did not pass the gate (pruned, failed to compile, wrong, ...) is refused:
        its kernel is not one to replay or export."""
        if which == "best":
            return self.best()
        if not re.fullmatch(r"[0-9]{1,12}", which.strip()):
            raise UsageError(f"{purpose} takes 'best' or a trial number, not {which[:40]!r}")
        rec = self.trial(int(which))
        status = rec["result"]["status"]
        if require_pass and status != "ok":
            raise EvotuneError(f"trial {rec['number']} of run {self.run_id} did not pass ({status}); "
                               f"nothing to {purpose}{hint}")
        return rec


# ---------------------------------------------------------------- the run a search writes to
# The databases Optuna's RDBStorage keeps studies in (a URL's scheme before any +driver).
STORAGE_SCHEMES = ("postgresql", "mysql", "sqlite")


def check_storage_url(storage: str | None) -> str | None:
    """`--storage` as given, once it reads as a database URL; UsageError otherwise."""
    if storage is None:
        return None
    try:
        from sqlalchemy.engine import make_url

        url = make_url(storage)
    except Exception:  # SQLAlchemy's ArgumentError and kin
        url = None
    if url is None or not url.drivername:
        raise UsageError(f"--storage {storage[:80]!r}: not a database URL (e.g. postgresql://user@host:5432/evotune)")
    if url.get_backend_name() not in STORAGE_SCHEMES:
        raise UsageError(f"--storage {redact_url(storage)[:80]!r}: scheme {url.drivername[:40]!r} is not a database "
                         f"Optuna keeps studies in; use {', '.join(s + '://' for s in STORAGE_SCHEMES)}")
    return storage


def resumed_family(run: str | None, resume: bool) -> str | None:
    """The family of the run a `search --resume` continues; None when not resuming or there is no such run
    (the resume itself then says so)."""
    if not (resume and run):
        return None
    try:
        return Run.open(run).meta().get("family")
    except EvotuneError:
        return None


def remote_meta(run: str | None, resume: bool, storage: str | None) -> dict | None:
    """The meta of a run to join: resuming with --storage a run that has no folder on this host."""
    if not (resume and run and storage):
        return None
    check_name(run)
    if (runs_dir() / run / "meta.json").exists():
        return None
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    store = Run(runs_dir() / run, storage).storage()
    if run not in optuna.study.get_all_study_names(storage=store):
        return None  # Run.open then says there is no such run
    meta = optuna.load_study(study_name=run, storage=store).user_attrs.get("meta")
    return meta if isinstance(meta, dict) else None


def run_to_continue(run: str | None, resume: bool, storage: str | None, remote: dict | None,
                    shape_spec: str) -> Run | None:
    """The run a `search --resume` continues (this host's folder, or one made from the study to join),
    checked against the shape; None for a new run, whose name is checked here, before the slow worker start."""
    if not resume:
        if run is not None:
            Run.check_new_name(run)
            if storage is not None:
                Run.check_study_free(run, storage)
        return None
    if not run:
        raise UsageError("--resume needs --run NAME")
    if remote is not None:  # another host created the run: join its study
        import socket

        _check_resumed_shape(run, remote.get("shape_spec"), shape_spec)
        return Run.join(run, storage, {"joined": {"host": socket.gethostname(),
                                                  "at": dt.datetime.now().isoformat(timespec="seconds")}})
    rn = Run.open(run)
    _check_resume_storage(rn, storage)
    _check_resumed_shape(run, rn.meta().get("shape_spec"), shape_spec)
    return rn


def _check_resumed_shape(run: str, searched, shape_spec: str) -> None:
    if searched != shape_spec:
        raise UsageError(f"run {run!r} searched {searched}, not {shape_spec}")


def _check_resume_storage(rn: Run, storage: str | None) -> None:
    if storage is not None and (rn.storage_url is None or redact_url(storage) != redact_url(rn.storage_url)):
        raise UsageError(f"run {rn.run_id!r} keeps its study in {rn.study_place}, not {redact_url(storage)}")
    rn.use_storage(storage)
    if "***" in (rn.storage_url or ""):
        raise UsageError(f"run {rn.run_id!r} keeps its study in {rn.storage_url}: give it with --storage URL, "
                         f"password included (or keep the password in ~/.pgpass)")


def storage_meta(storage: str | None, devices: list[int]) -> dict:
    """What meta.json records of the GPUs and the study storage (its password hidden)."""
    meta: dict = {"gpus": devices}
    if storage is not None:
        meta["storage"] = redact_url(storage)  # the study's name is the run's (Run.create)
    return meta


def new_run(name: str | None, meta: dict, storage: str | None) -> Run:
    """Create the run folder; with a shared storage, also the study holding meta.json for other hosts to join."""
    rn = Run.create(name, meta).use_storage(storage)
    if storage is not None:
        rn.share_meta()
    return rn


def record_device(run: Run, info: dict) -> None:
    """meta.json's device, filled in when the GPU worker started beside a new run answers (before any trial)."""
    run.write_json("meta.json", {**run.meta(), "device": info})


def _append_line(f, record: dict) -> None:
    """Append one record to the open, locked log as a single write()."""
    line = json.dumps(record, sort_keys=True) + "\n"
    # A run killed mid-write leaves a torn last line: start on a fresh line
    # so this record is not glued to it and lost with it.
    end = f.seek(0, os.SEEK_END)
    if end > 0:
        f.seek(-1, os.SEEK_END)
        if f.read(1) != b"\n":
            line = "\n" + line
    data = line.encode()
    while data:  # a regular file takes it in one write(); loop only for a short write
        data = data[os.write(f.fileno(), data):]
    os.fsync(f.fileno())


class TrialTail:
    """Reads trials.jsonl incrementally: each read() returns the records completed since the last one.
    A line still being written waits for the next read; a torn line is skipped. (A last line with no
    newline is taken when it is a whole JSON object: no prefix of one is.)"""

    def __init__(self, path: Path):
        self.path = Path(path)
        self.offset = 0

    def read(self) -> list[dict]:
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                data = f.read()
        except FileNotFoundError:
            return []
        out = []
        lines = data.split(b"\n")
        for i, line in enumerate(lines):
            last = i == len(lines) - 1
            try:
                rec = json.loads(line) if line.strip() else None
            except ValueError:
                rec = None
                if last:
                    break  # still being written (or torn: the next record starts on a new line)
            if isinstance(rec, dict):
                out.append(rec)
            self.offset += len(line) + (0 if last else 1)
        return out


def _json_kind(value) -> str:
    return {dict: "object", list: "list", str: "string", bool: "boolean", type(None): "null"}.get(
        type(value), "number")


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def meta_fault(meta: dict) -> str | None:
    """What makes `meta` (a run's meta.json) unusable to replay or export the run, in a few words; None if nothing."""
    for key, kind, name in (("family", str, "a string"), ("shape", dict, "a JSON object")):
        if not isinstance(meta.get(key), kind):
            return f"{key!r} is {'missing' if meta.get(key) is None else 'not ' + name}"
    return None


def record_fault(rec) -> str | None:
    """What makes `rec` (one parsed line of trials.jsonl) not a trial record, in a few words; None if it is one.
    Checks what readers rely on: the number, the config, the status, and a passing trial's time and error."""
    if not isinstance(rec, dict):
        return f"not a JSON object (a {_json_kind(rec)})"
    if not isinstance(rec.get("number"), int) or isinstance(rec.get("number"), bool) or rec["number"] < 0:
        return "'number' is not a trial number"
    if not isinstance(rec.get("config"), dict):
        return f"trial {rec['number']}: 'config' is not a JSON object"
    result = rec.get("result")
    if not isinstance(result, dict) or not isinstance(result.get("status"), str):
        return f"trial {rec['number']}: 'result' has no status"
    if result["status"] == "ok":
        for key in ("time_us", "max_abs"):
            if not _is_number(result.get(key)):
                return f"trial {rec['number']} passed but its {key} is {json.dumps(result.get(key))}, not a number"
    dup = rec.get("duplicate_of")
    if dup is not None and (not isinstance(dup, int) or isinstance(dup, bool)):
        return f"trial {rec['number']}: 'duplicate_of' is not a trial number"
    return None


def list_runs(root: Path | None = None) -> list[dict]:
    """One row per run folder under `root` (default: runs_dir()), by name: shape, device, trial count, best
    time, and `damaged` (None, or what is wrong in a few words). A damaged run does not hide the others."""
    root = runs_dir() if root is None else root
    folders = sorted({p.parent for pattern in ("*/meta.json", "*/trials.jsonl", "*/trials.jsonl.gz")
                      for p in root.glob(pattern)})
    return [_run_row(Run(path)) for path in folders]


def _run_row(run: Run) -> dict:
    row = {"run": run.run_id, "shape": None, "device": None, "trials": None, "best_us": None, "damaged": None}
    try:
        meta = run.meta()
        if meta_fault(meta):
            raise DamagedRun(f"{run.path / 'meta.json'}: {meta_fault(meta)}")
        device = meta.get("device")
        row.update(shape=meta.get("shape_spec"), device=device.get("name") if isinstance(device, dict) else None)
        records = run.trials()
    except DamagedRun as e:
        row["damaged"] = str(e).replace(str(run.path) + os.sep, "", 1)  # the file relative to its run
        return row
    best = final_best(records, read_beside(run.path))
    row.update(trials=len(records), best_us=best["result"]["time_us"] if best else None)
    return row


def pareto_front(records: list[dict]) -> list[dict]:
    """Non-dominated passing trials on (time_us, max_abs), fastest first."""
    ok = ok_records(records)
    front = []
    for r in ok:
        t, e = r["result"]["time_us"], r["result"]["max_abs"]
        dominated = any(
            (o["result"]["time_us"] <= t and o["result"]["max_abs"] <= e)
            and (o["result"]["time_us"] < t or o["result"]["max_abs"] < e)
            for o in ok
        )
        if not dominated:
            front.append(r)
    return sorted(front, key=lambda r: (r["result"]["time_us"], r["result"]["max_abs"]))


def base_meta(command_line: list[str] | None = None) -> dict:
    from ..build.compile import toolchain

    try:
        tc = toolchain()
    except Exception:  # NVRTC missing: the compile step will say so
        tc = {}
    # `python -m evotune` puts the package path in argv[0]: record what a user would type.
    argv = command_line if command_line is not None else ["evotune"] + sys.argv[1:]
    return {
        "command_line": " ".join(argv),
        "git_sha": git_sha(),
        "versions": {"evotune": __version__, "python": sys.version.split()[0], **tc},
    }
