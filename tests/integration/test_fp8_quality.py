"""The measurement tools behind the FP8 quality-gate explanation
(compass_kernels/integration/fp8_quality.py): routing replay, the FP8-dequantized copy, the
per-GEMM error. Small sizes; the table itself is
`python -m bench.fp8_quality`."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from bench.fp8_quality import (  # noqa: E402
    fp8_dequantized,
    gate,
    linear_errors,
    random_model,
)
from compass_kernels.integration.vllm.fp8_sync import is_block_fp8_weight  # noqa: E402

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def pair():
    torch.manual_seed(0)
    return fp8_dequantized(random_model(num_hidden_layers=2))


@pytest.fixture(scope="module")
def tokens():
    return torch.randint(0, 1000, (4, 33), generator=torch.Generator().manual_seed(1))


def test_dequantized_copy_changes_only_the_fp8_weights(pair):
    b, f = pair
    sb, sf = b.state_dict(), f.state_dict()
    moved = {k for k in sb if not torch.equal(sb[k], sf[k])}
    assert moved and all("proj" in k for k in moved)  # attention projections and experts
    assert {k for k in sb if "norm" in k or "embed" in k or "lm_head" in k or "gate." in k} & (
        moved
    ) == set()
    assert not is_block_fp8_weight("model.layers.0.mlp.gate.weight")


def test_identical_models_agree_exactly_with_and_without_replay(pair, tokens):
    b, _ = pair
    for frozen in (False, True):
        g = gate(b, b, tokens, freeze_routing=frozen)
        assert g["ratio_err_max"] == 1.0 and g["kl_max"] <= 1e-12 and g["routing_flips"] == 0


def test_replay_removes_the_routing_flips(pair, tokens):
    b, f = pair
    free = gate(b, f, tokens)
    frozen = gate(b, f, tokens, freeze_routing=True)
    assert free["routing_flips"] > 0
    assert frozen["ratio_err_mean"] < free["ratio_err_mean"]
    assert frozen["kl_mean"] < free["kl_mean"]


def test_gemm_error_equals_the_weight_error_of_e4m3(pair, tokens):
    """Per-GEMM relative output error ~ the weights' relative error (~2.6%
    for e4m3 with 3 mantissa bits): no averaging over K."""
    e = linear_errors(*pair, tokens)
    assert 0.015 < e["weight_rel_err"] < 0.04
    assert 0.5 < e["gemm_rel_err"] / e["weight_rel_err"] < 1.5
