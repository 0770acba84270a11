"""Tests for evotune.build.export: a standalone .cu file with the config baked in and a header on how to launch it."""

from __future__ import annotations

import json
import shutil
import subprocess

import pytest

from evotune.build.export import export_source, write_export
from evotune.build.template import instantiate

RECORD = {
    "result": {
        "timing": {"median_us": 12.345, "p10_us": 12.0, "p90_us": 13.1, "method": "cuda-graph",
                   "launches_per_rep": 20, "reps": 50},
        "verification": {"max_abs": 1.2e-4, "gate_ratio": 0.12, "atol": 1e-3, "rtol": 4e-3, "seeds": [0, 1, 2]},
        "resources": {"registers": 136, "spill_stores": 0, "stack_frame": 0},
    }
}
META = {
    "device": {"name": "NVIDIA H100 80GB HBM3", "driver": "580.65"},
    "versions": {"torch": "2.13.0", "nvrtc": "13.0", "evotune": "0.1.0"},
    "run_id": "20250101-000000-mission", "git_sha": "0123abcd",
}


def header_of(text: str) -> list[str]:
    """The `// ` lines before the first blank line."""
    head = text.split("\n\n", 1)[0]
    return head.splitlines()


def test_header_without_record(attention, space, mission):
    """With no record, the header says shape, config, entry, signature, launch geometry, flags and build line."""
    cfg = space.default_config()
    text = export_source(attention, mission, cfg)
    lines = header_of(text)
    assert all(line.startswith("//") for line in lines)
    assert lines[0] == "// evotune export: attention forward kernel, configuration baked in"
    assert "// shape        1,8,512,64:fp16  (B=1 H=8 Sq=512 Sk=512 D=64)" in lines
    assert f"// config       {json.dumps(cfg.as_dict(), sort_keys=True)}" in lines
    assert "// entry        evotune_attention" in lines
    assert any(line.startswith("// signature    evotune_attention(") for line in lines)
    assert "// grid         (8, 8, 1)   block (128, 1, 1)   dynamic shared memory 40960 B" in lines
    assert "// NVRTC flags  --gpu-architecture=sm_90a -std=c++17 --ptxas-options=-v -lineinfo" in lines
    assert "// build        nvcc -gencode arch=compute_90a,code=sm_90a -c THIS_FILE.cu" in lines
    assert not any(line.startswith(("// measured", "// device", "// resources", "// error")) for line in lines)
    assert "-I" not in "\n".join(lines)  # no install paths of this machine
    assert text.endswith(instantiate(attention, cfg, mission).code)


def test_header_with_record_and_meta(attention, space, mission):
    """A run record and its metadata add the resources, the measured time, the error and the device."""
    lines = header_of(export_source(attention, mission, space.default_config(), RECORD, META))
    assert "// resources    136 registers, 0 B spill stores, 0 B stack frame (ptxas -v, sm_90a)" in lines
    assert ("// measured     12.35 us median (p10 12.00, p90 13.10; cuda-graph, 20 launches x 50 replays)"
            in lines)
    assert any(line.startswith("// error        max abs 0.00012 vs fp32 reference, gate ratio 0.12") for line in lines)
    assert "// device       NVIDIA H100 80GB HBM3 (driver 580.65), torch 2.13.0, NVRTC 13.0" in lines
    assert "// run          20250101-000000-mission  git 0123abcd  evotune 0.1.0" in lines


def test_header_notes_large_shared_memory(attention, space, mission):
    """Above 48 KB of dynamic shared memory the header says to raise the kernel's limit first."""
    cfg = space.config({"block_m": 128, "block_n": 128, "compute_warps": 8, "stages": 3})
    geo = attention.geometry(cfg, mission)
    assert geo.dynamic_smem > 48 * 1024
    grid_line = next(line for line in header_of(export_source(attention, mission, cfg)) if line.startswith("// grid"))
    assert f"dynamic shared memory {geo.dynamic_smem} B" in grid_line
    assert "cudaFuncAttributeMaxDynamicSharedMemorySize" in grid_line


def test_write_export_creates_folders(tmp_path):
    """write_export makes missing parent folders and writes the text as given."""
    path = write_export(tmp_path / "a" / "b" / "k.cu", "// text\n")
    assert path.read_text() == "// text\n"


def test_export_compiles_with_nvcc_alone(attention, space, mission, tmp_path):
    """The exported file compiles with its header's build line (nvcc -gencode ... sm_90a -c) in a folder holding
    nothing else."""
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        pytest.skip("nvcc is not on PATH")
    work = tmp_path / "export"
    src = write_export(work / "attention_mission.cu",
                       export_source(attention, mission, space.default_config(), RECORD, META))
    assert [p.name for p in work.iterdir()] == ["attention_mission.cu"]
    proc = subprocess.run([nvcc, "-gencode", "arch=compute_90a,code=sm_90a", "-c", src.name, "-o", "attention_mission.o"], cwd=work,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    obj = (work / "attention_mission.o").read_bytes()
    assert obj[:4] == b"\x7fELF" and b"evotune_attention" in obj


def test_export_says_when_the_template_changed(attention, space, mission):
    """A record measured on other kernel source gets a NOTE line; one measured on this source does not."""
    from evotune.build.template import instantiate

    cfg = space.default_config()
    current = instantiate(attention, cfg, mission).digest
    stale = export_source(attention, mission, cfg, {"source_digest": "0" * 16, "result": {}})
    fresh = export_source(attention, mission, cfg, {"source_digest": current, "result": {}})
    assert "// NOTE         the kernel template changed" in stale
    assert "template changed" not in fresh


def test_write_export_bad_paths(tmp_path):
    """write_export to a folder, an empty name, or below a plain file is a one-line UsageError that writes nothing."""
    from evotune.errors import UsageError

    plain = tmp_path / "plain"
    plain.write_text("keep")
    for target, fragment in ((tmp_path, "is a folder"), ("", "empty file name"), (plain / "k.cu", "is not a folder")):
        with pytest.raises(UsageError, match=fragment) as info:
            write_export(target, "// text\n")
        assert "\n" not in str(info.value) and info.value.exit_code == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["plain"] and plain.read_text() == "keep"


def test_write_export_replaces_whole(tmp_path):
    """Writing over an existing export replaces it whole and leaves no temporary file beside it."""
    target = tmp_path / "k.cu"
    target.write_text("old")
    write_export(target, "// new\n")
    assert target.read_text() == "// new\n" and [p.name for p in tmp_path.iterdir()] == ["k.cu"]


@pytest.mark.parametrize("status", ["pruned", "compile_error", "wrong"])
def test_header_warns_when_the_trial_did_not_pass(attention, space, mission, status):
    """A record that did not pass (exported with --force) gets a WARNING line with its status and reason on one
    line; a passing record gets none."""
    record = {"result": {"status": status, "message": "first line\nsecond line"}}
    lines = header_of(export_source(attention, mission, space.default_config(), record))
    assert (f"// WARNING      this trial did not pass ({status}: first line second line); exported with --force"
            in lines)
    ok = header_of(export_source(attention, mission, space.default_config(), {"result": {"status": "ok"}}))
    assert not any("WARNING" in line for line in ok)
