"""A test-only kernel family: the real attention kernel with a fault planted in its source.

The extra search parameter `fault` picks the fault; every other knob means what it means to
the attention family, and `fault: none` gives the attention kernel's own instantiation. The
fault is code inserted right after the opening brace of the extern "C" entry point (input_mutation's
right before its closing brace, after the work; hang and stateful_counter also put file-scope
declarations ahead of the block), so it is all that differs from a healthy config:

    oob_write      one thread stores 2 TiB past the output buffer: an illegal address, which
                   poisons the CUDA context (the worker answers and exits; a fresh one follows)
    hang           the first CTA spins on a volatile flag that nothing sets. Bounded anyway: it
                   gives up HANG_BOUND_S after the module's first launch (one deadline shared by
                   every launch), so a GPU is never left spinning if killing the worker fails;
                   then that CTA returns with its tile unwritten, so the config still fails
    wrong_values   the softmax scale is 25% too large: finite, plausible, wrong
    unwritten      the last CTA returns at once: its tile keeps the NaN poison
    compile_error  a statement naming an undeclared identifier: NVRTC rejects it

The next faults compute correctly when the gate looks and cheat otherwise; each is caught by one
of the launch-integrity checks of evaluate.py (CAUGHT_AS gives the start of the WRONG message):

    skip_on_repeat    a CTA computes only when the first element of its own O tile is NaN (the
                      gate's poison), otherwise returns at once: issue 11's exploit, which had passed
                      every gate case and been timed at 1.79 us
    stateful_counter  a __device__ count of CTAs started, never re-zeroed: after the module's first
                      STATEFUL_LAUNCHES launches (more than the gate's checked launches) every CTA
                      but those of the first query tile returns at once
    input_mutation    after computing, one thread flips the low bit of K's first element
    write_past_o      one store of 1.0 just past O's last element (inside the allocation)
    write_before_o    one store of 1.0 just before O's first element

The faults write through the entry point's own parameters (kv_splits = 1, the mma.sync kernel:
the fault space has no other). It is loaded as a plugin family, `tests.fault_family:PROBLEM`
(tests/data/attention-faults.yaml names it), through the same code path as any family outside evotune.
"""

from __future__ import annotations

import re

from evotune.problems.attention import AttentionProblem

FAULTS = ("none", "oob_write", "hang", "wrong_values", "unwritten", "compile_error",
          "skip_on_repeat", "stateful_counter", "input_mutation", "write_past_o", "write_before_o")
FAMILY = "tests.fault_family:PROBLEM"

# How the gate reports each fault that computes correctly when checked: the start of the WRONG message.
CAUGHT_AS = {
    "skip_on_repeat": "repeat: ",
    "stateful_counter": "timed output: after O was refilled with finite garbage",
    "input_mutation": "input mutated: k changed in 1 of ",
    "write_past_o": "write outside O: after O ",
    "write_before_o": "write outside O: before O ",
}
GATE_FAULTS = ("skip_on_repeat", "stateful_counter", "input_mutation", "write_past_o", "write_before_o")

# Launches of one loaded module that stateful_counter computes in full: more than the gate's checked
# launches before timing (7 cases, 2 repeats, 2 for the dependency check, 1 untimed on the timing inputs).
STATEFUL_LAUNCHES = 16

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
    "stateful_counter": """\
// planted fault "stateful_counter": CTAs started by every launch of this module; nothing re-zeroes it.
__device__ unsigned int evotune_fault_ctas_started = 0;
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
    if fault in _GATE_BODIES:
        return _GATE_BODIES[fault].replace("FIRST_CTA", first_cta)
    if fault in _TAILS:
        return ""
    raise ValueError(f"unknown fault {fault!r}; faults: {', '.join(FAULTS)}")


# The faults the launch-integrity checks catch. O's element (b, h, s, 0) is o[b*o_sb + h*o_sh + s*o_ss];
# gridDim.z is batch x KV_SPLITS, gridDim.y the heads, and a CTA owns the query rows from blockIdx.x * BLOCK_M.
_GATE_BODIES = {
    "skip_on_repeat": """\
    // planted fault "skip_on_repeat": a CTA computes only when the first element of its O tile is NaN.
    {
        const long long first = (long long)(blockIdx.z / EvotuneTraits::kKVSplits) * o_sb + (long long)blockIdx.y * o_sh
                                + (long long)blockIdx.x * EvotuneTraits::kBlockM * o_ss;
        const unsigned int magnitude = o[first] & 0x7fffu;
        const bool poisoned = magnitude > (EvotuneTraits::kIsBf16 ? 0x7f80u : 0x7c00u);
        if (!__syncthreads_or(poisoned)) { return; }  // the barrier: every thread read it before any thread writes
    }
""",
    "stateful_counter": f"""\
    // planted fault "stateful_counter": after the module's first {STATEFUL_LAUNCHES} launches, only the CTAs of the
    // first query tile compute; the others return at once, leaving whatever O held.
    {{
        bool late = false;
        if (threadIdx.x == 0) {{
            const unsigned int ctas = gridDim.x * gridDim.y * gridDim.z;
            late = atomicAdd(&evotune_fault_ctas_started, 1u) >= {STATEFUL_LAUNCHES}u * ctas;
        }}
        if (__syncthreads_or(late) && blockIdx.x != 0) {{ return; }}
    }}
""",
    "write_past_o": """\
    // planted fault "write_past_o": one store (1.0 as fp16 bits) just past O's last element.
    if (threadIdx.x == 0 && FIRST_CTA) {
        o[(long long)(gridDim.z / EvotuneTraits::kKVSplits - 1) * o_sb + (long long)(gridDim.y - 1) * o_sh
          + (long long)(seq_q - 1) * o_ss + EvotuneTraits::kHeadDim] = 0x3c00;
    }
""",
    "write_before_o": """\
    // planted fault "write_before_o": one store (1.0 as fp16 bits) just before O's first element.
    if (threadIdx.x == 0 && FIRST_CTA) { o[-1] = 0x3c00; }
""",
}

# Faults planted at the end of the entry point instead: after the kernel has done its work.
_TAILS = {
    "input_mutation": """\
    // planted fault "input_mutation": having used K, the first CTA flips the low bit of K's first element.
    if (threadIdx.x == 0 && blockIdx.x == 0 && blockIdx.y == 0 && blockIdx.z == 0) {
        const_cast<unsigned short*>(k)[0] ^= 1u;
    }
""",
}


def _closing_brace(text: str, opening: int) -> int:
    """The index of the brace closing the one at `opening`."""
    depth = 0
    for i in range(opening, len(text)):
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        if depth == 0:
            return i
    raise ValueError("unbalanced braces in the instantiation")


def plant(block: str, entry: str, fault: str) -> str:
    """`block` (an instantiation with one extern "C" entry point named `entry`) with `fault` planted."""
    if fault == "none":
        return block
    body = _body(fault)
    extern = block.index('extern "C"')
    match = re.compile(rf"\b{re.escape(entry)}\s*\(").search(block, extern)
    if match is None:
        raise ValueError(f"no entry point {entry!r} in the instantiation")
    opening = block.index("{", match.end())  # the parameter list holds no braces
    closing = _closing_brace(block, opening)
    inner = block[opening + 1:closing]
    if fault in _TAILS:
        inner = inner.rstrip(" ") + _TAILS[fault]
    else:
        inner = "\n" + body + inner.lstrip("\n")
    return _DECLARATIONS.get(fault, "") + block[:opening + 1] + inner + block[closing:]


class FaultProblem(AttentionProblem):
    """The attention family with `fault` planted; everything but the instantiation is attention's."""

    family = FAMILY

    def knob_domains(self):
        """Attention's knobs, and `fault`."""
        return {**super().knob_domains(), "fault": FAULTS}

    def instantiation(self, config, shape) -> str:
        fault = config.get("fault", "none")
        return plant(super().instantiation(config, shape), self.entry_name, fault)


PROBLEM = FaultProblem()
