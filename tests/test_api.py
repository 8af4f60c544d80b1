"""The public API's surface: __all__ and dir() of every capability package, a
docstring (with shapes and dtypes where tensors are involved) on every public
function, class and method, and the papercuts a first user hit."""

from __future__ import annotations

import inspect
import re
import subprocess
import sys

import pytest
import torch

import compass_kernels as ck
from compass_kernels.routing import RoutingTrace

CAPABILITIES = [ck.advantages, ck.espo, ck.fp8, ck.packing, ck.routing]
DTYPE = re.compile(r"float(16|32|64)|bfloat16|float8|int(8|16|32|64)|uint8|\bbool\b|dtype")


@pytest.mark.parametrize("pkg", CAPABILITIES, ids=lambda m: m.__name__)
def test_all_and_dir_list_the_public_names_only(pkg):
    assert pkg.__all__ and len(set(pkg.__all__)) == len(pkg.__all__)
    for name in pkg.__all__:
        assert hasattr(pkg, name), f"{pkg.__name__}.__all__ names {name!r}, which is missing"
    assert dir(pkg) == sorted(pkg.__all__)  # no torch, register_op, *_op, annotations ...


def _public_members(pkg):
    for name in pkg.__all__:
        obj = getattr(pkg, name)
        if inspect.ismodule(obj):
            yield from ((f"{name}.{n}", o) for n, o in vars(obj).items() if _ours(o, n))
        elif _ours(obj, name):
            yield name, obj


def _ours(obj, name: str) -> bool:
    return (
        not name.startswith("_")
        and (inspect.isfunction(obj) or inspect.isclass(obj))
        and getattr(obj, "__module__", "").startswith("compass_kernels")
    )


def _methods(cls):
    for name, attr in vars(cls).items():
        if name.startswith("_"):
            continue
        if isinstance(attr, property):
            yield name, attr.fget
        elif isinstance(attr, (classmethod, staticmethod)):
            yield name, attr.__func__
        elif inspect.isfunction(attr):
            yield name, attr


def _takes_tensors(fn) -> bool:
    try:
        return "Tensor" in str(inspect.signature(fn))
    except (TypeError, ValueError):
        return False


@pytest.mark.parametrize("pkg", CAPABILITIES, ids=lambda m: m.__name__)
def test_every_public_function_and_class_has_a_docstring_with_shapes_and_dtypes(pkg):
    missing, vague = [], []
    for name, obj in _public_members(pkg):
        doc = inspect.getdoc(obj) or ""
        if not doc:
            missing.append(name)
        elif _takes_tensors(obj) and not ("[" in doc and DTYPE.search(doc)):
            vague.append(name)
        if inspect.isclass(obj):
            for mname, fn in _methods(obj):
                if not inspect.getdoc(fn):
                    missing.append(f"{name}.{mname}")
    assert not missing, f"{pkg.__name__}: no docstring: {missing}"
    assert not vague, f"{pkg.__name__}: takes tensors, docstring names no shape / dtype: {vague}"


def test_packing_schedule_is_an_attribute_in_a_fresh_interpreter():
    code = "import compass_kernels as ck; print(ck.packing.schedule.simulate.__name__)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "simulate"


def test_fp8_group_size_is_named_group_size():
    x = torch.randn(3, 256)
    q, s = ck.fp8.quantize_token_groups(x, group_size=128)
    assert s.shape == (3, 2)
    with pytest.raises(TypeError, match=r"'group'.*group_size"):
        ck.fp8.quantize_token_groups(x, group=128)
    with pytest.raises(TypeError, match="'groups'"):
        ck.fp8.quantize_token_groups(x, groups=128)


def test_canonical_default_is_what_the_default_codec_decodes_to():
    ids = torch.rand(9, 2, 16).argsort(-1)[..., :4].to(torch.uint8)  # rows unsorted
    missing = torch.zeros(9, dtype=torch.bool)
    missing[3] = True
    t = RoutingTrace(ids, torch.tensor([0, 4, 9]), 16, missing=missing)
    back = RoutingTrace.decode(t.encode())
    assert torch.equal(back.expert_ids, t.canonical().expert_ids)
    raw = RoutingTrace.decode(t.encode(codec="raw"))
    assert torch.equal(raw.expert_ids, t.canonical(sort=False).expert_ids)
    assert not torch.equal(t.canonical().expert_ids, t.canonical(sort=False).expert_ids)


def test_routing_trace_init_is_documented():
    doc = inspect.getdoc(RoutingTrace.__init__) or ""
    assert "[total_tokens" in doc and "uint8" in doc and "int64" in doc
