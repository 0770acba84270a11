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
          "skip_on_repeat", "stateful_counter", "input_mutation", "write_past_o", "write_before_o",
          "memo_o", "memo_fingerprint", "memo_late", "memo_cache")
FAMILY = "tests.fault_family:PROBLEM"

# How the gate reports each fault that computes correctly when checked: the start of the WRONG message.
# A launch-count cheat starts within the timing's warm-up; whether the rotation's end check or the audit on a
# changed input sees it first depends on which set its last full launch read: either names it (str.startswith
# takes the tuple).
_LATE = ("timed output: after timing over 2 rotating input sets", "changed input: after one key of the last timing set")
CAUGHT_AS = {
    "skip_on_repeat": "repeat: ",
    "stateful_counter": _LATE,
    "input_mutation": "input mutated: k changed in 1 of ",
    "write_past_o": "write outside O: after O ",
    "write_before_o": "write outside O: before O ",
    "memo_o": "timed output: after timing over 2 rotating input sets",
    "memo_fingerprint": "dependency check FAILED: ",
    "memo_late": _LATE,
    "memo_cache": "changed input: after one key of the last timing set was changed",
}
GATE_FAULTS = ("skip_on_repeat", "stateful_counter", "input_mutation", "write_past_o", "write_before_o",
               "memo_o", "memo_fingerprint", "memo_late", "memo_cache")
# The kernels that remember their own answers (issue 38), each CTA keeping its memo in __device__ arrays:
#   memo_o            returns at once when the first element of its O tile still holds what it last wrote there
#                     (issue 38's exploit: ok at 1.76 us on the mission shape, timed on one input set)
#   memo_fingerprint  when the first element of its Q tile (a fingerprint of the inputs) is the last launch's,
#                     copies the tile it kept in private memory into O instead of computing
#   memo_late         memo_o, but only after the module's first STATEFUL_LAUNCHES launches
#   memo_cache        after the module's first STATEFUL_LAUNCHES launches, keeps two answers per CTA (as many as the
#                     timing's input sets) keyed by that fingerprint and copies the matching one
MEMO_CTAS = 4096  # CTAs a memo has room for (the mission shape launches 64 at block_m 64)

# Launches of one loaded module that stateful_counter computes in full: more than the gate's checked
# launches before timing (7 cases, 2 repeats, 2 for the dependency check, 1 untimed on the timing inputs).
STATEFUL_LAUNCHES = 16

# Far longer than the search's --timeout in the GPU tests (12 s), far shorter than a stuck machine.
HANG_BOUND_S = 30

PLANTED_IDENTIFIER = "evotune_planted_compile_error"

# The memo faults' state (MEMO_CTAS and MEMO_ANSWER_ELEMS are filled in by plant()).
_MEMO_O_DECLARATIONS = """\
// planted memo: per CTA, the first element of its O tile as it last wrote it, and whether it has written.
__device__ unsigned short evotune_fault_memo_o[MEMO_CTAS];
__device__ unsigned char evotune_fault_memo_o_set[MEMO_CTAS];
"""
_COUNTER_DECLARATION = """\
// planted memo: CTAs started by every launch of this module; nothing re-zeroes it.
__device__ unsigned int evotune_fault_ctas_started = 0;
"""
_ANSWER_DECLARATIONS = """\
// planted memo: per CTA and slot, the fingerprint (first element of its Q tile) of an answer it kept, the
// slot it wrote last, and the answers themselves (O's logical (B, H, Sq, D) order).
__device__ unsigned short evotune_fault_fp[2][MEMO_CTAS];
__device__ unsigned char evotune_fault_fp_set[2][MEMO_CTAS];
__device__ unsigned char evotune_fault_fp_last[MEMO_CTAS];
__device__ unsigned short evotune_fault_answer[2][MEMO_ANSWER_ELEMS];
"""

# Where a CTA's tile starts: gridDim.z is batch x KV_SPLITS, gridDim.y the heads, and a CTA owns the query rows
# from blockIdx.x * BLOCK_M.
_TILE = """\
        const unsigned cta = blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z);
        const int tile_b = blockIdx.z / EvotuneTraits::kKVSplits, tile_h = blockIdx.y;
        const int tile_r0 = blockIdx.x * EvotuneTraits::kBlockM;
        const int tile_rows = min(EvotuneTraits::kBlockM, seq_q - tile_r0);
        const long long o_first = (long long)tile_b * o_sb + (long long)tile_h * o_sh + (long long)tile_r0 * o_ss;
        const unsigned short fingerprint = q[(long long)tile_b * q_sb + (long long)tile_h * q_sh
                                             + (long long)tile_r0 * q_ss];
"""


def _copy_tile(slot: str, to_o: bool) -> str:
    """Statements copying the CTA's O tile from (to_o) or into its kept answer in slot `slot`."""
    answer = f"evotune_fault_answer[{slot}][(((long long)tile_b * gridDim.y + tile_h) * seq_q + row) * D + col]"
    out = "o[(long long)tile_b * o_sb + (long long)tile_h * o_sh + (long long)row * o_ss + col]"
    dst, src = (out, answer) if to_o else (answer, out)
    return f"""\
            for (int i = threadIdx.x; i < tile_rows * EvotuneTraits::kHeadDim; i += blockDim.x) {{
                const int D = EvotuneTraits::kHeadDim, row = tile_r0 + i / D, col = i % D;
                {dst} = {src};
            }}
"""


def _late(flag: str) -> str:
    return f"""\
        bool {flag} = false;
        if (threadIdx.x == 0) {{
            const unsigned int ctas = gridDim.x * gridDim.y * gridDim.z;
            {flag} = atomicAdd(&evotune_fault_ctas_started, 1u) >= {STATEFUL_LAUNCHES}u * ctas;
        }}
        {flag} = __syncthreads_or({flag});
"""


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
    "memo_o": _MEMO_O_DECLARATIONS,
    "memo_late": _MEMO_O_DECLARATIONS + _COUNTER_DECLARATION,
    "memo_fingerprint": _ANSWER_DECLARATIONS,
    "memo_cache": _ANSWER_DECLARATIONS + _COUNTER_DECLARATION,
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

_MEMO_O_CHECK = """\
        const bool kept = cta < MEMO_CTAS && evotune_fault_memo_o_set[cta] && o[o_first] == evotune_fault_memo_o[cta];
"""
_GATE_BODIES["memo_o"] = f"""\
    // planted fault "memo_o": return at once when O's tile still starts with what this CTA last wrote there.
    {{
{_TILE}{_MEMO_O_CHECK}        if (__syncthreads_or(kept)) {{ return; }}  // every thread read O before any writes
    }}
"""
_GATE_BODIES["memo_late"] = f"""\
    // planted fault "memo_late": memo_o, after the module's first {STATEFUL_LAUNCHES} launches.
    {{
{_TILE}{_late("late")}{_MEMO_O_CHECK}        if (__syncthreads_or(late && kept)) {{ return; }}
    }}
"""
_GATE_BODIES["memo_fingerprint"] = f"""\
    // planted fault "memo_fingerprint": when the Q tile's first element is the last launch's, copy the kept tile.
    {{
{_TILE}        const bool hit = cta < MEMO_CTAS && evotune_fault_fp_set[0][cta] && evotune_fault_fp[0][cta] == fingerprint;
        if (__syncthreads_or(hit)) {{
{_copy_tile("0", to_o=True)}            return;
        }}
    }}
"""
_GATE_BODIES["memo_cache"] = f"""\
    // planted fault "memo_cache": after the module's first {STATEFUL_LAUNCHES} launches, copy the kept tile whose
    // fingerprint (the Q tile's first element) matches, from two slots.
    {{
{_TILE}{_late("late")}        int slot = -1;
        for (int s = 0; s < 2; ++s) {{
            if (cta < MEMO_CTAS && evotune_fault_fp_set[s][cta] && evotune_fault_fp[s][cta] == fingerprint) {{ slot = s; }}
        }}
        if (__syncthreads_or(late && slot >= 0)) {{
{_copy_tile("slot", to_o=True)}            return;
        }}
    }}
"""

_MEMO_O_TAIL = f"""\
    // planted memo: keep the first element of the O tile this CTA wrote.
    {{
        __syncthreads();
{_TILE}        if (threadIdx.x == 0 && cta < MEMO_CTAS) {{
            evotune_fault_memo_o[cta] = o[o_first];
            evotune_fault_memo_o_set[cta] = 1;
        }}
    }}
"""


def _answer_tail(slots: int) -> str:
    """Keep the O tile this CTA wrote, with its fingerprint: in slot 0, or (two slots) in the slot whose fingerprint
    matches, else the one not written last."""
    pick = "0" if slots == 1 else (
        "evotune_fault_fp_set[0][cta] && evotune_fault_fp[0][cta] == fingerprint ? 0 : "
        "evotune_fault_fp_set[1][cta] && evotune_fault_fp[1][cta] == fingerprint ? 1 : 1 - evotune_fault_fp_last[cta]")
    return f"""\
    // planted memo: keep the answer this CTA wrote, keyed by its Q tile's first element.
    {{
        __syncthreads();
{_TILE}        if (cta < MEMO_CTAS) {{
            const int slot = {pick};
            __syncthreads();  // every thread picked the slot before thread 0 changes what picks it
{_copy_tile("slot", to_o=False)}            __syncthreads();
            if (threadIdx.x == 0) {{
                evotune_fault_fp[slot][cta] = fingerprint;
                evotune_fault_fp_set[slot][cta] = 1;
                evotune_fault_fp_last[cta] = slot;
            }}
        }}
    }}
"""


# Faults planted at the end of the entry point instead: after the kernel has done its work.
_TAILS = {
    "input_mutation": """\
    // planted fault "input_mutation": having used K, the first CTA flips the low bit of K's first element.
    if (threadIdx.x == 0 && blockIdx.x == 0 && blockIdx.y == 0 && blockIdx.z == 0) {
        const_cast<unsigned short*>(k)[0] ^= 1u;
    }
""",
    "memo_o": _MEMO_O_TAIL,
    "memo_late": _MEMO_O_TAIL,
    "memo_fingerprint": _answer_tail(1),
    "memo_cache": _answer_tail(2),
}


def _closing_brace(text: str, opening: int) -> int:
    """The index of the brace closing the one at `opening`."""
    depth = 0
    for i in range(opening, len(text)):
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        if depth == 0:
            return i
    raise ValueError("unbalanced braces in the instantiation")


def plant(block: str, entry: str, fault: str, answer_elems: int = 1) -> str:
    """`block` (an instantiation with one extern "C" entry point named `entry`) with `fault` planted; the memo faults
    keep answers of `answer_elems` elements (O's size)."""
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
    if body:
        inner = "\n" + body + inner.lstrip("\n")
    declarations = _DECLARATIONS.get(fault, "").replace("MEMO_CTAS", str(MEMO_CTAS))
    declarations = declarations.replace("MEMO_ANSWER_ELEMS", str(answer_elems))
    planted = declarations + block[:opening + 1] + inner + block[closing:]
    return planted.replace("MEMO_CTAS", str(MEMO_CTAS))


class FaultProblem(AttentionProblem):
    """The attention family with `fault` planted; everything but the instantiation is attention's."""

    family = FAMILY

    def knob_domains(self):
        """Attention's knobs, and `fault`."""
        return {**super().knob_domains(), "fault": FAULTS}

    def instantiation(self, config, shape) -> str:
        fault = config.get("fault", "none")
        answer_elems = shape.batch * shape.heads * shape.seq_q * shape.head_dim
        return plant(super().instantiation(config, shape), self.entry_name, fault, answer_elems)


PROBLEM = FaultProblem()
