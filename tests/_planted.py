"""Python stand-ins for the kernels that cheat the gate, for the CPU tests of evaluate.py's checks
(tests/test_evaluate.py) and of the search over the fault family (tests/test_faults.py).

Each stand-in is a `launch_for(inputs, out)` as evaluate.evaluate_launches takes it: the "correct"
one copies the family's fp32 reference into `out`; each fault does what its CUDA twin in
tests/fault_family.py does, in Python on CPU tensors. `cpu_timer` stands in for
evaluate.time_launches and reports a time that shrinks with the work the launches skip, so a
cheating kernel looks as fast as it did on the GPU in issue 11.
"""

from __future__ import annotations

from evotune.records.result import Timing

CORRECT = "none"
GATE_FAULTS = ("skip_on_repeat", "stateful_counter", "input_mutation", "write_past_o", "write_before_o",
               "write_nan_past_o", "wrong_when_timed")
# Kernels that remember their own answers (issue 38), each as its CUDA twin in tests/fault_family.py does:
#   memo_o            returns at once when O's first elements still hold what it last wrote there
#   memo_fingerprint  when a fingerprint of the inputs (Q's first elements) matches the last launch's, copies the
#                     answer it kept in private memory into O instead of computing
#   memo_late         memo_o, but only after its first STATEFUL_LAUNCHES launches (more than the gate checks)
#   memo_cache        after its first STATEFUL_LAUNCHES launches, keeps one answer per fingerprint in two slots (as
#                     many as the timing's input sets) and copies the one whose fingerprint matches
MEMO_FAULTS = ("memo_o", "memo_fingerprint", "memo_late", "memo_cache")
MEMO_ELEMENTS = 4  # how many leading elements of O (memo_o) or of Q (the fingerprints) a memo compares
STATEFUL_LAUNCHES = 16  # as tests/fault_family.py: more than the gate's checked launches before timing

# cpu_timer's launches: warm-up, then each replay (a "captured graph" of REPLAY_LAUNCHES launches).
WARMUP_LAUNCHES, REPLAY_LAUNCHES, REPLAYS = 10, 4, 3
FULL_LAUNCH_US = 10.0  # what a launch that does all its work "takes" under cpu_timer


def on_cpu(problem):
    """`problem` with its inputs made on the CPU (the gate calls make_inputs without a device)."""

    class OnCPU(type(problem)):
        def make_inputs(self, shape, seed, device="cpu", pattern="normal"):
            return super().make_inputs(shape, seed, device="cpu", pattern=pattern)

    return OnCPU()


def _as_bits(t):
    import torch

    return t.contiguous().view({2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def _storage_element(out, offset: int):
    """A one-element view of `out`'s storage `offset` elements from O's first element."""
    return out.as_strided((1,), (1,), out.storage_offset() + offset)


def _span(out) -> int:
    return 1 + sum((n - 1) * s for n, s in zip(out.shape, out.stride()))


class Planted:
    """The stand-in for `fault` on `problem`/`shape`: one "loaded module" (its state lives as long as
    this object, as a __device__ variable lives as long as the CUDA module). `launches` counts the
    launches, `worked` those that did the work."""

    def __init__(self, problem, shape, fault: str = CORRECT, stateful_launches: int = STATEFUL_LAUNCHES,
                 mutated: str | None = None):
        self.problem, self.shape, self.fault = problem, shape, fault
        self.stateful_launches = stateful_launches
        self.mutated = mutated  # the input input_mutation changes (default: the last tensor of the inputs)
        self.launches = self.worked = 0
        self.memo = None     # memo_o / memo_late: O's leading elements as it last wrote them
        self.answers = {}    # memo_fingerprint / memo_cache: fingerprint -> the whole answer kept

    def launch_for(self, inputs, out):
        def launch():
            self.run_into(inputs, out)

        return launch

    def _compute(self, inputs, out, scale: float = 1.0) -> None:
        self.worked += 1
        out.copy_((self.problem.reference(self.shape, inputs) * scale).to(out.dtype))

    def _remember(self, inputs, out, fresh: bool) -> None:
        """The memo faults: skip or copy a kept answer when their key matches, else compute and keep it."""
        lead = out.reshape(-1)[:MEMO_ELEMENTS] if out.is_contiguous() else out.flatten()[:MEMO_ELEMENTS]
        if self.fault in ("memo_o", "memo_late"):
            if fresh and self.memo is not None and bool((_as_bits(lead) == self.memo).all()):
                return  # O still holds what it wrote: return at once
            self._compute(inputs, out)
            self.memo = _as_bits(out.flatten()[:MEMO_ELEMENTS]).clone()
            return
        q = [t for t in inputs.values() if hasattr(t, "flatten")][0]
        key = tuple(_as_bits(q.flatten()[:MEMO_ELEMENTS]).tolist())
        if fresh and key in self.answers:
            out.copy_(self.answers[key])  # no compute: the kept answer
            return
        self._compute(inputs, out)
        if self.fault == "memo_fingerprint":
            self.answers = {}  # only the last launch's
        elif len(self.answers) >= 2:
            self.answers.pop(next(iter(self.answers)))
        self.answers[key] = out.clone()

    def run_into(self, inputs, out) -> None:
        import torch

        self.launches += 1
        fault = self.fault
        if fault in MEMO_FAULTS:
            late = fault in ("memo_late", "memo_cache")
            self._remember(inputs, out, fresh=not late or self.launches > self.stateful_launches)
            return
        if fault == "skip_on_repeat":  # computes only into the gate's NaN poison
            if bool(torch.isnan(out[(0,) * out.dim()])):
                self._compute(inputs, out)
            return
        if fault == "stateful_counter":  # a count nothing re-zeroes: later launches return at once
            if self.launches <= self.stateful_launches:
                self._compute(inputs, out)
            return
        if fault == "wrong_when_timed":  # right while checked, 1% off once the launches pile up
            self._compute(inputs, out, 1.0 if self.launches <= self.stateful_launches else 1.01)
            return
        self._compute(inputs, out)
        if fault == "input_mutation":  # after using it, flip the low bit of one element of an input
            name = self.mutated or [n for n, t in inputs.items() if isinstance(t, torch.Tensor)][-1]
            first = inputs[name][(0,) * inputs[name].dim()]
            first.view(torch.int16 if first.element_size() == 2 else torch.int32).bitwise_xor_(1)
        elif fault == "write_past_o":
            _storage_element(out, _span(out)).fill_(1.0)
        elif fault == "write_before_o":
            _storage_element(out, -1).fill_(1.0)
        elif fault == "write_nan_past_o":  # 64 KiB past O's end, and NaN: the guard compares bits
            _storage_element(out, _span(out) + 65536 // out.element_size()).fill_(float("nan"))
        elif fault != CORRECT:
            raise ValueError(f"no stand-in for fault {fault!r}")


def cpu_timer(planted: Planted):
    """A `timer(launch, reps)` for evaluate.check_timed on the CPU: WARMUP_LAUNCHES launches, then
    REPLAYS replays of REPLAY_LAUNCHES launches; the reported time is FULL_LAUNCH_US times the share of
    the timed launches that did their work (plus 0.3 us), as a GPU would measure a kernel that skips it."""

    def timer(launch, reps):
        for _ in range(WARMUP_LAUNCHES):
            launch()

        def replay():
            for _ in range(REPLAY_LAUNCHES):
                launch()

        worked_before = planted.worked
        for _ in range(REPLAYS):
            replay()
        share = (planted.worked - worked_before) / (REPLAYS * REPLAY_LAUNCHES)
        t = 0.3 + FULL_LAUNCH_US * share
        return Timing(median_us=t, p10_us=t, p90_us=t, reps=REPLAYS, launches_per_rep=REPLAY_LAUNCHES,
                      method="cpu-stand-in"), replay

    return timer
