"""One validation rule (compass_kernels._validate.should_check) for every public op.

For each public function with a ``validate`` argument, on inputs whose data is
bad (a NaN, an out-of-range id or offset): the default checks on CPU tensors,
``validate=True`` checks, ``validate=False`` opts out (the call returns), and
FakeTensor / meta inputs are never read, not even with ``validate=True``.
Plus: every such function defaults to ``validate=None`` and decides with
should_check (or hands ``validate`` to a public function that does).
"""

from __future__ import annotations

import ast
import inspect
import textwrap

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import compass_kernels as ck
from compass_kernels._validate import should_check
from compass_kernels.testing import make_generator

T, E, K, V, H = 12, 8, 2, 32, 16
NAN = float("nan")


def _fp8_gemm_args(g):
    x = torch.randn(T, 128, generator=g)
    a_q, a_s = ck.fp8.quantize_token_groups(x)
    b_q, b_s = ck.fp8.quantize_blockwise(torch.randn(2, 64, 128, generator=g))
    a_s = a_s.clone()
    a_s.view(-1)[3] = NAN
    return a_q, a_s, b_q, b_s, torch.tensor([0, 5, T])


def _moe_weights(g, e=2, h=128, i=64):
    w13, s13 = ck.fp8.quantize_blockwise(torch.randn(e, 2 * i, h, generator=g))
    w2, s2 = ck.fp8.quantize_blockwise(torch.randn(e, h, i, generator=g))
    return w13, s13, w2, s2


def _cases():
    """name -> (fn, args with bad data, whether it runs on FakeTensors / meta)."""
    g = make_generator(3)
    bad_r = torch.randn(8, generator=g)
    bad_r[5] = NAN
    cu = torch.tensor([0, 5, T])
    bad_lp = torch.randn(T, generator=g)
    bad_lp[2] = NAN
    logits = torch.randn(T, V, generator=g)
    logits[4, 1] = NAN
    hidden = torch.randn(T, H, generator=g)
    hidden[1, 2] = NAN
    ids = torch.rand(T, E, generator=g).argsort(-1)[:, :K]
    z = torch.randn(T, E, generator=g)
    z[7, 0] = NAN
    x = torch.randn(T, 256, generator=g)
    x[0, 9] = NAN
    w = torch.randn(128, 128, generator=g)
    w[3, 3] = NAN
    w13, s13, w2, s2 = _moe_weights(g)
    s13_bad = s13.clone()
    s13_bad.view(-1)[0] = NAN
    tw = torch.rand(T, K, generator=g)
    tw[2, 1] = NAN
    targets = torch.randint(0, V, (T,), generator=g)
    y = torch.randn(2 * T, 64, generator=g)
    dst = torch.arange(T * K)
    dst[3] = 10 * T * K
    a = advantages = torch.randn(2, generator=g)
    del a
    return {
        "group_advantages": (
            lambda r: ck.advantages.group_advantages(r, group_size=4, **_kw()),
            (bad_r,),
            True,
        ),
        "rl_zvp": (
            lambda e, c, r, zv: ck.advantages.rl_zvp(e, c, r, zv, **_kw()),
            (bad_lp.abs(), cu, torch.randn(2, generator=g), torch.tensor([True, False])),
            True,
        ),
        "token_logprobs_entropy": (
            lambda lg, t: ck.espo.token_logprobs_entropy(lg, t, **_kw()),
            (logits, targets),
            True,
        ),
        "fused_linear_logprobs_entropy": (
            lambda h, wt, t: ck.espo.fused_linear_logprobs_entropy(h, wt, t, **_kw()),
            (hidden, torch.randn(V, H, generator=g), targets),
            True,
        ),
        "espo_loss": (
            lambda lp, old, ent, adv, c: ck.espo.espo_loss(
                lp, old, ent, adv, c, vocab_size=V, **_kw()
            ),
            (bad_lp, torch.randn(T, generator=g), torch.rand(T, generator=g), advantages, cu),
            True,
        ),
        "fused_linear_espo_loss": (
            lambda h, wt, t, old, ent, adv, c: ck.espo.fused_linear_espo_loss(
                h, wt, t, old, ent, adv, c, **_kw()
            ),
            (
                hidden,
                torch.randn(V, H, generator=g),
                targets,
                torch.randn(T, generator=g),
                torch.rand(T, generator=g),
                advantages,
                cu,
            ),
            False,
        ),
        "quantize_blockwise": (lambda t: ck.fp8.quantize_blockwise(t, **_kw()), (w,), True),
        "quantize_token_groups": (lambda t: ck.fp8.quantize_token_groups(t, **_kw()), (x,), True),
        "permute_quantize": (
            lambda t, i: ck.fp8.permute_quantize(t, i, E, **_kw()),
            (x, ids),
            True,
        ),
        "unpermute": (
            lambda yy, d, ww: ck.fp8.unpermute(yy, d, ww, **_kw()),
            (y, dst, torch.rand(T, K, generator=g)),
            True,
        ),
        "grouped_gemm": (
            lambda *args: ck.fp8.grouped_gemm(*args, **_kw()),
            _fp8_gemm_args(g),
            True,
        ),
        "moe_mlp": (
            lambda h, i, tw_, *ws: ck.fp8.moe_mlp(h, i % 2, tw_, *ws, **_kw()),
            (torch.randn(T, 128, generator=g), ids, tw, w13, s13, w2, s2),
            False,
        ),
        "grouped_mlp": (
            lambda xx, off, *ws: ck.fp8.grouped_mlp(xx, off, *ws, **_kw()),
            (torch.randn(T, 128, generator=g), torch.tensor([0, 5, T]), w13, s13_bad, w2, s2),
            False,
        ),
        "replay_topk": (lambda zz, i: ck.routing.replay_topk(zz, i, **_kw()), (z, ids), True),
    }


_VALIDATE: list = [None]


def _kw() -> dict:
    v = _VALIDATE[0]
    return {} if v == "default" else {"validate": v}


CASES = _cases()


def _call(name, validate, args):
    fn, _, _ = CASES[name]
    _VALIDATE[0] = validate
    try:
        return fn(*args)
    finally:
        _VALIDATE[0] = None


@pytest.mark.parametrize("name", sorted(CASES))
def test_cpu_checks_by_default_and_when_asked_never_when_opted_out(name):
    _, args, _ = CASES[name]
    for validate in ("default", None, True):
        with pytest.raises(ValueError, match="expected") as err:
            _call(name, validate, args)
    check_error = str(err.value)
    try:
        _call(name, False, args)  # opted out: the check's error never comes
    except Exception as e:  # noqa: BLE001 - a kernel may still refuse (e.g. an index error)
        assert str(e) != check_error, f"{name}: validate=False still ran the check"


@pytest.mark.parametrize("name", sorted(n for n, c in CASES.items() if c[2]))
def test_fake_and_meta_tensors_are_never_checked(name):
    _, args, _ = CASES[name]
    with FakeTensorMode() as mode:
        _call(name, True, tuple(mode.from_tensor(a) for a in args))
    _call(name, True, tuple(a.to("meta") for a in args))


def test_never_while_tracing_even_when_asked():
    """torch.compile traces through the checks (no graph break on a data read)."""
    fn = torch.compile(
        lambda r: ck.advantages.group_advantages(r, group_size=4, validate=True)[0],
        backend="eager",
        fullgraph=True,
    )
    r = torch.randn(8)
    r[1] = NAN
    assert fn(r).isnan().any()  # traced: unchecked, the NaN reaches its group


def test_should_check_rule():
    cpu, meta = torch.zeros(2), torch.zeros(2, device="meta")
    assert should_check(None, cpu) and should_check(True, cpu)
    assert not should_check(False, cpu)
    assert not should_check(True, meta) and not should_check(None, cpu, meta)
    with FakeTensorMode() as mode:
        assert not should_check(True, mode.from_tensor(cpu))
    with pytest.raises(TypeError, match="validate: expected True, False or None"):
        should_check("yes", cpu)


@pytest.mark.gpu
def test_should_check_on_cuda():
    t = torch.zeros(2, device="cuda")
    assert not should_check(None, t) and should_check(True, t) and not should_check(False, t)


def _public_functions_with_validate():
    for cap in ("advantages", "espo", "fp8", "packing", "routing"):
        mod = getattr(ck, cap)
        for n in mod.__all__:
            f = getattr(mod, n)
            if inspect.isfunction(f) and "validate" in inspect.signature(f).parameters:
                yield f"{cap}.{n}", f


def test_every_public_op_with_validate_is_covered_and_uses_the_rule():
    names = {}
    for qual, f in _public_functions_with_validate():
        names[qual.split(".")[1]] = f
        assert inspect.signature(f).parameters["validate"].default is None, qual
        tree = ast.parse(textwrap.dedent(inspect.getsource(f)))
        called = {
            n.func.id if isinstance(n.func, ast.Name) else n.func.attr
            for n in ast.walk(tree)
            if isinstance(n, ast.Call) and isinstance(n.func, ast.Name | ast.Attribute)
        }
        passes = any(
            any(kw.arg == "validate" for kw in n.keywords)
            or any(isinstance(a, ast.Name) and a.id == "validate" for a in n.args)
            for n in ast.walk(tree)
            if isinstance(n, ast.Call)
        )
        assert "should_check" in called or passes, f"{qual} decides validation on its own"
    assert set(names) == set(CASES), "a public op with validate= lacks a case here"
