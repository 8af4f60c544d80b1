"""compass-rl's preflight (integration/rl/preflight.py): every cap and size checked
against the model and the task before any engine or rank starts, naming the flag.
No engine is started here (fast): the checks read the model's config only."""

from __future__ import annotations

import json
import os
from types import SimpleNamespace

import pytest

from compass_kernels.integration.cpu.tiny_moe import DEFAULT_CONFIG
from compass_kernels.integration.rl import loop, preflight


def _args(*argv: str):
    return loop.build_parser().parse_args(list(argv))


def _cfg(**over):
    return SimpleNamespace(**{**DEFAULT_CONFIG, **over})


def test_defaults_pass():
    assert preflight.problems(_args(), _cfg()) == []
    preflight.check(_args("--tp", "2", "--cp", "2", "--dp", "1", "--ep", "2"), _cfg())


@pytest.mark.parametrize(
    "argv, cfg, flag",
    [
        (("--max-tokens", "20"), {}, "--max-tokens 20"),  # the case: no sequence fits
        (("--max-tokens", "55"), {}, "--max-tokens 55"),  # 24 + 32 = 56 tokens
        (
            ("--max-tokens", "55", "--max-new-tokens", "30", "--cp", "2", "--tp", "2", "--dp", "1"),
            {},
            "padded to a multiple of 8",
        ),  # 24 + 30 = 54 -> 56
        (("--max-new-tokens", "480"), {}, "--max-new-tokens 480"),  # past the model's 512
        (("--tp", "3"), {}, "--tp 3"),  # 4 heads
        (("--pp", "4"), {}, "--pp 4"),  # 3 layers
        (("--ep", "16", "--dp", "16"), {}, "--ep 16"),  # 8 experts
        (("--top-k", "9"), {"num_experts_per_tok": 9}, "--top-k"),
        ((), {"num_experts_per_tok": 9}, "num_experts_per_tok 9"),
        (("--allocate", "samples", "--max-alloc-n", "1"), {}, "--max-alloc-n 1"),
        (("--resample-n", "1"), {}, "--resample-n 1"),
        (("--resample-budget", "3", "--resample-n", "8"), {}, "--resample-budget 3"),
        (("--model-dir", "/x", "--num-experts", "16"), {}, "--num-experts"),
    ],
)
def test_each_bad_cap_names_its_flag(argv, cfg, flag):
    with pytest.raises(SystemExit, match=flag.replace("+", r"\+")):
        preflight.check(_args(*argv), _cfg(**cfg))


def test_tp8_with_8_heads_fails_only_on_hidden_size():
    got = preflight.problems(
        _args("--tp", "8", "--dp", "1"),
        _cfg(num_key_value_heads=8, num_attention_heads=8, vocab_size=1024, hidden_size=100),
    )
    assert len(got) == 1 and "hidden_size (100)" in got[0]


def test_every_problem_is_listed_at_once():
    got = preflight.problems(_args("--max-tokens", "10", "--pp", "5", "--tp", "3"), _cfg())
    assert {p.split()[0] for p in got} == {"--max-tokens", "--tp", "--pp"}


def test_run_fails_before_any_engine_starts(tmp_path, monkeypatch):
    """loop.run with --max-tokens below prompt + 1: SystemExit naming the flag, and
    neither vLLM nor a trainer rank is started (both replaced by tripwires)."""
    (tmp_path / "config.json").write_text(json.dumps({**DEFAULT_CONFIG, "model_type": "qwen3_moe"}))
    monkeypatch.setattr(loop, "_model_dir", lambda args: tmp_path)
    started = []
    import compass_kernels.integration.cpu.vllm_engine as ve
    import compass_kernels.integration.rl.loop_adapter as ranks

    monkeypatch.setattr(ve, "start_vllm", lambda *a, **k: started.append("vllm"))
    monkeypatch.setattr(ranks, "LoopAdapter", lambda *a, **k: started.append("ranks"))
    for key in ve.FAST_ENV:  # the loop's fast settings must not outlive it
        monkeypatch.delenv(key, raising=False)
    with pytest.raises(SystemExit, match="--max-tokens 20"):
        loop.run(_args("--max-tokens", "20", "--out", str(tmp_path / "out")))
    assert started == []
    assert not (tmp_path / "out").exists()
    assert [k for k in ve.FAST_ENV if k in os.environ] == []
