"""Export one configuration as a standalone .cu file: the template with the config baked in
as template arguments of one extern "C" entry point, and a header that says how to launch it.
`nvcc -gencode arch=compute_90a,code=sm_90a -c FILE.cu` compiles it with nothing of evotune beside it.
"""

from __future__ import annotations

import json
from pathlib import Path

from .compile import DEFAULT_ARCH, nvrtc_options
from ..outputs import write_output
from .template import geometry_of, instantiate


def build_command(arch: str = DEFAULT_ARCH) -> str:
    """The nvcc command (without its file arguments) that builds an export for `arch`. Only the real
    architecture: nvcc 13's `-arch=sm_90a` also embeds compute_90 PTX, which cannot hold the wgmma, setmaxnreg
    and TMA instructions of the arch-specific (sm_90a) Hopper variant, so ptxas refuses that PTX."""
    virtual = "compute_" + arch.removeprefix("sm_")
    return f"nvcc -gencode arch={virtual},code={arch}"


def export_source(problem, shape, config, record: dict | None = None, meta: dict | None = None,
                  arch: str = DEFAULT_ARCH, source=None) -> str:
    """The standalone source text for (problem, shape, config), with provenance from a run record. `source`: the
    KernelSource to write (a run's archived source of the trial, records/sources.py); default today's
    instantiation. Where the code written is not the code the record measured, the header says so."""
    src = source if source is not None else instantiate(problem, config, shape)
    geo = geometry_of(src, problem, config, shape)
    record, meta = record or {}, meta or {}
    result = record.get("result") or {}
    timing = result.get("timing") or {}
    ver = result.get("verification") or {}
    res = result.get("resources") or {}
    flags = " ".join(o for o in nvrtc_options(arch) if not o.startswith("-I"))
    lines = [
        f"evotune export: {problem.title}, configuration baked in",
        "",
        f"shape        {shape.spec}  ({problem.describe_shape(shape)})",
        f"config       {json.dumps(config.as_dict(), sort_keys=True)}",
        f"entry        {src.entry}",
        f"signature    {problem.signature(config)}",
        f"grid         {geo.grid}   block {geo.block}   dynamic shared memory {geo.dynamic_smem} B"
        + ("  (above 48 KB: set cudaFuncAttributeMaxDynamicSharedMemorySize first)" if geo.dynamic_smem > 48 * 1024 else ""),
        *problem.launch_notes(config, shape),
        f"NVRTC flags  {flags}",
        f"build        {build_command(arch)} -c THIS_FILE.cu",
    ]
    status = result.get("status")
    if status not in (None, "ok"):  # exported with --force: say so where whoever builds it will look
        why = " ".join(str(result.get("message") or "").split())[:200]
        said = f"{status}: {why}" if why else status
        lines.append(f"WARNING      this trial did not pass ({said}); exported with --force")
    if res:
        lines.append(f"resources    {res.get('registers')} registers, {res.get('spill_stores', 0)} B spill stores, "
                     f"{res.get('stack_frame', 0)} B stack frame (ptxas -v, {arch})")
    if timing:
        lines.append(f"measured     {timing.get('median_us', float('nan')):.2f} us median "
                     f"(p10 {timing.get('p10_us', float('nan')):.2f}, p90 {timing.get('p90_us', float('nan')):.2f}; "
                     f"{timing.get('method')}, {timing.get('launches_per_rep')} launches x {timing.get('reps')} replays)")
    if ver:
        nan = float("nan")
        lines.append(f"error        max abs {ver.get('max_abs', nan):.3g} vs fp32 reference, gate ratio "
                     f"{ver.get('gate_ratio', nan):.3g} (atol {ver.get('atol')}, rtol {ver.get('rtol')}), seeds {ver.get('seeds')}")
    if meta:
        dev = meta.get("device") or {}
        torch_version = dev.get("torch") or meta.get("versions", {}).get("torch", "?")  # recorded by the GPU worker
        lines.append(f"device       {dev.get('name', 'unknown')} (driver {dev.get('driver', '?')}), "
                     f"torch {torch_version}, NVRTC {meta.get('versions', {}).get('nvrtc', '?')}")
        lines.append(f"run          {meta.get('run_id', '?')}  git {meta.get('git_sha', '?')}  evotune {meta.get('versions', {}).get('evotune', '?')}")
    recorded_digest = record.get("source_digest")
    if recorded_digest and recorded_digest == src.digest:
        lines.append(f"source       {src.digest}: the code the trial measured"
                     + (" (from the run's source archive)" if source is not None else ""))
    if recorded_digest and recorded_digest != src.digest:
        lines.append(f"NOTE         the kernel template changed since this trial was measured (source {recorded_digest} "
                     f"then, {src.digest} now): the figures above are for the earlier code")
    header = "\n".join(("// " + line).rstrip() for line in lines) + "\n\n"
    return header + src.code


def write_export(path: str | Path, text: str, option: str = "-o") -> Path:
    """Write the export whole at `path`, making missing folders; one UsageError line if it cannot."""
    return write_output(path, text, option, create_parents=True)
