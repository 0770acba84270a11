"""A test-only kernel family: the real attention kernel with a fault planted in its source.

The extra search parameter `fault` picks the fault; every other knob means what it means to
the attention family, and `fault: none` gives the attention kernel's own instantiation. The
fault is code inserted right after the opening brace of the extern "C" entry point (the hang also
puts a few file-scope declarations ahead of the block), so it is all that differs from a healthy config:

    oob_write      one thread stores 2 TiB past the output buffer: an illegal address, which
                   poisons the CUDA context (the worker answers and exits; a fresh one follows)
    hang           the first CTA spins on a volatile flag that nothing sets. Bounded anyway: it
                   gives up HANG_BOUND_S after the module's first launch (one deadline shared by
                   every launch), so a GPU is never left spinning if killing the worker fails;
                   then that CTA returns with its tile unwritten, so the config still fails
    wrong_values   the softmax scale is 25% too large: finite, plausible, wrong
    unwritten      the last CTA returns at once: its tile keeps the NaN poison
    compile_error  a statement naming an undeclared identifier: NVRTC rejects it

It is loaded as a plugin family, `tests.fault_family:PROBLEM` (tests/data/attention-faults.yaml
names it), through the same code path as any family outside evotune.
"""

from __future__ import annotations

import re

from evotune.problems.attention import AttentionProblem

FAULTS = ("none", "oob_write", "hang", "wrong_values", "unwritten", "compile_error")
FAMILY = "tests.fault_family:PROBLEM"

# Far longer than the search's --timeout in the GPU tests (12 s), far shorter than a stuck machine.
HANG_BOUND_S = 30

PLANTED_IDENTIFIER = "evotune_planted_compile_error"

_DECLARATIONS = {
    "hang": """\
// planted fault "hang": nothing ever sets the release flag; the deadline is set once per module.
__device__ volatile int evotune_fault_release = 0;
__device__ unsigned long long evotune_fault_deadline = 0;
__device__ __forceinline__ unsigned long long evotune_fault_now_ns() {
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}
""",
}


def _body(fault: str) -> str:
    """The statements planted at the top of the entry point for `fault`."""
    first_cta = "blockIdx.x == 0 && blockIdx.y == 0 && blockIdx.z == 0"
    if fault == "oob_write":
        return f"""\
    // planted fault "oob_write": a store 2 TiB past the output buffer.
    if (threadIdx.x == 0 && {first_cta}) {{ ((volatile unsigned short*)o)[1ll << 40] = 1; }}
"""
    if fault == "hang":
        return f"""\
    // planted fault "hang": spin until released (never), giving up at the module's shared deadline.
    if ({first_cta}) {{
        const unsigned long long mine = evotune_fault_now_ns() + {HANG_BOUND_S}ull * 1000000000ull;
        const unsigned long long first = atomicCAS(&evotune_fault_deadline, 0ull, mine);
        const unsigned long long deadline = first ? first : mine;
        while (evotune_fault_release == 0 && evotune_fault_now_ns() < deadline) {{ __nanosleep(1000); }}
        return;  // this CTA's tile stays unwritten: a run that outlives the watchdog still fails the gate
    }}
"""
    if fault == "wrong_values":
        return """\
    // planted fault "wrong_values": the softmax scale is 25% too large.
    scale_log2 *= 1.25f;
"""
    if fault == "unwritten":
        return """\
    // planted fault "unwritten": the last CTA returns without writing its tile.
    if (blockIdx.x == gridDim.x - 1 && blockIdx.y == gridDim.y - 1 && blockIdx.z == gridDim.z - 1) { return; }
"""
    if fault == "compile_error":
        return f"""\
    // planted fault "compile_error": an undeclared identifier.
    {PLANTED_IDENTIFIER} += 1;
"""
    raise ValueError(f"unknown fault {fault!r}; faults: {', '.join(FAULTS)}")


def plant(block: str, entry: str, fault: str) -> str:
    """`block` (an instantiation with one extern "C" entry point named `entry`) with `fault` planted."""
    if fault == "none":
        return block
    body = _body(fault)
    extern = block.index('extern "C"')
    match = re.compile(rf"\b{re.escape(entry)}\s*\(").search(block, extern)
    if match is None:
        raise ValueError(f"no entry point {entry!r} in the instantiation")
    brace = block.index("{", match.end()) + 1  # the parameter list holds no braces
    return _DECLARATIONS.get(fault, "") + block[:brace] + "\n" + body + block[brace:].lstrip("\n")


class FaultProblem(AttentionProblem):
    """The attention family with `fault` planted; everything but the instantiation is attention's."""

    family = FAMILY

    def instantiation(self, config, shape) -> str:
        fault = config.get("fault", "none")
        return plant(super().instantiation(config, shape), self.entry_name, fault)


PROBLEM = FaultProblem()
