"""Process groups for megatron-core on the CPU: a one-process gloo group with
Megatron's parallel state (:func:`init_single_process_gloo`), several spawned gloo
processes running a function (:func:`run_distributed`), a free port.

Both apply the CPU shim (:func:`compass_kernels.integration.cpu.megatron.apply`)
where Megatron runs in them, and initialize its parallel state with
:func:`compass_kernels.integration.megatron.parallel.init_parallel_state`.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Callable
from typing import Any

import torch

__all__ = [
    "destroy_single_process_gloo",
    "find_free_port",
    "init_single_process_gloo",
    "run_distributed",
]

# Resources this module created (and may therefore destroy): flags, plus
# "megatron_world", the default group Megatron's groups were made from.
_OWNED: dict[str, Any] = {}


def find_free_port(host: str = "127.0.0.1") -> int:
    """Return a TCP port that is free on ``host`` right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def init_single_process_gloo(*, seed: int = 0, apply_shim: bool = True) -> None:
    """Create a world-size-1 gloo process group and Megatron's parallel state (idempotent).

    A second call changes nothing (in particular it does not re-seed).

    Parameters
    ----------
    seed : int, default 0
        Seed of Megatron's RNG tracker (``model_parallel_cuda_manual_seed``),
        applied when this call initializes the parallel state.
    apply_shim : bool, default True
        Call :func:`apply` first (required on a machine without CUDA).

    Notes
    -----
    An existing default process group of world size 1 (e.g. vLLM's) is reused.

    Raises
    ------
    RuntimeError
        If a default process group already exists with a world size other than 1.
    """
    import torch.distributed as dist

    if not isinstance(seed, int) or seed < 0:
        raise ValueError(f"seed must be a non-negative int, got {seed!r}")
    if apply_shim:
        from compass_kernels.integration.cpu.megatron import apply

        apply()
    if dist.is_initialized():
        if dist.get_world_size() != 1:
            raise RuntimeError(
                f"a process group of world size {dist.get_world_size()} already exists; "
                "init_single_process_gloo needs world size 1"
            )
    else:
        dist.init_process_group(backend="gloo", store=dist.HashStore(), rank=0, world_size=1)
        _OWNED["default_group"] = True
    from megatron.core import parallel_state

    world = dist.distributed_c10d._get_default_group()
    if _OWNED.get("megatron_world") not in (None, world):
        # Megatron's groups were made from a default group that is gone (e.g. a
        # vLLM engine that owned it shut down): they are stale, make them anew.
        parallel_state.destroy_model_parallel()
        _OWNED.pop("megatron_parallel", None)
    from compass_kernels.integration.megatron.parallel import init_parallel_state

    if init_parallel_state(seed):
        _OWNED["megatron_parallel"] = True
    _OWNED["megatron_world"] = world


def destroy_single_process_gloo() -> None:
    """Undo :func:`init_single_process_gloo`: destroy what it created.

    Megatron's parallel state and the default process group are destroyed only
    if :func:`init_single_process_gloo` created them (a default group that
    existed before, e.g. vLLM's, is left alone). Calling it twice is harmless.
    """
    import torch.distributed as dist
    from megatron.core import parallel_state

    _OWNED.pop("megatron_world", None)
    if _OWNED.pop("megatron_parallel", False):
        parallel_state.destroy_model_parallel()
    if _OWNED.pop("default_group", False) and dist.is_initialized():
        dist.destroy_process_group()


def _distributed_worker(
    rank: int,
    fn: Callable,
    world_size: int,
    port: int,
    args: tuple,
    megatron: dict | None,
    results,
) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group(
        backend="gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world_size,
    )
    try:
        if megatron is not None:
            from compass_kernels.integration.cpu.megatron import apply

            apply()
            sizes = dict(megatron)
            seed = int(sizes.pop("seed", 0))
            from compass_kernels.integration.megatron.parallel import init_parallel_state

            init_parallel_state(seed, **sizes)
        out = fn(rank, world_size, *args)
        results.put((rank, out))
    finally:
        if megatron is not None:
            from megatron.core import parallel_state

            parallel_state.destroy_model_parallel()
        dist.destroy_process_group()


def run_distributed(
    fn: Callable,
    world_size: int = 2,
    args: tuple = (),
    *,
    megatron: dict | None = None,
    timeout: float = 120.0,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` in ``world_size`` spawned gloo processes.

    Each process joins a gloo process group over ``127.0.0.1`` on a free port.
    With ``megatron`` given, each process also applies the CPU shim and
    initializes Megatron's parallel state with those sizes.

    Parameters
    ----------
    fn : callable
        A picklable (module-level) function; its return value must be picklable.
    world_size : int, default 2
        Number of processes.
    args : tuple
        Extra positional arguments for ``fn``.
    megatron : dict, optional
        Keyword arguments for ``parallel_state.initialize_model_parallel``
        (e.g. ``{"tensor_model_parallel_size": 2}``) plus an optional ``seed``.
    timeout : float, default 120
        Seconds to wait for all processes; on expiry they are killed and
        ``TimeoutError`` is raised.

    Returns
    -------
    list
        ``fn``'s return value per rank, indexed by rank.

    Raises
    ------
    torch.multiprocessing.ProcessRaisedException
        If a worker raised (the message holds its traceback).
    """
    import torch.multiprocessing as mp

    if not callable(fn):
        raise TypeError(f"fn must be callable, got {type(fn).__name__}")
    if not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 1:
        raise ValueError(f"world_size must be a positive int, got {world_size!r}")
    if not isinstance(args, tuple):
        raise TypeError(f"args must be a tuple, got {type(args).__name__}")
    if not isinstance(timeout, (int, float)) or timeout <= 0:
        raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}")
    if megatron is not None and not isinstance(megatron, dict):
        raise TypeError(f"megatron must be a dict or None, got {type(megatron).__name__}")

    ctx = mp.get_context("spawn")
    results = ctx.SimpleQueue()
    port = find_free_port()
    procs = mp.start_processes(
        _distributed_worker,
        args=(fn, world_size, port, args, megatron, results),
        nprocs=world_size,
        join=False,
        start_method="spawn",
    )
    deadline = time.monotonic() + timeout
    while not procs.join(timeout=0.5):
        if time.monotonic() > deadline:
            for proc in procs.processes:
                if proc.is_alive():
                    proc.kill()
            raise TimeoutError(f"run_distributed: workers did not finish within {timeout} s")
    out: dict[int, Any] = {}
    while not results.empty():
        rank, value = results.get()
        out[rank] = value
    missing = sorted(set(range(world_size)) - set(out))
    if missing:
        raise RuntimeError(f"run_distributed: ranks {missing} returned no result")
    return [out[r] for r in range(world_size)]
