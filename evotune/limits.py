"""The target GPU's per-CTA limits and SM count (H100, sm_90): the one table every other place reads.

The search spaces read them by context name (space.device_context), the static gate
(compile.static_violations) checks ptxas's report against them, and each family's
instantiation asserts its traits against them at compile time, so the number is written once.
This module imports nothing of evotune: every floor may read it.
"""

from __future__ import annotations

# Opt-in dynamic shared memory per block (227 KB; cudaFuncAttributeMaxDynamicSharedMemorySize).
SMEM_PER_BLOCK = 232448
THREADS_PER_BLOCK = 1024
REGISTERS_PER_SM = 65536
REGISTERS_PER_THREAD = 255
# Streaming multiprocessors of the H100 SXM: a persistent grid's size where the device is not at hand.
MULTIPROCESSORS = 132

# The limits a search space's expressions may read, by the names they read them as.
DEVICE_LIMITS = {"smem_limit": SMEM_PER_BLOCK, "max_threads": THREADS_PER_BLOCK, "registers_per_sm": REGISTERS_PER_SM,
                 "multiprocessors": MULTIPROCESSORS}


def launch_asserts(threads: int, dynamic_smem: int, rows: tuple[str, int], traits: str = "EvotuneTraits") -> str:
    """C++ static_asserts for an instantiation: the host's launch geometry (block threads, dynamic shared
    memory, rows per CTA as `(traits member, value)`) equals what `traits` derives, and the traits fit these
    limits. The host launches from its own geometry while the kernel indexes by its traits (FlashAttention-2
    reads both from one traits type); binding them here turns a disagreement into a compile error."""
    member, value = rows
    return (f"// The host's launch geometry (Problem.geometry) must be what the traits derive, and fit the device\n"
            f"// (evotune/limits.py): a disagreement fails to compile instead of launching wrong.\n"
            f"static_assert({traits}::kThreads == {threads}, "
            f"\"host geometry: block threads {threads} != {traits}::kThreads\");\n"
            f"static_assert({traits}::kSmemBytes == {dynamic_smem}, "
            f"\"host geometry: dynamic shared memory {dynamic_smem} B != {traits}::kSmemBytes\");\n"
            f"static_assert({traits}::{member} == {value}, "
            f"\"host geometry: {value} rows per CTA != {traits}::{member}\");\n"
            f"static_assert({traits}::kThreads <= {THREADS_PER_BLOCK}, "
            f"\"a CTA has at most {THREADS_PER_BLOCK} threads\");\n"
            f"static_assert({traits}::kSmemBytes <= {SMEM_PER_BLOCK}, "
            f"\"the tiles exceed the {SMEM_PER_BLOCK} B ({SMEM_PER_BLOCK // 1024} KB) of shared memory per CTA\");\n")
