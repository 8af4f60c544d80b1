"""The reference RL loop (``compass-rl``): vLLM rollouts with routing capture,
overlapped rewards, zero-variance elimination, length-aware packing,
megatron-core training with router replay and ESPO, weight sync.

- :mod:`compass_kernels.integration.rl.task`: the synthetic verifiable task, the reward-model
  stand-in, reward composition with the advantage-inversion guard, penalties.
- :mod:`compass_kernels.integration.rl.rollout`: vLLM rounds (scheduler order, capture,
  overlapped scoring).
- :mod:`compass_kernels.integration.rl.trainer`: packing, megatron-core passes, ESPO step.
- :mod:`compass_kernels.integration.rl.loop`: the driver and CLI (``compass-rl``).
"""
