#!/usr/bin/env bash
# verl 0.9.1 GRPO on a Qwen3-MoE with every compass piece switched on.
# Each override is annotated with the piece it turns on; drop a line to turn
# that piece off. Needs GPUs (vLLM rollout, Megatron actor): this exact
# command has NOT been run yet (see README.md, "The GPU run it still owes").
set -euo pipefail
MODEL=${MODEL:-Qwen/Qwen3-30B-A3B}
DATA=${DATA:-$HOME/data/gsm8k}

# compass registers itself in the driver and in every Ray worker when verl is
# imported (verl imports VERL_USE_EXTERNAL_MODULES everywhere).
export VERL_USE_EXTERNAL_MODULES=compass_kernels.integration.verl.plugin
export COMPASS_VERL_PATCHES=old_entropy,balancing,replay   # pieces 2, 4, 5
export COMPASS_VERL_ESPO=rho=0.2,alpha=0.02                 # compass_espo options
export COMPASS_VERL_ADV=mode=grpo,rl_zvp=true,alpha=0.1     # estimator options

python3 -m verl.trainer.main_ppo --config-name=ppo_megatron_trainer \
  data.train_files="$DATA/train.parquet" data.val_files="$DATA/test.parquet" \
  data.train_batch_size=256 data.max_prompt_length=1024 data.max_response_length=4096 \
  actor_rollout_ref.model.path="$MODEL" \
  actor_rollout_ref.rollout.name=vllm actor_rollout_ref.rollout.n=8 \
  `# 1/2. the policy loss: compass_espo (or compass_grpo / compass_gspo), verl's aggregation` \
  actor_rollout_ref.actor.policy_loss.loss_mode=compass_espo \
  actor_rollout_ref.actor.loss_agg_mode=seq-mean-token-mean \
  `# 3. the advantage estimator (norm_adv_by_std_in_grpo=false: Dr.GRPO)` \
  algorithm.adv_estimator=compass_grpo \
  algorithm.norm_adv_by_std_in_grpo=true \
  `# 4. balancing: DP ranks (trainer.balance_batch) and micro-batches (dynamic bsz) by the compass planner` \
  trainer.balance_batch=true \
  actor_rollout_ref.actor.use_dynamic_bsz=true \
  actor_rollout_ref.actor.ppo_max_token_len_per_gpu=16384 \
  `# 5. router replay: vLLM returns the routes, compass replays them (verl's own R3 off)` \
  actor_rollout_ref.rollout.enable_rollout_routing_replay=true \
  actor_rollout_ref.actor.megatron.router_replay.mode=disabled \
  +ray_kwargs.ray_init.runtime_env.env_vars.VERL_USE_EXTERNAL_MODULES="$VERL_USE_EXTERNAL_MODULES" \
  +ray_kwargs.ray_init.runtime_env.env_vars.COMPASS_VERL_PATCHES="$COMPASS_VERL_PATCHES" \
  +ray_kwargs.ray_init.runtime_env.env_vars.COMPASS_VERL_ESPO="$COMPASS_VERL_ESPO" \
  +ray_kwargs.ray_init.runtime_env.env_vars.COMPASS_VERL_ADV="$COMPASS_VERL_ADV" \
  trainer.n_gpus_per_node=8 trainer.nnodes=1 trainer.total_epochs=1 "$@"
