"""Capture on a tiny Qwen3-MoE whose first layer is dense: columns are the MoE layers'
global numbers (1, 2), never shifted, and match transformers (own engine start)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")

from compass_kernels.integration.vllm import capture as rc  # noqa: E402

pytestmark = [pytest.mark.integration, pytest.mark.vllm]

_DENSE = {"mlp_only_layers": [0]}


@pytest.fixture(scope="module")
def dense_path():
    pytest.importorskip("tokenizers")
    from compass_kernels.integration.cpu.tiny_moe import cached_tiny_qwen3_moe

    return cached_tiny_qwen3_moe(**_DENSE)


def test_dense_first_layer_is_not_a_column(dense_path):
    pytest.importorskip("vllm")
    from transformers import AutoModelForCausalLM
    from vllm import SamplingParams

    from compass_kernels.integration.cpu.vllm_engine import shutdown_vllm, start_vllm

    llm = start_vllm(dense_path, max_model_len=128, max_num_seqs=2)
    try:
        capture = rc.enable_routing_capture(llm)
        assert capture.layers == [1, 2]
        g = torch.Generator().manual_seed(40)
        prompts = [torch.randint(3, 1000, (n,), generator=g).tolist() for n in (33, 20)]
        params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        traces = capture.collect(outs)
    finally:
        shutdown_vllm(llm)
    hf = AutoModelForCausalLM.from_pretrained(dense_path, dtype=torch.float32).eval()
    for out, trace in zip(outs, traces, strict=True):
        assert list(trace.layer_ids) == [1, 2] and trace.missing is None
        tokens = (list(out.prompt_token_ids) + list(out.outputs[0].token_ids))[:-1]
        with torch.no_grad():
            logits = hf(torch.tensor([tokens]), output_router_logits=True).router_logits
        assert len(logits) == 2  # transformers reports the two MoE layers only
        ref = np.sort(torch.stack([torch.topk(lg, 2, -1).indices for lg in logits], 1), -1)
        got = np.sort(trace.expert_ids.numpy().astype(np.int64), -1)
        assert np.array_equal(got, ref)
