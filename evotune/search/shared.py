"""One search agent's view of a study that other agents share: processes on this host (one per
GPU, same run folder) and processes on other hosts (same RDB storage, each host with its own run
folder).

What the agents share, and how:

- Claims. Right after study.ask() an agent tags the trial with the user attr "evotune":
  {"digest", "agent", "claim", "log"}; claim is true when the agent will compile and measure the
  config. A config is taken while a live agent's RUNNING trial claims it, or once a record has it.
  The agents of one run folder ask-and-tag under the folder's flock (Run.lock), so they never
  claim a config twice. Agents of different folders (hosts) can ask the same config in the same
  instant (between one's ask and its tag): the lower trial number wins. The other agent sees the
  claim before compiling, or at the latest before telling: then its measurement is recorded with
  counted=false and duplicate_of the winner. A race costs at most one extra measurement, never a
  record, and never a second counted result for a digest.
- Records. Each record is also stored on its trial (user attr "record") before the trial is told.
  A folder's trials.jsonl is the truth for the agents that write to it ("log" in the tag names the
  folder): it is read incrementally. Records of agents writing to other folders come from the study
  and are appended to this folder's trials.jsonl once (Run.append_missing), so every folder ends up
  with the whole run.
- Liveness. A trial left RUNNING by a dead agent must not keep its config claimed. Agents on this
  host are alive while their process is (pid and start time, from the agent id). Agents on other
  hosts write a heartbeat into the study's user attrs every BEAT_S; one silent for STALE_S is dead
  (so the hosts' clocks must agree to within a few seconds: NTP). An untagged RUNNING trial (asked,
  then the agent died before tagging it) is dead once no other agent is alive, or after STALE_S.
  Dead agents' RUNNING trials are told FAIL by whichever agent notices first.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from dataclasses import dataclass
from pathlib import Path

TAG = "evotune"          # trial user attr: {"digest", "agent", "claim"}
RECORD = "record"        # trial user attr: the trial's record, as in trials.jsonl
AGENT_KEY = "agent:"     # study user attr prefix: one entry per agent that ever ran on the study
BEAT_S = 10.0            # heartbeat period of an agent
STALE_S = 60.0           # an agent on another host silent this long is dead
REGISTRY_MAX_AGE_S = 2.0  # how old a cached read of the agents' entries may be


def _host_id() -> str:
    """Names the process-id space this process lives in: host name, boot, and pid namespace (two containers
    on one machine may share a host name, never a pid namespace); agents with the same id can see each
    other's processes."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()[:8]
    except OSError:
        boot = "noboot"
    try:
        ns = str(os.stat("/proc/self/ns/pid").st_ino)
    except OSError:
        ns = "0"
    return f"{socket.gethostname()}-{boot}-{ns}"


def _start_ticks(pid: int) -> str | None:
    """A process's start time (clock ticks since boot), which tells a live pid from a reused one; None if it
    is gone or a zombie (killed, not yet reaped)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return None if fields[0] in ("Z", "X") else fields[19]


def pid_alive(pid: int, start: str) -> bool:
    if Path("/proc/self/stat").exists():
        return _start_ticks(pid) == start if start else _start_ticks(pid) is not None
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


@dataclass(frozen=True)
class Agent:
    """Who is asking: host (see _host_id), process id and start time; `label` names it in records."""

    host: str
    pid: int
    start: str
    label: str

    @classmethod
    def current(cls, label: str | None = None) -> "Agent":
        host = _host_id()
        pid = os.getpid()
        return cls(host=host, pid=pid, start=_start_ticks(pid) or "", label=label or f"{socket.gethostname()}:{pid}")

    @property
    def id(self) -> str:
        return f"{self.host}/{self.pid}/{self.start}"


def _parse_id(agent_id: str) -> tuple[str, int, str] | None:
    try:
        host, pid, start = agent_id.rsplit("/", 2)
        return host, int(pid), start
    except (AttributeError, ValueError):
        return None


class SharedStudy:
    """The records, claims and live agents of a study as one agent sees them; refresh() brings it up to date."""

    def __init__(self, run, label: str | None = None):
        self.run = run
        self.me = Agent.current(label)
        self.log_id = run.log_id
        self.study = None
        self.records: dict[int, dict] = {}   # trial number -> record (this folder's log, and other folders')
        self.firsts: dict[str, dict] = {}    # digest -> its first record (duplicate_of None)
        self.counted: set[int] = set()       # trial numbers of counted records
        self.admitted_seen: set[str] = set()  # digests with a counted record
        self.claims: dict[str, list[int]] = {}  # digest -> numbers of other live agents' RUNNING claims
        self.mine: set[int] = set()          # this agent's trials asked and not yet told
        self.from_others = 0                 # records of other agents taken in since start()
        self._tail = run.tail()
        self._finished: set[int] = set()     # trial numbers seen finished (they never change again)
        self._untagged_since: dict[int, float] = {}
        self._registry: dict[str, dict] = {}
        self._registry_read = -1e9
        self._beat: threading.Thread | None = None
        self._stop = threading.Event()
        for rec in self._tail.read():
            self._add(rec, mine=True)  # the log as it was: not news from other agents

    # ---------------------------------------------------------------- records
    def _add(self, rec: dict, mine: bool = False) -> bool:
        number = rec.get("number")
        if number is None or number in self.records:
            return False
        self.records[number] = rec
        digest = rec.get("digest")
        if rec.get("duplicate_of") is None and digest is not None:
            prior = self.firsts.get(digest)
            if prior is None or (rec.get("counted") and not prior.get("counted")):
                self.firsts[digest] = rec
        if rec.get("counted"):
            self.counted.add(number)
            self.admitted_seen.add(digest)
        if not mine:
            self.from_others += 1
        return True

    def add(self, rec: dict) -> None:
        """Take in this agent's own new record."""
        self._add(rec, mine=True)

    @property
    def evaluated(self) -> int:
        return len(self.counted)

    # ---------------------------------------------------------------- claims
    def claimed_elsewhere(self, digest: str, below: int | None = None) -> int | None:
        """The lowest trial number by which another live agent claims `digest` (only numbers below `below`)."""
        numbers = [n for n in self.claims.get(digest, ()) if below is None or n < below]
        return min(numbers) if numbers else None

    def other_claims(self, below: int | None = None) -> int:
        """Configs other live agents are measuring (claimed below trial `below`) that have no record yet."""
        return sum(1 for d, ns in self.claims.items()
                   if d not in self.admitted_seen and any(below is None or n < below for n in ns))

    def conflict(self, digest: str, number: int) -> int | None:
        """Why trial `number`, which measured `digest`, must not count: the counted record of another trial, or
        a lower-numbered live claim by another agent (a race between agents); None when it counts."""
        first = self.firsts.get(digest)
        if first is not None and first.get("counted") and first.get("number") != number:
            return first["number"]
        return self.claimed_elsewhere(digest, below=number)

    def tag(self, trial, digest: str, claim: bool) -> None:
        self.mine.add(trial.number)
        trial.set_user_attr(TAG, {"digest": digest, "agent": self.me.id, "claim": bool(claim), "log": self.log_id})

    def store(self, trial, record: dict) -> None:
        """Put the record on its trial, for other hosts' agents (best effort: a trial another agent judged dead
        and closed takes no more attrs; the record still goes to this folder's log)."""
        try:
            trial.set_user_attr(RECORD, record)
        except Exception:
            pass

    def told(self, number: int) -> None:
        self.mine.discard(number)

    # ---------------------------------------------------------------- lifecycle
    def start(self, study) -> None:
        """Join the study: register this agent, start its heartbeat, close trials dead agents left RUNNING."""
        self.study = study
        self._write_entry({"started": time.time()})
        self._beat = threading.Thread(target=self._beat_loop, name="evotune-heartbeat", daemon=True)
        self._beat.start()
        self.refresh(judge=True)

    def close(self) -> None:
        """Leave the study: stop the heartbeat and mark this agent ended (best effort)."""
        self._stop.set()
        if self._beat is not None:
            self._beat.join(5)
        if self.study is not None:
            try:
                self._write_entry({"ended": time.time()})
            except Exception:
                pass

    def _write_entry(self, extra: dict) -> None:
        entry = {"host": self.me.host, "pid": self.me.pid, "start": self.me.start, "label": self.me.label,
                 "beat": time.time(), **extra}
        self.study.set_user_attr(AGENT_KEY + self.me.id, entry)

    def _beat_loop(self) -> None:
        started = time.time()
        while not self._stop.wait(BEAT_S):
            try:
                self._write_entry({"started": started})
            except Exception:  # a storage hiccup: the next beat retries
                pass

    # ---------------------------------------------------------------- refresh
    def refresh(self, judge: bool = True) -> None:
        """Take in new records (this folder's log, other folders' trials) and the live claims; with `judge`, close
        RUNNING trials whose agent is dead."""
        from optuna.trial import TrialState

        for rec in self._tail.read():
            self._add(rec)
        mirror, running = [], []
        for t in self.study.get_trials(deepcopy=False):
            if t.number in self._finished:
                continue
            if t.state.is_finished():
                self._finished.add(t.number)
                self._untagged_since.pop(t.number, None)
                rec, tag = t.user_attrs.get(RECORD), t.user_attrs.get(TAG)
                # The records of agents writing to this folder's log come from the log (the truth for them: a
                # record torn by a kill is lost, and its config measured again); other folders' (other hosts')
                # from the study, copied into the log.
                if rec is not None and isinstance(tag, dict) and tag.get("log") != self.log_id \
                        and rec.get("number") not in self.records:
                    mirror.append(rec)
            elif t.state == TrialState.RUNNING and t.number not in self.mine:
                running.append(t)
        if mirror:
            for rec in self.run.append_missing(mirror, self._tail, set(self.records)):
                self._add(rec)
        self.claims = self._judge(running, close=judge)

    def _judge(self, running: list, close: bool) -> dict[str, list[int]]:
        from optuna.trial import TrialState

        now = time.monotonic()
        untagged = [t for t in running if not isinstance(t.user_attrs.get(TAG), dict)]
        remote = any(self._host((t.user_attrs.get(TAG) or {}).get("agent")) != self.me.host for t in running)
        # Agents register before they ask, and the trials were listed before this read: every agent that
        # owns one of them is in the registry read here.
        registry = self._agents(fresh=bool(untagged) or (remote and now - self._registry_read > REGISTRY_MAX_AGE_S))
        others = untagged and any(self._running(aid, entry) for aid, entry in registry.items() if aid != self.me.id)
        claims: dict[str, list[int]] = {}
        dead = []
        for t in running:
            tag = t.user_attrs.get(TAG)
            if not isinstance(tag, dict):
                since = self._untagged_since.setdefault(t.number, now)
                if not others or now - since > STALE_S:
                    dead.append(t)
                continue
            # A trial of this very agent that is not among its own: left by an earlier search in this process.
            alive = tag.get("agent") != self.me.id and self._alive(tag.get("agent"), registry.get(tag.get("agent")))
            if alive is None:  # an agent not (yet) in the registry: give it STALE_S from when first seen
                alive = now - self._untagged_since.setdefault(t.number, now) <= STALE_S
            if not alive:
                dead.append(t)
            elif tag.get("claim"):
                claims.setdefault(tag.get("digest"), []).append(t.number)
        if close:
            for t in dead:
                try:
                    self.study.tell(t.number, state=TrialState.FAIL, skip_if_finished=True)
                except Exception:  # another agent closed it first, or it just finished
                    pass
        return claims

    def _agents(self, fresh: bool) -> dict[str, dict]:
        if fresh or time.monotonic() - self._registry_read > REGISTRY_MAX_AGE_S * 5:
            attrs = self.study.user_attrs
            self._registry = {k[len(AGENT_KEY):]: v for k, v in attrs.items()
                              if k.startswith(AGENT_KEY) and isinstance(v, dict)}
            self._registry_read = time.monotonic()
        return self._registry

    def _host(self, agent_id) -> str | None:
        parsed = _parse_id(agent_id) if isinstance(agent_id, str) else None
        return parsed[0] if parsed else None

    def _alive(self, agent_id, entry: dict | None) -> bool | None:
        """Whether the agent that tagged a trial is alive; None when nothing is known of it."""
        parsed = _parse_id(agent_id) if isinstance(agent_id, str) else None
        if parsed is None:
            return None
        host, pid, start = parsed
        if host == self.me.host:  # this host: the process itself says (a cached entry may be out of date)
            return pid_alive(pid, start)
        if entry is None:
            return None
        return not entry.get("ended") and time.time() - float(entry.get("beat", 0)) < STALE_S

    def _running(self, agent_id: str, entry: dict) -> bool:
        """Whether a registered agent is searching now (its entry is fresh: read just before)."""
        if entry.get("ended"):
            return False
        return bool(self._alive(agent_id, entry))
