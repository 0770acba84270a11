"""Read a compiled kernel's SASS (cuobjdump -sass on the cubin): which tensor-core instructions it
runs, whether it touches local memory, how it loads. No GPU needed: the cubin comes from NVRTC.

cuobjdump (and the nvdisasm that recent ones call) comes from a CUDA toolkit on PATH or from the
`nvidia-cuda-cuobjdump` and `nvidia-cuda-nvdisasm` wheels (`pip install 'evotune[sass]'`).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

from ..errors import EvotuneError

# SASS opcode (the mnemonic before the first '.') -> what the summary calls it.
CLASSES = {
    "HGMMA": "wgmma (Hopper warpgroup MMA)",
    "HMMA": "mma.sync (warp MMA)",
    "UTMALDG": "TMA tensor loads",
    "UTMASTG": "TMA tensor stores",
    "LDGSTS": "cp.async loads",
    "LDSM": "ldmatrix",
    "SYNCS": "mbarrier operations",
    "LDL": "local-memory loads",
    "STL": "local-memory stores",
}
_INSTRUCTION = re.compile(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)")


def cuobjdump_path() -> str:
    """cuobjdump from PATH, else from a CUDA root (compile.cuda_roots: the wheel, CUDA_PATH/CUDA_HOME, /usr/local/cuda)."""
    from .compile import cuda_roots

    found = shutil.which("cuobjdump")
    if found:
        return found
    for root in cuda_roots():
        path = root / "bin" / "cuobjdump"
        if path.is_file() and os.access(path, os.X_OK):
            return str(path)
    raise EvotuneError("cuobjdump not found: install a CUDA toolkit or `pip install 'evotune[sass]'`")


def disassemble(cubin_path: str) -> str:
    """The SASS text of a cubin (one cached before compile.complete_elf existed is completed in a copy)."""
    import tempfile

    from .compile import complete_elf

    tool = cuobjdump_path()
    data = Path(cubin_path).read_bytes()
    whole = complete_elf(data)
    with tempfile.TemporaryDirectory() as tmp:
        if whole != data:
            cubin_path = os.path.join(tmp, "kernel.cubin")
            Path(cubin_path).write_bytes(whole)
        # cuobjdump 13.3 and later leave SASS to nvdisasm: the one beside it (the wheels' bin folder) first.
        env = dict(os.environ, PATH=os.path.dirname(tool) + os.pathsep + os.environ.get("PATH", ""))
        proc = subprocess.run([tool, "-sass", cubin_path], capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        said = (proc.stderr or proc.stdout).strip().splitlines()
        raise EvotuneError(f"cuobjdump -sass failed (exit {proc.returncode}): {said[0] if said else 'no output'}")
    return proc.stdout


def opcode_counts(sass: str) -> dict[str, int]:
    """Static count of each opcode (without its .modifiers) in the SASS text."""
    counts: dict[str, int] = {}
    for match in _INSTRUCTION.finditer(sass):
        op = match.group(1)
        counts[op] = counts.get(op, 0) + 1
    return counts


_WAIT_ONE = "WARPGROUP.DEPBAR.LE gsb0, 0x1"  # wgmma.wait_group 1: all but the last committed group done
_PREDICATE = re.compile(r"^@!?U?P\w+\s+")


def _instruction_texts(sass: str) -> list[str]:
    """Each instruction of the listing in program order, as written after its address (predicate included, up to
    the ';')."""
    return [m.group(1).strip() for m in re.finditer(r"/\*[0-9a-f]{4,}\*/\s+(.*?);", sass)]


def exp2_under_wgmma(sass: str) -> list[int]:
    """For each wait that leaves one wgmma group running (the Hopper kernel's wait for S while P V runs on), the
    MUFU.EX2 that follow it in program order before the next warpgroup wait: the softmax's exp2 that may run while the
    warpgroup's own P V is still on the tensor cores. 0 means ptxas put the wait for P V above the softmax."""
    found = []
    lines = _instruction_texts(sass)
    for i, text in enumerate(lines):
        if _WAIT_ONE not in text:
            continue
        count = 0
        for later in lines[i + 1:]:
            if later.startswith("WARPGROUP.DEPBAR"):
                break
            count += later.startswith("MUFU.EX2")
        found.append(count)
    return found


def wgmma_issue_gaps(sass: str) -> list[int]:
    """For each pair of consecutive HGMMA of one product (the group a wgmma.commit_group closes, its last HGMMA marked
    gsb0), the instructions ptxas placed between them in program order: what the warp issues between a product's
    wgmma, mostly the next k-step's shared-memory descriptor (knob lean_addressing)."""
    gaps, since = [], None
    for text in _instruction_texts(sass):
        if _PREDICATE.sub("", text).startswith("HGMMA"):
            if since is not None:
                gaps.append(since)
            since = None if "gsb0" in text else 0
        elif since is not None:
            since += 1
    return gaps


def summary(sass: str) -> dict:
    """The opcode classes of CLASSES with their static counts, and the verdicts the docs quote."""
    counts = opcode_counts(sass)
    classes = {op: counts.get(op, 0) for op in CLASSES}
    return {"instructions": sum(counts.values()), "classes": classes,
            "tensor_core": "wgmma" if classes["HGMMA"] else ("mma.sync" if classes["HMMA"] else "none"),
            "local_memory": classes["LDL"] + classes["STL"], "exp2_under_wgmma": exp2_under_wgmma(sass),
            "wgmma_issue_gaps": wgmma_issue_gaps(sass)}
