"""The reference RL loop (``compass-rl``): vLLM rollouts with routing capture,
overlapped rewards, zero-variance elimination, length-aware packing,
megatron-core training with router replay and ESPO, weight sync.

- :mod:`compass_kernels.integration.rl.task`: the synthetic verifiable task, the reward-model
  stand-in, reward composition with the advantage-inversion guard, penalties.
- :mod:`compass_kernels.integration.rl.rollout`: vLLM rounds (scheduler order, capture,
  overlapped scoring).
- :mod:`compass_kernels.integration.rl.batch`: the step's batch, its packing checks, the
  gap sums and RL-ZVP token advantages both the driver and the ranks compute.
- :mod:`compass_kernels.integration.rl.shares`: what each trainer rank receives (its
  micro-batches in ``ck.packing``'s THD / context-parallel layout).
- :mod:`compass_kernels.integration.rl.rank_worker`: one rank's model chunk, replay,
  optimizer and Megatron schedule (``RankWorker``).
- :mod:`compass_kernels.integration.rl.rank_processes`: the rank processes and the
  command / reply messages between them and the driver.
- :mod:`compass_kernels.integration.rl.quantile`: the exact quantile over ranks (radix select).
- :mod:`compass_kernels.integration.rl.distributed_trainer`: the driver's trainer over the
  ranks (``DistributedTrainer``: shares out, replies reduced).
- :mod:`compass_kernels.integration.rl.loop_adapter`: the trainer interface the loop calls
  (``LoopAdapter``).
- :mod:`compass_kernels.integration.rl.loop`: the driver and CLI (``compass-rl``).
- :mod:`compass_kernels.integration.rl.report`: what a run writes after its steps
  (steps.csv, steps.png, the gap summary); the per-step table is ``console``'s.
"""
