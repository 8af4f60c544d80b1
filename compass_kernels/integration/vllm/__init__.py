"""vLLM adapters: routing capture, length-aware rollout, FP8 MoE experts, weight sync into a
live engine (bf16 or FP8). Each module imports vLLM lazily."""
