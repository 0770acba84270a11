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

    def launch_for(self, inputs, out):
        def launch():
            self.run_into(inputs, out)

        return launch

    def _compute(self, inputs, out, scale: float = 1.0) -> None:
        self.worked += 1
        out.copy_((self.problem.reference(self.shape, inputs) * scale).to(out.dtype))

    def run_into(self, inputs, out) -> None:
        import torch

        self.launches += 1
        fault = self.fault
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
