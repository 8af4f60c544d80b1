"""A model, a data set and a reward for running verl's trainer on the CPU platform.

:func:`prepare` writes, under one folder:

- ``model/``: the tiny Qwen3-MoE of :mod:`compass_kernels.integration.cpu.tiny_moe` with the
  two chat tokens verl's Qwen3 wiring asks for (``<|im_start|>``, ``<|im_end|>``; the
  embedding and head grow by two rows, seeded) and a Qwen-style chat template;
- ``train.parquet`` / ``test.parquet`` (the names of verl's gsm8k preprocessing): prompts in
  verl's RL format (``prompt`` as chat messages, ``data_source``,
  ``reward_model.ground_truth``);
- the reward is :func:`compute_score` of this file (``reward.custom_reward_function.path``
  is this module's path): how often the response contains the prompt's target syllable,
  so the samples of one prompt get different rewards.

``python -m compass_kernels.integration.cpu.verl_data DIR`` prepares ``DIR`` and prints the
variables ``examples/verl/run_qwen3_moe_compass.sh`` reads (``MODEL``, ``DATA``, ``REWARD``).
Everything is generated here; nothing is downloaded.
"""

from __future__ import annotations

import random
import sys
from pathlib import Path
from typing import Any

__all__ = ["CHAT_TEMPLATE", "DATA_SOURCE", "compute_score", "prepare"]

#: Qwen's chat format (what verl's continuous-token wiring for qwen3 models expects)
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
#: ``data_source`` of every row (verl routes rewards by it)
DATA_SOURCE = "compass_syllables"
_SYLLABLES = ("ka", "ri", "to", "mu", "se", "na", "lo", "vi")


def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs) -> float:
    """verl's reward signature: the share of the response's words containing ``ground_truth``."""
    if data_source != DATA_SOURCE:
        raise ValueError(f"compute_score: unknown data_source {data_source!r}")
    words = str(solution_str).split()
    if not words:
        return 0.0
    return sum(ground_truth in w for w in words) / len(words)


def _chat_model(src: Path, out: Path, seed: int) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(src)
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tok.chat_template = CHAT_TEMPLATE
    model: Any = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)  # loosely typed
    old = model.get_input_embeddings().weight.shape[0]
    model.resize_token_embeddings(len(tok), mean_resizing=False)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for w in (model.get_input_embeddings().weight, model.get_output_embeddings().weight):
            scale = w[:old].std()
            w[old:] = torch.randn(w[old:].shape, generator=g) * scale
    model.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)


def _rows(n: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        target = _SYLLABLES[i % len(_SYLLABLES)]
        words = " ".join(rng.choice(_SYLLABLES) + rng.choice(_SYLLABLES) for _ in range(6))
        rows.append(
            {
                "data_source": DATA_SOURCE,
                "prompt": [{"role": "user", "content": f"say {target}: {words}"}],
                "ability": "syllables",
                "reward_model": {"style": "rule", "ground_truth": target},
                "extra_info": {"index": i, "split": "train"},
            }
        )
    return rows


def prepare(out_dir: str | Path, *, prompts: int = 16, seed: int = 0) -> dict[str, str]:
    """Write the chat model, ``train.parquet`` and ``test.parquet`` into ``out_dir``.

    Returns
    -------
    dict with ``MODEL`` (model folder), ``DATA`` (the folder of the parquet files) and
    ``REWARD`` (the path of this module, whose :func:`compute_score` is the reward).
    """
    import pandas as pd

    from compass_kernels.integration.cpu.tiny_moe import cached_tiny_qwen3_moe

    if not isinstance(prompts, int) or isinstance(prompts, bool) or prompts < 1:
        raise ValueError(f"prepare: prompts must be a positive int, got {prompts!r}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model = out / "model"
    if not (model / "config.json").exists():
        _chat_model(Path(cached_tiny_qwen3_moe(seed=seed)), model, seed)
    pd.DataFrame(_rows(prompts, seed)).to_parquet(out / "train.parquet")
    pd.DataFrame(_rows(max(prompts // 4, 1), seed + 1)).to_parquet(out / "test.parquet")
    return {"MODEL": str(model), "DATA": str(out), "REWARD": str(Path(__file__).resolve())}


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python -m compass_kernels.integration.cpu.verl_data DIR")
    for key, value in prepare(sys.argv[1]).items():
        print(f"export {key}={value}")
