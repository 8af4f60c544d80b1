"""One declaration per op: the torch.library op, its fake, its backend table and
its dispatch, from a single spec.

    group_advantages_op = register_op(
        "group_advantages",
        "(Tensor rewards, Tensor order, Tensor offsets, int mode, float eps, "
        "float zero_var_tol) -> (Tensor, Tensor, Tensor, Tensor)",
        outputs=_alloc_outputs,                         # also the fake
        kernels={"torch": "compass_kernels.advantages.reference:group_advantages_torch",
                 "triton": "compass_kernels.advantages.triton:group_advantages_triton"},
    )
    adv, zv, mean, std = group_advantages_op(r, order, offsets, 0, 1e-6, 1e-6)

A kernel spec is "package.module:function" (Python: torch, Triton) or
"submodule.function" in compass_kernels._C (C++ / CUDA: "cpp", "cuda").
Kernel calling convention (every backend): ``kernel(*args, *outputs)`` writes the
outputs in place; CUDA entry points take the raw stream handle last. ``outputs``
allocates the outputs from the op's arguments with tensor factory methods, so
the same function is the fake (meta / FakeTensor) implementation.

Calling the op:
- eagerly, ``op(*args, backend=None, out=None)`` resolves the backend (cached),
  allocates the outputs (or writes into ``out``, e.g. poisoned ones in tests)
  and calls the kernel: no trip through the torch dispatcher (~10 us saved);
- under torch.compile / export, the same call goes through
  ``torch.ops.compass.<name>`` (``backend`` is a schema argument, so an explicit
  backend is traceable too), whose implementation is the same function.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._python_dispatch import is_in_torch_dispatch_mode

from compass_kernels import _dispatch
from compass_kernels._ext import BackendUnavailableError, cuda_stream, load

NAMESPACE = "compass"
_lib = torch.library.Library(NAMESPACE, "FRAGMENT")
OPS: dict[str, Op] = {}


class Op:
    """A registered op: callable eagerly, traceable through ``torch.ops.compass.<name>``."""

    def __init__(
        self,
        name: str,
        schema: str,
        outputs: Callable[..., tuple[torch.Tensor, ...]],
        kernels: dict[str, str | Callable[..., Any]],
    ) -> None:
        if not schema.startswith("(") or ") ->" not in schema:
            raise ValueError(f"{name}: schema must look like '(args) -> outputs', got {schema!r}")
        self.name = name
        self.qualname = f"{NAMESPACE}::{name}"
        self.outputs = outputs
        self._specs = dict(kernels)
        self._kernels: dict[str, Callable[..., Any]] = {}
        self._chosen: dict[tuple, str] = {}  # (device, backend) -> resolved backend
        _dispatch.register_cache(self._chosen)
        args, _, rets = schema.partition(") ->")
        sep = ", " if args.strip() != "(" else ""
        _lib.define(f"{name}{args}{sep}str? backend=None) ->{rets}")
        self._single = not rets.strip().startswith("(")
        self._nargs = args.count(",") + (1 if sep else 0)  # schema args before backend
        _lib.impl(name, self._impl, "CPU")
        _lib.impl(name, self._impl, "CUDA")
        torch.library.register_fake(self.qualname)(self._fake)
        self.backends = tuple(self._specs)

    # ------------------------------------------------------------ backends
    def add_backend(self, backend: str, kernel: str | Callable[..., Any]) -> None:
        """Register one more backend, or replace one (tests plant bugs this way:
        tests/mutants.py)."""
        self._specs[backend] = kernel
        self._kernels.pop(backend, None)
        self._chosen.clear()
        self.backends = tuple(self._specs)

    def kernel(self, backend: str) -> Callable[..., Any]:
        """The raw kernel of ``backend`` (``kernel(*args, *outputs[, stream])``)."""
        k = self._kernels.get(backend)
        if k is None:
            k = self._kernels[backend] = self._load(backend)
        return k

    def _load(self, backend: str) -> Callable[..., Any]:
        spec = self._specs.get(backend)
        if spec is None:
            raise BackendUnavailableError(
                f"{self.qualname} has no {backend!r} backend (it has {', '.join(self._specs)})"
            )
        if callable(spec):
            return spec
        if ":" in spec:  # "package.module:function" (Python: torch, Triton wrappers)
            module, _, attr = spec.partition(":")
            return getattr(importlib.import_module(module), attr)
        obj: Any = load()  # "submodule.function" in compass_kernels._C
        for part in spec.split("."):
            if not hasattr(obj, part):
                raise BackendUnavailableError(
                    f"{self.qualname}: compass_kernels._C has no {spec} (backend {backend!r}); "
                    "rebuild the extension (pip install -e .)"
                )
            obj = getattr(obj, part)
        return obj

    # ---------------------------------------------------------------- calls
    def run(self, args: tuple, backend: str | None = None, out=None):
        """Resolve, allocate (unless ``out``), launch; returns the outputs."""
        first = args[0] if type(args[0]) is torch.Tensor else _first_tensor(args)
        dev = first.device
        chosen = self._chosen.get((dev, backend))
        if chosen is None:
            chosen = _dispatch.resolve(dev, backend, op=self.qualname, available=self.backends)
            self._chosen[(dev, backend)] = chosen
        outs = self.outputs(*args) if out is None else out
        kernel = self.kernel(chosen)
        if chosen == "cuda":
            kernel(*args, *outs, cuda_stream(first))
        else:
            kernel(*args, *outs)
        return outs[0] if self._single else tuple(outs)

    def __call__(self, *args, backend: str | None = None, out=None):
        if torch.compiler.is_compiling() or _symbolic(args):
            # FakeTensor / meta / a dispatch mode: the dispatcher runs the fake (the
            # outputs' shapes); no data pointer ever reaches a kernel.
            res = getattr(torch.ops.compass, self.name)(*args, backend)
            if out is None:
                return res
            for o, r in zip(out, (res,) if self._single else res, strict=True):
                o.copy_(r)  # traced / fake: the op is functional, ``out`` gets its values
            return out[0] if self._single else tuple(out)
        return self.run(args, backend, out)

    def _impl(self, *args, backend=None):
        if len(args) > self._nargs:
            args, backend = args[: self._nargs], args[self._nargs]
        return self.run(args, backend)

    def _fake(self, *args, backend=None):
        outs = self.outputs(*args[: self._nargs])
        return outs[0] if self._single else tuple(outs)


def has_no_data(*tensors) -> bool:
    """True while tracing (torch.compile) or when a tensor is fake / meta: data
    checks (a host read) are skipped there, the kernels never run."""
    return torch.compiler.is_compiling() or _symbolic(tensors)


def _symbolic(args: tuple) -> bool:
    """Whether the call must go through the dispatcher: a tensor argument that is
    not a plain tensor with data (FakeTensor, meta, another subclass), or an
    active TorchDispatchMode (FakeTensorMode, make_fx)."""
    if is_in_torch_dispatch_mode():
        return True
    for a in args:
        if isinstance(a, torch.Tensor) and (type(a) is not torch.Tensor or a.is_meta):
            return True
    return False


def _first_tensor(args: tuple) -> torch.Tensor:
    for a in args:
        if isinstance(a, torch.Tensor):
            return a
    raise TypeError("an op needs at least one tensor argument")


def register_op(
    name: str,
    schema: str,
    *,
    outputs: Callable[..., tuple[torch.Tensor, ...]],
    kernels: dict[str, str | Callable[..., Any]],
) -> Op:
    """Define ``torch.ops.compass.<name>`` with its fake, backend table and dispatch."""
    if name in OPS:
        raise ValueError(f"op {NAMESPACE}::{name} is already registered")
    op = OPS[name] = Op(name, schema, outputs, kernels)
    return op
