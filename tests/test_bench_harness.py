"""Tests of the bench harness (bench/harness.py, python -m bench) and the advantages baselines."""

from __future__ import annotations

import csv
import math
import time
import types

import pytest
import torch

from bench import __main__ as bench_main
from bench import harness
from bench.harness import CSV_COLUMNS, Case, CheckFailure, run_case


def _recording_case(log: list[str], *, wrong: bool = False) -> Case:
    x = torch.arange(10, dtype=torch.float32)

    def provider(name: str, offset: float):
        def call() -> torch.Tensor:
            log.append(name)
            return x * 2 + offset

        return call

    return Case(
        name="double",
        shape={"n": 10},
        providers={"base": provider("base", 0.0), "cand": provider("cand", 1.0 if wrong else 0.0)},
        baseline="base",
    )


def _sleep_case(base_s: float, cand_s: float, op: str = "sleepy", n: int = 1) -> Case:
    return Case(
        name=op,
        shape={"n": n},
        providers={"slow": lambda: time.sleep(base_s), "fast": lambda: time.sleep(cand_s)},
        baseline="slow",
    )


def test_providers_are_interleaved():
    log: list[str] = []
    run_case(_recording_case(log), reps=4, warmup=2, target_sample_s=0.0)
    # first call (output + errors), 1 more warmup round, 4 timed reps, 1 memory call each
    assert log == ["base", "cand"] * (1 + 1 + 4 + 1)


def test_samples_of_several_calls_stay_interleaved():
    log: list[str] = []
    rows = run_case(_recording_case(log), reps=3, warmup=1, target_sample_s=1e-3, max_inner=5)
    assert [len(r.samples) for r in rows] == [3, 3]
    timed = log[2:-2]  # drop first calls and memory calls
    assert timed == (["base"] * 5 + ["cand"] * 5) * 3


def test_samples_are_nvtx_ranges_when_enabled(monkeypatch):
    from compass_kernels import profiling

    events: list[str | None] = []
    monkeypatch.setattr(profiling._state, "enabled", True)
    monkeypatch.setattr(
        profiling._state, "backend", ("rec", events.append, lambda: events.append(None))
    )
    run_case(_recording_case([]), reps=2, warmup=1, target_sample_s=0.0)
    assert events == ["bench.double.base", None, "bench.double.cand", None] * 2


def test_ratio_median_and_rows():
    rows = run_case(_sleep_case(0.004, 0.001), reps=5, warmup=1, target_sample_s=0.0)
    slow, fast = rows
    assert (slow.provider, fast.provider) == ("slow", "fast")
    assert slow.is_baseline and not fast.is_baseline
    assert slow.ratio_vs_baseline == 1.0
    assert slow.median_s >= 0.004 and fast.median_s >= 0.001
    assert fast.ratio_vs_baseline == pytest.approx(slow.median_s / fast.median_s)
    assert fast.ratio_vs_baseline > 1.5
    assert slow.median_s == pytest.approx(sorted(slow.samples)[2])
    assert slow.iqr_s >= 0


def test_cpu_memory_counts_returned_tensors():
    n = 2**21  # 8 MiB of float32
    case = Case("alloc", {"n": n}, {"big": lambda: torch.ones(n), "none": lambda: None}, "big")
    big, none = run_case(case, reps=2, warmup=1, target_sample_s=0.0)
    assert big.peak_mem_bytes >= 4 * n
    assert none.peak_mem_bytes < 4 * n


def test_provider_error_is_reported_and_others_still_run():
    def broken():
        raise RuntimeError("no kernel for this shape")

    case = Case("op", {"n": 1}, {"base": lambda: 1.0, "broken": broken}, "base")
    base, bad = run_case(case, reps=2, warmup=1, target_sample_s=0.0)
    assert not base.error and base.median_s > 0
    assert bad.error == "RuntimeError: no kernel for this shape" and math.isnan(bad.median_s)
    assert "ERROR" in harness.format_table([base, bad])
    with pytest.raises(CheckFailure, match="no kernel for this shape"):
        run_case(case, reps=2, warmup=1, check=True)


def test_case_rejects_unknown_baseline():
    with pytest.raises(ValueError, match="baseline 'nope'"):
        Case("op", {"n": 1}, {"a": lambda: None}, baseline="nope")


def test_check_passes_equal_and_catches_wrong_candidate():
    run_case(_recording_case([]), reps=2, warmup=1, target_sample_s=0.0, check=True)
    with pytest.raises(CheckFailure) as info:
        run_case(_recording_case([], wrong=True), reps=2, warmup=1, check=True)
    msg = str(info.value)
    assert "double[n=10] cand" in msg and "mismatched elements: 10 / 10" in msg


def test_compare_outputs_nested_structures():
    t = torch.ones(3)
    harness.compare_outputs((t, {"k": 2.0}), (t, {"k": 2.0}), atol=None, rtol=None, where="o")
    with pytest.raises(CheckFailure, match=r"o\[1\]: expected keys"):
        harness.compare_outputs((t, {"j": 2.0}), (t, {"k": 2.0}), atol=None, rtol=None, where="o")
    with pytest.raises(CheckFailure, match="expected 2 items, got 1"):
        harness.compare_outputs((t,), (t, t), atol=None, rtol=None, where="o")
    with pytest.raises(CheckFailure, match=r"o\[0\]: expected a tensor"):
        harness.compare_outputs([3.0], [t], atol=None, rtol=None, where="o")
    # bool outputs compare exactly, whatever the float tolerance
    with pytest.raises(CheckFailure, match="mismatched elements: 1 / 2"):
        harness.compare_outputs(
            torch.tensor([True, True]), torch.tensor([True, False]), atol=1.0, rtol=1.0, where="z"
        )


def test_csv_rows_columns_and_append(tmp_path):
    rows = run_case(_sleep_case(0.002, 0.001), reps=3, warmup=1, target_sample_s=0.0)
    path = harness.append_csv(rows, tmp_path / "res" / "results.csv")
    harness.append_csv(rows, path)
    with path.open(newline="") as f:
        reader = csv.DictReader(f)
        assert tuple(reader.fieldnames) == CSV_COLUMNS
        recs = list(reader)
    assert len(recs) == 4  # header written once
    first = recs[0]
    assert first["op"] == "sleepy" and first["provider"] == "slow" and first["shape"] == "n=1"
    assert first["device"] == "cpu" and first["torch_version"] == torch.__version__
    assert first["commit"] and first["machine"] and first["timestamp"]
    assert float(first["ratio_vs_baseline"]) == 1.0
    assert float(recs[1]["ratio_vs_baseline"]) == pytest.approx(
        float(first["median_s"]) / float(recs[1]["median_s"]), rel=1e-3
    )
    assert int(recs[1]["peak_mem_bytes"]) >= 0


def test_roofline_model_in_rows_table_and_csv(tmp_path):
    from bench.roofline import H100_SXM, Model

    # 3.35 GB over 3.35 TB/s = 1 ms, plus one launch floor
    model = Model(bytes=3.35e9)
    assert model.seconds() == pytest.approx(1e-3 + H100_SXM.launch_s)
    assert model.bound() == "memory"
    assert Model(bytes=1.0, flops=1979e12 * 1e-3, precision="fp8").bound() == "compute"
    assert Model(bytes=1e3).bound() == "launch"
    with pytest.raises(ValueError, match="precision: expected one of"):
        Model(bytes=1.0, precision="fp4").seconds()
    case = _sleep_case(0.0, 0.0)
    case.model = model
    rows = run_case(case, reps=2, warmup=1, target_sample_s=0.0)
    assert all(r.model_s == pytest.approx(model.seconds()) for r in rows)
    table = harness.format_table(rows)
    assert "1 ms" in table.splitlines()[2] and "a model, not a measurement" in table
    path = harness.append_csv(rows, tmp_path / "results.csv")
    with path.open(newline="") as f:
        rec = next(csv.DictReader(f))
    assert float(rec["h100_model_s"]) == pytest.approx(model.seconds())


def test_csv_refuses_foreign_header(tmp_path):
    path = tmp_path / "results.csv"
    path.write_text("a,b\n1,2\n")
    rows = run_case(_sleep_case(0.0, 0.0), reps=2, warmup=1, target_sample_s=0.0)
    with pytest.raises(ValueError, match="expected"):
        harness.append_csv(rows, path)


def _row(op: str, provider: str, shape: str, ratio: float, error: str = "") -> harness.Row:
    return harness.Row(
        op,
        provider,
        shape,
        "cpu",
        1e-3 / ratio,
        1e-5,
        ratio,
        0,
        is_baseline=provider == "base",
        error=error,
    )


def test_plot_one_png_per_op(tmp_path):
    rows = [_row("op_a", p, f"n={n}", r) for n in (1, 2) for p, r in (("base", 1.0), ("c", 3.0))]
    rows += [_row("op_b", "base", "n=1", 1.0), _row("op_b", "c", "n=1", 0.5)]
    rows += [_row("op_c", "base", "n=1", math.nan, error="boom")]  # nothing to plot
    paths = harness.plot_results(rows, tmp_path)
    assert sorted(p.name for p in paths) == ["op_a.png", "op_b.png"]
    for p in paths:
        assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and p.stat().st_size > 1000


def test_format_table_aligned():
    rows = run_case(_sleep_case(0.001, 0.0), reps=2, warmup=1)
    lines = harness.format_table(rows).splitlines()
    assert lines[0].split()[:3] == ["op", "shape", "provider"]
    assert "rss delta (approx)" in lines[0]
    assert "baseline" in lines[2] and lines[3].split()[-4].endswith("x")
    assert lines[0].endswith("H100 model") and lines[3].split()[-1] == "-"  # no model given
    assert len({line.index("sleepy") for line in lines[2:4]}) == 1
    assert lines[4].startswith("vs base: median minus the baseline")


def _fake_bench(wrong: bool) -> types.ModuleType:
    mod = types.ModuleType("bench.bench_fake")
    mod.OP = "fake"
    mod.cases = lambda quick: [_recording_case([], wrong=wrong)]
    return mod


def test_main_check_exit_codes(capsys):
    assert bench_main.main(["--check", "--no-progress"], modules=[_fake_bench(False)]) == 0
    assert "check OK" in capsys.readouterr().out
    assert bench_main.main(["--check", "--no-progress"], modules=[_fake_bench(True)]) == 1
    assert "CHECK FAILED" in capsys.readouterr().err


def test_main_writes_csv_and_plots(tmp_path, capsys):
    argv = ["--quick", "--reps", "2", "--out", str(tmp_path), "--no-progress"]
    assert bench_main.main(argv, modules=[_fake_bench(False)]) == 0
    out = capsys.readouterr().out
    assert "appended 2 rows" in out
    assert (tmp_path / "results.csv").exists() and (tmp_path / "double.png").exists()
    assert bench_main.main([*argv, "--only", "other"], modules=[_fake_bench(False)]) == 2


def test_discover_and_only_filter():
    mods = bench_main.discover()
    names = [bench_main.op_name(m) for m in mods]
    assert "advantages" in names
    fake = _fake_bench(False)
    assert len(bench_main.collect([fake], quick=True, only=["fake"])) == 1
    assert len(bench_main.collect([fake], quick=True, only=["double"])) == 1
    assert bench_main.collect([fake], quick=True, only=["advantages"]) == []


# ----------------------------------------------------------------------------- advantages bench


def test_advantages_baselines_match_the_reference():
    """The bench's baselines implement the spec (so speedups compare like with like)."""
    reference = pytest.importorskip("compass_kernels.advantages.reference")
    from bench import bench_advantages as ba

    g = torch.Generator().manual_seed(0)
    rewards = ba.binary_rewards(13, 7, g)
    rewards[:7] += torch.rand(7, generator=g)  # one group with non-binary rewards
    ids = torch.arange(13).repeat_interleave(7)
    perm = torch.randperm(ids.numel(), generator=g)

    def check(adv, zv, ref_adv, ref_zv):
        torch.testing.assert_close(adv, ref_adv.to(torch.float32), atol=1e-5, rtol=1e-5)
        assert torch.equal(zv, ref_zv)

    for mode in ("grpo", "dr_grpo", "rloo"):
        ref_adv, ref_zv, _, _ = reference.group_advantages_reference(rewards, ids, mode=mode)
        assert bool(ref_zv.any()) and not bool(ref_zv.all())
        check(*ba.group_advantages_torch(rewards, 7, mode=mode), ref_adv, ref_zv)
        # verl's semantics equal the spec here (no group of one, std 0 or > tol)
        check(*ba.group_advantages_verl(rewards, ids, mode=mode), ref_adv, ref_zv)
        # shuffled ids, then with a group of one and ids that are not 0..G-1
        r_s, ids_s = rewards[perm], ids[perm] * 3 + 5
        for any_ids in (False, True):
            out = ba.group_advantages_torch_ids(r_s, ids_s, mode=mode, any_ids=any_ids)
            check(*out, ref_adv[perm], ref_zv[perm])
        r_1, ids_1 = torch.cat([r_s, torch.tensor([1.0])]), torch.cat([ids_s, torch.tensor([99])])
        ref1_adv, ref1_zv, _, _ = reference.group_advantages_reference(r_1, ids_1, mode=mode)
        for any_ids in (False, True):
            out = ba.group_advantages_torch_ids(r_1, ids_1, mode=mode, any_ids=any_ids)
            check(*out, ref1_adv, ref1_zv)
        check(*ba.group_advantages_loop(r_1, ids_1, mode=mode), ref1_adv, ref1_zv)
    ones = torch.ones(5)  # groups of one: zero-variance
    adv, zv = ba.group_advantages_torch(ones, 1)
    assert adv.tolist() == [0.0] * 5 and bool(zv.all())

    lengths = ba.lognormal_lengths(40, 64, g)
    lengths[3] = 0
    cu = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
    h = torch.rand(int(cu[-1]) + 5, generator=g)  # 5 padding tokens after the last sequence
    r, z = torch.randint(0, 2, (40,), generator=g).float(), torch.rand(40, generator=g) < 0.5
    a = torch.randn(40, generator=g)
    for adv_in in (a, None):
        ref = reference.rl_zvp_reference(h, cu, r, z, alpha=0.1, advantages=adv_in)
        for fn in (ba.rl_zvp_torch, ba.rl_zvp_loop):
            out = fn(h, cu, r, z, alpha=0.1, advantages=adv_in)
            torch.testing.assert_close(out, ref.to(torch.float32), atol=1e-6, rtol=1e-6)


def test_advantages_bench_quick_cases_are_well_formed():
    from bench import bench_advantages as ba

    cases = ba.cases(quick=True)
    names = {c.name for c in cases}
    assert names >= {"overhead", "group_advantages_grpo", "rl_zvp"}
    assert names >= {"group_advantages_grpo_ids_grouped", "group_advantages_grpo_ids_shuffled"}
    for c in cases:
        assert len(c.providers) >= 2
        assert c.baseline == ("kernel (raw binding)" if c.name == "overhead" else "torch")
    full = {(c.name, c.shape_str) for c in ba.cases(quick=False)}
    for name in ("group_advantages_grpo", "group_advantages_grpo_ids_shuffled"):
        assert (name, "prompts=8192,samples=16") in full
    lengths = ba.lognormal_lengths(4096, ba.MAX_LEN, torch.Generator().manual_seed(1))
    assert int(lengths.min()) >= 1 and int(lengths.max()) == ba.MAX_LEN


def test_overhead_raw_kernel_row_fails_loudly_when_the_binding_moves(monkeypatch):
    from bench import bench_advantages as ba
    from compass_kernels.advantages import group_advantages_op

    monkeypatch.setitem(
        group_advantages_op._specs, "torch", "compass_kernels.advantages.reference:moved_away"
    )
    monkeypatch.setattr(group_advantages_op, "_kernels", {})
    call = ba._raw_group_kernel(torch.ones(8), 4)
    with pytest.raises(RuntimeError, match="_raw_group_kernel"):
        call()
