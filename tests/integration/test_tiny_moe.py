"""The generated tiny Qwen3-MoE checkpoint: loads in transformers, deterministic, cached."""

from __future__ import annotations

import hashlib
import os

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

from compass_kernels.integration.cpu import tiny_moe  # noqa: E402

pytestmark = pytest.mark.integration

# Small variant for the build tests: same code paths, less work.
_SMALL = {"num_hidden_layers": 1, "corpus_lines": 400}


def _digest(path, name):
    return hashlib.sha256((path / name).read_bytes()).hexdigest()


def test_checkpoint_loads_in_transformers(tiny_moe_path):
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    for name in ("config.json", "model.safetensors", "tokenizer.json", "generation_config.json"):
        assert (tiny_moe_path / name).is_file(), name
    cfg = AutoConfig.from_pretrained(tiny_moe_path)
    assert cfg.model_type == "qwen3_moe"
    assert (cfg.vocab_size, cfg.hidden_size, cfg.num_hidden_layers) == (1024, 128, 3)
    assert (cfg.num_experts, cfg.num_experts_per_tok) == (8, 2)
    assert cfg.mlp_only_layers == [] and cfg.decoder_sparse_step == 1

    model = AutoModelForCausalLM.from_pretrained(tiny_moe_path).eval()
    assert type(model).__name__ == "Qwen3MoeForCausalLM"
    params = list(model.parameters())
    assert all(p.dtype == torch.float32 for p in params)
    assert 0.8e6 < sum(p.numel() for p in params) < 1.3e6

    tok = AutoTokenizer.from_pretrained(tiny_moe_path)
    assert len(tok) <= cfg.vocab_size
    assert tok.eos_token == tiny_moe.EOS_TOKEN and tok.eos_token_id == cfg.eos_token_id
    text = "Karito sena 42 lovi pe?"
    ids = tok(text).input_ids
    assert tok.decode(ids) == text
    assert len(ids) < len(text)  # BPE merges learned something

    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits
    assert logits.shape == (1, len(ids), cfg.vocab_size)
    assert torch.isfinite(logits).all()
    # Random weights scaled so the next-token distribution is far from uniform.
    assert logits[0, -1].std() > 0.3


def test_deterministic_for_seed(tmp_path):
    a = tiny_moe.make_tiny_qwen3_moe(tmp_path / "a", seed=3, **_SMALL)
    b = tiny_moe.make_tiny_qwen3_moe(tmp_path / "b", seed=3, **_SMALL)
    c = tiny_moe.make_tiny_qwen3_moe(tmp_path / "c", seed=4, **_SMALL)
    for name in ("model.safetensors", "tokenizer.json", "config.json"):
        assert _digest(a, name) == _digest(b, name), name
    assert _digest(a, "model.safetensors") != _digest(c, "model.safetensors")
    assert _digest(a, "tokenizer.json") != _digest(c, "tokenizer.json")


def test_overrides_change_the_config(tmp_path):
    from transformers import AutoConfig

    path = tiny_moe.make_tiny_qwen3_moe(
        tmp_path, num_experts=4, rope_theta=1e6, tie_word_embeddings=True, **_SMALL
    )
    cfg = AutoConfig.from_pretrained(path)
    assert cfg.num_experts == 4 and cfg.num_hidden_layers == 1
    assert cfg.rope_parameters["rope_theta"] == 1e6
    assert cfg.tie_word_embeddings is True

    built = tiny_moe.tiny_qwen3_moe_config(num_experts=4)
    assert built.num_experts == 4 and built.rope_parameters["rope_theta"] == 10000.0


def test_cache_builds_once_and_atomically(tmp_path, monkeypatch):
    first = tiny_moe.cached_tiny_qwen3_moe(tmp_path, **_SMALL)
    assert first.parent == tmp_path
    assert first.name == f"tiny_qwen3_moe-{tiny_moe.config_hash(**_SMALL)}"
    stamp = os.stat(first / "model.safetensors").st_mtime_ns
    again = tiny_moe.cached_tiny_qwen3_moe(tmp_path, **_SMALL)
    assert again == first
    assert os.stat(again / "model.safetensors").st_mtime_ns == stamp  # not rebuilt
    # No temporary build folder is left behind.
    assert sorted(p.name for p in tmp_path.iterdir()) == [first.name]

    monkeypatch.setenv("COMPASS_CACHE", str(tmp_path / "env"))
    from_env = tiny_moe.cached_tiny_qwen3_moe(**_SMALL)
    assert from_env.parent == tmp_path / "env"

    assert tiny_moe.config_hash(seed=1, **_SMALL) != tiny_moe.config_hash(seed=0, **_SMALL)
    assert tiny_moe.config_hash(num_experts=4) != tiny_moe.config_hash()


def test_bad_arguments_name_the_argument(tmp_path):
    with pytest.raises(TypeError, match="num_expert"):
        tiny_moe.make_tiny_qwen3_moe(tmp_path, num_expert=4)
    with pytest.raises(ValueError, match="num_experts_per_tok"):
        tiny_moe.make_tiny_qwen3_moe(tmp_path, num_experts=2, num_experts_per_tok=3)
    with pytest.raises(ValueError, match="num_key_value_heads"):
        tiny_moe.make_tiny_qwen3_moe(tmp_path, num_key_value_heads=3)
    with pytest.raises(ValueError, match="seed"):
        tiny_moe.make_tiny_qwen3_moe(tmp_path, seed=-1)
    with pytest.raises(ValueError, match="vocab_size"):
        tiny_moe.config_hash(vocab_size=100)
    assert not any(tmp_path.iterdir())  # nothing written on bad input
