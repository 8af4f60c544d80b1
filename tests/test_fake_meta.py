"""Every public op under FakeTensorMode and on the meta device: the outputs'
shapes and dtypes equal the real call's, and no data pointer reaches a kernel
(before issue 21 the eager call handed a FakeTensor's pointer to C++ and
segfaulted); the same public functions under torch.compile; and
torch.library.opcheck of every compass op call a public function makes."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

from compass_kernels import advantages, espo, fp8, packing, routing
from compass_kernels.testing import make_generator

T, E, K, V, H = 12, 16, 2, 64, 32


def _cases():
    g = make_generator(0)
    ids = torch.rand(T, E, generator=g).argsort(-1)[:, :K]
    cu = torch.tensor([0, 5, 12])
    return {
        "replay_topk": (routing.replay_topk, (torch.randn(T, E, generator=g), ids)),
        "token_logprobs_entropy": (
            espo.token_logprobs_entropy,
            (torch.randn(T, V, generator=g), torch.randint(0, V, (T,), generator=g)),
        ),
        "fused_linear_logprobs_entropy": (
            espo.fused_linear_logprobs_entropy,
            (
                torch.randn(T, H, generator=g),
                torch.randn(V, H, generator=g),
                torch.randint(0, V, (T,), generator=g),
            ),
        ),
        "espo_loss": (
            lambda a, b, c, d, e: espo.espo_loss(a, b, c, d, e, vocab_size=V),
            (
                torch.randn(T, generator=g),
                torch.randn(T, generator=g),
                torch.rand(T, generator=g),
                torch.randn(2, generator=g),
                cu,
            ),
        ),
        "group_advantages": (
            lambda r: advantages.group_advantages(r, group_size=4),
            (torch.randn(8, generator=g),),
        ),
        "group_advantages_ids": (
            lambda r, i: advantages.group_advantages(r, i, num_groups=3),
            (torch.randn(8, generator=g), torch.tensor([2, 0, 1, 0, 2, 1, 1, 0])),
        ),
        "rl_zvp": (
            advantages.rl_zvp,
            (
                torch.rand(T, generator=g),
                cu,
                torch.randn(2, generator=g),
                torch.tensor([True, False]),
            ),
        ),
        "overlong_penalty": (
            lambda lens: advantages.overlong_penalty(lens, max_len=10, cache_len=4),
            (torch.tensor([3, 9, 12]),),
        ),
        "pack": (lambda x: packing.pack(x, [5, 7], [0, 1]), (torch.randn(12, 3, generator=g),)),
        "quantize_blockwise": (fp8.quantize_blockwise, (torch.randn(256, 128, generator=g),)),
        "quantize_token_groups": (fp8.quantize_token_groups, (torch.randn(T, 256, generator=g),)),
        "permute_quantize": (
            lambda x, i: fp8.permute_quantize(x, i, E),
            (torch.randn(T, 256, generator=g), ids),
        ),
    }


CASES = _cases()


def _tensors(x) -> list[torch.Tensor]:
    """Every tensor in a result (tuples, lists, dicts, dataclasses, namedtuples)."""
    if isinstance(x, torch.Tensor):
        return [x]
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        return [t for f in dataclasses.fields(x) for t in _tensors(getattr(x, f.name))]
    if isinstance(x, dict):
        return [t for v in x.values() for t in _tensors(v)]
    if isinstance(x, (tuple, list)):
        return [t for v in x for t in _tensors(v)]
    return []


def _meta_of(x: torch.Tensor) -> tuple:
    return tuple(x.shape), x.dtype


@pytest.mark.parametrize("name", sorted(CASES))
def test_public_op_under_fake_tensor_mode_and_meta(name):
    fn, args = CASES[name]
    real = [_meta_of(t) for t in _tensors(fn(*args))]
    assert real, name
    with FakeTensorMode() as mode:
        fake_out = fn(*(mode.from_tensor(a) for a in args))
    fake = _tensors(fake_out)
    assert [_meta_of(t) for t in fake] == real
    # outputs computed from the inputs are fake (a host plan built from Python ints,
    # e.g. pack's cu_seqlens, may be a plain CPU tensor)
    assert any(type(t).__name__ == "FakeTensor" for t in fake)
    meta = _tensors(fn(*(a.to("meta") for a in args)))
    assert [_meta_of(t) for t in meta] == real
    assert any(t.is_meta for t in meta)


@pytest.mark.parametrize("name", ["replay_topk", "quantize_token_groups", "group_advantages"])
def test_public_op_through_torch_compile(name):
    fn, args = CASES[name]
    want = _tensors(fn(*args))
    got = _tensors(torch.compile(fn, backend="aot_eager", fullgraph=False)(*args))
    assert len(got) == len(want)
    for a, b in zip(got, want, strict=True):
        assert _meta_of(a) == _meta_of(b)
        torch.testing.assert_close(a, b, equal_nan=True)


class _RecordOps(TorchDispatchMode):
    """Records every compass op call (op, args) a public function makes."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.namespace == "compass":
            self.calls.append((func, args, kwargs))
        return func(*args, **kwargs)


@pytest.mark.parametrize("name", sorted(CASES))
def test_opcheck_through_the_public_function(name):
    fn, args = CASES[name]
    with _RecordOps() as rec:
        fn(*args)
    if name == "overlong_penalty":  # plain torch, no compass op
        assert not rec.calls
        return
    assert rec.calls, f"{name} made no compass op call through the dispatcher"
    for func, a, kw in rec.calls:
        a = tuple(x.clone() if isinstance(x, torch.Tensor) else x for x in a)
        torch.library.opcheck(
            func, a, kw, test_utils=("test_schema", "test_faketensor", "test_autograd_registration")
        )
