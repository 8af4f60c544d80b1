"""The Megatron drop-in (compass_kernels/integration/megatron/espo.py) on a real megatron-core
GPTModel (tiny Qwen3-MoE, CPU, gloo world size 1): the model's labels output
(vocab-parallel cross-entropy) is -log-prob, and after Megatron's loss scaling
the parameter gradients are those of the float64 reference loss computed from
the model's logits."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("megatron.core")
pytest.importorskip("transformers")

from compass_kernels.espo.reference_loss import espo_loss_reference  # noqa: E402
from compass_kernels.testing import assert_verbose_allclose, make_generator  # noqa: E402

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def model(megatron_cpu, tiny_moe_path):
    from transformers import AutoConfig

    from compass_kernels.integration.megatron.convert import (
        build_megatron_model,
        load_hf_state_dict,
    )

    cfg = AutoConfig.from_pretrained(tiny_moe_path)
    m = build_megatron_model(cfg, load_hf_state_dict(tiny_moe_path))
    m.train()
    return cfg, m


def test_loss_func_gives_the_reference_gradients(model):
    from compass_kernels.integration.megatron.espo import EspoBatch, make_loss_func

    cfg, m = model
    T, nmb = 61, 2
    g = make_generator(3)
    ids = torch.randint(0, cfg.vocab_size, (1, T + 1), generator=g)
    tokens, labels = ids[:, :-1], ids[:, 1:]
    pos = torch.arange(T)[None]
    cu = torch.tensor([0, 17, 40, 58])  # 3 responses, 3 padding tokens after
    mask = torch.rand(T, generator=g) > 0.1
    with torch.no_grad():
        logits = m(tokens, pos, attention_mask=None)
        now = torch.log_softmax(logits.double(), -1)[0].gather(1, labels[0, :, None])[:, 0]
    old = (now + 0.05 * torch.randn(T, generator=g, dtype=torch.float64)).float()
    ent = torch.rand(T, generator=g) * 3
    adv = torch.randn(3, generator=g)
    batch = EspoBatch(cu, old, ent, adv, mask, num_sequences=12)
    opts = dict(vocab_size=cfg.vocab_size, rho=0.3)

    m.zero_grad(set_to_none=True)
    out = m(tokens, pos, attention_mask=None, labels=labels)
    assert out.shape == (1, T)
    loss, report = make_loss_func(batch, num_microbatches=nmb, **opts)(out)
    assert set(report) >= {"espo/loss", "espo/clip_frac", "espo/kl_k3"}
    (loss * 1 / nmb).backward()  # schedules.forward_step: * cp_size / num_microbatches
    ours = {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}

    m.zero_grad(set_to_none=True)
    logits = m(tokens, pos, attention_mask=None)
    lp = torch.log_softmax(logits.double(), -1)[0].gather(1, labels[0, :, None])[:, 0]
    ref, ref_metrics = espo_loss_reference(lp, old, ent, adv, cu, mask, num_sequences=12, **opts)
    ref.backward()
    assert float(ref_metrics["clip_frac"]) > 0
    assert_verbose_allclose(report["espo/loss"].double(), ref.detach(), atol=1e-7, rtol=1e-4)
    checked = 0
    for name, p in m.named_parameters():
        if p.grad is None:
            continue
        scale = p.grad.abs().max().item() + 1e-12
        assert_verbose_allclose(ours[name], p.grad.float(), atol=1e-4 * scale, rtol=2e-3, name=name)
        checked += 1
    assert checked > 10
    m.zero_grad(set_to_none=True)
