"""The fused attention forward family: kernels/attention.cu against PyTorch SDPA.

CPU side (no torch needed): which shapes are supported, template arguments, launch
geometry. GPU side (torch + CuPy): inputs, the launch, the fp32 reference, and SDPA.
"""

from __future__ import annotations

import math
import os
import sys
from dataclasses import dataclass
from functools import lru_cache

from ..errors import UsageError
from ..limits import MULTIPROCESSORS, THREADS_PER_BLOCK, launch_asserts
from .shapes import PRESETS, Shape, parse_shape
from ..space.searchspace import DEVICE_CONTEXT_NAMES, device_context
from . import LaunchGeometry, Problem, aim_key, check_sinks, knob_reader, sink_logits  # noqa: F401 (check_sinks: API)
from . import varlen as _varlen
from .varlen import check_cu_seqlens

SMEM_LAYOUTS = {"plain": 0, "pad": 1, "swizzle": 2}

# Names the search space's expressions may read: the shape, then the device limits.
CONTEXT_NAMES = ("batch", "heads", "kv_heads", "seq_q", "seq_k", "head_dim", "head_dim_v", "dtype", "dtype_bytes",
                 "causal", "softcap", "window", "sinks", "varlen") + DEVICE_CONTEXT_NAMES


def shape_context(shape: Shape) -> dict:
    """The names CONTEXT_NAMES for `shape` on an H100."""
    return {
        "batch": shape.batch, "heads": shape.heads, "kv_heads": shape.kv_heads, "seq_q": shape.seq_q, "seq_k": shape.seq_k,
        "head_dim": shape.head_dim, "head_dim_v": shape.dv, "dtype": shape.dtype, "dtype_bytes": shape.dtype_bytes,
        "causal": shape.causal, "softcap": shape.has_softcap, "window": shape.has_window,
        "sinks": shape.sinks, "varlen": shape.is_varlen, **device_context(),
    }

# The value a knob takes when a (reduced) search space does not list it.
KNOB_DEFAULTS = {"block_m": 64, "block_n": 64, "compute_warps": 4, "producer_warps": 0, "stages": 2,
                 "smem_layout": "swizzle", "q_in_regs": True, "kv_splits": 1, "warp_key_groups": 1,
                 "mma": "sync", "pingpong": False, "persistent": False, "pdl": False, "epilogue": "regs",
                 "key_merge": "gather", "kv_load": "cp_async", "kv_cluster": 1, "exp2_fma": 0,
                 "rescale": "always", "softmax_overlap": False, "lean_addressing": False, "p_operand": "regs",
                 "empty_warpgroups": "compute", "causal_extent": "tile", "stripe_order": "fixed"}


# Knob rescale (the Hopper traits' RESCALE_SLACK, kRescaleSlackLog2; -1 = always): how far a K/V tile's row max may
# exceed the row's running max before the row takes it and O is rescaled, as a power of two in exp2 terms; always:
# every tile, as before the knob.
RESCALE_SLACK_LOG2 = {"always": None, "new_max": 0, "lazy": 8}


# The values each knob may take: what the templates' traits (AttnTraits, hopper::HopperTraits) accept for
# it alone, from their static_asserts; which combinations compile is the space's constraints' business.
KNOB_DOMAINS = {
    "mma": ("sync", "wgmma"),
    "block_m": range(16, 2049, 16),      # whole 16-row mma tiles; at most 4 per warp of at most 32 warps
    "block_n": range(16, 257, 16),       # whole 16-key ldmatrix steps, at most 256
    "compute_warps": range(1, THREADS_PER_BLOCK // 32 + 1),  # at most 1024 threads per CTA
    "producer_warps": range(0, 5),
    "stages": range(1, 9),               # the Hopper kernel's deep ring (stages 5 to 8): the space's constraint
    "smem_layout": tuple(SMEM_LAYOUTS),
    "q_in_regs": (True, False),
    "kv_splits": range(1, 17),
    "warp_key_groups": range(1, 17),     # each group takes a whole 16 keys of a tile of at most 256
    "pingpong": (False, True),
    "persistent": (False, True),
    "pdl": (False, True),
    "epilogue": ("regs", "tma"),
    "key_merge": ("gather", "split"),
    "kv_load": ("cp_async", "tma", "tma_split"),
    "kv_cluster": (1, 2, 4),             # CTAs per cluster sharing each K/V tile (multicast); 1: none
    "exp2_fma": range(0, 9),             # eighths of the softmax's exp2 computed on the FMA pipe; 0: all on the MUFU
    "rescale": tuple(RESCALE_SLACK_LOG2),  # wgmma: when O is rescaled for a row's new max (every tile, or skipped)
    "softmax_overlap": (False, True),    # wgmma: the consumer loop rotated so the softmax runs under its own P V
    "lean_addressing": (False, True),    # wgmma: descriptors advanced by one add, slots in unsigned arithmetic
    "p_operand": ("regs", "smem"),       # wgmma: where P V reads P (FlashAttention-3's MmaPV_is_RS true or false)
    "empty_warpgroups": ("compute", "skip"),  # wgmma: a consumer warpgroup with only padding rows computes them or not
    "causal_extent": ("tile", "warpgroup"),  # wgmma, causal: a warpgroup's keys end at its tile's diagonal or its own
    "stripe_order": ("fixed", "mirrored"),  # persistent: each warpgroup's stripe fixed, or mirrored every other tile
}


knob = knob_reader(KNOB_DEFAULTS)


def is_wgmma(config) -> bool:
    """The Hopper variant (kernels/attention_hopper.cuh: wgmma, TMA, mbarriers) rather than mma.sync."""
    return knob(config, "mma") == "wgmma"


def wgmma_block_m(config) -> int:
    """Query rows per CTA of the Hopper variant: 64 (wgmma's M) per consumer warpgroup of 4 compute warps."""
    return 16 * int(knob(config, "compute_warps"))


# The Hopper kernel's setmaxnreg split (kernels/attention_hopper.cuh's kProducerRegs, kConsumerRegs) by consumer
# warpgroups, with a producer warpgroup: registers per producer thread and per consumer thread.
SETMAXNREG_SPLIT = {2: (24, 240), 3: (32, 160), 4: (24, 112)}


def setmaxnreg_registers(config) -> int:
    """The registers the Hopper kernel's warpgroups hold after setmaxnreg, over the CTA; 0 where it does not resize
    them (mma.sync, no producer, one consumer warpgroup). LaunchGeometry.register_split: setmaxnreg.inc takes only what
    the CTA's setmaxnreg.dec freed, so the launch's allocation must hold this much."""
    consumers = wgmma_block_m(config) // 64
    if not is_wgmma(config) or int(knob(config, "producer_warps")) == 0 or consumers < 2:
        return 0
    producer_regs, consumer_regs = SETMAXNREG_SPLIT[consumers]
    producer_regs = mirrored_producer_regs(config) or producer_regs
    return 128 * producer_regs + 128 * consumers * consumer_regs


def rows_per_cta(config) -> int:
    """Query rows per CTA (the traits' kBlockM): wgmma_block_m for the Hopper variant, else the block_m knob."""
    return wgmma_block_m(config) if is_wgmma(config) else int(knob(config, "block_m"))


def is_pdl(config) -> bool:
    """Programmatic dependent launch (both variants): the kernel waits for the previous grid in its stream before
    its first global access (griddepcontrol.wait) and is launched with programmatic stream serialization, so its
    launch and prologue overlap that grid's tail (docs/PDL.md)."""
    return bool(knob(config, "pdl"))


def is_tma_store(config) -> bool:
    """The Hopper variant's TMA-store epilogue (knob epilogue = tma, kernels/hopper/epilogue.cuh): each consumer
    warpgroup stages O in shared memory and one thread stores it with TMA (through a fourth tensor map, o_map)."""
    return is_wgmma(config) and knob(config, "epilogue") == "tma"


def is_softmax_overlap(config) -> bool:
    """The Hopper variant's consumer loop rotated (knob softmax_overlap, the traits' SOFTMAX_OVERLAP: kSoftmaxOverlap):
    the wait for P(t-1) V(t-1) opens the next iteration, so ptxas cannot schedule it above
    tile t's softmax, which then runs while this warpgroup's P V is on the tensor cores (FlashAttention-3's intra-warpgroup
    overlap). Without it ptxas puts that wait above the softmax. The instructions run in the same order either way."""
    return is_wgmma(config) and bool(knob(config, "softmax_overlap"))


def is_lean_addressing(config) -> bool:
    """The Hopper variant's index arithmetic made lean (knob lean_addressing, the traits' LEAN_ADDRESSING:
    kLeanAddressing, SlotUse): each k-step's wgmma descriptor is one add from the tile's address >> 4 (CUTLASS's
    descriptor iterator) instead of a mask, shift and or per k-step, and the K/V slot and parity come from unsigned %
    and /. The uniform-datapath instructions between a tile's wgmma issues and in its bookkeeping drop (the gpt2
    winner's consumer loop: 434 SASS instructions to 412, 90 uniform to 68); the arithmetic's results are the same."""
    return is_wgmma(config) and bool(knob(config, "lean_addressing"))


def is_p_smem(config) -> bool:
    """The Hopper variant's P V with P from shared memory (knob p_operand = smem, the traits' P_SMEM: kPSmem;
    FlashAttention-3's d64 tile runs so): each consumer warpgroup stores P's packed fragments to a
    64 x block_n tile of its own (stmatrix) and P V reads it through descriptors, so the registers that held P until
    its P V completed are free, for a 192-key S tile among others. regs: P stays in registers as P V's A operand."""
    return is_wgmma(config) and knob(config, "p_operand") == "smem"


def is_skip_empty(config) -> bool:
    """The Hopper variant's empty warpgroups skipped (knob empty_warpgroups = skip, the traits' SKIP_EMPTY:
    kSkipEmpty): a consumer warpgroup whose 64 query rows all lie past seq_q (the padding of a ragged last
    query tile, e.g. 128 of the last 192-row tile's rows at seq_q 1024) computes and stores nothing and only gives the
    K/V and Q barriers their arrivals; a persistent grid then hands its tiles out from tile_counter (causal or not),
    so that the CTAs that draw the cheap thin tiles take more. compute: the padding rows are computed and discarded,
    and the persistent non-causal grid walks a fixed stride."""
    return is_wgmma(config) and knob(config, "empty_warpgroups") == "skip"


def is_causal_warpgroup(config) -> bool:
    """The Hopper variant's causal K/V range per consumer warpgroup (knob causal_extent = warpgroup,
    the traits' CAUSAL_WG: kCausalWarpgroup): each warpgroup computes the K/V tiles up to its own 64 rows'
    diagonal and only gives the barriers their releases for the CTA's later tiles, which are masked whole for its rows
    (at block_m 128 and block_n 64 its first warpgroup skips one of each query tile's tiles, at block_m 256 three,
    two and one); without a producer the last warpgroup's first thread issues the loads, since it alone walks every
    tile. tile: every warpgroup walks the tile's range and its masked tiles add nothing to the output."""
    return is_wgmma(config) and knob(config, "causal_extent") == "warpgroup"


def is_stripe_mirror(config) -> bool:
    """The persistent Hopper variant's stripes mirrored (knob stripe_order = mirrored, the traits' STRIPE_MIRROR:
    kStripeMirror): with causal_extent = warpgroup the warpgroup on a query tile's last 64 rows walks the
    most K/V tiles; consumer warpgroup wg computes stripe wg of the CTA's even query tiles and W - 1 - wg of its odd
    ones, and Q has a second buffer, so that a warpgroup done with one tile starts the next (whose long stripe it then
    takes) while the longest finishes. fixed: warpgroup wg always computes rows 64 wg.., with Q's one buffer."""
    return is_persistent(config) and knob(config, "stripe_order") == "mirrored"


# stripe_order = mirrored with four consumer warpgroups: the producer's registers (HopperTraits::kProducerRegs says
# why; the instantiation asserts that the traits' split holds what setmaxnreg_registers counts). 32 + 4 x 112 per
# thread, 61440 registers, is the launch's whole allocation (96 a thread, 640 threads).
MIRRORED_WG4_PRODUCER_REGS = 32


def mirrored_producer_regs(config) -> int:
    """The producer's setmaxnreg count where stripe_order = mirrored changes it (four consumer warpgroups); else 0."""
    return MIRRORED_WG4_PRODUCER_REGS if is_stripe_mirror(config) and wgmma_block_m(config) == 256 else 0


def is_deep_ring(config) -> bool:
    """The Hopper kernel's K/V ring deeper than four slots (stages 5 to 8, kernels/attention_hopper.cuh's
    HopperTraits::kBarrierSlots: barriers for eight); a warpgroup that runs ahead into the next query tile (stripe_order =
    mirrored) may then be further ahead of the longest one."""
    return is_wgmma(config) and int(knob(config, "stages")) > 4


# The Hopper kernel's head dims (HopperTraits); the mma.sync kernel takes 64, 128 and 256 of them (the space's
# constraint says why).
HEAD_DIMS = (64, 96, 128, 192, 256)
# (Q/K head dim, V head dim) pairs of a value head dim of its own, the Hopper kernel's (HopperTraits' HEAD_DIM_V; the
# space's constraint says why these): DeepSeek-V2/V3's MLA prefill (192/128), and 128/64.
HEAD_DIM_V_PAIRS = ((192, 128), (128, 64))


def tile_dim(config, shape: Shape) -> int:
    """The columns a Q or K/V tile holds in shared memory: the Hopper kernel's tiles are whole 64-column regions of
    the 128-byte swizzle (HopperTraits::kTileDim: head dim 96 is held as 128, TMA filling the rest with zeros); the
    mma.sync kernel's hold the head dim."""
    return (shape.head_dim + 63) // 64 * 64 if is_wgmma(config) else shape.head_dim


def tile_dim_v(config, shape: Shape) -> int:
    """The columns a V tile and O's staging tile hold (HopperTraits::kTileDimV): tile_dim's rule at V's head dim."""
    return (shape.dv + 63) // 64 * 64 if is_wgmma(config) else shape.dv


def q_buffer_bytes(config, shape: Shape) -> int:
    """Shared memory that stripe_order = mirrored adds: Q's second buffer (a Q tile); none otherwise."""
    return 2 * tile_dim(config, shape) * wgmma_block_m(config) if is_stripe_mirror(config) else 0


def uses_tile_counter(config, shape: Shape) -> bool:
    """Whether a launch takes the persistent grid's two tile counters: the causal persistent grid, and with
    empty_warpgroups = skip the non-causal one too (both hand out tiles dynamically)."""
    return is_persistent(config) and (shape.causal or is_skip_empty(config))


def p_tile_bytes(config, shape: Shape) -> int:
    """Shared memory that p_operand = smem adds: every consumer warpgroup's P tile (64 rows x block_n keys, 2 bytes
    each), at the end of the dynamic shared memory; none otherwise."""
    return 2 * wgmma_block_m(config) * int(knob(config, "block_n")) if is_p_smem(config) else 0


def rescale_slack_log2(config) -> int | None:
    """The Hopper variant's conditional rescaling (knob rescale, the traits' RESCALE_SLACK: kRescaleSlackLog2, -1 at
    always): a row keeps its running max until a tile's exceeds it by more than 2^slack in exp2 terms, and a warp skips
    O's rescaling (its alpha multiplies) on the tiles where none of its rows took a new one. new_max: slack 0, every
    new max is taken, the output bit for bit always's; lazy: slack 8 (FlashAttention-4's); None: always rescaled (and
    every mma.sync config, whose kernel skips the multiplies where no row's max moved anyway)."""
    return RESCALE_SLACK_LOG2[knob(config, "rescale")] if is_wgmma(config) else None


def is_split_merge(config) -> bool:
    """mma.sync with key groups, knob key_merge = split (kernels/attention_split_merge.cuh): each key group merges
    and stores 1/warp_key_groups of the head dim, instead of the row group's first warp merging and storing all."""
    return not is_wgmma(config) and int(knob(config, "warp_key_groups")) > 1 and knob(config, "key_merge") == "split"


def is_tma_load(config) -> bool:
    """mma.sync with knob kv_load = tma (kernels/attention_tma_load.cuh): Q, K and V arrive by TMA boxes issued by
    one thread, on one mbarrier per slot, through three tensor maps, instead of every thread's 16-byte cp.async; or
    kv_load = tma_split, the same with K and V on mbarriers of their own (kernels/attention_tma_split.cuh)."""
    return not is_wgmma(config) and knob(config, "kv_load") in ("tma", "tma_split")


def is_tma_split(config) -> bool:
    """kv_load = tma_split: a step's Q K^T waits for K only, its P V for V."""
    return not is_wgmma(config) and knob(config, "kv_load") == "tma_split"


def tma_load_bytes(config) -> int:
    """Shared memory kv_load = tma adds (TmaLoad::kExtraBytes): an mbarrier per stage (tma_split: two,
    TmaSplit::kExtraBytes), then the slack that puts the tiles on the next 1024-byte boundary."""
    return 1024 + (16 if is_tma_split(config) else 8) * int(knob(config, "stages")) if is_tma_load(config) else 0


def kv_cluster(config) -> int:
    """CTAs per cluster that share each K/V tile by TMA multicast (knob kv_cluster, with kv_load = tma); 1: none."""
    return int(knob(config, "kv_cluster")) if not is_wgmma(config) and knob(config, "kv_load") == "tma" else 1


def is_tma_multicast(config) -> bool:
    """kv_load = tma with kv_cluster 2 or 4 (kernels/attention_tma_multicast.cuh): consecutive query tiles of a head
    form a cluster, and each CTA loads 1/kv_cluster of every K/V tile's rows into every CTA of it."""
    return kv_cluster(config) > 1


def exp2_fma_eighths(config) -> int:
    """Eighths of each row's softmax exp2 computed by a polynomial on the FMA pipe rather than by the MUFU's ex2.approx
    (knob exp2_fma, both variants; kernels/attention_exp2_fma.cuh); 0: all on the MUFU."""
    return int(knob(config, "exp2_fma"))


def uses_tensor_maps(config) -> bool:
    """Whether the entry takes CUtensorMaps of Q, K and V (the Hopper variant, or mma.sync with kv_load = tma)."""
    return is_wgmma(config) or is_tma_load(config)


def merge_bytes(config, shape: Shape) -> int:
    """Shared memory of the key groups' merge (mma.sync). gather: fp32 O, max and sum of every key group but the
    first (AttnTraits::kMergeBytes); split: G - 1 slots of O at a pitch of head_dim + 8 floats, then every group's
    max and sum (SplitMerge::kBytes)."""
    groups, block_m, dim = int(knob(config, "warp_key_groups")), int(knob(config, "block_m")), shape.head_dim
    if groups == 1 or is_wgmma(config):
        return 0
    if is_split_merge(config):
        return 4 * ((groups - 1) * block_m * (dim + 8) + 2 * groups * block_m)
    return 4 * (groups - 1) * block_m * (dim + 2)


def o_stage_bytes(config, shape: Shape) -> int:
    """Shared memory the TMA-store epilogue adds: an O-sized staging tile (V's head dim wide) under PERSISTENT (the next
    tile's Q arrives in Q's buffer meanwhile); none otherwise (O is staged in Q's buffer, free by then)."""
    return 2 * tile_dim_v(config, shape) * wgmma_block_m(config) if is_tma_store(config) and is_persistent(config) else 0


def is_persistent(config) -> bool:
    """The Hopper variant's persistent grid (HopperTraits::kPersistent): at most one CTA per SM loops over the tiles."""
    return is_wgmma(config) and bool(knob(config, "persistent"))


def query_tiles(config, shape: Shape) -> int:
    """Query tiles of a launch: ceil(seq_q / rows per CTA) per (batch, head)."""
    return math.ceil(shape.seq_q / rows_per_cta(config)) * shape.heads * shape.batch


def current_multiprocessors() -> int:
    """The SMs a persistent grid is sized for: EVOTUNE_SM_COUNT if set (fewer CTAs, e.g. to leave SMs to another
    stream, or so that the GPU tests make each CTA walk several tiles of a small shape); else the CUDA device in use
    where this process has CUDA up (a GPU worker, the PyTorch op); else the H100's (limits.MULTIPROCESSORS). A grid
    sized for another GPU still computes every tile, but more CTAs than SMs leave a second, ragged wave. Never
    imports torch itself (the search process does without it)."""
    told = os.environ.get("EVOTUNE_SM_COUNT", "").strip()
    if told:
        if not told.isdigit() or int(told) < 1:
            raise UsageError(f"EVOTUNE_SM_COUNT={told!r}: write a positive number of SMs")
        return int(told)
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized():
        return int(torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count)
    return MULTIPROCESSORS

# Correctness gate, elementwise against an fp32 reference: |out - ref| <= ATOL*rms(V) + RTOL*|ref|.
# The relative term is needed because |O| grows where a row attends few keys (causal
# rows near the diagonal copy V almost verbatim), and one rounding of O to the output
# dtype alone is 2^-11 (fp16) or 2^-8 (bf16) of |O|. Measured on the H100 (torch 2.11,
# docs/PERFORMANCE.md): SDPA's max-abs error is 1.6e-4 (fp16) and 1.3e-3 (bf16) on the
# mission shape, 9.3e-4 fp16 causal, 8.7e-3 on bf16 d128 causal; each is at most ~0.3
# of this gate. A kernel that drops, repeats or misplaces one K/V tile is off by ~1e-1
# at |ref| ~ 0.1, dozens of times the gate. ATOL is scaled by rms(V) because O is a convex
# combination of V's rows: with |V| x30 (the "large" input pattern) P's rounding alone
# errs by ~2^-11 * |V| where O itself may be near zero.
TOLERANCE = {"fp16": (1e-3, 4e-3), "bf16": (8e-3, 3e-2)}  # (atol, rtol)


class AttentionProblem(Problem):
    family = "attention"
    kernel_file = "attention.cu"
    entry_name = "evotune_attention"
    default_space = "attention"
    default_shape = "mission"
    title = "attention forward kernel"
    context_names = CONTEXT_NAMES
    perturbed = "key"
    baseline_kind = "SDPA"
    rate_unit = "TFLOP/s"
    knob_abbrev = {"block_m": "M", "block_n": "N", "compute_warps": "cw", "producer_warps": "pw", "stages": "st",
                   "smem_layout": "", "q_in_regs": ("qreg", "qsmem"), "kv_splits": "kv",
                   "persistent": ("persistent", "onetile"), "pdl": ("pdl", "nopdl"), "epilogue": "epi-",
                   "key_merge": "merge-", "kv_load": "load-", "kv_cluster": "cluster", "exp2_fma": "ex2fma",
                   "rescale": "rescale-", "softmax_overlap": ("overlap", "nooverlap"),
                   "lean_addressing": ("leanaddr", "rebuiltaddr"), "p_operand": "p-",
                   "empty_warpgroups": "empty-", "causal_extent": "extent-", "stripe_order": "stripes-"}
    # pdl, epilogue, key_merge, kv_load, kv_cluster, exp2_fma, rescale, softmax_overlap, lean_addressing, p_operand,
    # empty_warpgroups, causal_extent and stripe_order came after the recorded runs; at false, regs, gather, cp_async,
    # 1, 0, always, false, false, regs, compute, tile and fixed they leave the source as it was (flagged lines).
    late_knobs = {"pdl": False, "epilogue": "regs", "key_merge": "gather", "kv_load": "cp_async", "kv_cluster": 1,
                  "exp2_fma": 0, "rescale": "always", "softmax_overlap": False, "lean_addressing": False,
                  "p_operand": "regs", "empty_warpgroups": "compute", "causal_extent": "tile",
                  "stripe_order": "fixed"}
    # The amount of work, not its form: a tiling tuned on one batch/heads/length is a good start on
    # another; head_dim, dtype, the mask and the layout must match (warm start). K/V heads too are an
    # amount (of K/V traffic): the kernel's code is the same for every group size.
    size_fields = frozenset({"batch", "heads", "kv_heads", "seq_q", "seq_k"})

    # ------------------------------------------------------------ shapes
    def parse_shape(self, text: str) -> Shape:
        return parse_shape(text)

    def shape_from_dict(self, d: dict) -> Shape:
        return Shape.from_dict(d)

    def presets(self) -> dict:
        return dict(PRESETS)

    def shape_columns(self, shape: Shape) -> dict:
        columns = {"B": str(shape.batch), "H": str(shape.heads), "Sq": str(shape.seq_q), "Sk": str(shape.seq_k),
                   "D": str(shape.head_dim) + (f"/{shape.dv}" if shape.has_dv else ""), "dtype": shape.dtype,
                   "causal": "yes" if shape.causal else "no"}
        if shape.is_varlen:  # the longest sequence and the tokens in all
            columns.update(Sq=f"<={shape.seq_q} ({shape.total_q})", Sk=f"<={shape.seq_k} ({shape.total_k})")
        return columns

    def describe_shape(self, shape: Shape) -> str:
        kv = f" KV={shape.kv_heads}" if shape.kv_heads != shape.heads else ""
        mods = f" softcap={shape.softcap:g}" if shape.has_softcap else ""
        mods += f" window=({shape.window_left},{shape.window_right})" if shape.has_window else ""
        mods += " sinks" if shape.sinks else ""
        mods += f" Dv={shape.dv}" if shape.has_dv else ""
        if shape.is_varlen:
            return (f"varlen B={shape.batch} H={shape.heads}{kv} Sq<={shape.seq_q} ({shape.total_q} in all) "
                    f"Sk<={shape.seq_k} ({shape.total_k} in all) D={shape.head_dim}{mods}")
        return f"B={shape.batch} H={shape.heads}{kv} Sq={shape.seq_q} Sk={shape.seq_k} D={shape.head_dim}{mods}"

    def sanitize_shape(self, shape: Shape) -> Shape:
        """A small ragged shape of the same class (head dim, dtype, mask, layout, K/V group size:
        two K/V heads then, so a head-group index that is off by one group shows)."""
        from dataclasses import replace

        if shape.is_varlen:
            return _varlen.sanitize_shape(shape)
        grouped = shape.kv_heads != shape.heads
        return replace(shape, batch=1, heads=2 * shape.kv_group if grouped else 2, kv_heads=2 if grouped else 0,
                       seq_q=197, seq_k=300 if not shape.causal else 197)

    def rate(self, shape: Shape, time_us: float) -> float:
        return shape.flops() / time_us / 1e6  # TFLOP/s

    # ------------------------------------------------------------ CPU side
    def check_shape(self, shape: Shape) -> None:
        """Refuse shapes the kernel does not compute, with the reason."""
        if shape.head_dim not in HEAD_DIMS:
            raise UsageError(f"attention: head_dim {shape.head_dim} is not supported "
                             f"({', '.join(map(str, HEAD_DIMS[:-1]))} or {HEAD_DIMS[-1]})")
        if shape.dtype not in ("fp16", "bf16"):
            raise UsageError(f"attention: dtype {shape.dtype} is not supported (fp16 or bf16)")
        if shape.has_dv and (shape.head_dim, shape.dv) not in HEAD_DIM_V_PAIRS:
            pairs = ", ".join(f"{d}/{dv}" for d, dv in HEAD_DIM_V_PAIRS)
            raise UsageError(f"attention: value head dim {shape.dv} beside head dim {shape.head_dim} is not supported "
                             f"(q, k / v: {pairs}, or one head dim for all three)")
        if shape.has_dv and shape.is_varlen:
            raise UsageError(f"attention: {shape.spec}: a value head dim of its own is not supported with varlen")

    def context(self, shape: Shape) -> dict:
        """Names the search space's expressions may use for this shape."""
        return shape_context(shape)

    def knob_domains(self) -> dict:
        return KNOB_DOMAINS

    def template_args(self, config, shape: Shape) -> list[tuple[str, object]]:
        """(name, value) of the traits' template parameters, in order: AttnTraits for mma.sync,
        hopper::HopperTraits for wgmma (whose BLOCK_M is 64 rows per consumer warpgroup)."""
        problem_args = [
            ("HEAD_DIM", shape.head_dim),
            ("IS_BF16", "true" if shape.dtype == "bf16" else "false"),
            ("IS_CAUSAL", "true" if shape.causal else "false"),
        ]
        if is_wgmma(config):
            return [
                ("BLOCK_N", int(knob(config, "block_n"))),
                ("CONSUMER_WGS", int(knob(config, "compute_warps")) // 4),
                ("PRODUCER_WARPS", int(knob(config, "producer_warps"))),
                ("STAGES", int(knob(config, "stages"))),
                ("Q_IN_REGS", "true" if knob(config, "q_in_regs") else "false"),
                ("PINGPONG", "true" if knob(config, "pingpong") else "false"),
                ("PERSISTENT", "true" if knob(config, "persistent") else "false"),
                ("PDL", "true" if is_pdl(config) else "false"),
                ("TMA_STORE", "true" if is_tma_store(config) else "false"),
                ("EXP2_FMA", exp2_fma_eighths(config)),
                ("RESCALE_SLACK", -1 if rescale_slack_log2(config) is None else rescale_slack_log2(config)),
                ("SOFTMAX_OVERLAP", "true" if is_softmax_overlap(config) else "false"),
                ("LEAN_ADDRESSING", "true" if is_lean_addressing(config) else "false"),
                ("CAUSAL_WG", "true" if is_causal_warpgroup(config) else "false"),
                ("SKIP_EMPTY", "true" if is_skip_empty(config) else "false"),
                ("P_SMEM", "true" if is_p_smem(config) else "false"),
                ("STRIPE_MIRROR", "true" if is_stripe_mirror(config) else "false"),
            ] + problem_args + score_mod_args(shape) + varlen_args(shape) + head_dim_v_args(shape)
        if has_score_mods(shape) or shape.is_varlen or shape.has_dv:
            raise UsageError(f"attention: {shape.spec}: softcap, window, sinks, varlen and a value head dim of its own "
                             f"are in the Hopper kernel only (mma = wgmma); the mma.sync kernel does not compute them")
        return [
            ("BLOCK_M", int(knob(config, "block_m"))),
            ("BLOCK_N", int(knob(config, "block_n"))),
            ("COMPUTE_WARPS", int(knob(config, "compute_warps"))),
            ("PRODUCER_WARPS", int(knob(config, "producer_warps"))),
            ("STAGES", int(knob(config, "stages"))),
            ("SMEM_LAYOUT", SMEM_LAYOUTS[knob(config, "smem_layout")]),
            ("Q_IN_REGS", "true" if knob(config, "q_in_regs") else "false"),
            ("KV_SPLITS", int(knob(config, "kv_splits"))),
            ("WARP_KEY_GROUPS", int(knob(config, "warp_key_groups"))),
            ("PDL", "true" if is_pdl(config) else "false"),
            ("EXP2_FMA", exp2_fma_eighths(config)),
            ("SPLIT_MERGE", "true" if is_split_merge(config) else "false"),
            ("KV_LOAD", 2 if is_tma_split(config) else 1 if is_tma_load(config) else 0),
            ("KV_CLUSTER", kv_cluster(config)),
        ] + problem_args

    def instantiation(self, config, shape: Shape, write_lse: bool = False) -> str:
        """The entry point; with `write_lse` (training: the op's autograd path, never searched) it also takes
        `float* lse, long long lse_sb, long long lse_sh` and writes each query row's natural-log log-sum-exp."""
        args = self.template_args(config, shape)
        targs = ",\n    ".join(f"/* {name} = */ {value}" for name, value in args)
        lse_params = ",\n                  float* __restrict__ lse, long long lse_sb, long long lse_sh" if write_lse else ""
        lse_args, lse_targ = (", lse, lse_sb, lse_sh", ", true") if write_lse else ("", "")
        # softcap / window / sinks shapes (Hopper only): their runtime values last (ScoreArgs), after lse's (defaults
        # without it); the sinks pointer only where the shape has sinks, so softcap and window kernels keep their entry.
        mod_params, mod_args = "", ""
        if has_score_mods(shape):
            sink_param, sink_arg = (", const float* __restrict__ sinks", ", sinks") if shape.sinks else ("", "")
            mod_params = ",\n                  float softcap_scale, int window_left, int window_right" + sink_param
            mod_args = ("" if write_lse else ", nullptr, 0, 0") + ", {softcap_scale, window_left, window_right" + \
                sink_arg + "}"
        varlen_params, varlen_args_text, varlen_note = _varlen_entry(shape, write_lse)
        mod_params, mod_args = mod_params + varlen_params, mod_args + varlen_args_text
        geo = self.geometry(config, shape)
        asserts = launch_asserts(geo.threads, geo.dynamic_smem, ("kBlockM", rows_per_cta(config)))
        if is_wgmma(config):
            tma = is_tma_store(config)
            traits = _traits("evotune::hopper::HopperTraits", targs, _hopper_smem_members(config, shape))
            asserts += _register_split_assert(config)
            o_map_param, o_map_arg, o_map_note = (
                (", const __grid_constant__ CUtensorMap o_map", ", &o_map",
                 "\n// o_map (epilogue = tma): O's CUtensorMap, boxes of 64 columns x 64 rows (one consumer warpgroup's).")
                if tma else ("", ", nullptr", ""))
            skip_note = ("\n// empty_warpgroups = skip: the non-causal PERSISTENT grid takes tile_counter too (its tiles are "
                         "handed out).") if is_skip_empty(config) and is_persistent(config) else ""
            skip_note += varlen_note
            if shape.has_dv:
                skip_note += (f"\n// HEAD_DIM_V = {shape.dv}: V (v_map) and O (o, its strides; o_map) are {shape.dv} "
                              f"columns wide, Q and K {shape.head_dim}.")
            return f"""{traits}
{asserts}
// Launch: grid (ceil(seq_q / kBlockM), heads, batch), or with PERSISTENT (min(tiles, SMs), 1, 1) for tiles =
// ceil(seq_q / kBlockM) * heads * batch; block (EvotuneTraits::kThreads), dynamic shared
// memory EvotuneTraits::kSmemBytes. q_map, k_map, v_map: the CUtensorMaps of Q, K, V by value (4-D:
// head_dim, seq, head, batch; 128-byte swizzle; boxes of 64 columns x kBlockM or BLOCK_N rows), kernel
// parameters, so a launch uploads nothing and a CUDA graph records them with the launch.
// o: fp16/bf16 bit patterns; strides in elements (b = batch, h = head, s = sequence). kv_magic: 0, or with
// grouped-query attention ceil(2^32 / group) for group = heads / kv_heads; the K and V maps span kv_heads.
// n_heads, n_batch: the query heads and the batch. tile_counter: PERSISTENT with causal only (else null): two
// unsigned ints zeroed once; the kernel leaves them zero (one pair per launch that may run concurrently).{skip_note}{o_map_note}
extern "C" __global__ void __launch_bounds__(EvotuneTraits::kThreads, 1)
{self.entry_name}(const __grid_constant__ CUtensorMap q_map, const __grid_constant__ CUtensorMap k_map,
                  const __grid_constant__ CUtensorMap v_map, unsigned short* __restrict__ o,
                  long long o_sb, long long o_sh, long long o_ss, int seq_q, int seq_k, float scale_log2,
                  unsigned kv_magic, int n_heads, int n_batch, unsigned* tile_counter{o_map_param}{lse_params}{mod_params}) {{
    evotune::hopper::attention_fwd_wgmma<EvotuneTraits{lse_targ}>(&q_map, &k_map, &v_map, o, o_sb, o_sh, o_ss, seq_q, seq_k,
                                                        scale_log2, kv_magic, n_heads, n_batch, tile_counter{o_map_arg}{lse_args}{mod_args});
}}
"""
        traits = _sync_traits(config, targs)
        map_params, map_args, map_note = _tma_load_entry(config)
        return f"""{traits}
{asserts}
// Launch: grid (ceil(seq_q / BLOCK_M), heads, batch * KV_SPLITS), block (EvotuneTraits::kThreads),
// dynamic shared memory EvotuneTraits::kSmemBytes. Pointers are fp16/bf16 bit patterns;
// strides are in elements (b = batch, h = head, s = sequence; the head-dim stride is 1).
// With KV_SPLITS > 1 the fp32 workspace ws_o / ws_lse and the int counters ws_count
// (zeroed once; the kernel leaves them zero) hold one slice per (batch, head, query tile).
// kv_magic: 0, or with grouped-query attention ceil(2^32 / group) for group = heads / kv_heads (k and v hold
// kv_heads heads; query head h reads K/V head h / group).{map_note}
extern "C" __global__ void __launch_bounds__(EvotuneTraits::kThreads){_cluster_dims(config)}
{self.entry_name}(const unsigned short* __restrict__ q, const unsigned short* __restrict__ k,
                  const unsigned short* __restrict__ v, unsigned short* __restrict__ o,
                  long long q_sb, long long q_sh, long long q_ss, long long k_sb, long long k_sh, long long k_ss,
                  long long v_sb, long long v_sh, long long v_ss, long long o_sb, long long o_sh, long long o_ss,
                  int seq_q, int seq_k, float scale_log2, float* ws_o, float* ws_lse, int* ws_count, unsigned kv_magic{map_params}{lse_params}) {{
    evotune::attention_fwd<EvotuneTraits{lse_targ}>(q, k, v, o, q_sb, q_sh, q_ss, k_sb, k_sh, k_ss, v_sb, v_sh, v_ss,
                                          o_sb, o_sh, o_ss, seq_q, seq_k, scale_log2, ws_o, ws_lse, ws_count,
                                          {map_args}kv_magic{lse_args});
}}
"""

    def geometry(self, config, shape: Shape, multiprocessors: int = MULTIPROCESSORS) -> LaunchGeometry:
        """The launch; the instantiation asserts that the traits derive the same threads and shared memory. A
        persistent grid has min(query tiles, `multiprocessors`) CTAs (the H100's SMs unless told) and carries its
        tiles, so a launch sizes it for its device (LaunchGeometry.grid_for; launch_plan does)."""
        block_m, block_n = rows_per_cta(config), int(knob(config, "block_n"))
        if is_wgmma(config):
            # HopperTraits: Q + STAGES (K, V) tiles (V's at its head dim) + 1024 B to align them; consumer and producer
            # warps.
            smem = 2 * (tile_dim(config, shape) * (block_m + int(knob(config, "stages")) * block_n)
                        + tile_dim_v(config, shape) * int(knob(config, "stages")) * block_n) + 1024
            smem += o_stage_bytes(config, shape) + q_buffer_bytes(config, shape) + p_tile_bytes(config, shape)
            threads = 32 * (int(knob(config, "compute_warps")) + int(knob(config, "producer_warps")))
            if is_persistent(config):
                tiles = query_tiles(config, shape)
                return LaunchGeometry(grid=(min(tiles, multiprocessors), 1, 1), block=(threads, 1, 1),
                                      dynamic_smem=smem, register_split=setmaxnreg_registers(config), tiles=tiles)
            return LaunchGeometry(grid=(math.ceil(shape.seq_q / block_m), shape.heads, shape.batch),
                                  block=(threads, 1, 1), dynamic_smem=smem, register_split=setmaxnreg_registers(config))
        threads = 32 * (int(knob(config, "compute_warps")) + int(knob(config, "producer_warps")))
        pitch = shape.head_dim + (8 if knob(config, "smem_layout") == "pad" else 0)
        smem = 2 * pitch * (block_m + 2 * int(knob(config, "stages")) * block_n)
        smem += merge_bytes(config, shape) + tma_load_bytes(config)
        # kv_cluster: the query tiles padded to whole clusters (attention_tma_multicast.cuh: the extra CTA loads its
        # parts for the others and stores nothing).
        clusters = math.ceil(math.ceil(shape.seq_q / block_m) / kv_cluster(config))
        return LaunchGeometry(grid=(clusters * kv_cluster(config), shape.heads,
                                    shape.batch * int(knob(config, "kv_splits"))),
                              block=(threads, 1, 1), dynamic_smem=smem)

    def error_scale(self, inputs: dict) -> float:
        """The scale of the absolute error: O is a convex combination of V's rows, so rounding
        P or the accumulator errs in proportion to |V|. The RMS of V (1 for N(0,1) inputs)."""
        return float(inputs["v"].float().pow(2).mean().sqrt().item())

    def tolerance(self, shape: Shape) -> tuple[float, float]:
        """(atol, rtol) of the elementwise gate for this shape's dtype."""
        return TOLERANCE[shape.dtype]

    def signature(self, config=None) -> str:
        if config is not None and is_wgmma(config):
            return ("evotune_attention(const __grid_constant__ CUtensorMap q_map, k_map, v_map  /* by value: 3 x 128 B "
                    "kernel parameters */, unsigned short* o, int64 o_sb, o_sh, o_ss, int seq_q, int seq_k, "
                    "float scale_log2, uint32 kv_magic, int n_heads, int n_batch, uint32* tile_counter)  // kv_magic = "
                    "kv_head_magic(heads / kv_heads): 0 without grouping; n_heads, n_batch: the query heads and batch; "
                    "tile_counter: persistent causal (or empty_warpgroups = skip) only, 2 zeroed uint32 the kernel leaves zero "
                    "(else null)"
                    + (", const __grid_constant__ CUtensorMap o_map  /* epilogue = tma: O's map by value */"
                       if is_tma_store(config) else "")
                    + "  // softcap or window shapes add float softcap_scale (scale / C; scale_log2 is then C log2 e), "
                    "int window_left, int window_right (clamped to seq_k, seq_q) last")
        return ("evotune_attention(const unsigned short* q, k, v, unsigned short* o  /* fp16 or bf16 bit patterns */, "
                "int64 q_sb, q_sh, q_ss, k_sb, k_sh, k_ss, v_sb, v_sh, v_ss, o_sb, o_sh, o_ss, "
                "int seq_q, int seq_k, float scale_log2, float* ws_o, float* ws_lse, int* ws_count, uint32 kv_magic"
                + (", const __grid_constant__ CUtensorMap q_map, k_map, v_map  /* kv_load = tma: by value */"
                   if config is not None and is_tma_load(config) else "")
                + ")  // strides in elements; scale_log2 = scale*log2(e); workspace only for kv_splits > 1; "
                "kv_magic = 0, or ceil(2^32 / (heads / kv_heads)) with grouped-query attention")

    def launch_notes(self, config, shape: Shape) -> list[str]:
        """Extra launch requirements for an export header."""
        cluster = [f"kv_cluster   the entry's __cluster_dims__({kv_cluster(config)}, 1, 1) groups consecutive query tiles; "
                   f"grid x is padded to a multiple of {kv_cluster(config)} (a plain launch forms the clusters)"
                   ] if is_tma_multicast(config) else []
        pdl = ["pdl          cudaLaunchKernelEx with cudaLaunchAttributeProgrammaticStreamSerialization = 1 lets it "
               "start under the previous kernel's tail (its griddepcontrol.wait precedes every global access); a "
               "plain launch is correct too (the wait then returns at once)"] if is_pdl(config) else []
        return self._workspace_notes(config, shape) + cluster + pdl

    def _workspace_notes(self, config, shape: Shape) -> list[str]:
        n_o, n_lse, n_count = self.workspace_elems(config, shape)
        maps = [f"tensor maps  cuTensorMapEncodeTiled, rank 4 (head_dim, seq, head, batch), strides in bytes, "
                f"SWIZZLE_128B, OOB fill zero; boxes 64 x {rows_per_cta(config)} (Q), 64 x "
                f"{int(knob(config, 'block_n')) // kv_cluster(config)} (K, V)" + (", 64 x 64 (O: epilogue = tma, stored through it)"
                                                             if is_tma_store(config) else ""),
                "             passed by value (CUtensorMap arguments of <<<>>>, or pointers to them in "
                "cuLaunchKernel's kernelParams); nothing to copy to the device"] if uses_tensor_maps(config) else []
        if not is_wgmma(config):
            if not n_count:
                return ["workspace    none (kv_splits = 1): pass null for ws_o, ws_lse, ws_count"] + maps
            return [f"workspace    ws_o {n_o} fp32, ws_lse {n_lse} fp32, ws_count {n_count} int32 zeroed once "
                    f"(the kernel leaves the counters zero)"] + maps
        notes = maps
        if is_persistent(config):
            notes.append(f"persistent   grid (min({query_tiles(config, shape)} query tiles, the device's SMs), 1, 1): "
                         f"each CTA loops over the tiles; the grid above is the H100's {MULTIPROCESSORS} SMs")
        notes.append(f"tile_counter {n_count} uint32 zeroed once (the persistent grid's tile scheduler, causal or "
                     "empty_warpgroups = skip; the "
                     "kernel leaves them zero; one pair per concurrently running launch)" if n_count
                     else "tile_counter none: pass null")
        return notes

    def workspace_elems(self, config, shape: Shape) -> tuple[int, int, int]:
        """(ws_o floats, ws_lse floats, ws_count ints) a launch needs: the split-KV workspace (kv_splits > 1), or
        the two tile counters of the persistent Hopper grid when causal or empty_warpgroups = skip (tile_counter);
        zeros otherwise."""
        if is_wgmma(config):
            return (0, 0, 2) if uses_tile_counter(config, shape) else (0, 0, 0)
        splits = int(knob(config, "kv_splits"))
        if splits == 1:
            return 0, 0, 0
        tiles = math.ceil(shape.seq_q / int(knob(config, "block_m"))) * shape.heads * shape.batch
        rows = tiles * splits * int(knob(config, "block_m"))
        return rows * shape.head_dim, rows, tiles

    # ------------------------------------------------------------ GPU side
    def torch_dtype(self, shape: Shape):
        import torch

        return {"fp16": torch.float16, "bf16": torch.bfloat16}[shape.dtype]

    # Input patterns of the gate. "normal" is N(0,1); the others stress the online softmax.
    PATTERNS = ("normal", "large", "dominant_key", "equal_scores", "very_negative")

    def make_inputs(self, shape: Shape, seed: int, device="cuda", pattern: str = "normal") -> dict:
        """Fresh Q, K, V in the shape's layout (never zeros); the output buffer comes from `new_output`.

        large:         |Q|, |K| x4 (peaked softmax, scores ~ N(0, 16^2)) and |V| x30 (large |O|)
        dominant_key:  one key per head aligned with every query: it takes almost all the mass
        equal_scores:  every key identical: uniform attention, O = mean of V
        very_negative: keys point away from the queries: scaled scores near -240, so exp()
                       underflows to 0 in fp32 unless the running max is subtracted
        """
        import torch

        if pattern not in self.PATTERNS:
            raise UsageError(f"attention: unknown input pattern {pattern!r}; patterns: {', '.join(self.PATTERNS)}")
        if shape.is_varlen:  # the packed tensors as (1, H, total, D) views, and cu_seqlens_q / _k (problems.varlen)
            return _varlen.make_inputs(self, shape, seed, device, pattern)
        gen = torch.Generator(device=device)
        gen.manual_seed(seed)
        dt = self.torch_dtype(shape)
        b, h, hk, d = shape.batch, shape.heads, shape.kv_heads, shape.head_dim

        def randn(seq, heads=h, dim=d):  # (B, heads, seq, dim) in fp32
            return torch.randn(b, heads, seq, dim, generator=gen, device=device)

        # K and V have kv_heads heads (grouped-query attention): never expanded per query head here. V: its head dim.
        q, k, v = randn(shape.seq_q), randn(shape.seq_k, hk), randn(shape.seq_k, hk, shape.dv)
        if pattern == "large":
            q, k, v = q * 4, k * 4, v * 30
        elif pattern in ("dominant_key", "very_negative"):
            u = torch.randn(b, hk, 1, d, generator=gen, device=device)  # one direction per K/V head
            q = u.repeat_interleave(shape.kv_group, dim=1) + 0.3 * q  # ... shared by its group's queries
            if pattern == "dominant_key":
                j = int(torch.randint(shape.seq_k, (1,), generator=gen, device=device).item())
                k[:, :, j, :] = 4 * u[:, :, 0, :]
            else:
                k = -30 * u + 0.3 * k
        elif pattern == "equal_scores":
            k = k[:, :, :1, :].expand_as(k).clone()

        def place(t):
            if shape.layout == "bshd":
                # A model's projection output: (B, S, H, D) memory, viewed as (B, H, S, D) without a copy.
                return t.transpose(1, 2).contiguous().to(dt).transpose(1, 2)
            return t.to(dt).contiguous()

        inputs = {"q": place(q), "k": place(k), "v": place(v), "scale": 1.0 / math.sqrt(shape.head_dim)}
        if shape.sinks:
            inputs["sinks"] = sink_logits(shape, gen, device)
        return inputs

    def perturb(self, shape: Shape, inputs: dict, rng=None) -> tuple[dict, object]:
        """Inputs with one key/value row changed, and the boolean (B, H, Sq) mask of output rows that must
        change (all others must stay bitwise equal): those of every query head of that K/V head's group that
        can see the key. The row (batch, K/V head, key) is drawn from `rng` (a random.Random); without one,
        the middle key of the last batch and K/V head."""
        import torch

        if shape.is_varlen:  # one key of one sequence; no other sequence's row may move
            return _varlen.perturb(self, shape, inputs, rng, visibility_mask)
        # A key some query can see: with top-left causal and Sq < Sk, keys past Sq-1 are seen by none; with a
        # window, the keys between the first row's left edge and the last row's right edge.
        lo, hi = 0, (min(shape.seq_q, shape.seq_k) if shape.causal else shape.seq_k) - 1
        if shape.has_window:
            lo, hi = shape.key_range(0)[0], shape.key_range(shape.seq_q - 1)[1]
            if hi < lo:
                raise UsageError(f"attention: {shape.spec}: no query sees any key; nothing to perturb")
        if rng is None:
            b, kvh, j = shape.batch - 1, shape.kv_heads - 1, (lo + hi + 1) // 2
        else:
            b, kvh, j = rng.randrange(shape.batch), rng.randrange(shape.kv_heads), rng.randint(lo, hi)
        device = inputs["k"].device
        must_change = torch.zeros(shape.batch, shape.heads, shape.seq_q, dtype=torch.bool, device=device)
        group = slice(kvh * shape.kv_group, (kvh + 1) * shape.kv_group)  # the query heads that read K/V head kvh
        if shape.has_window:
            must_change[b, group, :] = visibility_mask(shape, device)[:, j]  # the rows whose window holds key j
        elif shape.causal:
            must_change[b, group, j:] = True  # top-left causal: query i sees key j iff j <= i
        else:
            must_change[b, group, :] = True
        # The key is aimed at one query that sees it (problems.aim_key): with Sq = 1 and Sk in the thousands a key
        # nudged by a constant moved no row beyond the tolerance.
        seen = must_change[b].nonzero().tolist()  # (head, row) pairs; j lies in [lo, hi], so some row sees it
        head, row = seen[rng.randrange(len(seen))] if rng is not None else seen[-1]
        k, v = aim_key(inputs, b, kvh, j, head, row)
        return {**inputs, "k": k, "v": v}, must_change

    def new_output(self, inputs: dict):
        import torch

        q, v = inputs["q"], inputs["v"]
        if v.shape[-1] == q.shape[-1]:
            return torch.empty_like(q)  # keeps the (B,H,S,D) or (B,S,H,D) strides
        # A value head dim of its own (dense shapes only): (B, H, Sq, Dv) in q's layout.
        b, h, sq, dv = q.shape[0], q.shape[1], q.shape[2], v.shape[-1]
        bshd = q.stride(1) < q.stride(2)
        stride = (sq * h * dv, dv, h * dv, 1) if bshd else (h * sq * dv, sq * dv, dv, 1)
        return torch.empty_strided((b, h, sq, dv), stride, dtype=q.dtype, device=q.device)

    def launch_plan(self, config, shape: Shape) -> "LaunchPlan":
        """What a launch of `config` on `shape` needs besides the tensors (grid, block, shared memory, the
        variant, the workspace sizes, whether it is a programmatic dependent launch), worked out once per
        (config, shape): the op launches the same key
        call after call, and each call then only packs pointers and strides."""
        return _launch_plan(self, config, shape, current_multiprocessors() if is_persistent(config) else MULTIPROCESSORS)

    def entry_params(self, config, write_lse: bool = False, shape: Shape | None = None) -> tuple:
        """The entry point's parameters in order, (name, kind), kind one of "ptr" (u64), "i64", "i32",
        "f32", "u32" and "map" (a 128-byte CUtensorMap by value): the one list both launch paths (CuPy's
        call here, the PyTorch op's reusable parameter packet) read, matching `instantiation`. A softcap, window or
        sinks `shape` adds their runtime values last (SCORE_MOD_PARAMS, then SINK_PARAMS)."""
        params = _entry_params(is_wgmma(config), write_lse, is_tma_store(config), is_tma_load(config))
        if shape is not None and has_score_mods(shape):
            params += SCORE_MOD_PARAMS + (SINK_PARAMS if shape.sinks else ())
        if shape is not None and shape.is_varlen:
            params += VARLEN_PARAMS
        return params

    def launch_values(self, config, shape: Shape, q, k, v, out, scale: float, lse=None, workspace=(),
                      sinks=None, cu_seqlens=None) -> dict:
        """name -> value of every entry parameter for these tensors (ints, floats, map records).
        `lse`: the (B, H, Sq) fp32 log-sum-exp output of a write_lse kernel (any strides, unit last one); varlen: (1, H,
        total_q) with a unit row stride. `sinks`: a sinks shape's (H,) contiguous fp32 sink logits on q's device
        (check_sinks). Varlen: q, k, v and out are the packed tensors seen as one batch, (1, H, total, D) views of (total,
        H, D) memory (packed_view), and `cu_seqlens` the pair of (B + 1,) int32 offset tensors (check_cu_seqlens)."""
        plan = self.launch_plan(config, shape)
        for name, t in (("q", q), ("k", k), ("v", v), ("o", out)):
            if t.stride(-1) != 1 or t.data_ptr() % 16 or any(s % 8 for s in t.stride()[:-1]):
                raise UsageError(f"attention: {name} must have unit head-dim stride and 16-byte aligned rows")
        if k.shape[1] != shape.kv_heads or v.shape[1] != shape.kv_heads or q.shape[1] != shape.heads:
            raise UsageError(f"attention: q, k, v have {q.shape[1]}, {k.shape[1]}, {v.shape[1]} heads; the shape "
                             f"{shape.spec} has {shape.heads} query and {shape.kv_heads} K/V heads")
        # softcap: the cap C folds into scale_log2 (C log2 e) and softcap_scale (scale / C) (score_mod_values).
        values = {"o": out.data_ptr(), "o_sb": out.stride(0), "o_sh": out.stride(1), "o_ss": out.stride(2),
                  "seq_q": shape.seq_q, "seq_k": shape.seq_k,
                  "scale_log2": (shape.softcap if shape.has_softcap else scale) * math.log2(math.e),
                  "kv_magic": int(plan.kv_magic), "n_heads": shape.heads, "n_batch": shape.batch}
        if plan.workspace[2] and len(workspace) != 3:
            raise UsageError(f"attention: this launch needs its workspace (new_workspace), got {len(workspace)} tensors")
        if uses_tensor_maps(config):
            values.update(zip(MAP_PARAMS, self.tensor_maps(config, shape, {"q": q, "k": k, "v": v, "o": out})))
        if plan.wgmma:
            values["tile_counter"] = workspace[2].data_ptr() if workspace else 0
        else:
            for name, t in (("q", q), ("k", k), ("v", v)):
                values.update({name: t.data_ptr(), f"{name}_sb": t.stride(0), f"{name}_sh": t.stride(1),
                               f"{name}_ss": t.stride(2)})
            values.update(zip(("ws_o", "ws_lse", "ws_count"), [t.data_ptr() for t in workspace] or (0, 0, 0)))
        if lse is not None:
            values.update(lse=lse.data_ptr(), lse_sb=lse.stride(0), lse_sh=lse.stride(1))
        if has_score_mods(shape):
            values.update(score_mod_values(shape, scale))
        if shape.sinks:
            values["sinks"] = check_sinks(sinks, shape, q.device).data_ptr()
        if shape.is_varlen:
            for name, t, total in (("q", q, shape.total_q), ("k", k, shape.total_k), ("o", out, shape.total_q)):
                if t.shape[0] != 1 or t.shape[2] != total:
                    raise UsageError(f"attention: {shape.spec}: {name} must be the packed tensor seen as (1, H, {total}, D), "
                                     f"got {tuple(t.shape)}")
            if lse is not None and lse.stride(-1) != 1:
                raise UsageError("attention: a varlen log-sum-exp is (1, H, total_q) with a unit row stride")
            cu_q, cu_k = check_cu_seqlens(cu_seqlens, shape, q.device)
            values.update(cu_seqlens_q=cu_q.data_ptr(), cu_seqlens_k=cu_k.data_ptr())
        return values

    def new_workspace(self, config, shape: Shape, device) -> tuple:
        """The workspace of one launch ((ws_o, ws_lse, ws_count) tensors; () when workspace_elems is zeros): the
        split-KV slices, or the Hopper persistent grid's tile counters (ws_count, as tile_counter). Per
        launch, not per plan: two streams may run the same config at once. Counters start at zero and the
        kernel re-zeroes them."""
        n_o, n_lse, n_count = self.launch_plan(config, shape).workspace
        if not n_count:
            return ()
        import torch

        return (torch.empty(n_o, dtype=torch.float32, device=device),
                torch.empty(n_lse, dtype=torch.float32, device=device),
                torch.zeros(n_count, dtype=torch.int32, device=device))

    def launcher(self, kernel, config, shape: Shape, inputs: dict, out, lse=None):
        """A zero-argument callable that launches the kernel on torch's current stream (`lse`: see launch_values)."""
        from ..build.compile import torch_stream_launcher

        plan = self.launch_plan(config, shape)
        q, k, v = inputs["q"], inputs["k"], inputs["v"]
        workspace = self.new_workspace(config, shape, out.device)
        values = self.launch_values(config, shape, q, k, v, out, inputs["scale"], lse, workspace, inputs.get("sinks"),
                                    (inputs["cu_seqlens_q"], inputs["cu_seqlens_k"]) if shape.is_varlen else None)
        args = tuple(as_kernel_arg(kind, values[name]) for name, kind in self.entry_params(config, lse is not None, shape))
        # The workspace is kept alive by the launcher (its first default argument).
        return torch_stream_launcher(kernel, plan.grid, plan.block, args, plan.dynamic_smem, keep=workspace,
                                     pdl=plan.pdl)

    def tensor_map_args(self, config, shape: Shape, strides: dict) -> dict:
        """name -> TiledMapArgs of the maps a launch needs (uses_tensor_maps), in the entry's order: Q, K, V, and with
        the Hopper variant's TMA-store epilogue O; `strides` maps each name to its tensor's (B, H, S, D) element strides ("o" is
        read only for that epilogue). Pure: checked on the CPU."""
        names = MAP_TENSORS[:4 if is_tma_store(config) else 3]
        return dict(zip(names, _map_args(config, shape, *(tuple(strides[n]) for n in names))))

    def tensor_maps(self, config, shape: Shape, inputs: dict) -> tuple:
        """The tensor maps (tensor_map_args) of these tensors ("q", "k", "v", and "o" the output) as the kernel's
        by-value arguments (tma.param: 128-byte numpy records), each encoded once per (address, layout) and
        remembered (tma.map_param)."""
        from ..build.tma import map_param

        args = self.tensor_map_args(config, shape, {n: t.stride() for n, t in inputs.items()})
        return tuple(map_param(inputs[n].data_ptr(), a) for n, a in args.items())

    def reference(self, shape: Shape, inputs: dict):
        """softmax(cap(scale·QKᵀ) + mask)·V in fp32 (no TF32), one (batch, head-chunk) at a time to bound memory;
        cap(s) = C tanh(s / C) with a softcap, the mask visibility_mask's (causal, window), a row that sees no key 0.
        With sinks each row's softmax has one more column, its head's sink logit, that carries no value.
        Grouped K/V heads are expanded per query head here only, one chunk at a time. Varlen: each sequence's."""
        import torch

        if shape.is_varlen:
            return _varlen.reference(self, shape, inputs)

        q, k, v = (inputs[n].float() for n in ("q", "k", "v"))
        out = torch.empty(q.shape[:-1] + v.shape[-1:], dtype=torch.float32, device=q.device)  # O: V's head dim
        prev = torch.backends.cuda.matmul.allow_tf32
        torch.backends.cuda.matmul.allow_tf32 = False
        try:
            heads_per_chunk = max(1, (1 << 27) // (shape.seq_q * shape.seq_k))
            mask = visibility_mask(shape, q.device)
            for b in range(shape.batch):
                for h0 in range(0, shape.heads, heads_per_chunk):
                    sl = (b, slice(h0, h0 + heads_per_chunk))
                    kv_sl = (b, torch.arange(h0, min(h0 + heads_per_chunk, shape.heads), device=q.device)
                             // shape.kv_group) if shape.kv_group > 1 else sl
                    s = torch.matmul(q[sl], k[kv_sl].transpose(-1, -2)) * inputs["scale"]
                    if shape.has_softcap:
                        s = shape.softcap * torch.tanh(s / shape.softcap)
                    if mask is not None:
                        s = s.masked_fill(~mask, float("-inf"))
                    if shape.sinks:
                        out[sl] = torch.matmul(sink_probs(s, inputs["sinks"][sl[1]]), v[kv_sl])
                        continue
                    p = torch.softmax(s, dim=-1)
                    if mask is not None and shape.has_window:
                        p = torch.nan_to_num(p, nan=0.0)  # a row whose window holds no key: O = 0 (flash-attention's)
                    out[sl] = torch.matmul(p, v[kv_sl])
        finally:
            torch.backends.cuda.matmul.allow_tf32 = prev
        return out

    def baselines(self) -> list[str]:
        return ["flash", "cudnn", "efficient", "math"]

    def baselines_for(self, shape: Shape) -> list[str]:
        """SDPA's backends; with a softcap or a window also FlexAttention (compiled, the same mask and score_mod):
        issue 42's anchor for those semantics, and, where SDPA cannot compute them, the fastest PyTorch path there.
        Varlen: FlexAttention with a document mask too (SDPA's backends only where every sequence has one length)."""
        return self.baselines() + (["flex"] if has_score_mods(shape) or shape.is_varlen else [])

    def baseline_skip_reason(self, name: str, shape: Shape) -> str | None:
        if shape.is_varlen:
            why = _varlen.skip_reason(name, shape)
            dense = _varlen.dense_equivalent(shape)
            return why if why or name == "flex" else self.baseline_skip_reason(name, dense)
        if name == "flex":
            return None if has_score_mods(shape) else "skipped: FlexAttention only beside softcap/window/sinks"
        if shape.sinks:
            return "skipped: SDPA has no attention sinks"
        if shape.has_softcap:
            return "skipped: SDPA has no softcap"
        if shape.has_window and name == "flash":
            return "skipped: SDPA's flash backend takes no mask (a window is a boolean attn_mask)"
        if shape.has_dv and name == "flash":
            return "skipped: SDPA's flash backend needs one head dim for q, k and v"
        if name == "math" and shape.seq_q * shape.seq_k * shape.batch * shape.heads > (1 << 28):
            return "skipped: the math backend's S matrix is too large"
        if shape.kv_heads != shape.heads and not sdpa_has_gqa():
            import torch

            return f"skipped: torch {torch.__version__} SDPA has no enable_gqa (torch >= 2.5 reads grouped K/V heads)"
        return None

    def baseline_launcher(self, name: str, shape: Shape, inputs: dict, probe: bool = True):
        """A callable running SDPA with one backend forced (a window as its boolean attn_mask, as the op's fallback
        passes it), or FlexAttention, returning its output; with `probe`, None if the backend refuses these inputs
        (found by running it once)."""
        import torch.nn.functional as F
        from torch.nn.attention import SDPBackend, sdpa_kernel

        if shape.is_varlen:  # FlexAttention with a document mask; SDPA on the dense batch of uniform lengths
            if name == "flex":
                return self.probed(_varlen.flex_launcher(shape, inputs, _flex_fns(), sees), probe)
            return _varlen.sdpa_launcher(self, name, shape, inputs, probe)
        if name == "flex":
            return self.probed(flex_launcher(shape, inputs), probe)
        backend = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
                   "efficient": SDPBackend.EFFICIENT_ATTENTION, "math": SDPBackend.MATH}[name]
        q, k, v = inputs["q"], inputs["k"], inputs["v"]

        # Grouped K/V heads go in un-repeated (enable_gqa); the keyword only where needed, so SDPA's path
        # for ungrouped shapes is the one it always was.
        gqa = {"enable_gqa": True} if shape.kv_heads != shape.heads else {}
        mask = visibility_mask(shape, q.device) if shape.has_window else None
        masked = {"attn_mask": mask} if mask is not None else {}

        def run():
            with sdpa_kernel([backend]):
                return F.scaled_dot_product_attention(q, k, v, is_causal=shape.causal and mask is None,
                                                      scale=inputs["scale"], **masked, **gqa)

        return self.probed(run, probe)


# FlexAttention per process: one compiled flex_attention, and per mask/score signature (the shape's sizes, mask and
# cap) one mask_mod, score_mod and block mask, built once: torch.compile guards on the mods' identity, so a new
# closure per launcher (each input set, each check) would recompile at every launcher.
_FLEX: dict = {}


def flex_launcher(shape: Shape, inputs: dict):
    """FlexAttention on `inputs` with `shape`'s causal mask, window (bottom-right) and softcap, compiled; with sinks,
    its output and log-sum-exp through the sink's share (flex_with_sinks), compiled with it."""
    q, k, v = inputs["q"], inputs["k"], inputs["v"]
    kw = dict(_flex_mods(shape, q.device))
    kw.update(scale=inputs["scale"], enable_gqa=shape.kv_heads != shape.heads)
    if shape.sinks:
        fn, sinks = _FLEX["sink_fn"], inputs["sinks"]
        return lambda: fn(q, k, v, sinks, **kw)
    fn = _FLEX["fn"]
    return lambda: fn(q, k, v, **kw)


def flex_with_sinks(q, k, v, sinks, **kw):
    """Attention sinks on FlexAttention, which has none: a sink adds exp(sink) to each row's softmax denominator, so
    the output without it, O, and its log-sum-exp L give O · exp(L) / (exp(L) + exp(sink)) = O · sigmoid(L - sink)
    (flash-attention's and the gpt-oss reference's semantics; a row that sees no key has L = -inf and gets 0)."""
    import torch
    from torch.nn.attention.flex_attention import AuxRequest, flex_attention

    out, aux = flex_attention(q, k, v, return_aux=AuxRequest(lse=True), **kw)
    share = torch.sigmoid(aux.lse - sinks.view(1, -1, 1))
    return (out.float() * share.unsqueeze(-1)).to(out.dtype)


def _flex_fns() -> dict:
    """_FLEX with the compiled flex_attention ("fn") and flex_with_sinks ("sink_fn"), made once per process."""
    import torch
    from torch.nn.attention.flex_attention import flex_attention

    if "fn" not in _FLEX:
        # dynamic=False: a shape of its own is a static compile of its own. With automatic dynamic shapes the third
        # shape of a process compiled with symbolic sizes, which inductor's flex lowering refused (InductorError, H200,
        # torch 2.11), and the baseline read as "not supported".
        _FLEX["fn"] = torch.compile(flex_attention, dynamic=False)
        _FLEX["sink_fn"] = torch.compile(flex_with_sinks, dynamic=False)
    return _FLEX


def _flex_mods(shape: Shape, device) -> dict:
    import torch
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    _flex_fns()
    sq, sk = shape.seq_q, shape.seq_k
    left, right, causal, cap = shape.window_left, shape.window_right, shape.causal, shape.softcap
    key = (sq, sk, left, right, causal, cap, str(device))
    if key in _FLEX:
        return _FLEX[key]

    def mask_mod(b, h, qi, kj):
        return sees(qi, kj, sq, sk, causal, left, right)

    def score_mod(s, b, h, qi, kj):
        return cap * torch.tanh(s / cap)

    mods = {"block_mask": create_block_mask(mask_mod, None, None, sq, sk, device=device)
            if causal or shape.has_window else None}
    if shape.has_softcap:
        mods["score_mod"] = score_mod
    _FLEX[key] = mods
    return mods


def _varlen_entry(shape: Shape, write_lse: bool) -> tuple[str, str, str]:
    """(parameters, arguments, comment) a varlen shape's Hopper entry adds (VarlenArgs, hopper/varlen.cuh): the
    sequences' offsets last, after the score mods' values (their defaults where the shape has none, and lse's where
    it has none); seq_q / seq_k carry max_seqlen_q / _k. Empty strings for a dense shape."""
    if not shape.is_varlen:
        return "", "", ""
    defaults = "" if has_score_mods(shape) else ("" if write_lse else ", nullptr, 0, 0") + ", {0.f, 0, 0, nullptr}"
    return (",\n                  const int* __restrict__ cu_seqlens_q, const int* __restrict__ cu_seqlens_k",
            defaults + ", {cu_seqlens_q, cu_seqlens_k}",
            "\n// VARLEN: grid z is the sequence; q_map, k_map, v_map span the packed tensors as one batch (head_dim, "
            "total,\n// heads, 1); o points at the packed O (total_q, heads, head_dim); seq_q, seq_k: max_seqlen_q, "
            "max_seqlen_k;\n// cu_seqlens_q, cu_seqlens_k: the B + 1 int32 prefix sums of the sequences' lengths "
            "(hopper/varlen.cuh).")


def _sync_traits(config, targs: str) -> str:
    """The mma.sync instantiation's EvotuneTraits. Only split-merge and TMA-loading configs' text differs from the plain
    AttnTraits (so every other config keeps its source): the split merge's slots replace gather's (kMergeBytes) in the
    launch's shared memory (kernels/attention_split_merge.cuh); TMA loads add their mbarriers and the slack that
    aligns the tiles to 1024 bytes (kernels/attention_tma_load.cuh)."""
    smem_terms = ((" - kMergeBytes + evotune::SplitMerge<EvotuneBaseTraits>::kBytes" if is_split_merge(config) else "")
                  + (f" + evotune::{'TmaSplit' if is_tma_split(config) else 'TmaLoad'}<EvotuneBaseTraits>::kExtraBytes"
                     if is_tma_load(config) else ""))
    members = [f"static constexpr int kSmemBytes = EvotuneBaseTraits::kSmemBytes{smem_terms};"] if smem_terms else []
    return _traits("evotune::AttnTraits", targs, members)


def _hopper_smem_members(config, shape: Shape) -> list[str]:
    """The Hopper traits members for the shared memory that some knobs add to the base traits' (Q, the K/V slots and
    the alignment slack): the persistent TMA-store epilogue's staging tile after the K/V slots
    (kernels/hopper/epilogue.cuh), stripe_order = mirrored's second Q buffer after that, and p_operand = smem's P tiles
    at the end; none otherwise."""
    members, terms = [], []
    if o_stage_bytes(config, shape):
        members.append("static constexpr int kOStageBytes = kOBytes;  // epilogue = tma, persistent: O's staging tile")
        terms.append("kOStageBytes")
    if q_buffer_bytes(config, shape):
        members.append("static constexpr int kQ1Offset = " + " + ".join(["kQBytes + kStages * (kKBytes + kVBytes)"] + terms)
                       + ";  // stripe_order = mirrored: Q's second buffer, after the K/V slots (and O's staging tile)")
        terms.append("kQBytes")
    if p_tile_bytes(config, shape):
        members.append("static constexpr int kPBytes = kBlockM * kBlockN * 2;  // p_operand = smem: the P tiles")
        terms.append("kPBytes")
    if terms:
        members.append(f"static constexpr int kSmemBytes = EvotuneBaseTraits::kSmemBytes + {' + '.join(terms)};")
    return members


def _register_split_assert(config) -> str:
    """The static_assert that ties the traits' setmaxnreg split (kProducerRegs, kConsumerRegs) to the host's
    (setmaxnreg_registers, the launch's register_split), where the kernel resizes its warpgroups; else nothing."""
    regs = setmaxnreg_registers(config)
    if not regs:
        return ""
    split = "128 * EvotuneTraits::kProducerRegs + EvotuneTraits::kConsumerThreads * EvotuneTraits::kConsumerRegs"
    return (f"static_assert(EvotuneTraits::kSetMaxNReg && {split} == {regs}, "
            f"\"host geometry: the setmaxnreg split holds {regs} registers\");\n")


def _traits(base: str, targs: str, members: list[str]) -> str:
    """EvotuneTraits: the `base` traits template at `targs`, as they are, or with `members` added in a struct of its own
    (configs without such members keep the plain alias, and so their source)."""
    if not members:
        return f"""using EvotuneTraits = {base}<
    {targs}>;"""
    body = "\n    ".join(members)
    return f"""using EvotuneBaseTraits = {base}<
    {targs}>;
struct EvotuneTraits : EvotuneBaseTraits {{
    {body}
}};"""


def _cluster_dims(config) -> str:
    """The mma.sync entry's compile-time cluster shape for kv_cluster 2 or 4 (so a plain launch forms the clusters);
    nothing otherwise."""
    return f" __cluster_dims__({kv_cluster(config)}, 1, 1)" if is_tma_multicast(config) else ""


def _tma_load_entry(config) -> tuple[str, str, str]:
    """(parameters, arguments, comment) the mma.sync entry adds for kv_load = tma: the three maps by value; empty
    strings otherwise."""
    if not is_tma_load(config):
        return "", "nullptr, nullptr, nullptr, ", ""
    return ((",\n                  const __grid_constant__ CUtensorMap q_map, const __grid_constant__ "
             "CUtensorMap k_map, const __grid_constant__ CUtensorMap v_map"),
            "&q_map, &k_map, &v_map, ",
            ("\n// q_map, k_map, v_map (kv_load = tma): the CUtensorMaps of Q, K, V by value (4-D: head_dim, seq, "
             "head, batch;\n// 128-byte swizzle; boxes of 64 columns x BLOCK_M or BLOCK_N rows); q, k, v and "
             "their strides are then unused."
             + (f"\n// kv_cluster = {kv_cluster(config)}: clusters of {kv_cluster(config)} CTAs along x (__cluster_dims__), "
                f"grid x padded to a multiple of {kv_cluster(config)};\n// K's and V's boxes are BLOCK_N / "
                f"{kv_cluster(config)} rows, each CTA's part of a tile, multicast to the cluster."
                if is_tma_multicast(config) else "")))


@dataclass(frozen=True)
class LaunchPlan:
    """The tensor-independent part of a launch (AttentionProblem.launch_plan)."""

    wgmma: bool
    grid: tuple
    block: tuple
    dynamic_smem: int
    seq_q: object         # np.int32, ready to pass
    seq_k: object
    workspace: tuple      # (ws_o floats, ws_lse floats, ws_count ints); zeros without a K/V split
    kv_magic: object      # np.uint32 kv_head_magic(shape.kv_group): 0 without grouped-query attention
    # Programmatic dependent launch (knob pdl): the one fact both launch paths read (the search's and the gate's
    # torch_stream_launcher, the op's PreparedLaunch); only a kernel compiled with pdl may be launched so, since
    # its griddepcontrol.wait is what keeps it from reading the previous kernel's output early.
    pdl: bool = False


@lru_cache(maxsize=1024)
def _launch_plan(problem, config, shape: Shape, multiprocessors: int) -> LaunchPlan:
    import numpy as np

    geo = problem.geometry(config, shape)
    return LaunchPlan(is_wgmma(config), geo.grid_for(multiprocessors), tuple(geo.block), int(geo.dynamic_smem),
                      np.int32(shape.seq_q), np.int32(shape.seq_k), problem.workspace_elems(config, shape),
                      np.uint32(kv_head_magic(shape.kv_group)), is_pdl(config))


# The tensors a launch maps (uses_tensor_maps: Q, K, V; O with the TMA-store epilogue) and the entry's parameters for them.
MAP_TENSORS = ("q", "k", "v", "o")
MAP_PARAMS = ("q_map", "k_map", "v_map", "o_map")


@lru_cache(maxsize=1024)
def _map_args(config, shape: Shape, q_strides: tuple, k_strides: tuple, v_strides: tuple,
              o_strides: tuple | None = None) -> tuple:
    """(Q, K, V) TiledMapArgs of a launch (uses_tensor_maps) on tensors with these (B, H, S, D) element strides, and O's
    where `o_strides` is given (the TMA-store epilogue: a box of 64 rows, one consumer warpgroup's, stored by
    each warpgroup on its own). K's and V's maps span the K/V heads (kv_heads): the kernel reads head
    h / kv_group of them."""
    from ..build.tma import tiled_map_args

    # kv_cluster: each CTA's box is its part of a K/V tile, BLOCK_N / kv_cluster rows (attention_tma_multicast.cuh).
    block_m, kv_rows = rows_per_cta(config), int(knob(config, "block_n")) // kv_cluster(config)
    # Q's and K's maps span the head dim, V's and O's V's head dim (shape.dv).
    maps = [(q_strides, shape.heads, shape.seq_q, block_m, shape.head_dim),
            (k_strides, shape.kv_heads, shape.seq_k, kv_rows, shape.head_dim),
            (v_strides, shape.kv_heads, shape.seq_k, kv_rows, shape.dv)]
    if o_strides is not None:
        maps.append((o_strides, shape.heads, shape.seq_q, 64, shape.dv))
    batch = shape.batch
    if shape.is_varlen:  # the packed tensors as one batch of all their rows (kernels/hopper/varlen.cuh)
        batch = 1
        maps = [(st, heads, shape.total_q if i in (0, 3) else shape.total_k, rows, dim)  # Q, O: queries; K, V: keys
                for i, (st, heads, _, rows, dim) in enumerate(maps)]
    return tuple(tiled_map_args(shape.dtype, (batch, heads, seq, dim), strides, rows)
                 for strides, heads, seq, rows, dim in maps)


@lru_cache(maxsize=8)
def _entry_params(wgmma: bool, write_lse: bool, tma_store: bool = False, tma_load: bool = False) -> tuple:
    """AttentionProblem.entry_params (kernels/attention.cu and attention_hopper.cuh entry points)."""
    tail = (("o_sb", "i64"), ("o_sh", "i64"), ("o_ss", "i64"), ("seq_q", "i32"), ("seq_k", "i32"), ("scale_log2", "f32"))
    lse = (("lse", "ptr"), ("lse_sb", "i64"), ("lse_sh", "i64")) if write_lse else ()
    if wgmma:
        return ((("q_map", "map"), ("k_map", "map"), ("v_map", "map"), ("o", "ptr")) + tail
                + (("kv_magic", "u32"), ("n_heads", "i32"), ("n_batch", "i32"), ("tile_counter", "ptr"))
                + ((("o_map", "map"),) if tma_store else ()) + lse)
    strides = tuple((f"{t}_s{d}", "i64") for t in "qkv" for d in "bhs")
    return ((("q", "ptr"), ("k", "ptr"), ("v", "ptr"), ("o", "ptr")) + strides + tail
            + (("ws_o", "ptr"), ("ws_lse", "ptr"), ("ws_count", "ptr"), ("kv_magic", "u32"))
            + ((("q_map", "map"), ("k_map", "map"), ("v_map", "map")) if tma_load else ()) + lse)


# The Hopper entry's runtime values of a softcap, window or sinks shape (ScoreArgs in kernels/attention_hopper.cuh),
# last; a sinks shape's sink logits after them.
SCORE_MOD_PARAMS = (("softcap_scale", "f32"), ("window_left", "i32"), ("window_right", "i32"))
SINK_PARAMS = (("sinks", "ptr"),)


def has_score_mods(shape: Shape) -> bool:
    """Whether the shape has a softcap, a window or sinks: the Hopper kernel's ScoreArgs, not the mma.sync kernel's."""
    return shape.has_softcap or shape.has_window or shape.sinks


# The Hopper entry's varlen parameters (VarlenArgs in kernels/hopper/varlen.cuh), last.
VARLEN_PARAMS = (("cu_seqlens_q", "ptr"), ("cu_seqlens_k", "ptr"))


def varlen_args(shape: Shape) -> list[tuple[str, object]]:
    """HopperTraits' VARLEN template argument (after SOFTCAP, LOCAL and SINKS, given as false where score_mod_args
    leaves them out), only for a varlen shape: a dense shape instantiates the source it did before VARLEN existed."""
    if not shape.is_varlen:
        return []
    pad = [] if has_score_mods(shape) else [("SOFTCAP", "false"), ("LOCAL", "false")]
    return pad + ([] if shape.sinks else [("SINKS", "false")]) + [("VARLEN", "true")]


def head_dim_v_args(shape: Shape) -> list[tuple[str, object]]:
    """HopperTraits' HEAD_DIM_V template argument (last: after SOFTCAP, LOCAL, SINKS and VARLEN, given as false where
    the shape has none of them), only for a shape with a value head dim of its own: every other shape instantiates
    the source it did before HEAD_DIM_V existed (the default 0, V's head dim that of Q)."""
    if not shape.has_dv:
        return []
    if shape.is_varlen:  # varlen_args passed the rest (check_shape refuses the pair today; the order holds anyway)
        return [("HEAD_DIM_V", shape.dv)]
    pad = [] if has_score_mods(shape) else [("SOFTCAP", "false"), ("LOCAL", "false")]
    pad += [] if shape.sinks else [("SINKS", "false")]
    return pad + [("VARLEN", "false"), ("HEAD_DIM_V", shape.dv)]


def score_mod_args(shape: Shape) -> list[tuple[str, object]]:
    """HopperTraits' SOFTCAP, LOCAL and SINKS template arguments, only where the shape has them: a shape without them
    instantiates the same source as before they existed (the defaults, false), and SINKS only with sinks."""
    if not has_score_mods(shape):
        return []
    return ([("SOFTCAP", "true" if shape.has_softcap else "false"), ("LOCAL", "true" if shape.has_window else "false")]
            + ([("SINKS", "true")] if shape.sinks else []))


def score_mod_values(shape: Shape, scale: float) -> dict:
    """softcap_scale, window_left, window_right for the entry: scale / C (0 without a cap: unread), and the window's
    sides clamped to [0, seq_k] and [0, seq_q], an unbounded side (-1) to the bound, which changes no row's keys
    (row i + Sk - Sq - Sk < 0 and i + Sk - Sq + Sq >= Sk - 1) and keeps the kernel's row arithmetic inside int."""
    left = shape.seq_k if shape.window_left < 0 else min(shape.window_left, shape.seq_k)
    right = shape.seq_q if shape.window_right < 0 else min(shape.window_right, shape.seq_q)
    return {"softcap_scale": scale / shape.softcap if shape.has_softcap else 0.0,
            "window_left": left, "window_right": right}


def sees(i, j, seq_q: int, seq_k: int, causal: bool, left: int, right: int):
    """Whether query i sees key j, elementwise over index tensors (broadcast; FlexAttention's mask_mod passes scalar
    ones): the causal mask top-left aligned, as SDPA's is_causal, and flash-attention's window (left, right) bottom-right
    aligned, -1 a side unbounded (Shape.key_range). The one statement of the rule the reference, the op's fallback and
    the FlexAttention baseline mask by."""
    seen = (i >= 0) & (j >= 0)
    if causal:
        seen = seen & (j <= i)
    diag = seq_k - seq_q
    if left >= 0:
        seen = seen & (j >= i + diag - left)
    if right >= 0:
        seen = seen & (j <= i + diag + right)
    return seen


def sink_probs(s, sinks):
    """softmax over the columns of scores `s` (..., H, Sq, Sk) and one more per head, its sink logit (`sinks`, (H,)),
    without the sink's column: the probabilities V is weighted by. A row whose keys are all masked (-inf) gets 0."""
    import torch

    lse = torch.logsumexp(torch.cat([s, sinks.view(-1, 1, 1).expand(*s.shape[:-1], 1)], dim=-1), dim=-1, keepdim=True)
    return torch.exp(s - lse)


def visibility_mask(shape: Shape, device=None):
    """The (Sq, Sk) boolean mask of the keys each query sees (sees), or None when every query sees every key."""
    if not (shape.causal or shape.has_window):
        return None
    import torch

    i = torch.arange(shape.seq_q, device=device)[:, None]
    j = torch.arange(shape.seq_k, device=device)[None, :]
    return sees(i, j, shape.seq_q, shape.seq_k, shape.causal, shape.window_left, shape.window_right)


def as_kernel_arg(kind: str, value):
    """`value` as the numpy scalar CuPy passes for a parameter of `kind` (a map record is already one)."""
    import numpy as np

    if kind == "map":
        return value
    return {"ptr": np.uint64, "i64": np.int64, "i32": np.int32, "f32": np.float32, "u32": np.uint32}[kind](value)


def kv_head_magic(group: int) -> int:
    """The kernels' kv_magic launch argument for `group` query heads per K/V head: 0 for 1 (no grouping: the
    K/V head is the query head), else ceil(2^32 / group), with which __umulhi(head, magic) == head // group for
    every head < 2^16 (MAX_DIMS) (kernels/attention.cu kv_head_of says why not a division)."""
    if not 1 <= group < 1 << 16:
        raise UsageError(f"attention: a K/V group of {group} query heads is out of range (1 to 65535)")
    return 0 if group == 1 else -(-(1 << 32) // group)


def sdpa_has_gqa() -> bool:
    """Whether the installed torch's SDPA takes enable_gqa (torch >= 2.5)."""
    import inspect

    import torch.nn.functional as F

    try:
        return "enable_gqa" in inspect.signature(F.scaled_dot_product_attention).parameters
    except (TypeError, ValueError):  # a builtin without a signature: ask the docstring
        return "enable_gqa" in (F.scaled_dot_product_attention.__doc__ or "")


PROBLEM = AttentionProblem()
