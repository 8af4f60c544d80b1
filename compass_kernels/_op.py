"""An op is one annotated Python function; everything else derives from it.

    class GroupAdvantages(NamedTuple):      # named outputs
        adv: torch.Tensor
        zero_var: torch.Tensor
        ...

    @op(kernels={"torch": "compass_kernels.advantages.reference:group_advantages_torch",
                 "triton": "compass_kernels.advantages.triton:group_advantages_triton"})
    def group_advantages_op(rewards: torch.Tensor, order: torch.Tensor, offsets: torch.Tensor,
                            mode: int, eps: float, zero_var_tol: float) -> GroupAdvantages:
        '''Shapes and dtypes of every argument and output.'''
        return GroupAdvantages(adv=torch.empty_like(rewards), ...)   # the outputs; also the fake

    res = group_advantages_op(rewards=r, order=o, offsets=off, mode=0, eps=1e-6,
                              zero_var_tol=1e-6)
    res.adv, res.zero_var

From the function come: the op's name (``torch.ops.compass.group_advantages``:
the function's name without ``_op``), its schema (``torch.library.infer_schema``
over the annotations and defaults, plus ``str? backend=None`` so an explicit
backend is traceable), its fake (the function's body allocates the outputs from
the arguments with tensor factory methods, so it runs on FakeTensors and meta
tensors as well), the output names (a NamedTuple return annotation; a plain
``torch.Tensor`` return is one output, named ``out`` unless ``op(output=)``
says otherwise), and the call into every backend:

- Python kernels (torch, Triton wrappers: "package.module:function") are called
  with every argument and output **by name**: ``kernel(rewards=..., ...,
  adv=..., zero_var=..., ...)``, writing the outputs in place;
  a Python "cuda" backend also gets ``stream=`` (the raw CUDA stream handle);
- compiled entry points in compass_kernels._C ("submodule.function", backends
  "cpp" / "cuda") take positional arguments: the op passes them in the
  function's parameter order, then the outputs in the return's order, then (CUDA)
  the raw stream handle. The order comes from the one signature, nowhere else.

Calls are by name only (a positional, unknown or missing argument raises
TypeError naming the op), so adding, removing or reordering a parameter cannot
silently shift the others. Parameter names may not be ``backend``, ``out``,
``self`` or start with ``_`` (the eager call's own names).

Calling the op:
- eagerly, ``op(name=value, ..., backend=None, out=None)`` resolves the backend
  (cached), allocates the outputs (or writes into ``out``, e.g. poisoned ones
  in tests) and calls the kernel: no trip through the torch dispatcher (the
  call is a function generated from the signature; ``op.run`` is the same
  without the tracing check: the dispatcher's implementation);
- under torch.compile, FakeTensor, meta or a dispatch mode, the same call goes
  through ``torch.ops.compass.<name>``, whose implementation is the same path.
"""

from __future__ import annotations

import importlib
import inspect
import sys
import types
import typing
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, cast

import torch

from compass_kernels import _dispatch
from compass_kernels._ext import BackendUnavailableError, cuda_stream, load
from compass_kernels._validate import has_no_data, is_symbolic  # noqa: F401  (re-exported)

NAMESPACE = "compass"
_lib = torch.library.Library(NAMESPACE, "FRAGMENT")
OPS: dict[str, Op] = {}
_RESERVED = ("backend", "out", "self")  # keywords of every eager call


class Op:
    """A registered op: callable eagerly by name, traceable through
    ``torch.ops.compass.<name>``.

    Attributes: ``name``, ``qualname``, ``params`` (argument names in order),
    ``returns`` (output names), ``defaults``, ``backends``, ``schema``.
    """

    if TYPE_CHECKING:  # generated per op from its signature (_compile_call)

        def __call__(self, **kwargs: Any) -> Any: ...

        def run(self, **kwargs: Any) -> Any: ...

    def __init__(
        self,
        fn: Callable[..., Any],
        kernels: dict[str, str | Callable[..., Any]],
        name: str | None = None,
        output: str = "out",
        localns: dict[str, Any] | None = None,
    ) -> None:
        self.name = name or fn.__name__.removesuffix("_op")
        self.qualname = f"{NAMESPACE}::{self.name}"
        self.__doc__ = fn.__doc__
        self.__wrapped__ = fn
        self.outputs = fn  # the allocator: also the fake
        sig = inspect.signature(fn)
        hints = typing.get_type_hints(fn, localns=localns)  # localns: a function-local op
        params = []
        for p in sig.parameters.values():
            if p.kind not in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY):
                raise TypeError(f"{self.qualname}: parameter {p.name}: no *args / **kwargs")
            if p.name in _RESERVED or p.name.startswith("_"):
                raise TypeError(f"{self.qualname}: parameter {p.name!r} is reserved ({_RESERVED})")
            if p.name not in hints:
                raise TypeError(f"{self.qualname}: parameter {p.name} needs a type annotation")
            params.append(p.replace(annotation=hints[p.name], kind=p.POSITIONAL_OR_KEYWORD))
        self.params: tuple[str, ...] = tuple(p.name for p in params)
        self.defaults = {p.name: p.default for p in params if p.default is not p.empty}
        self._names = frozenset(self.params)
        tensors = [p.name for p in params if p.annotation is torch.Tensor]
        if not tensors:
            raise TypeError(f"{self.qualname}: needs at least one torch.Tensor parameter")
        self._first = tensors[0]  # its device picks the backend
        self._tensor_like = tuple(
            p.name for p in params if p.annotation in (torch.Tensor, torch.Tensor | None)
        )
        ret = hints.get("return")
        if ret is torch.Tensor:
            self.returns: tuple[str, ...] = (output,)
            self._result: Any = None  # one output: the tensor itself; else its NamedTuple
            ret_type: Any = torch.Tensor
        elif isinstance(ret, type) and issubclass(ret, tuple) and hasattr(ret, "_fields"):
            self.returns = tuple(ret._fields)
            self._result = ret
            ret_type = types.GenericAlias(tuple, (torch.Tensor,) * len(self.returns))
        else:
            raise TypeError(
                f"{self.qualname}: return annotation must be torch.Tensor or a "
                f"NamedTuple of tensors, got {ret!r}"
            )
        backend = inspect.Parameter(
            "backend", inspect.Parameter.POSITIONAL_OR_KEYWORD, default=None, annotation=str | None
        )

        def proto(*args, **kwargs):  # a prototype carrying the signature for infer_schema
            raise NotImplementedError

        cast(Any, proto).__signature__ = sig.replace(
            parameters=[*params, backend], return_annotation=ret_type
        )
        self.schema = torch.library.infer_schema(proto, mutates_args=())
        self._schema_names = (*self.params, "backend")
        _lib.define(self.name + self.schema)
        _lib.impl(self.name, self._impl, "CPU")
        _lib.impl(self.name, self._impl, "CUDA")
        torch.library.register_fake(self.qualname)(self._fake)
        self._specs = dict(kernels)
        self._kernels: dict[str, Callable[..., Any]] = {}
        self._chosen: dict[tuple, str] = {}  # (device, backend) -> resolved backend
        _dispatch.register_cache(self._chosen)
        self.backends = tuple(self._specs)
        self._compile_call()

    def __repr__(self) -> str:
        return f"<op {self.qualname}{self.schema}>"

    # ------------------------------------------------------------ backends
    def add_backend(
        self, backend: str, kernel: str | Callable[..., Any], *, positional: bool = False
    ) -> None:
        """Register one more backend, or replace one (tests plant bugs this way:
        tests/mutants.py); a ``positional`` kernel takes the arguments, then the
        outputs, in order (as the compiled entry points do)."""
        if positional and callable(kernel):
            kernel = self._positional(kernel, stream=False)
        self._specs[backend] = kernel
        self._kernels.pop(backend, None)
        self._chosen.clear()
        self.backends = tuple(self._specs)

    def kernel(self, backend: str) -> Callable[..., Any]:
        """The kernel of ``backend`` as the op calls it: ``kernel(**arguments, **outputs)``
        (a compiled entry point wrapped to take its arguments by name)."""
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
        if ":" in spec:  # "package.module:function": Python, called by name
            module, _, attr = spec.partition(":")
            fn = getattr(importlib.import_module(module), attr)
            if backend != "cuda":
                return fn
            first = self._first

            def with_stream(**kw):  # a Python "cuda" backend gets the stream by name
                return fn(**kw, stream=cuda_stream(kw[first]))

            return with_stream
        obj: Any = load()  # "submodule.function" in compass_kernels._C: positional
        for part in spec.split("."):
            if not hasattr(obj, part):
                raise BackendUnavailableError(
                    f"{self.qualname}: compass_kernels._C has no {spec} (backend {backend!r}); "
                    "rebuild the extension (pip install -e .)"
                )
            obj = getattr(obj, part)
        return self._positional(obj, stream=backend == "cuda")

    def _positional(self, entry: Callable[..., Any], *, stream: bool) -> Callable[..., Any]:
        """A compiled entry point called by name: arguments in the signature's order,
        outputs in the return's order, then the stream for CUDA."""
        order = (*self.params, *self.returns)
        first = self._first

        def call(**kw):
            args = [kw[n] for n in order]
            if stream:
                args.append(cuda_stream(kw[first]))
            return entry(*args)

        cast(Any, call).__wrapped__ = entry
        return call

    # ---------------------------------------------------------------- calls
    def bind(self, values: tuple | list) -> dict[str, Any]:
        """Positional values in schema order (a dispatcher call's ``inputs``, as
        ``register_autograd``'s setup_context gets them) -> name -> value."""
        return dict(zip(self._schema_names, values, strict=False))

    def input_grads(self, **grads: torch.Tensor | None) -> tuple:
        """The backward's return for the schema's inputs: the named gradients, None elsewhere."""
        unknown = grads.keys() - self._names
        if unknown:
            raise TypeError(f"{self.qualname}: no parameter {', '.join(sorted(unknown))}")
        return tuple(grads.get(n) for n in self._schema_names)

    def _complete(self, kw: dict[str, Any]) -> dict[str, Any]:
        """Defaults filled in; an unknown or missing name raises TypeError."""
        unknown = kw.keys() - self._names
        if unknown:
            raise TypeError(
                f"{self.qualname}() got unexpected argument(s) "
                f"{', '.join(sorted(unknown))}; it takes {', '.join(self.params)}"
            )
        full = {**self.defaults, **kw}
        missing = [n for n in self.params if n not in full]
        if missing:
            raise TypeError(f"{self.qualname}() missing argument(s) {', '.join(missing)}")
        return full

    # ---------------------------------------------------------------- calls
    # ``op(name=value, ...)`` runs a function generated from the signature (as
    # dataclasses generate __init__): Python binds the names, fills the defaults
    # and rejects unknown or missing ones at C speed, and the kernel call lists
    # every argument and output by keyword. No dict is built on the eager path.

    def _compile_call(self) -> None:
        ps, rets = self.params, self.returns
        sig = ", ".join(f"{n}=_D[{n!r}]" if n in self.defaults else n for n in ps)
        by_name = ", ".join(f"{n}={n}" for n in ps)
        tensors = "".join(f"{n}, " for n in self._tensor_like)
        if self._result is None:
            outs, ret, count = f"{rets[0]}=out", "return out", ""
        else:
            outs = ", ".join(f"{r}=out[{i}]" for i, r in enumerate(rets))
            ret = "return out if type(out) is _R else _R._make(out)"
            count = f"    elif len(out) != {len(rets)}:\n        _op._bad_out(out)\n"
        body = (
            f"    _dev = {self._first}.device\n"
            f"    _b = _op._chosen.get((_dev, backend))\n"
            f"    if _b is None:\n"
            f"        _b = _op._resolve(_dev, backend)\n"
            f"    if out is None:\n"
            f"        out = _alloc({by_name})\n"
            f"{count}"
            f"    (_op._kernels.get(_b) or _op.kernel(_b))({by_name}, {outs})\n"
            f"    {ret}\n"
        )
        src = (
            f"def __call__(_op, *, {sig}, backend=None, out=None):\n"
            f"    if _symbolic(({tensors})) or _compiling():\n"
            f"        return _op._traced(dict({by_name}), backend, out)\n"
            + body
            + f"\n\ndef run(_op, *, {sig}, backend=None, out=None):\n"
            + body
        )
        env: dict[str, Any] = {
            "_D": self.defaults,
            "_R": self._result,
            "_symbolic": is_symbolic,
            "_compiling": torch.compiler.is_compiling,
            "_alloc": self.outputs,
        }
        exec(compile(src, f"<op {self.qualname}>", "exec"), env)  # noqa: S102 - our own source
        call, run = env["__call__"], env["run"]
        call.__qualname__, run.__qualname__ = f"{self.name}_op", f"{self.name}_op.run"
        self.source = src
        # a class per op: Python looks __call__ up on the type. ``run`` is the eager
        # path alone (the dispatcher's implementation; tests with poisoned ``out``).
        self.__class__ = type(f"Op_{self.name}", (Op,), {"__call__": call, "run": run})

    def _resolve(self, dev: torch.device, backend: str | None) -> str:
        chosen = _dispatch.resolve(dev, backend, op=self.qualname, available=self.backends)
        self._chosen[(dev, backend)] = chosen
        return chosen

    def _bad_out(self, out) -> None:
        raise TypeError(f"out: expected {len(self.returns)} tensors {self.returns}, got {len(out)}")

    def _traced(self, kw: dict[str, Any], backend: str | None, out):
        """FakeTensor / meta / a dispatch mode / torch.compile: through the dispatcher,
        which runs the fake (the outputs' shapes); no data pointer reaches a kernel."""
        res = getattr(torch.ops.compass, self.name)(**kw, backend=backend)
        if self._result is None:
            return res if out is None else out.copy_(res)
        if out is None:
            return self._result._make(res)
        for o, r in zip(out, res, strict=True):
            o.copy_(r)  # traced / fake: the op is functional, ``out`` gets its values
        return self._result._make(out)

    def _run(self, kw: dict[str, Any], backend: str | None, out):
        """The eager call from a dict of arguments (the dispatcher's implementation)."""
        return type(self).run(self, **kw, backend=backend, out=out)

    def _impl(self, *args, **kwargs):
        kw = self.bind(args)
        kw.update(kwargs)
        backend = kw.pop("backend", None)
        res = self._run(kw, backend, None)
        return res if self._result is None else tuple(res)

    def _fake(self, *args, **kwargs):
        kw = self.bind(args)
        kw.update(kwargs)
        kw.pop("backend", None)
        res = self.outputs(**self._complete(kw))
        return res if self._result is None else tuple(res)


def op(
    *, kernels: dict[str, str | Callable[..., Any]], name: str | None = None, output: str = "out"
) -> Callable[[Callable[..., Any]], Op]:
    """Declare an op from its annotated function (see the module docstring):
    defines ``torch.ops.compass.<name>`` with its fake, backend table and dispatch.
    ``output``: the keyword a single output (a ``torch.Tensor`` return) reaches
    the kernels by."""

    def declare(fn: Callable[..., Any]) -> Op:
        key = name or fn.__name__.removesuffix("_op")
        if key in OPS:
            raise ValueError(f"op {NAMESPACE}::{key} is already registered")
        caller = sys._getframe(1).f_locals  # where the op is declared (names in annotations)
        o = OPS[key] = Op(fn, kernels, key, output, caller)
        return o

    return declare
