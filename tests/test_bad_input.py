"""Bad input, round two (issue 30): options as Python users pass them, integer and
float extremes, and the minor findings. Codec headers: tests/test_codec_fuzz.py;
zero-size shapes: tests/test_zero_size.py; compass-rl caps: tests/test_rl_preflight.py;
verl: tests/test_verl_register.py.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import compass_kernels as ck
from compass_kernels._validate import as_bool, as_float, as_float_tuple, as_int
from compass_kernels.packing.schedule import LengthPredictor

# ---------------------------------------------------------------- normalisers
# Every spelling of one number a Python user passes: the library must treat them
# as the plain value, once, at the boundary.
SCALAR_FORMS = {
    "python": lambda v: v,
    "np_scalar": lambda v: np.int64(v) if isinstance(v, int) else np.float64(v),
    "np_small": lambda v: np.int32(v) if isinstance(v, int) else np.float32(v),
    "np_0d": lambda v: np.array(v),
    "torch_0d": lambda v: torch.tensor(
        v, dtype=torch.int64 if isinstance(v, int) else torch.float64
    ),
    "torch_0d_f32": lambda v: torch.tensor(
        v, dtype=torch.int32 if isinstance(v, int) else torch.float32
    ),
}
SEQ_FORMS = {
    "tuple": tuple,
    "list": list,
    "np_1d": lambda v: np.array(v, dtype=np.float64),
    "np_1d_f32": lambda v: np.array(v, dtype=np.float32),
    "torch_1d": lambda v: torch.tensor(v, dtype=torch.float64),
}


@pytest.mark.parametrize("form", SCALAR_FORMS)
def test_normalisers_unwrap_every_scalar_form(form):
    wrap = SCALAR_FORMS[form]
    assert as_int("n", wrap(7)) == 7 and type(as_int("n", wrap(7))) is int
    got = as_float("x", wrap(0.25))
    assert got == 0.25 and type(got) is float


@pytest.mark.parametrize("form", SEQ_FORMS)
def test_float_tuple_every_sequence_form(form):
    got = as_float_tuple("q", SEQ_FORMS[form]([0.25, 0.5]))
    assert got == (0.25, 0.5) and all(type(x) is float for x in got)


@pytest.mark.parametrize(
    "fn, value, match",
    [
        (as_int, True, "n: expected an int, got True"),
        (as_int, np.bool_(True), "n: expected an int"),
        (as_int, torch.tensor(True), "n: expected an int"),
        (as_int, 2.0, "n: expected an int"),
        (as_int, np.float64(2.0), "n: expected an int"),
        (as_int, "2", "n: expected an int"),
        (as_int, np.array([1, 2]), r"n: expected an int, got an array of shape \[2\]"),
        (as_float, True, "n: expected a number"),
        (as_float, float("nan"), "n: expected a finite number"),
        (as_float, np.float32("inf"), "n: expected a finite number"),
        (as_float, 1j, "n: expected a number"),
        (as_float, torch.ones(2), r"n: expected a number, got a tensor of shape \[2\]"),
        (as_bool, 1, "n: expected a bool"),
        (as_float_tuple, "ab", "n: expected a sequence"),
        (as_float_tuple, np.ones((2, 2)), "n: expected a 1-d sequence"),
        (as_float_tuple, [0.1, float("nan")], r"n\[1\]: expected a finite number"),
    ],
)
def test_normalisers_refuse_naming_the_argument(fn, value, match):
    with pytest.raises((TypeError, ValueError), match=match):
        fn("n", value)


def test_int_bounds_named():
    with pytest.raises(ValueError, match="dp: expected a positive int, got 0"):
        as_int("dp", 0, lo=1)
    with pytest.raises(ValueError, match=r"k: expected an int in \[0, 3\], got 4"):
        as_int("k", 4, lo=0, hi=3)


# ------------------------------------------------- every public option (property)
def _espo(**opt):
    g = torch.Generator().manual_seed(3)
    T = 37
    lp = torch.randn(T, generator=g, dtype=torch.float64) * 0.1 - 1
    old = lp + torch.randn(T, generator=g, dtype=torch.float64) * 0.05
    ent = torch.rand(T, generator=g, dtype=torch.float64) * 3
    cu = torch.tensor([0, 5, 17, 30, 37])
    adv = torch.randn(4, generator=g, dtype=torch.float64)
    loss, m = ck.espo.espo_loss(lp, old, ent, adv, cu, **opt)
    return torch.stack([loss, m["clip_frac"]])


def _group(**opt):
    r = torch.tensor([1.0, 0.0, 0.5, 0.5, 2.0, 1.0], dtype=torch.float64)
    if "num_groups" in opt:
        return ck.advantages.group_advantages(r, torch.tensor([0, 0, 1, 1, 2, 2]), **opt)[0]
    return ck.advantages.group_advantages(r, **{"group_size": 2, **opt})[0]


def _rl_zvp(**opt):
    ent = torch.rand(10, generator=torch.Generator().manual_seed(0))
    cu = torch.tensor([0, 4, 10])
    return ck.advantages.rl_zvp(
        ent, cu, torch.tensor([1.0, -1.0]), torch.tensor([True, True]), **opt
    )


def _overlong(**opt):
    return ck.advantages.overlong_penalty(
        torch.arange(0, 20), **{"max_len": 16, "cache_len": 4, **opt}
    )


def _alloc(**opt):
    s, a = torch.tensor([1.0, 3.0, 0.0, 2.0]), torch.tensor([4.0, 4.0, 2.0, 8.0])
    return ck.advantages.allocate_rollouts(s, a, opt.pop("budget", 20), **opt)


def _plan(**opt):
    p = ck.packing.plan([5, 9, 3, 12, 7, 4, 8, 6], **{"dp_size": 2, "max_tokens": 24, **opt})
    return p.order


def _pack(**opt):
    x = torch.arange(30.0).reshape(15, 2)
    b = ck.packing.pack(x, [4, 5, 6], [2, 0], **opt)
    return next(iter(b.tensors.values()))


def _qblock(**opt):
    w = torch.randn(40, 72, generator=torch.Generator().manual_seed(1))
    q, s = ck.fp8.quantize_blockwise(w, **{"block": (16, 32), **opt})
    return torch.cat([q.float().reshape(-1), s.reshape(-1)])


def _qtok(**opt):
    x = torch.randn(7, 64, generator=torch.Generator().manual_seed(1))
    q, s = ck.fp8.quantize_token_groups(x, **opt)
    return torch.cat([q.float().reshape(-1), s.reshape(-1)])


def _logprobs(**opt):
    logits = torch.randn(6, 11, generator=torch.Generator().manual_seed(1))
    return ck.espo.token_logprobs_entropy(logits, torch.arange(6) % 11, **opt)[0]


def _replay(**opt):
    logits = torch.randn(5, 8, generator=torch.Generator().manual_seed(1))
    ids = torch.tensor([[0, 3], [1, 2], [7, 6], [4, 5], [2, 0]])
    return ck.routing.replay_topk(logits, ids, **opt)[0]


def _predictor(**opt):
    length = opt.pop("length", 120)
    p = LengthPredictor(**opt)
    p.observe("a", length)
    p.observe("b", 40)
    return torch.tensor([p.predict("a"), p.predict("new")])


# (name, call, option, a valid Python value, is_int)
OPTIONS = [
    ("espo.rho", _espo, "rho", 0.3, False, {"vocab_size": 100}),
    ("espo.alpha", _espo, "alpha", 0.05, False, {"vocab_size": 100}),
    ("espo.clip", _espo, "clip", 0.1, False, {}),
    ("espo.clip_pair", _espo, "clip", (0.1, 0.3), False, {}),
    ("espo.vocab_size", _espo, "vocab_size", 1000, True, {}),
    ("espo.num_groups", _espo, "num_groups", 3, True, {"vocab_size": 100}),
    ("espo.quantiles", _espo, "quantiles", (0.3, 0.8), False, {"vocab_size": 100}),
    ("espo.dual_clip", _espo, "dual_clip", 3.0, False, {"mode": "grpo"}),
    ("espo.num_sequences", _espo, "num_sequences", 9, True, {"vocab_size": 100}),
    ("group.group_size", _group, "group_size", 3, True, {}),
    ("group.num_groups", _group, "num_groups", 3, True, {}),
    ("group.eps", _group, "eps", 0.01, False, {}),
    ("group.zero_var_tol", _group, "zero_var_tol", 0.2, False, {}),
    ("rl_zvp.alpha", _rl_zvp, "alpha", 0.3, False, {}),
    ("overlong.max_len", _overlong, "max_len", 12, True, {}),
    ("overlong.cache_len", _overlong, "cache_len", 5, True, {}),
    ("alloc.budget", _alloc, "budget", 17, True, {}),
    ("alloc.budget_float", _alloc, "budget", 17.5, False, {}),
    ("alloc.min_n", _alloc, "min_n", 3, True, {}),
    ("alloc.max_n", _alloc, "max_n", 6, True, {}),
    ("alloc.prior", _alloc, "prior", (0.5, 2.0), False, {}),
    ("plan.dp_size", _plan, "dp_size", 3, True, {}),
    ("plan.max_tokens", _plan, "max_tokens", 20, True, {}),
    ("plan.pad_multiple", _plan, "pad_multiple", 4, True, {}),
    ("plan.micro_batch_multiple", _plan, "micro_batch_multiple", 2, True, {}),
    ("pack.pad_multiple", _pack, "pad_multiple", 4, True, {}),
    ("pack.cp_size", _pack, "cp_size", 2, True, {"pad_multiple": 4}),
    ("pack.cp_rank", _pack, "cp_rank", 1, True, {"pad_multiple": 4, "cp_size": 2}),
    ("fp8.block", _qblock, "block", (8, 16), True, {}),
    ("fp8.eps", _qblock, "eps", 1e-3, False, {}),
    ("fp8.group_size", _qtok, "group_size", 32, True, {}),
    ("espo.temperature", _logprobs, "temperature", 0.7, False, {}),
    ("routing.scaling", _replay, "scaling", 2.5, False, {}),
    ("routing.min_score_ratio", _replay, "min_score_ratio", 0.01, False, {}),
    ("schedule.history", _predictor, "history", 3, True, {}),
    ("schedule.sibling_weight", _predictor, "sibling_weight", 0.5, False, {}),
    ("schedule.default", _predictor, "default", 300.0, False, {}),
    ("schedule.length", _predictor, "length", 77, True, {}),
]
IDS = [o[0] for o in OPTIONS]


def _forms(value, is_int):
    if isinstance(value, tuple):
        forms = dict(SEQ_FORMS)
        if is_int:  # integer pairs: integer arrays
            forms = {"tuple": tuple, "list": list, "np_1d": np.array, "torch_1d": torch.tensor}
        return forms
    return SCALAR_FORMS


def _same(a, b):
    assert type(a) is type(b)
    if isinstance(a, tuple):
        for x, y in zip(a, b, strict=True):
            _same(x, y)
    else:
        torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("name, call, option, value, is_int, base", OPTIONS, ids=IDS)
@settings(max_examples=12, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_every_option_accepts_numpy_and_torch_forms(name, call, option, value, is_int, base, data):
    """Property: every public option gives the same result from each Python form of
    the same value (Python number, NumPy scalar of any width, 0-d array, 0-d tensor;
    for pairs / tuples: list, 1-d array, 1-d tensor)."""
    forms = _forms(value, is_int)
    form = data.draw(st.sampled_from(sorted(forms)), label="form")
    if isinstance(value, float) and form in ("np_small", "torch_0d_f32"):
        value = float(np.float32(value))  # the exact float32 value: no rounding in question
    if isinstance(value, tuple) and form == "np_1d_f32":
        value = tuple(float(np.float32(v)) for v in value)
    want = call(**base, **{option: value})
    got = call(**base, **{option: forms[form](value)})
    _same(want, got)


INT_OPTIONS = [o for o in OPTIONS if o[4] and not isinstance(o[3], tuple)]


@pytest.mark.parametrize(
    "name, call, option, value, is_int, base", INT_OPTIONS, ids=[o[0] for o in INT_OPTIONS]
)
@pytest.mark.parametrize("bad", [True, np.bool_(True), torch.tensor(True)], ids=str)
def test_bool_is_refused_where_an_int_is_meant(name, call, option, value, is_int, base, bad):
    if option in ("budget", "length"):  # numbers, not counts: bool still refused
        pass
    with pytest.raises((TypeError, ValueError), match=option):
        call(**base, **{option: bad})


def test_dp_size_true_refused():
    """The issue's minor finding: dp_size=True was taken as 1."""
    with pytest.raises(TypeError, match="dp_size: expected an int, got True"):
        ck.packing.plan([5, 6], dp_size=True, max_tokens=10)


# ------------------------------------------------------------ integer extremes
def test_allocate_huge_float_budget_clamps_to_the_full_spend():
    """A large finite float budget (pybind TypeError before) clamps to sum(max_n x cost):
    the allocation every prompt at max_n, spent exactly that."""
    s, a = torch.tensor([1.0, 2.0, 0.0]), torch.tensor([3.0, 4.0, 1.0])
    cost = torch.tensor([10, 20, 5])
    for budget in (1e30, 1.7e308, 2**70, np.float64(1e300), torch.tensor(1e30)):
        n, st_ = ck.advantages.allocate_rollouts(
            s, a, budget, max_n=8, cost=cost, return_stats=True
        )
        assert n.tolist() == [8, 8, 8] and st_.spent == 8 * 35


def test_allocate_cost_times_n_overflow_is_refused_naming_cost():
    s, a = torch.tensor([1.0, 2.0]), torch.tensor([3.0, 4.0])
    with pytest.raises(ValueError, match=r"cost: sum\(cost\) x max_n = .* passes 2\^62"):
        ck.advantages.allocate_rollouts(s, a, 2**62, cost=torch.tensor([2**58, 2**58]))
    with pytest.raises(ValueError, match="cost: .* passes 2"):
        ck.advantages.allocate_rollouts(s, a, 10, cost=torch.tensor([1e19, 1.0]))


@pytest.mark.parametrize("scale", [2**40, 2**48, 2**52])
def test_allocate_large_costs_never_overspend(scale):
    """Near the int64 range the spend is exact: <= budget, never negative or 0."""
    g = torch.Generator().manual_seed(0)
    s, a = torch.rand(6, generator=g) * 4, torch.full((6,), 4.0)
    cost = torch.randint(1, 9, (6,), generator=g) * scale
    budget = int(cost.sum()) * 5
    n, st_ = ck.advantages.allocate_rollouts(s, a, budget, max_n=16, cost=cost, return_stats=True)
    spent = sum(int(x) * int(c) for x, c in zip(n.tolist(), cost.tolist(), strict=True))
    assert st_.spent == spent and 0 < spent <= budget


def test_planner_total_near_int64():
    """[2**61] * 3 over 3 ranks: the total 3 * 2^61 fits int64, so it is planned
    (the planner refused it: "overflows int64"); a total past int64 names lengths."""
    p = ck.packing.plan([2**61] * 3, dp_size=3, max_tokens=2**61)
    assert sorted(p.order.tolist()) == [0, 1, 2] and p.num_micro_batches == 1
    assert p.stats["max_over_lower_bound"] == 1.0
    p = ck.packing.plan([3 * 2**59, 2**59, 2**60, 2**60], dp_size=2, max_tokens=2**61)
    loads = sorted(int(p.tokens[p.micro_batch(r, 0)].sum()) for r in range(2))
    assert loads == [2**61, 2**61]  # balanced exactly, in units of the gcd
    with pytest.raises(ValueError, match=r"lengths: the total token count \d+ .* overflows int64"):
        ck.packing.plan([2**62] * 3, dp_size=3, max_tokens=2**62)
    with pytest.raises(ValueError, match=r"lengths: .* passes 2\^61"):
        ck.packing.plan([2**61 + 1, 2**61, 2**61], dp_size=3, max_tokens=2**62)
    with pytest.raises(ValueError, match="max_tokens: expected a positive int below 2"):
        ck.packing.plan([5], dp_size=1, max_tokens=2**64)


def test_pack_refuses_duplicate_indices_and_extreme_lengths():
    x = torch.arange(15.0)
    with pytest.raises(ValueError, match="indices: sequence 1 appears more than once"):
        ck.packing.pack(x, [4, 5, 6], [1, 2, 1])
    with pytest.raises(ValueError, match=r"lengths: expected 0 <= length < 2\^31"):
        ck.packing.pack(x, [4, 2**62, 6], [0])
    with pytest.raises(ValueError, match=r"lengths: expected 0 <= length < 2\^31"):
        ck.packing.pack(x, [4, -5, 16], [0])


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=pytest.mark.triton)])
def test_group_sums_near_float64_max_refused_naming_rewards(backend):
    """float64 rewards near 1e308 overflowed the group sum to NaN advantages: refused,
    naming rewards; rewards well inside the bound stay exact (scale-equivariant)."""
    r = torch.tensor([1e308, -1e308, 1e308, 5.0], dtype=torch.float64)
    with pytest.raises(ValueError, match=r"rewards: \|rewards\[0\]\| = 1e\+308 overflows"):
        ck.advantages.group_advantages(r, group_size=2, backend=backend)
    big = torch.tensor([1e150, -1e150, 3e150, 1e150], dtype=torch.float64)
    adv, _, stats = ck.advantages.group_advantages(
        big, group_size=2, mode="dr_grpo", backend=backend
    )
    assert torch.isfinite(adv).all() and torch.isfinite(stats.group_std).all()
    torch.testing.assert_close(adv / 1e150, torch.tensor([1.0, -1, 1, -1], dtype=torch.float64))


# --------------------------------------------------------------- minor findings
def test_length_predictor_observe_refuses_nan_inf_bool():
    p = LengthPredictor()
    for bad in (float("nan"), float("inf"), np.float64("nan"), True):
        with pytest.raises((TypeError, ValueError), match="length"):
            p.observe("a", bad)
    p.observe("a", np.int64(30))
    p.end_step()
    costs = ck.advantages.token_costs(p, ["a", "new"])
    assert costs.tolist() == [30, 30] and bool((costs > 0).all())


def test_length_predictor_fallback_is_the_mean_as_documented():
    """Docstring and code agree: the fallback is the arithmetic mean (the expected
    length a token budget spends), not the median."""
    p = LengthPredictor()
    for n in (10, 20, 90):
        p.observe(n, n)
    assert p.predict("unseen") == pytest.approx(40.0)  # median would be 20
    assert "arithmetic mean" in LengthPredictor.__doc__
    assert "median of every" not in LengthPredictor.__doc__


def test_espo_numpy_options_issue_cases():
    """The issue's cases: an array of quantiles, a NumPy clip pair, np.int64
    vocab_size / num_groups, np.float32 clip (unhashable / refused before)."""
    ref = _espo(quantiles=(0.25, 0.75), vocab_size=100)
    _same(ref, _espo(quantiles=np.array([0.25, 0.75]), vocab_size=np.int64(100)))
    _same(_espo(clip=(0.1, 0.2)), _espo(clip=np.array([0.1, 0.2])))
    _same(
        _espo(num_groups=3, vocab_size=100), _espo(num_groups=np.int64(3), vocab_size=np.int64(100))
    )
    _same(_espo(clip=float(np.float32(0.2))), _espo(clip=np.float32(0.2)))
    with pytest.raises((TypeError, ValueError), match="num_groups"):
        _espo(num_groups=True, vocab_size=100)
    with pytest.raises((TypeError, ValueError), match=r"quantiles\[1\]"):
        _espo(quantiles=np.array([0.2, math.nan]), vocab_size=100)
