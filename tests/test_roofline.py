"""bench/roofline.py: the one table of device ceilings and the per-kernel model."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from bench import roofline

ROOT = Path(__file__).resolve().parents[1]


def test_json_has_every_kernel_on_both_devices():
    out = subprocess.run(
        [sys.executable, "-m", "bench.roofline", "--json"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    d = json.loads(out.stdout)
    assert set(d["devices"]) == {"H100-SXM", "H200"}
    assert d["devices"]["H100-SXM"]["hbm_bytes_per_s"] == 3.35e12
    assert d["devices"]["H200"]["hbm_bytes_per_s"] == 4.8e12
    names = [k["kernel"] for k in d["kernels"]]
    assert len(names) == len(roofline.KERNELS) >= 19
    for k in d["kernels"]:
        assert set(k["devices"]) == {"H100-SXM", "H200"}, k["kernel"]
        for dev in k["devices"].values():
            assert dev["model_us"] > 0 and 0 < dev["share"] <= 1, k["kernel"]
            assert dev["bound"], k["kernel"]
        assert k["bytes"] > 0
    counted = [k for k in d["kernels"] if k["warp_instructions"] > 0]
    assert len(counted) >= 12 and all("Triton" in k["instruction_source"] for k in counted)
    text = subprocess.run(
        [sys.executable, "-m", "bench.roofline"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    ).stdout
    assert "MODEL (not measured" in text


def test_device_by_name():
    assert roofline.device_by_name("NVIDIA H100 80GB HBM3") is roofline.H100_SXM
    assert roofline.device_by_name("NVIDIA H200") is roofline.H200
    for bad in ("NVIDIA H100 PCIe", "NVIDIA A100-SXM4-80GB", "cpu"):
        with pytest.raises(ValueError, match="gpu_name"):
            roofline.device_by_name(bad)


def test_model_resources_and_bounds():
    d = roofline.H100_SXM
    m = roofline.Model(bytes=3.35e9)  # 1 ms of HBM
    assert m.seconds(d) == pytest.approx(1e-3 + d.launch_s)
    assert m.bound(d) == "memory" and m.share(d) == pytest.approx(1e-3 / (1e-3 + d.launch_s))
    issue = roofline.Model(bytes=3.35e9, instructions=2 * d.issue_per_s * 1e-3)
    assert issue.bound(d) == "issue" and issue.share(d) == pytest.approx(0.5, rel=1e-2)
    lat = roofline.Model(bytes=1e6, serial_steps=100)
    assert lat.bound(d) == "latency"
    assert roofline.Model(bytes=10).bound(d) == "launch"
    # the same bytes on the H200: 4.8 / 3.35 faster
    assert m.seconds(roofline.H200) - roofline.H200.launch_s == pytest.approx(3.35e9 / 4.8e12)


def test_sass_profile_counts_loops_and_ops():
    sass = "\n".join(
        [
            "        /*0000*/                   LDG.E.128 R2, desc[UR4][R2.64] ;",
            "        /*0010*/                   MUFU.EX2 R4, R4 ;",
            "        /*0020*/                   SHFL.BFLY PT, R5, R4, 0x1, 0x1f ;",
            "        /*0030*/              @P0 BRA 0x10 ;",
            "        /*0040*/                   STG.E [R2.64], R4 ;",
            "        /*0050*/                   EXIT ;",
            "        /*0060*/                   CALL.REL.NOINC 0x100 ;",
            "        /*0070*/                   BRA 0x70 ;",
            "        /*0080*/                   NOP ;",
        ]
    )
    p = roofline.sass_profile(sass)
    assert p["main"] == 6 and [tuple(x) for x in p["loops"]] == [(0x10, 0x30, 3)]
    assert p["ops"] == {"LDG": 1, "LDG.128": 1, "MUFU": 1, "SHFL": 1, "STG": 1}
    with pytest.raises(ValueError, match="sass"):
        roofline.sass_profile("no code")


def test_timing_rows_use_the_detected_device():
    from bench import gpu_timing

    gpu_timing.DEVICE = roofline.H200
    try:
        r = gpu_timing.row("logprobs_fwd", "triton", 1e-3, bytes_=4.8e9)
        assert r["of_peak"] == 1.0
        assert r["model_ms"] > 0 and r["measured_over_model"] > 0
    finally:
        gpu_timing.DEVICE = None
    r = gpu_timing.row("logprobs_fwd", "triton", 1e-3, bytes_=4.8e9)
    assert "of_peak" not in r and "ceiling" in r


def test_sass_counts_are_of_the_launched_variants():
    """Every count in bench/sass_counts.json was compiled from the variant its op
    launches at the modelled shape: the launch-plan case of SASS_SPECS, with the
    specialization and keywords Triton's binder gives that call now, from today's
    kernel source. A count from a hand-written aot_variants() signature, another
    case, or a kernel edited since (stale), fails here: rerun
    ``python -m bench.roofline --sass``."""
    pytest.importorskip("triton")
    counts = json.loads(roofline.SASS_COUNTS.read_text())["kernels"]
    assert set(counts) == set(roofline.SASS_SPECS)
    bad = []
    for key, (module, kernel, case) in roofline.SASS_SPECS.items():
        row = counts[key]
        assert (row["module"], row["kernel"]) == (module, kernel), key
        assert row["source"].startswith(f"launched variant ({case}: "), key
        now = roofline.launched_record(module, kernel, case)
        for field in ("case", "specialization", "keywords", "kernel_hash"):
            if row.get(field) != now[field]:
                bad.append(f"{key}.{field}: recorded {row.get(field)!r}, launched {now[field]!r}")
    assert not bad, "stale bench/sass_counts.json (python -m bench.roofline --sass):\n" + "\n".join(
        bad
    )


def test_launched_record_names_the_launch_and_tracks_the_source(monkeypatch):
    pytest.importorskip("triton")
    rec = roofline.launched_record(*roofline.SASS_SPECS["unpermute"])
    assert rec["keywords"]["BLOCK"] > 0 and "y_ptr:*bf16/16" in rec["specialization"]
    with pytest.raises(ValueError, match="case"):
        roofline.launched_record("fp8.triton", "_unpermute_kernel", "no such case")
    with pytest.raises(ValueError, match="case"):  # that case does not launch this kernel
        roofline.launched_record("fp8.triton", "_quantize_block_kernel", rec["case"])
    # an edit to a helper the kernel calls changes the hash (the count is then stale)
    import inspect

    base = roofline.kernel_source_hash("espo.triton_logprobs", "_fwd_kernel")
    real = inspect.getsource

    def edited(obj):
        src = real(obj)
        return src + "\n# edited\n" if "def _aligned_split" in src else src

    monkeypatch.setattr(inspect, "getsource", edited)
    assert roofline.kernel_source_hash("espo.triton_logprobs", "_fwd_kernel") != base


def test_gpu_kernels_doc_has_the_generated_table():
    """docs/perf/gpu_kernels.md's per-kernel table is ``python -m bench.roofline
    --markdown`` of today's model and counts (regenerate it after --sass)."""
    doc = (ROOT / "docs" / "perf" / "gpu_kernels.md").read_text()
    table = roofline._markdown(roofline.kernel_rows())
    assert table in doc, "docs/perf/gpu_kernels.md: paste python -m bench.roofline --markdown"
