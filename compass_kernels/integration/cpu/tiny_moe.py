"""A tiny random-weight Qwen3-MoE checkpoint and tokenizer, generated locally.

The checkpoint is in the HF layout (``config.json``, ``model.safetensors`` with
one tensor per expert projection, ``generation_config.json``) plus a byte-level
BPE tokenizer trained with the ``tokenizers`` library on generated text and
saved as a ``PreTrainedTokenizerFast``, so both vLLM and transformers load the
folder directly. Nothing is downloaded.

Everything is a deterministic function of the seed and the configuration:
building twice with the same arguments gives the same weights and the same
tokenizer files.

Examples
--------
>>> from compass_kernels.integration.cpu.tiny_moe import cached_tiny_qwen3_moe
>>> path = cached_tiny_qwen3_moe()          # doctest: +SKIP
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import random
import shutil
import tempfile
from pathlib import Path
from typing import Any

__all__ = [
    "DEFAULT_CONFIG",
    "EOS_TOKEN",
    "GENERATOR_VERSION",
    "cached_tiny_qwen3_moe",
    "config_hash",
    "make_tiny_qwen3_moe",
    "tiny_qwen3_moe_config",
]

#: Bump when the generated content changes for the same arguments.
GENERATOR_VERSION = 1

#: End-of-sequence token of the generated tokenizer (also used for padding).
EOS_TOKEN = "<|endoftext|>"

#: Qwen3-MoE model configuration of the tiny checkpoint (~1.0M parameters).
DEFAULT_CONFIG: dict[str, Any] = {
    "vocab_size": 1024,
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "moe_intermediate_size": 64,
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "norm_topk_prob": True,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "max_position_embeddings": 512,
    "rope_theta": 10000.0,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
}

#: Options of the generator itself (not part of the model configuration).
_GENERATOR_OPTIONS: dict[str, Any] = {
    # Weight matrices are N(0, weight_scale**2 / fan_in); embeddings N(0, 1).
    "weight_scale": 1.0,
    # RMSNorm weights are 1 + norm_noise * N(0, 1), so a swapped norm is visible.
    "norm_noise": 0.1,
    # Lines of generated text the BPE tokenizer is trained on.
    "corpus_lines": 3000,
}

_SYLLABLES = (
    "ka ri to mu se na lo vi pe du ga zo fi he ju ny qu wa xi be "
    "an en in on un ar er ir or ur st th ch sh pl tr"
).split()


def _split_options(overrides: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """Split keyword overrides into model-config and generator options.

    Raises
    ------
    TypeError
        If an override names neither a config field nor a generator option.
    """
    model_cfg = json.loads(json.dumps(DEFAULT_CONFIG))
    gen_opts = dict(_GENERATOR_OPTIONS)
    for key, value in overrides.items():
        if key in model_cfg:
            model_cfg[key] = value
        elif key in gen_opts:
            gen_opts[key] = value
        else:
            known = sorted(model_cfg) + sorted(gen_opts)
            raise TypeError(f"unknown override {key!r}; expected one of {known}")
    _validate(model_cfg, gen_opts)
    return model_cfg, gen_opts


def _validate(cfg: dict[str, Any], opts: dict[str, Any]) -> None:
    """Check the combined configuration, naming the offending argument."""
    for key in (
        "vocab_size",
        "hidden_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "moe_intermediate_size",
        "num_experts",
        "num_experts_per_tok",
        "max_position_embeddings",
        "corpus_lines",
    ):
        value = cfg.get(key, opts.get(key))
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise ValueError(f"{key} must be a positive int, got {value!r}")
    if cfg["vocab_size"] < 300:
        raise ValueError(
            f"vocab_size must be >= 300 (256 byte tokens + specials + merges), "
            f"got {cfg['vocab_size']}"
        )
    if cfg["num_attention_heads"] % cfg["num_key_value_heads"]:
        raise ValueError(
            f"num_key_value_heads ({cfg['num_key_value_heads']}) must divide "
            f"num_attention_heads ({cfg['num_attention_heads']})"
        )
    if cfg["num_experts_per_tok"] > cfg["num_experts"]:
        raise ValueError(
            f"num_experts_per_tok ({cfg['num_experts_per_tok']}) must be <= "
            f"num_experts ({cfg['num_experts']})"
        )
    if cfg["head_dim"] % 2:
        raise ValueError(f"head_dim must be even for RoPE, got {cfg['head_dim']}")
    for key in ("weight_scale", "norm_noise"):
        if not isinstance(opts[key], (int, float)) or opts[key] < 0:
            raise ValueError(f"{key} must be a non-negative number, got {opts[key]!r}")


def tiny_qwen3_moe_config(**overrides: Any):
    """Build the ``transformers.Qwen3MoeConfig`` of the tiny model.

    Parameters
    ----------
    **overrides
        Fields of :data:`DEFAULT_CONFIG` to change (e.g. ``num_hidden_layers=2``).

    Returns
    -------
    transformers.Qwen3MoeConfig
        The configuration, with ``eos``/``pad`` ids left unset.
    """
    model_cfg, _ = _split_options(overrides)
    return _hf_config(model_cfg)


def _hf_config(model_cfg: dict[str, Any]):
    from transformers import Qwen3MoeConfig

    kwargs = dict(model_cfg)
    theta = float(kwargs.pop("rope_theta"))
    kwargs["rope_parameters"] = {"rope_theta": theta, "rope_type": "default"}
    return Qwen3MoeConfig(**kwargs)


def config_hash(*, seed: int = 0, **overrides: Any) -> str:
    """Short hash identifying the generated content for these arguments.

    The hash covers the model configuration, generator options, seed,
    :data:`GENERATOR_VERSION` and the transformers / tokenizers versions (whose
    layouts and trainers determine the bytes on disk).

    Parameters
    ----------
    seed : int
        Seed of the generator.
    **overrides
        As for :func:`make_tiny_qwen3_moe`.

    Returns
    -------
    str
        16 hex digits.
    """
    import tokenizers
    import transformers

    _check_seed(seed)
    model_cfg, gen_opts = _split_options(overrides)
    blob = json.dumps(
        {
            "config": model_cfg,
            "options": gen_opts,
            "seed": seed,
            "generator": GENERATOR_VERSION,
            "transformers": transformers.__version__,
            "tokenizers": tokenizers.__version__,
        },
        sort_keys=True,
    )
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def _check_seed(seed: Any) -> None:
    if not isinstance(seed, int) or isinstance(seed, bool) or seed < 0:
        raise ValueError(f"seed must be a non-negative int, got {seed!r}")


def _corpus(seed: int, lines: int) -> list[str]:
    """Deterministic pseudo-text: words made of syllables, with punctuation and digits."""
    rng = random.Random(seed)
    words = []
    for _ in range(600):
        n = rng.choice((1, 2, 2, 3, 3, 4))
        words.append("".join(rng.choice(_SYLLABLES) for _ in range(n)))
    # Zipf-like word frequencies, so BPE learns whole frequent words.
    weights = [1.0 / (i + 1) for i in range(len(words))]
    out = []
    for _ in range(lines):
        n = rng.randint(4, 14)
        sent = rng.choices(words, weights=weights, k=n)
        if rng.random() < 0.3:
            sent.insert(rng.randrange(len(sent) + 1), str(rng.randint(0, 999)))
        text = " ".join(sent)
        out.append(text[0].upper() + text[1:] + rng.choice((".", ".", "?", "!", ",")))
    return out


def _train_tokenizer(vocab_size: int, seed: int, lines: int):
    """Train a byte-level BPE of at most ``vocab_size`` tokens on generated text."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(seed, lines), trainer=trainer)
    if tok.get_vocab_size() > vocab_size:
        raise RuntimeError(
            f"trained tokenizer has {tok.get_vocab_size()} tokens > vocab_size {vocab_size}"
        )
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS_TOKEN, pad_token=EOS_TOKEN)


def _init_weights(model, seed: int, weight_scale: float, norm_noise: float) -> None:
    """Fill every parameter from a seeded generator, in parameter-name order."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters(), key=lambda kv: kv[0]):
            noise = torch.randn(param.shape, generator=gen, dtype=torch.float32)
            if param.dim() == 1:  # RMSNorm weights
                value = 1.0 + norm_noise * noise
            elif name.endswith("embed_tokens.weight"):
                value = noise
            else:  # [..., out, in] matrices, fan-in is the last dim
                value = noise * (weight_scale / math.sqrt(param.shape[-1]))
            param.copy_(value.to(param.dtype))


def make_tiny_qwen3_moe(path: str | os.PathLike, *, seed: int = 0, **overrides: Any) -> Path:
    """Generate the tiny Qwen3-MoE checkpoint and tokenizer into ``path``.

    Parameters
    ----------
    path : str or os.PathLike
        Output folder; created if missing. Existing files of the same names are
        overwritten.
    seed : int, default 0
        Seeds the weights and the tokenizer's training text.
    **overrides
        Fields of :data:`DEFAULT_CONFIG` (e.g. ``num_experts=4``,
        ``rope_theta=1e6``, ``tie_word_embeddings=True``) or generator options
        ``weight_scale``, ``norm_noise``, ``corpus_lines``.

    Returns
    -------
    pathlib.Path
        ``path``, holding ``config.json``, ``model.safetensors``,
        ``generation_config.json`` and the tokenizer files (float32 weights).

    Raises
    ------
    TypeError
        If an override is unknown.
    ValueError
        If a value is out of range (the message names the argument).
    """
    import torch
    from transformers import GenerationConfig, Qwen3MoeForCausalLM

    _check_seed(seed)
    if path is None or str(path) == "":
        raise ValueError("path must be a folder path, got an empty value")
    model_cfg, gen_opts = _split_options(overrides)
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)

    tokenizer = _train_tokenizer(model_cfg["vocab_size"], seed, gen_opts["corpus_lines"])
    eos_id = tokenizer.convert_tokens_to_ids(EOS_TOKEN)

    config = _hf_config(model_cfg)
    config.eos_token_id = eos_id
    config.pad_token_id = eos_id
    config.bos_token_id = None
    config.dtype = torch.float32
    config.architectures = ["Qwen3MoeForCausalLM"]

    # transformers wraps PreTrainedModel.to (functools.wraps): mypy reads it as unbound
    model = Qwen3MoeForCausalLM(config).to(torch.float32)  # type: ignore[arg-type]
    _init_weights(model, seed, float(gen_opts["weight_scale"]), float(gen_opts["norm_noise"]))
    model.generation_config = GenerationConfig(
        eos_token_id=eos_id, pad_token_id=eos_id, do_sample=False
    )
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    (out / "compass_tiny_moe.json").write_text(
        json.dumps(
            {
                "seed": seed,
                "generator": GENERATOR_VERSION,
                "config": model_cfg,
                "options": gen_opts,
            },
            indent=1,
            sort_keys=True,
        )
    )
    return out


def _cache_root(cache_dir: str | os.PathLike | None) -> Path:
    if cache_dir is not None:
        return Path(cache_dir)
    env = os.environ.get("COMPASS_CACHE")
    if env:
        return Path(env)
    return Path.home() / ".cache" / "compass_kernels"


def cached_tiny_qwen3_moe(
    cache_dir: str | os.PathLike | None = None, *, seed: int = 0, **overrides: Any
) -> Path:
    """Return the tiny checkpoint from the cache, generating it on first use.

    The folder is ``<root>/tiny_qwen3_moe-<hash>``, where ``root`` is
    ``cache_dir``, else ``$COMPASS_CACHE``, else ``~/.cache/compass_kernels``
    and ``hash`` is :func:`config_hash`. A missing folder is built in a
    temporary folder beside it and renamed into place, so concurrent callers
    never see a partial checkpoint.

    Parameters
    ----------
    cache_dir : str or os.PathLike, optional
        Cache root overriding ``$COMPASS_CACHE``.
    seed : int, default 0
        As for :func:`make_tiny_qwen3_moe`.
    **overrides
        As for :func:`make_tiny_qwen3_moe`.

    Returns
    -------
    pathlib.Path
        The checkpoint folder.
    """
    root = _cache_root(cache_dir)
    target = root / f"tiny_qwen3_moe-{config_hash(seed=seed, **overrides)}"
    if (target / "config.json").is_file():
        return target
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".tiny_qwen3_moe-", dir=root))
    try:
        make_tiny_qwen3_moe(tmp, seed=seed, **overrides)
        try:
            os.rename(tmp, target)
        except OSError:
            # Another process won the race (target exists and is non-empty).
            if not (target / "config.json").is_file():
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return target
