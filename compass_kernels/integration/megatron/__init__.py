"""Megatron-core adapters: router replay, the HF <-> Megatron converter, the ESPO loss and FP8
experts hooks, real ranks (parallel_state layouts), and the per-version source pins."""
