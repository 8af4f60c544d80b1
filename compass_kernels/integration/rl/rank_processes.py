"""The trainer rank processes and the messages between them and the driver.

:class:`RankProcesses` spawns ``layout.world_size`` processes, each running
:func:`rank_main`: it joins a gloo process group on 127.0.0.1, applies the CPU
shim for megatron-core (the ranks are CPU ranks), initializes Megatron's
parallel state with the layout, builds its
:class:`~compass_kernels.integration.rl.rank_worker.RankWorker` and then runs
the commands it receives (a method name and its arguments) one at a time,
answering each on the shared result queue. :meth:`RankProcesses.command`
sends one command to every rank and collects the answers in rank order; a
rank's exception reaches the driver with its traceback (:class:`RankError`).
"""

from __future__ import annotations

import pickle
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from compass_kernels.integration.megatron.parallel import Layout

__all__ = ["DEVICES", "RankError", "RankProcesses", "rank_main"]

#: Where the ranks run: CPU processes over gloo, with the CPU shim for megatron-core.
DEVICES = ("cpu",)


class RankError(RuntimeError):
    """A rank failed (the message holds its traceback) or did not answer in time."""


def rank_main(
    rank: int,
    world: int,
    port: int,
    layout: Layout,
    model_dir: str,
    lr: float,
    replay: bool,
    seed: int,
    cmd_q: Any,
    res_q: Any,
) -> None:
    """One rank process: a gloo (CPU) rank of ``world``, the CPU shim applied,
    Megatron's parallel state from ``layout``, a ``RankWorker`` of the checkpoint
    in ``model_dir``; then the commands of ``cmd_q`` until "stop"."""
    import torch.distributed as dist
    from transformers import AutoConfig

    from compass_kernels.integration.cpu import megatron as megatron_cpu
    from compass_kernels.integration.megatron.convert import load_hf_state_dict
    from compass_kernels.integration.megatron.parallel import init_parallel_state
    from compass_kernels.integration.rl.rank_worker import RankWorker

    torch.set_num_threads(1)
    torch.manual_seed(seed)
    worker = None
    try:
        dist.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
        )
        megatron_cpu.apply()  # a CPU rank: megatron-core's CUDA-only calls, on the CPU
        init_parallel_state(seed, **layout.megatron_sizes())
        hf_config = AutoConfig.from_pretrained(model_dir)
        worker = RankWorker(hf_config, load_hf_state_dict(model_dir), layout, lr=lr, replay=replay)
        res_q.put((rank, "ready", (worker.info, worker.layers)))
        while True:
            cmd, args = cmd_q.get()
            if cmd == "stop":
                break
            t0 = time.perf_counter()
            result = getattr(worker, cmd)(*args)
            res_q.put((rank, cmd, (result, time.perf_counter() - t0)))
    except BaseException:  # noqa: BLE001 - reported to the driver, then the rank exits
        res_q.put((rank, "error", traceback.format_exc()))
    finally:
        from megatron.core import parallel_state as ps

        if worker is not None:
            worker.replay.remove()
        ps.destroy_model_parallel()
        if dist.is_initialized():
            dist.destroy_process_group()


@dataclass
class Replies:
    """Every rank's answer to one command (rank order) and the driver's wait."""

    values: list[Any]
    seconds: float


class RankProcesses:
    """``layout.world_size`` rank processes (:func:`rank_main`) and their queues.

    Parameters
    ----------
    model_dir : HF checkpoint folder every rank loads (its own slices).
    layout : the parallel sizes.
    lr, replay, seed : the workers' AdamW learning rate, router replay, Megatron seed.
    timeout : seconds to wait for any one command on all ranks.
    device : where the ranks run (:data:`DEVICES`).

    ``last_reply_bytes`` / ``reply_bytes_total``: what each rank sent back for the
    last command of each name / in total per command (pickled, as the queue
    carries it)."""

    def __init__(
        self,
        model_dir: str | Path,
        layout: Layout,
        *,
        lr: float,
        replay: bool,
        seed: int,
        timeout: float,
        device: str = "cpu",
    ) -> None:
        import torch.multiprocessing as mp

        from compass_kernels.integration.cpu.process_groups import find_free_port

        if device not in DEVICES:
            raise ValueError(
                f"device: expected one of {DEVICES} (CPU ranks over gloo with the CPU shim; "
                f"no CUDA / NCCL rank path is implemented), got {device!r}"
            )
        self.timeout = timeout
        self.last_reply_bytes: dict[str, list[int]] = {}
        self.reply_bytes_total: dict[str, int] = {}
        ctx = mp.get_context("spawn")
        world = layout.world_size
        self._res = ctx.Queue()
        self._cmds = [ctx.Queue() for _ in range(world)]
        port = find_free_port()
        args = (world, port, layout, str(model_dir), lr, replay, seed)
        self._procs = [
            ctx.Process(target=rank_main, args=(r, *args, self._cmds[r], self._res), daemon=True)
            for r in range(world)
        ]
        for p in self._procs:
            p.start()
        self.ready = self.collect("ready").values

    def __len__(self) -> int:
        return len(self._procs)

    def collect(self, cmd: str) -> Replies:
        """Every rank's answer to ``cmd`` (rank order); a rank's error, a dead rank or
        no answer in ``timeout`` closes the processes and raises :class:`RankError`."""
        import queue

        t0 = time.perf_counter()
        out: dict[int, Any] = {}
        deadline = time.monotonic() + self.timeout
        while len(out) < len(self._procs):
            try:
                rank, what, value = self._res.get(timeout=1.0)
            except queue.Empty:
                dead = [r for r, p in enumerate(self._procs) if not p.is_alive() and r not in out]
                if dead or time.monotonic() > deadline:
                    self.close()
                    why = f"ranks {dead} exited" if dead else f"no answer in {self.timeout} s"
                    raise RankError(f"{cmd}: {why}") from None
                continue
            if what == "error":
                self.close()
                raise RankError(f"rank {rank} failed during {cmd}:\n{value}")
            if what != cmd:
                self.close()
                raise RankError(f"rank {rank} answered {what!r} to {cmd!r}")
            out[rank] = value
        values = [out[r] for r in range(len(self._procs))]
        self.last_reply_bytes[cmd] = [
            len(pickle.dumps(v[0])) if cmd != "ready" else 0 for v in values
        ]
        self.reply_bytes_total[cmd] = self.reply_bytes_total.get(cmd, 0) + sum(
            self.last_reply_bytes[cmd]
        )
        return Replies(values, time.perf_counter() - t0)

    def command(self, cmd: str, per_rank_args: list[tuple]) -> list[Any]:
        """Run ``RankWorker.<cmd>(*args)`` on every rank (its own args); the results
        in rank order."""
        for q, args in zip(self._cmds, per_rank_args, strict=True):
            q.put((cmd, args))
        return [v[0] for v in self.collect(cmd).values]

    def close(self) -> None:
        for q, p in zip(self._cmds, self._procs, strict=True):
            if p.is_alive():
                try:
                    q.put(("stop", ()))
                except (ValueError, OSError):
                    pass
        for p in self._procs:
            p.join(timeout=20)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
