"""Search agents: `evotune search --gpus 0,1` runs one agent process per entry, each running the
search loop (search.SearchLoop) with its own GPU worker on its device, all on one run folder and one Optuna study
(shared.py says how they share it). `--gpus 0,0` puts two agents on one GPU: they measure in
turn or at once as the driver schedules them, so their timings are noisier than one agent's.

The parent process (the CLI) never touches the GPU: it starts the agents, follows the run's
records for its display, and passes Ctrl-C on. The agents run in a process group of their own,
so a Ctrl-C at the terminal reaches the parent alone, which sends each agent one SIGINT: the agent
finishes the candidate it is measuring, records it, closes the proposals queued behind it as FAIL
and exits. A second Ctrl-C sends a second SIGINT: the agents stop at once, as a single search does
on Ctrl-C (the candidates in flight are lost and measured again on resume). An agent whose parent
dies stops as on the first SIGINT.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import socket
import sys
import time
import traceback
from dataclasses import dataclass, field, replace
from typing import Callable

INTERRUPTED = 130  # an agent's exit code after Ctrl-C


@dataclass(frozen=True)
class AgentSpec:
    """What one agent process needs; everything in it is pickled to the spawned process."""

    label: str                 # names the agent in records ("host:gpu1")
    device: int                # CUDA device index of its GPU worker
    run_path: str
    storage: str | None        # the study's storage URL as typed (password included); None: what meta.json says
    problem: object
    shape: object
    space: object
    options: object            # search.SearchOptions
    timeout_s: float = 60.0    # per candidate on the GPU
    # (spec) -> (evaluate, close); None: a GPUWorker on `device`. A module-level function (pickled by name).
    evaluator: Callable | None = field(default=None, compare=False)


def agent_label(device: int, index: int = 0) -> str:
    """The agent's name in records: host and GPU, and which agent of that GPU when it has several."""
    return f"{socket.gethostname()}:gpu{device}" + (f".{index}" if index else "")


def specs_for(devices: list[int], options, **common) -> list[AgentSpec]:
    """One AgentSpec per entry of --gpus, in order (a repeated device gets a second label). Agent i samples
    with seed options.seed + i: with one seed they would all propose the same configs and wait on each other."""
    seen: dict[int, int] = {}
    out = []
    for i, d in enumerate(devices):
        out.append(AgentSpec(label=agent_label(d, seen.get(d, 0)), device=d,
                             options=replace(options, seed=options.seed + i), **common))
        seen[d] = seen.get(d, 0) + 1
    return out


def gpu_evaluator(spec: AgentSpec):
    from .loop import worker_evaluator
    from ..gpu.workers import GPUWorker

    worker = GPUWorker(device=spec.device, timeout_s=spec.timeout_s)
    return worker_evaluator(worker, spec.problem, spec.shape), worker.close


_sigints = [0]


def _on_sigint(signum, frame):
    # The first SIGINT asks the search to stop after the candidate in flight (run_search's should_stop);
    # the second stops it at once; later ones must not cut short the cleanup that records what finished.
    _sigints[0] += 1
    if _sigints[0] == 2:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        raise KeyboardInterrupt


def agent_main(spec: AgentSpec, results) -> None:
    """An agent process: search the run until it has its trials; report (label, status, payload) on `results`."""
    parent = os.getppid()
    os.setpgrp()  # out of the terminal's foreground group: Ctrl-C reaches the parent, which passes it on
    signal.signal(signal.SIGINT, _on_sigint)
    from ..errors import EvotuneError
    from ..records.runs import Run
    from .loop import SearchLoop

    def should_stop() -> bool:
        return _sigints[0] > 0 or os.getppid() != parent

    code, message = 0, None
    try:
        evaluate, close = (spec.evaluator or gpu_evaluator)(spec)
        try:
            summary = SearchLoop(spec.problem, spec.space, spec.shape, Run(spec.run_path, spec.storage), evaluate,
                                 spec.options, should_stop=should_stop, agent=spec.label).run()
        finally:
            close()
        if should_stop():
            code, message = INTERRUPTED, (spec.label, "stopped", summary)
        else:
            message = (spec.label, "done", summary)
    except KeyboardInterrupt:
        code, message = INTERRUPTED, (spec.label, "interrupted", None)
    except EvotuneError as e:
        code, message = 1, (spec.label, "error", str(e))
    except Exception as e:
        code, message = 1, (spec.label, "error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}")
    try:
        results.put(message)
        results.close()
        results.join_thread()
    except Exception:
        pass
    sys.exit(code)


class Agents:
    """The agent processes of one search, started together."""

    def __init__(self, specs: list[AgentSpec]):
        ctx = mp.get_context("spawn")  # no fork: the parent holds threads (the live display, the storage's)
        self.results = ctx.Queue()
        self.specs = list(specs)
        self.procs = {s.label: ctx.Process(target=agent_main, args=(s, self.results), name=f"evotune-{s.label}")
                      for s in self.specs}
        self.outcomes: dict[str, tuple[str, object]] = {}  # label -> (status, search.SearchSummary or message)

    def start(self) -> "Agents":
        for p in self.procs.values():
            p.start()
        return self

    def alive(self) -> list[str]:
        return [label for label, p in self.procs.items() if p.is_alive()]

    def collect(self) -> None:
        """Take in the agents' reports that have arrived."""
        while True:
            try:
                label, status, payload = self.results.get_nowait()
            except Exception:  # queue.Empty
                return
            self.outcomes[label] = (status, payload)

    def interrupt(self) -> None:
        """One SIGINT to each live agent: the first asks it to stop after the candidate it is measuring, the
        second to stop at once."""
        for p in self.procs.values():
            if p.is_alive():
                try:
                    os.kill(p.pid, signal.SIGINT)
                except ProcessLookupError:
                    pass

    def wait(self, timeout: float | None = None) -> bool:
        """Wait for every agent to exit (at most `timeout` seconds); True when all have."""
        deadline = None if timeout is None else time.time() + timeout
        while self.alive() and (deadline is None or time.time() < deadline):
            self.collect()  # drained as they come: an agent exits only once its report is through the pipe
            live = next((p for p in self.procs.values() if p.is_alive()), None)  # the last may exit meanwhile
            if live is not None:
                live.join(0.2)
        self.collect()
        return not self.alive()

    def kill(self) -> None:
        for p in self.procs.values():
            if p.is_alive():
                p.kill()
        for p in self.procs.values():
            p.join(5)

    def failures(self) -> dict[str, str]:
        """label -> why, for each agent that ended with an error or died (a crash, a kill)."""
        self.collect()
        out = {}
        for label, p in self.procs.items():
            status, payload = self.outcomes.get(label, (None, None))
            if status == "error":
                out[label] = str(payload).splitlines()[0]
            elif status is None and p.exitcode not in (None, 0, INTERRUPTED):
                out[label] = f"exited with code {p.exitcode}"
        return out
