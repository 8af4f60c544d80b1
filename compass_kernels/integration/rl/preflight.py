"""compass-rl's checks of every cap and size against the model and the task, run
before any engine or rank starts (``loop.run`` calls :func:`check` right after
reading the model's config). Each failure is a ``SystemExit`` naming the flag and
what it must satisfy: a run that cannot work fails in a second, not a minute in
with a rank traceback naming an internal argument.

The argument-only checks (ranges of single flags) are ``loop._check_args``;
the layout's divisibility (pp | layers, ep | experts, tp | kv heads and vocab)
is ``Layout.check``. Here: what needs the model and the task together.
"""

from __future__ import annotations

import argparse
from typing import Any

__all__ = ["check", "problems"]

#: vLLM's max_model_len is the longest sequence plus this margin (loop.run)
ENGINE_MARGIN = 32
#: the generated model's size flags (ignored with --model-dir)
SIZE_FLAGS = ("hidden_size", "num_layers", "num_experts", "top_k", "moe_intermediate_size")


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def problems(args: argparse.Namespace, hf_config: Any, task: Any = None) -> list[str]:
    """Every reason the run cannot work, each naming its flag (empty: it can).

    ``hf_config``: the model's HF config (``num_hidden_layers``, heads, experts,
    ``max_position_embeddings``); ``task``: a ``TaskConfig`` (default: the one
    ``loop.run`` builds from the flags)."""
    from compass_kernels.integration.megatron.parallel import Layout
    from compass_kernels.integration.rl.task import TaskConfig

    out: list[str] = []
    if task is None:
        task = TaskConfig(
            vocab_size=int(hf_config.vocab_size),
            max_new_tokens=args.max_new_tokens,
            overlong_cache=max(1, args.max_new_tokens // 4),
        )
    layout = Layout(tp=args.tp, pp=args.pp, ep=args.ep, cp=args.cp, dp=args.dp)
    # the longest sequence the trainer packs: prompt + response, padded for CP / SP
    longest = task.max_prompt + task.max_new_tokens
    m = layout.pad_multiple
    padded = -(-longest // m) * m
    if args.max_tokens < padded:
        out.append(
            f"--max-tokens {args.max_tokens} is below the longest sequence: a prompt of up to "
            f"{task.max_prompt} tokens + --max-new-tokens {task.max_new_tokens}"
            + (f", padded to a multiple of {m} (2*cp*tp)" if m > 1 else "")
            + f" = {padded}; no micro-batch could hold it"
        )
    ctx = getattr(hf_config, "max_position_embeddings", None)
    if ctx is not None and longest + ENGINE_MARGIN > int(ctx):
        out.append(
            f"--max-new-tokens {task.max_new_tokens}: prompt ({task.max_prompt}) + response + "
            f"{ENGINE_MARGIN} = {longest + ENGINE_MARGIN} exceeds the model's "
            f"max_position_embeddings ({int(ctx)})"
        )
    heads = int(getattr(hf_config, "num_attention_heads", 1) or 1)
    if heads % args.tp:
        out.append(f"--tp {args.tp} does not divide the model's num_attention_heads ({heads})")
    hidden = getattr(hf_config, "hidden_size", None)
    if hidden is not None and int(hidden) % args.tp:
        out.append(f"--tp {args.tp} does not divide the model's hidden_size ({int(hidden)})")
    layers = int(getattr(hf_config, "num_hidden_layers", 0) or 0)
    if args.pp > layers:
        out.append(f"--pp {args.pp} is more stages than the model's {layers} layers")
    experts = int(getattr(hf_config, "num_experts", 0) or 0)
    top_k = int(getattr(hf_config, "num_experts_per_tok", 0) or 0)
    if experts and not 1 <= top_k <= experts:
        flag = "--top-k" if getattr(args, "top_k", None) is not None else "the model's"
        out.append(f"{flag} num_experts_per_tok {top_k} is not in [1, num_experts = {experts}]")
    if experts and args.ep > experts:
        out.append(f"--ep {args.ep} is more expert-parallel ranks than the {experts} experts")
    try:
        layout.check(hf_config)
    except ValueError as exc:
        out.append(str(exc))
    # budgets
    if args.allocate != "off" and args.max_alloc_n < 2:
        out.append(
            f"--max-alloc-n {args.max_alloc_n}: a sampled prompt needs at least 2 samples "
            "(min_n = 2) under --allocate"
        )
    if args.resample_n < 2:
        out.append(f"--resample-n {args.resample_n}: a group needs at least 2 samples")
    if 0 < args.resample_budget < args.resample_n:
        out.append(
            f"--resample-budget {args.resample_budget} is below --resample-n {args.resample_n}: "
            "stage 1 could never resample a prompt (0 turns it off)"
        )
    if getattr(args, "model_dir", None):
        given = [_flag(n) for n in SIZE_FLAGS if getattr(args, n, None) is not None]
        if given:
            out.append(
                f"{', '.join(given)}: size flags of the generated model, ignored with "
                "--model-dir (drop them)"
            )
    return out


def check(args: argparse.Namespace, hf_config: Any, task: Any = None) -> None:
    """Raise ``SystemExit`` listing every :func:`problems` entry (none: return)."""
    found = problems(args, hf_config, task)
    if found:
        raise SystemExit("compass-rl: " + "\ncompass-rl: ".join(found))
