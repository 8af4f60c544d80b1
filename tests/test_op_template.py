"""The op template (compass_kernels/_op.py, _dispatch.py, csrc/compass_pybind.h):
the TensorView caster, one-declaration ops, dispatch rules, arch checks."""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import pytest
import torch

import compass_kernels as ck
from compass_kernels import _dispatch
from compass_kernels._ext import BackendUnavailableError, dl, load
from compass_kernels._op import op
from compass_kernels.advantages import _groups_from_ids, group_advantages_op
from compass_kernels.testing import make_generator

# ------------------------------------------------------------ the caster


def _encode_args(ids: torch.Tensor, e: int = 8):
    """The route codec's encode op (host-side C++, kept): a caster test bed."""
    rows, k = ids.shape
    payload = torch.empty(load().routing.set_code_bytes(rows, e, k), dtype=torch.uint8)
    status, table = torch.empty(2, dtype=torch.int64), torch.empty(k * e, dtype=torch.int64)
    return ids, e, None, payload, status, table


_IDS = torch.tensor([[0, 3], [1, 7], [2, 5], [6, 7], [0, 1]], dtype=torch.uint8)


def _decoded(payload: torch.Tensor, rows: int, e: int = 8, k: int = 2) -> torch.Tensor:
    ids = torch.empty(rows, k, dtype=torch.uint8)
    load().routing.decode_sets_cpu(payload, e, ids, 0)
    return ids


@pytest.mark.parametrize("form", ["tensor", "capsule", "numpy", "dlpack_object"])
def test_caster_takes_every_dlpack_form(form):
    """Tensors, capsules and any object with __dlpack__ (numpy here) become views."""
    ids, e, missing, payload, status, table = _encode_args(_IDS.clone())

    class Wrapped:  # a foreign array type: only the protocol
        def __init__(self, t):
            self.t = t

        def __dlpack__(self, **kwargs):
            return self.t.__dlpack__(**kwargs)

        def __dlpack_device__(self):
            return self.t.__dlpack_device__()

    conv = {
        "tensor": lambda t: t,
        "capsule": dl,
        "numpy": lambda t: t.numpy(),
        "dlpack_object": Wrapped,
    }[form]
    payload.fill_(0xAA)
    status.fill_(7)
    load().routing.encode_sets_op_cpu(conv(ids), e, None, conv(payload), conv(status), conv(table))
    assert status.tolist() == [0, -1]
    assert torch.equal(_decoded(payload, 5), _IDS)
    assert table[:e].tolist() == list(range(e))  # C(a, 1) = a


def test_caster_rejects_non_tensors_and_names_arguments():
    ids, e, missing, payload, status, table = _encode_args(_IDS.clone())
    enc = load().routing.encode_sets_op_cpu
    with pytest.raises(TypeError, match="incompatible function arguments"):
        enc([1, 2], e, None, payload, status, table)
    with pytest.raises(ValueError, match="status: expected dtype int64, got int32\\[2\\] on cpu"):
        enc(ids, e, None, payload, status.int(), table)
    n = payload.numel()
    with pytest.raises(ValueError, match=f"payload: expected size {n} \\(set_code_bytes"):
        enc(ids, e, None, payload[:-1], status, table)
    with pytest.raises(ValueError, match="ids: expected a contiguous tensor"):
        enc(torch.empty(5, 4, dtype=torch.uint8)[:, ::2], e, None, payload, status, table)
    with pytest.raises(ValueError, match="ids: expected dtype uint8 \\| int16"):
        enc(ids.float(), e, None, payload, status, table)


def test_outputs_never_require_grad():
    """Rewards that require grad are read (detached); advantages carry no graph."""
    r = torch.tensor([1.0, 0.0, 1.0, 1.0], requires_grad=True)
    adv, _, _ = ck.advantages.group_advantages(r, group_size=2)
    raw = group_advantages_op(
        rewards=r,
        order=torch.arange(4),
        offsets=torch.tensor([0, 2, 4]),
        mode=0,
        eps=1e-6,
        zero_var_tol=1e-6,
    )
    assert not adv.requires_grad and torch.equal(adv, raw.adv)


# ---------------------------------------------------------- group plan


@pytest.mark.parametrize("n", [0, 1, 7, 131, 1000])
@pytest.mark.parametrize("kind", ["compact", "wide", "int32", "uint8", "negative", "sorted"])
def test_group_plan_matches_a_stable_sort(n, kind):
    """The plan equals torch's stable sort + unique on fresh random ids."""
    g = make_generator(n * 7 + len(kind))
    if kind == "wide":
        ids = torch.randint(-(2**62), 2**62, (max(n // 3, 1),), generator=g)[
            torch.randint(0, max(n // 3, 1), (n,), generator=g)
        ]
    elif kind == "uint8":
        ids = torch.randint(0, 256, (n,), generator=g).to(torch.uint8)
    elif kind == "negative":
        ids = torch.randint(-40, 3, (n,), generator=g)
    else:
        ids = torch.randint(0, max(n // 4, 1), (n,), generator=g)
    if kind == "int32":
        ids = ids.to(torch.int32)
    if kind == "sorted":  # the one-pass path: runs of a non-decreasing sequence
        ids = torch.sort(ids * 3 - 7).values
    order, offsets, unique = _groups_from_ids(ids)
    ref_sorted, ref_order = torch.sort(ids.to(torch.int64), stable=True)
    ref_unique, ref_counts = torch.unique_consecutive(ref_sorted, return_counts=True)
    assert torch.equal(order, ref_order)
    assert torch.equal(unique, ref_unique)
    assert offsets[0] == 0 and torch.equal(offsets.diff(), ref_counts)


@pytest.mark.parametrize("delta", [-1, 1])
def test_group_plan_checks_num_groups(delta):
    ids = torch.tensor([4, 2, 4, 9, 2])
    with pytest.raises(ValueError, match=f"num_groups: expected .* 3, got {3 + delta}"):
        _groups_from_ids(ids, 3 + delta)
    order, offsets, unique = _groups_from_ids(ids, 3)
    assert unique.tolist() == [2, 4, 9] and offsets.tolist() == [0, 2, 4, 5]


def test_group_plan_full_int64_range():
    ids = torch.tensor([2**63 - 1, -(2**63), 0, 2**63 - 1])
    order, offsets, unique = _groups_from_ids(ids)
    assert unique.tolist() == [-(2**63), 0, 2**63 - 1]
    assert order.tolist() == [1, 2, 0, 3] and offsets.tolist() == [0, 1, 2, 4]


# ------------------------------------------------------------- dispatch


def test_missing_backend_names_op_and_backend():
    def test_only_scale_cpp_op(x: torch.Tensor) -> torch.Tensor:
        return torch.empty_like(x)

    scale = op(kernels={"cpp": lambda *, x, out: out.copy_(x * 2)})(test_only_scale_cpp_op)
    x = torch.arange(3.0)
    assert torch.equal(scale(x=x), x * 2)
    assert torch.equal(torch.ops.compass.test_only_scale_cpp(x), x * 2)
    with pytest.raises(
        BackendUnavailableError,
        match="compass::test_only_scale_cpp has no 'triton' backend \\(it has cpp\\)",
    ):
        scale(x=x, backend="triton")
    with pytest.raises(ValueError, match="already registered"):
        op(kernels={})(test_only_scale_cpp_op)


def test_an_op_is_called_by_name_only():
    """Positional, unknown and missing arguments raise TypeError; defaults fill in;
    the schema, output names and the generated call come from the one signature."""

    class Pair(NamedTuple):
        total: torch.Tensor
        scaled: torch.Tensor

    def test_only_pair_op(x: torch.Tensor, y: torch.Tensor, alpha: float = 2.0) -> Pair:
        return Pair(total=torch.empty_like(x), scaled=torch.empty_like(x))

    def kernel(*, x, y, alpha, total, scaled):
        torch.add(x, y, out=total)
        torch.mul(x, alpha, out=scaled)

    pair = op(kernels={"torch": kernel})(test_only_pair_op)
    assert pair.schema == (
        "(Tensor x, Tensor y, float alpha=2.0, str? backend=None) -> (Tensor, Tensor)"
    )
    assert pair.params == ("x", "y", "alpha") and pair.returns == ("total", "scaled")
    x, y = torch.arange(3.0), torch.ones(3)
    res = pair(x=x, y=y)
    assert torch.equal(res.total, x + 1) and torch.equal(res.scaled, 2 * x)
    assert torch.equal(pair(y=y, x=x, alpha=0.5).scaled, x / 2)
    with pytest.raises(TypeError, match="positional"):
        pair(x, y)
    with pytest.raises(TypeError, match="alhpa"):
        pair(x=x, y=y, alhpa=1.0)
    with pytest.raises(TypeError, match="'y'"):
        pair(x=x)
    traced = torch.ops.compass.test_only_pair(x=x, y=y, alpha=3.0)
    assert torch.equal(traced[1], 3 * x)
    torch.library.opcheck(torch.ops.compass.test_only_pair.default, (x, y), {"alpha": 3.0})
    with pytest.raises(TypeError, match="reserved"):
        op(kernels={})(lambda out: None)


def test_cpu_default_is_the_reference_else_cpp():
    assert _dispatch.resolve(torch.device("cpu"), None) == "torch"
    assert _dispatch.resolve(torch.device("cpu"), None, available=("cpp", "cuda")) == "cpp"
    with pytest.raises(ValueError, match="backend: expected one of"):
        _dispatch._resolve("cpu", None, "no-such-backend", "op", ("cpp",))


@pytest.mark.parametrize(
    ("cap", "archs", "ok"),
    [
        ((9, 0), ("80", "90a"), True),  # sm_90a SASS
        ((8, 0), ("80", "90a"), True),  # sm_80 SASS
        ((8, 9), ("80", "90a"), True),  # L40: sm_80 SASS runs on 8.x
        ((10, 0), ("80", "90a"), True),  # Blackwell: compute_80 PTX JIT
        ((7, 5), ("80", "90a"), False),  # T4: nothing
        ((10, 0), ("90a",), False),  # 'a' SASS runs on sm_90 only, no portable PTX
        ((8, 6), ("90a",), False),
        ((10, 0), ("80-real",), False),  # SASS only, other major
        ((10, 0), ("90-virtual",), True),
    ],
)
def test_arch_compatibility(cap, archs, ok):
    assert _dispatch.can_run_arch(cap, archs) is ok


def test_compiled_archs_are_reported():
    from compass_kernels._ext import compiled_cuda_archs, has_cuda_kernels

    if not has_cuda_kernels():
        pytest.skip("built without CUDA")
    assert set(compiled_cuda_archs()) >= {"80", "90a"}


# ------------------------------------------------------------- tracing


def test_explicit_backend_is_traceable():
    """backend= is a schema argument: torch.compile(fullgraph=True) keeps it."""
    r = torch.tensor([1.0, 0.0, 1.0, 1.0])
    adv = lambda x: ck.advantages.group_advantages(x, group_size=2, backend="torch")[0]
    fn = torch.compile(adv, backend="eager", fullgraph=True)
    ref, _, _ = ck.advantages.group_advantages(r, group_size=2)
    assert torch.equal(fn(r), ref)


def test_numpy_dtype_roundtrip_of_views():
    """A view with a byte offset (a slice) is read at its offset, not at the storage start."""
    base = torch.cat([torch.tensor([[4, 5], [3, 6]], dtype=torch.uint8), _IDS])
    ids, e, missing, payload, status, table = _encode_args(base[2:])
    load().routing.encode_sets_op_cpu(ids, e, missing, payload, status, table)
    assert np.array_equal(_decoded(payload, 5).numpy(), _IDS.numpy())


# -------------------------------------------------------------- evidence


def test_gpu_evidence_is_in_sync_with_the_committed_runs():
    """compass_kernels/gpu_evidence.json is generated from docs/gpu_runs: a new
    report without `python scripts/update_evidence.py` fails here."""
    import importlib.util
    import json
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    spec = importlib.util.spec_from_file_location("upd", root / "scripts" / "update_evidence.py")
    upd = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(upd)
    committed = json.loads((root / "compass_kernels" / "gpu_evidence.json").read_text())
    assert upd.collect(root / "docs" / "gpu_runs") == committed


def test_info_reports_evidence_per_op_and_backend():
    ev = ck.info()["evidence"]
    assert set(ev) >= {"group_advantages", "rl_zvp"}
    assert ev["group_advantages"]["torch"][0].startswith("the plain-torch reference")
    assert any(lv.startswith("interpreter-run") for lv in ev["rl_zvp"]["triton"])
