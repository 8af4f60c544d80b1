"""The package raises no warning of its own in the tests: pyproject's filterwarnings turn
a UserWarning / RuntimeWarning / FutureWarning attributed to a compass_kernels module into
an error, and leave third-party modules' warnings alone. The two checks that once
converted a requires-grad tensor to a Python float (a torch UserWarning at our line) stay
silent."""

from __future__ import annotations

import warnings

import pytest
import torch

from compass_kernels._validate import check_finite
from compass_kernels.routing import _check_finite_rows


@pytest.mark.parametrize("category", [UserWarning, RuntimeWarning, FutureWarning])
def test_a_warning_from_a_package_module_is_an_error(category):
    with pytest.raises(category, match="planted"):
        warnings.warn_explicit("planted", category, "x.py", 1, module="compass_kernels.routing")


def test_a_third_party_warning_is_left_alone():
    with warnings.catch_warnings(record=True) as seen:
        warnings.warn_explicit("theirs", UserWarning, "x.py", 1, module="megatron.core.x")
    assert [str(w.message) for w in seen] == ["theirs"]


def _no_warning(fn, *args):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fn(*args)


def test_check_finite_on_a_requires_grad_tensor_is_silent():
    t = torch.randn(7, 3, requires_grad=True)
    _no_warning(check_finite, "x", t)
    bad = t.detach().clone()
    bad[2, 1] = float("nan")
    bad.requires_grad_(True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(ValueError, match=r"x: expected finite values, got nan at \[2, 1\]"):
            check_finite("x", bad)


def test_router_logits_check_on_a_requires_grad_tensor_is_silent():
    logits = torch.randn(5, 8, requires_grad=True)
    _no_warning(_check_finite_rows, "router_logits", logits)
    bad = logits.detach().clone()
    bad[3, 2] = float("inf")
    bad.requires_grad_(True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(
            ValueError,
            match="router_logits: expected finite values, got inf at row 3",
        ):
            _check_finite_rows("router_logits", bad)
