"""Ahead-of-time compilation and inspection of GPU code, without a GPU.

Two sources of device code are inspected the same way:

- Triton kernels, compiled here for an explicit target with
  :func:`compile_triton` (Triton's own compiler, ``GPUTarget("cuda", arch, 32)``);
  no driver or device is touched, and ``TRITON_INTERPRET=1`` in the process
  does not get in the way.
- CUDA / CUTLASS kernels in a cubin or in a shared library with an embedded
  fatbin (``compass_kernels/_C*.so``), read with ``cuobjdump``.

What is read: PTX, SASS (``cuobjdump --dump-sass``), and per-kernel resources
(``cuobjdump --dump-resource-usage``: registers, stack, static shared, local
memory, constant bank 0). ``cuobjdump`` does not report spills as such: ptxas
puts them in the stack frame (``STACK``), next to call stacks and local
arrays. For Triton kernels the PTX is also run through ``ptxas -v`` (same flags
Triton uses) to get exact spill stores/loads.

The ``assert_*`` helpers are for tests; their messages name the offending
kernel and the numbers.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import re
import subprocess
import sys
import sysconfig
import tempfile
import types
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

__all__ = [
    "CompiledArtifacts",
    "ToolNotFoundError",
    "compile_triton",
    "find_tool",
    "sass_of",
    "resource_usage",
    "functions_in",
    "assert_sass_contains",
    "assert_no_spills",
    "assert_registers_at_most",
]

_TOOLS = ("cuobjdump", "nvdisasm", "ptxas")


class ToolNotFoundError(FileNotFoundError):
    """A CUDA binary tool (cuobjdump, nvdisasm, ptxas) was not found."""


# --------------------------------------------------------------------------------------
# Tool discovery


def _tool_dirs() -> list[tuple[str, Path]]:
    """Candidate directories, in search order, each with a label for error messages."""
    dirs: list[tuple[str, Path]] = []
    cuda_home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    if cuda_home:
        dirs.append(("$CUDA_HOME/bin", Path(cuda_home) / "bin"))
    dirs.append(("/usr/local/cuda/bin", Path("/usr/local/cuda/bin")))
    for entry in os.environ.get("PATH", "").split(os.pathsep):
        if entry:
            dirs.append(("PATH", Path(entry)))
    # NVIDIA wheels: nvidia-cuda-cuobjdump / -nvdisasm install under nvidia/cu13/bin
    # (CUDA 13) or nvidia/cuda_<tool>/bin (CUDA 12); search every nvidia/*/bin.
    roots = {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"], *sys.path}
    for root in sorted(r for r in roots if r):
        nvidia = Path(root) / "nvidia"
        if nvidia.is_dir():
            for bin_dir in sorted(nvidia.glob("*/bin")):
                dirs.append(("nvidia wheel", bin_dir))
    triton_bin = _triton_nvidia_bin()
    if triton_bin is not None:
        dirs.append(("triton wheel", triton_bin))
    return dirs


def _triton_nvidia_bin() -> Path | None:
    try:
        import triton
    except ImportError:
        return None
    return Path(triton.__file__).parent / "backends" / "nvidia" / "bin"


def find_tool(name: str) -> Path:
    """Locate a CUDA binary tool.

    Search order: ``$CUDA_HOME/bin`` (or ``$CUDA_PATH/bin``), ``/usr/local/cuda/bin``,
    ``$PATH``, the ``nvidia-cuda-cuobjdump`` / ``nvidia-cuda-nvdisasm`` wheels
    (``site-packages/nvidia/*/bin``), then ``triton/backends/nvidia/bin``.

    Parameters
    ----------
    name : str
        ``"cuobjdump"``, ``"nvdisasm"`` or ``"ptxas"`` (other names are searched
        the same way).

    Returns
    -------
    pathlib.Path
        The first executable file found.

    Raises
    ------
    ToolNotFoundError
        Listing every directory searched and how to install the tool.
    """
    if not name or os.sep in name:
        raise ValueError(f"find_tool expects a bare tool name, got {name!r}")
    searched: list[str] = []
    seen: set[Path] = set()
    for label, directory in _tool_dirs():
        if directory in seen:
            continue
        seen.add(directory)
        searched.append(f"{label}: {directory}")
        candidate = directory / name
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return candidate
    hint = {
        "cuobjdump": "pip install nvidia-cuda-cuobjdump",
        "nvdisasm": "pip install nvidia-cuda-nvdisasm",
        "ptxas": "install the CUDA toolkit or triton (it ships ptxas)",
    }.get(name, "install the CUDA toolkit")
    raise ToolNotFoundError(
        f"{name} not found ({hint}, or set CUDA_HOME). Looked in:\n  " + "\n  ".join(searched)
    )


def _run(cmd: list[str]) -> str:
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise RuntimeError(
            f"{' '.join(cmd)} failed with exit code {proc.returncode}:\n"
            f"{proc.stderr.strip() or proc.stdout.strip()}"
        )
    return proc.stdout


@contextlib.contextmanager
def _as_file(path_or_bytes: str | os.PathLike | bytes, suffix: str) -> Iterator[str]:
    if isinstance(path_or_bytes, bytes | bytearray):
        with tempfile.TemporaryDirectory(prefix="compass_aot_") as tmp:
            path = os.path.join(tmp, "module" + suffix)
            with open(path, "wb") as f:
                f.write(path_or_bytes)
            yield path
        return
    path = os.fspath(path_or_bytes)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"no such file: {path}")
    yield path


# --------------------------------------------------------------------------------------
# Disassembly and resource reports


def sass_of(path_or_bytes: str | os.PathLike | bytes, *, function: str | None = None) -> str:
    """SASS text of a cubin, or of every cubin embedded in a shared library / fatbin.

    Parameters
    ----------
    path_or_bytes : path or bytes
        A ``.cubin`` / ``.so`` / ``.fatbin`` path, or the bytes of a cubin.
    function : str, optional
        Only this (mangled) function.

    Returns
    -------
    str
        ``cuobjdump --dump-sass`` output.
    """
    cmd = [str(find_tool("cuobjdump")), "--dump-sass"]
    if function is not None:
        cmd += ["--function", function]
    with _as_file(path_or_bytes, ".cubin") as path:
        return _run([*cmd, path])


_ARCH_RE = re.compile(r"^arch\s*=\s*(\S+)")
_FUNCTION_RE = re.compile(r"^\s*Function\s+(.+?):\s*$")
_FIELD_RE = re.compile(r"([A-Z]+(?:\[\d+\])?):(\d+)")
_FIELD_NAMES = {"REG": "registers", "STACK": "stack", "SHARED": "shared", "LOCAL": "local"}


def parse_resource_usage(text: str) -> list[dict[str, Any]]:
    """Parse ``cuobjdump --dump-resource-usage`` output into one dict per (function, arch).

    Parameters
    ----------
    text : str
        The tool's output.

    Returns
    -------
    list of dict
        Keys ``name``, ``arch`` (``"sm_90a"``; ``None`` for a bare cubin), ``registers``,
        ``stack``, ``shared`` (static), ``local``, ``constant`` (bank 0), all bytes
        except ``registers``.
    """
    rows: list[dict[str, Any]] = []
    arch: str | None = None
    pending: str | None = None
    for line in text.splitlines():
        if m := _ARCH_RE.match(line.strip()):
            arch = m.group(1)
            continue
        if m := _FUNCTION_RE.match(line):
            pending = m.group(1)
            continue
        if pending is not None:
            fields = dict(_FIELD_RE.findall(line))
            if "REG" not in fields:
                raise ValueError(f"unexpected resource line for {pending!r}: {line!r}")
            row: dict[str, Any] = {"name": pending, "arch": arch}
            for key, out in _FIELD_NAMES.items():
                row[out] = int(fields.get(key, 0))
            row["constant"] = int(fields.get("CONSTANT[0]", 0))
            rows.append(row)
            pending = None
    return rows


def resource_usage(
    path_or_bytes: str | os.PathLike | bytes, *, arch: str | None = None
) -> dict[str, dict[str, Any]]:
    """Per-kernel resources of a cubin or of a shared library with an embedded fatbin.

    Parameters
    ----------
    path_or_bytes : path or bytes
        ``.cubin`` / ``.so`` / ``.fatbin`` path, or cubin bytes.
    arch : str, optional
        Keep only kernels built for this SM (e.g. ``"sm_90a"``). Needed when the
        same kernel is embedded for several architectures.

    Returns
    -------
    dict
        ``{kernel_name: {name, arch, registers, stack, shared, local, constant}}``
        (bytes except registers; names as cuobjdump prints them, i.e. mangled).
        Register spills show up in ``stack`` (with call stacks and local
        arrays); cuobjdump cannot tell them apart.

    Raises
    ------
    ValueError
        If a kernel appears for several architectures and ``arch`` is not given.
    """
    with _as_file(path_or_bytes, ".cubin") as path:
        text = _run([str(find_tool("cuobjdump")), "--dump-resource-usage", path])
    out: dict[str, dict[str, Any]] = {}
    for row in parse_resource_usage(text):
        if arch is not None and row["arch"] not in (arch, None):
            continue
        prev = out.get(row["name"])
        if prev is not None and prev["arch"] != row["arch"]:
            raise ValueError(
                f"kernel {row['name']} is embedded for {prev['arch']} and {row['arch']}; "
                "pass arch= to pick one"
            )
        out[row["name"]] = row
    return out


def functions_in(path_or_bytes: str | os.PathLike | bytes) -> list[str]:
    """Sorted names (mangled) of the device functions in a cubin / shared library."""
    with _as_file(path_or_bytes, ".cubin") as path:
        text = _run([str(find_tool("cuobjdump")), "--dump-resource-usage", path])
    return sorted({row["name"] for row in parse_resource_usage(text)})


_PTXAS_USED_RE = re.compile(r"Used (\d+) registers")
_PTXAS_SPILL_RE = re.compile(
    r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads"
)


def parse_ptxas_log(text: str) -> dict[str, int]:
    """Registers and spill bytes from a single-kernel ``ptxas -v`` log.

    Returns
    -------
    dict
        ``registers``, ``stack``, ``spill_stores``, ``spill_loads``.
    """
    used = _PTXAS_USED_RE.search(text)
    spill = _PTXAS_SPILL_RE.search(text)
    if used is None or spill is None:
        raise ValueError(f"cannot parse ptxas -v output:\n{text}")
    return {
        "registers": int(used.group(1)),
        "stack": int(spill.group(1)),
        "spill_stores": int(spill.group(2)),
        "spill_loads": int(spill.group(3)),
    }


# --------------------------------------------------------------------------------------
# Triton ahead-of-time compilation


@dataclasses.dataclass(frozen=True)
class CompiledArtifacts:
    """Everything a Triton AOT compile produced, plus lazily computed reports.

    Attributes
    ----------
    name : str
        Kernel (entry point) name.
    arch : int
        SM number compiled for (90 -> ``sm_90a``).
    asm : dict
        Triton's stages: ``ttir``, ``ttgir``, ``llir``, ``ptx`` (str) and ``cubin`` (bytes).
    metadata : dict
        Triton's kernel metadata (``shared`` is the shared memory requested at launch).
    """

    name: str
    arch: int
    asm: Mapping[str, Any]
    metadata: Mapping[str, Any]

    @property
    def ptx(self) -> str:
        """PTX text."""
        return self.asm["ptx"]

    @property
    def cubin(self) -> bytes:
        """The cubin ptxas produced."""
        return self.asm["cubin"]

    @functools.cached_property
    def sass(self) -> str:
        """SASS of the cubin (``cuobjdump --dump-sass``)."""
        return sass_of(self.cubin)

    @functools.cached_property
    def resource_usage(self) -> dict[str, Any]:
        """Resources of this kernel.

        ``registers``, ``stack``, ``shared`` (static, from the cubin), ``local``,
        ``constant`` from cuobjdump; ``spill_stores`` / ``spill_loads`` (bytes) from
        ``ptxas -v`` on the same PTX with Triton's flags; ``shared_launch``, the
        shared memory Triton requests at launch (``metadata["shared"]``).
        """
        usage = resource_usage(self.cubin)
        if self.name not in usage:
            raise RuntimeError(f"kernel {self.name} not in its own cubin: {sorted(usage)}")
        row = dict(usage[self.name])
        ptxas = self._ptxas_report()
        if ptxas["registers"] != row["registers"]:
            raise RuntimeError(
                f"{self.name}: ptxas -v re-run reports {ptxas['registers']} registers, the "
                f"cubin {row['registers']}; the flags used no longer match Triton's"
            )
        row.update(spill_stores=ptxas["spill_stores"], spill_loads=ptxas["spill_loads"])
        row["shared_launch"] = int(self.metadata.get("shared", 0))
        row["arch"] = row["arch"] or f"sm_{self.arch}{'a' if self.arch >= 90 else ''}"
        return row

    def _ptxas_report(self) -> dict[str, int]:
        # Mirrors triton/backends/nvidia/compiler.py make_cubin (ptxas -lineinfo -v
        # --regAllocOptLevel=2 [--fmad=false]); Triton discards that log.
        from triton.backends.nvidia.compiler import get_ptxas, sm_arch_from_capability

        ptxas = get_ptxas(self.arch).path
        gpu = sm_arch_from_capability(self.arch)
        fmad = [] if self.metadata.get("enable_fp_fusion", True) else ["--fmad=false"]
        with tempfile.TemporaryDirectory(prefix="compass_aot_") as tmp:
            src = os.path.join(tmp, f"{self.name}.ptx")
            with open(src, "w") as f:
                f.write(self.ptx)
            cmd = [ptxas, "-lineinfo", *fmad, "-v", "--regAllocOptLevel=2"]
            cmd += [f"--gpu-name={gpu}", src, "-o", os.path.join(tmp, "out.cubin")]
            proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if proc.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stderr}")
        return parse_ptxas_log(proc.stderr + proc.stdout)


# id(InterpretedFunction) -> (that object, its JITFunction twin); the object is kept
# so its id cannot be reused, the twin so Triton's compile cache keeps hitting.
_JIT_TWINS: dict[int, tuple[Any, Any]] = {}


def _jit_twin(interpreted: Any) -> Any:
    from triton.runtime.jit import JITFunction

    hit = _JIT_TWINS.get(id(interpreted))
    if hit is None or hit[0] is not interpreted:
        hit = (interpreted, JITFunction(interpreted.fn, **interpreted.kwargs))
        _JIT_TWINS[id(interpreted)] = hit
    return hit[1]


def _interpreted_behind(member: Any, interpreted_cls: type) -> Any:
    """The InterpretedFunction a ``tl.tensor`` member wrapper forwards to, if any.

    Under the interpreter ``core._tensor_member_fn`` installs a plain wrapper that
    closes over the InterpretedFunction (``x.sum()``); compiled Triton installs the
    JITFunction itself.
    """
    if issubclass(type(member), interpreted_cls):
        return member
    if not issubclass(type(member), types.FunctionType):
        return None
    for cell in getattr(member, "__closure__", None) or ():
        try:
            inner = cell.cell_contents
        except ValueError:
            continue
        if isinstance(inner, interpreted_cls) and inner.__name__ == member.__name__:
            return inner
    return None


def _interpreter_leftovers() -> list[str]:
    """``triton.language`` attributes still replaced by interpreter code."""
    import triton.language as tl
    from triton.runtime import interpreter

    source = interpreter.__file__

    def from_interpreter(value: Any) -> bool:
        value = value.fget if isinstance(value, property) else value
        value = value.func if isinstance(value, functools.partial) else value
        code = getattr(value, "__code__", None)
        return code is not None and code.co_filename == source

    holders = {
        "tl": tl,
        "tl.core": tl.core,
        "tl.math": tl.math,
        "tl.tensor": tl.core.tensor,
        "tl.dtype": tl.core.dtype,
        "tl.condition": tl.core.condition,
    }
    return [
        f"{label}.{name}"
        for label, holder in holders.items()
        for name, value in list(vars(holder).items())
        if from_interpreter(value)
    ]


@contextlib.contextmanager
def _compilable() -> Iterator[None]:
    """Make an interpreter-mode process look like a compiling one, then restore it.

    With ``TRITON_INTERPRET=1`` at import, every ``@triton.jit`` function (ours and
    Triton's own ``tl.sum``, ``tl.cdiv``, ...) is an ``InterpretedFunction``, which
    the code generator cannot compile. For the duration of the compile:
    ``knobs.runtime.interpret`` is off, every module-level InterpretedFunction in
    ``sys.modules`` is replaced by a JITFunction twin, and so are the member
    wrappers on classes of ``triton.*`` modules (``tl.tensor.sum``). Refuses
    (RuntimeError) when interpreter patches of ``triton.language`` were left
    behind (see ``tests.triton_interpreter``).

    Not thread safe: do not run interpreted kernels while compiling. Jit helpers
    held only in closures (a kernel defined inside a function, calling a local
    helper) are not found.
    """
    from triton import knobs
    from triton.runtime.interpreter import InterpretedFunction

    leftovers = _interpreter_leftovers()
    if leftovers:
        raise RuntimeError(
            "cannot compile: triton.language is still patched by the Triton interpreter "
            f"({', '.join(leftovers[:4])}, ...). An interpreted @triton.jit helper call "
            "(tl.sum, tl.max, ...) leaves these behind (a Triton interpreter bug). Call "
            "tests.triton_interpreter.apply() before running interpreted kernels "
            "(tests/conftest.py does), or compile in a process that has not run any."
        )
    swaps: list[tuple[Any, str, Any]] = []

    def swap(holder: Any, name: str, old: Any, interpreted: Any) -> None:
        swaps.append((holder, name, old))
        setattr(holder, name, _jit_twin(interpreted))

    try:
        with knobs.runtime.scope():
            knobs.runtime.interpret = False
            for modname, mod in list(sys.modules.items()):
                namespace = getattr(mod, "__dict__", None)
                if not isinstance(namespace, dict):
                    continue
                in_triton = modname == "triton" or modname.startswith("triton.")
                # type() rather than isinstance(): isinstance reads __class__, which
                # some modules' lazy / deprecated attributes answer with a warning.
                for name, value in list(namespace.items()):
                    kind = type(value)
                    if issubclass(kind, InterpretedFunction):
                        swap(mod, name, value, value)
                    elif in_triton and issubclass(kind, type) and value.__module__ == modname:
                        for attr, member in list(vars(value).items()):
                            target = _interpreted_behind(member, InterpretedFunction)
                            if target is not None:
                                swap(value, attr, member, target)
            yield
    finally:
        for holder, name, old in reversed(swaps):
            setattr(holder, name, old)


def _as_jit_function(fn: Any) -> Any:
    """``fn`` as a JITFunction (its twin when ``TRITON_INTERPRET=1`` made it interpreted)."""
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    if isinstance(fn, JITFunction):
        return fn
    if isinstance(fn, InterpretedFunction):
        return _jit_twin(fn)
    raise TypeError(f"expected a @triton.jit function, got {type(fn).__name__}")


def _gpu_target(arch: int):
    from triton.backends.compiler import GPUTarget

    return GPUTarget("cuda", arch, 32)


def compile_triton(
    fn: Any,
    signature: Mapping[str, str],
    constexprs: Mapping[str, Any] | None = None,
    *,
    arch: int = 90,
    num_warps: int = 4,
    num_stages: int = 3,
    divisible_by_16: tuple[str, ...] = (),
    **options: Any,
) -> CompiledArtifacts:
    """Compile a ``@triton.jit`` kernel for an NVIDIA target without a GPU.

    Parameters
    ----------
    fn : triton JITFunction (or InterpretedFunction under ``TRITON_INTERPRET=1``)
        The kernel.
    signature : dict
        Every parameter name -> Triton type string (``"*fp32"``, ``"i64"``, ``"fp32"``,
        ``"constexpr"`` for the compile-time ones).
    constexprs : dict, optional
        Values of the ``constexpr`` parameters.
    arch : int, optional
        SM number; 90 compiles for ``sm_90a`` (wgmma, TMA).
    num_warps, num_stages : int, optional
        Launch / pipelining options, as in a launch.
    divisible_by_16 : tuple of str, optional
        Parameters to compile as multiples of 16 (``tt.divisibility``), as Triton's
        launcher specializes aligned pointers and strides at a real launch.
    **options
        Further Triton compile options (e.g. ``maxnreg``, ``enable_fp_fusion``).

    Returns
    -------
    CompiledArtifacts
        ``.ptx``, ``.cubin``, ``.sass``, ``.resource_usage``.
    """
    import triton
    from triton.compiler import ASTSource

    missing = [p for p in fn.arg_names if p not in signature]
    if missing:
        raise ValueError(f"signature lacks parameters {missing} of {fn.__name__}")
    opts = {"num_warps": num_warps, "num_stages": num_stages, **options}
    # Explicit, so the compile does not depend on TRITON_DEFAULT_FP_FUSION (whose
    # default flips in Triton 3.10) and does not warn.
    opts.setdefault("enable_fp_fusion", True)
    with _compilable():
        jit = _as_jit_function(fn)
        attrs = {(jit.arg_names.index(p),): [["tt.divisibility", 16]] for p in divisible_by_16}
        src = ASTSource(jit, dict(signature), dict(constexprs or {}), attrs)
        kernel = triton.compile(src, target=_gpu_target(arch), options=opts)
    metadata = kernel.metadata._asdict()
    return CompiledArtifacts(
        name=kernel.name, arch=arch, asm=dict(kernel.asm), metadata=types.MappingProxyType(metadata)
    )


# --------------------------------------------------------------------------------------
# Assertions for tests


def _kernels(usage: Mapping[str, Any]) -> dict[str, Mapping[str, Any]]:
    """Accept one kernel's dict (has ``registers``) or ``{name: dict}``."""
    if "registers" in usage and not isinstance(usage["registers"], Mapping):
        return {str(usage.get("name", "<kernel>")): usage}
    if not usage:
        raise AssertionError("resource usage is empty: no kernels to check")
    return dict(usage)


def assert_sass_contains(sass: str, pattern: str, *, kernel: str | None = None) -> None:
    """Assert a regular expression occurs in SASS text.

    Parameters
    ----------
    sass : str
        ``cuobjdump --dump-sass`` output.
    pattern : str
        Regular expression, e.g. ``r"QGMMA\\."`` or ``"HGMMA"``.
    kernel : str, optional
        Name used in the failure message.
    """
    if re.search(pattern, sass) is None:
        opcodes = sorted(
            set(re.findall(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][\w.]*)", sass))
        )
        raise AssertionError(
            f"SASS of {kernel or 'kernel'} has no match for {pattern!r}; opcodes present: "
            f"{' '.join(opcodes) or '(none: is this SASS?)'}"
        )


def assert_no_spills(usage: Mapping[str, Any]) -> None:
    """Assert no kernel spills registers.

    Parameters
    ----------
    usage : dict
        One kernel's resource dict (``CompiledArtifacts.resource_usage``) or the
        ``{name: dict}`` from :func:`resource_usage`. Where ptxas spill counts
        are known (Triton kernels) they decide. Otherwise (cuobjdump of a cubin
        or .so) any ``stack`` or ``local`` bytes fail: ptxas puts spills in the
        stack frame, and cuobjdump cannot tell them from local arrays or a call
        stack, none of which a hot kernel should have.
    """
    bad = []
    for name, row in _kernels(usage).items():
        stores, loads = row.get("spill_stores"), row.get("spill_loads")
        stack, local = row.get("stack", 0), row.get("local", 0)
        if stores is not None or loads is not None:
            failed = (stores or 0) > 0 or (loads or 0) > 0
            detail = f"spill stores {stores} B, spill loads {loads} B"
        else:
            failed = stack > 0 or local > 0
            detail = "spills unknown (cuobjdump): stack and local bytes may be spills"
        if failed:
            bad.append(
                f"{name}: {detail}, stack {stack} B, local {local} B, "
                f"registers {row.get('registers')}"
            )
    if bad:
        raise AssertionError("register spills:\n  " + "\n  ".join(bad))


def assert_registers_at_most(usage: Mapping[str, Any], n: int) -> None:
    """Assert every kernel uses at most ``n`` registers per thread.

    Parameters
    ----------
    usage : dict
        One kernel's resource dict or ``{name: dict}``.
    n : int
        Register budget per thread.
    """
    bad = [
        f"{name}: {row['registers']} registers > {n}"
        for name, row in _kernels(usage).items()
        if row["registers"] > n
    ]
    if bad:
        raise AssertionError("register budget exceeded:\n  " + "\n  ".join(bad))


# --------------------------------------------------------------------------------------
# Launched variants: the specialization a real launch gets, from a real call's arguments


@dataclasses.dataclass(frozen=True)
class Launch:
    """One ``kernel[grid](*args, **kwargs)`` call as a wrapper made it."""

    fn: Any  # the JITFunction / InterpretedFunction launched
    args: tuple
    kwargs: Mapping[str, Any]
    grid: Any

    @property
    def name(self) -> str:
        return getattr(self.fn, "__name__", None) or self.fn.fn.__name__


@contextlib.contextmanager
def record_launches(*, execute: bool = False) -> Iterator[list[Launch]]:
    """Record every Triton launch made inside the block (interpreted or compiled).

    With ``execute=False`` the kernels are not run: the wrappers can then be
    called with ``meta`` tensors at any size (T x V past 2^31, say); Triton's
    specialization reads only their dtype and data pointer (0 on meta: 16-byte
    aligned, as every torch allocation is)."""
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    launches: list[Launch] = []
    originals = {cls: vars(cls)["run"] for cls in (InterpretedFunction, JITFunction)}

    def wrap(original):
        def run(self, *args, grid, warmup=False, **kwargs):
            launches.append(Launch(self, args, types.MappingProxyType(dict(kwargs)), grid))
            if execute:
                return original(self, *args, grid=grid, warmup=warmup, **kwargs)
            return None

        return run

    try:
        for cls, original in originals.items():
            cls.run = wrap(original)
        yield launches
    finally:
        for cls, original in originals.items():
            cls.run = original


def specialization_of(launch: Launch, *, arch: int = 90) -> tuple[dict, dict, dict, Any]:
    """(signature, constexprs, attrs, options) Triton's JIT derives for ``launch``
    on an sm_``arch`` device: its own binder (``create_function_from_signature``
    with the CUDA backend's ``specialize_impl``: integers equal to 1 made
    constants, multiples of 16 marked ``tt.divisibility``, i32 below 2^31 else
    i64, pointers 16-byte aligned) and ``JITFunction._pack_args``."""
    from triton.compiler.compiler import make_backend
    from triton.runtime.jit import create_function_from_signature

    with _compilable():
        jit = _as_jit_function(launch.fn)
        backend = make_backend(_gpu_target(arch))
        binder = create_function_from_signature(jit.signature, jit.params, backend)
        kwargs = dict(launch.kwargs)
        bound, spec, options = binder(*launch.args, **kwargs)
        options, signature, constexprs, attrs = jit._pack_args(
            backend, kwargs, bound, spec, options
        )
    return signature, constexprs, attrs, options


_LAUNCH_CACHE: dict[str, CompiledArtifacts] = {}


def compile_launch(launch: Launch, *, arch: int = 90) -> CompiledArtifacts:
    """Compile ``launch`` exactly as the JIT would on an sm_``arch`` device (cached
    per kernel and specialization, as the JIT's own cache)."""
    import triton
    from triton.compiler import ASTSource

    signature, constexprs, attrs, options = specialization_of(launch, arch=arch)
    opts = dict(options.__dict__)
    key = repr((id(launch.fn), arch, signature, constexprs, attrs, sorted(opts.items())))
    hit = _LAUNCH_CACHE.get(key)
    if hit is not None:
        return hit
    with _compilable():
        jit = _as_jit_function(launch.fn)
        src = ASTSource(jit, signature, constexprs, attrs)
        kernel = triton.compile(src, target=_gpu_target(arch), options=opts)
    metadata = kernel.metadata._asdict()
    art = CompiledArtifacts(
        name=kernel.name, arch=arch, asm=dict(kernel.asm), metadata=types.MappingProxyType(metadata)
    )
    _LAUNCH_CACHE[key] = art
    return art


@dataclasses.dataclass(frozen=True)
class LaunchedVariant:
    """A kernel compiled as one of its op's real launches at a typical shape."""

    module: str  # "espo.triton_logprobs"
    case: str  # what the launch was: op and shape
    launch: Launch
    artifacts: CompiledArtifacts

    @property
    def name(self) -> str:
        return self.artifacts.name

    @property
    def sass(self) -> str:
        return self.artifacts.sass

    @functools.cached_property
    def specialization(self) -> str:
        """The launch's signature as Triton specialized it (``V:i32/16`` = i32,
        multiple of 16; ``K:1`` = the constant 1)."""
        signature, constexprs, attrs, _ = specialization_of(self.launch, arch=self.artifacts.arch)
        jit = _as_jit_function(self.launch.fn)
        out = []
        for i, (p, ty) in enumerate(signature.items()):
            if ty == "constexpr":
                if p in jit.arg_names and not jit.params[i].is_constexpr:
                    out.append(f"{p}:{constexprs.get((i,))}")
                continue
            div = any(a == ["tt.divisibility", 16] for a in attrs.get((i,), []))
            out.append(f"{p}:{ty}{'/16' if div else ''}")
        return " ".join(out)


def launched_variants(module: str, *, arch: int = 90) -> list[LaunchedVariant]:
    """Every Triton kernel of ``module`` (``"espo.triton_logprobs"``,
    ``"espo.triton_loss"``, ``"routing.triton"``, ``"fp8.triton_gemm"``,
    ``"advantages.triton"``) compiled as its op launches it at the op's typical
    and largest shapes (tests/launch_plans.py: the calls; the specialization
    comes from the arguments those calls pass, via Triton's own binder).
    ``.sass`` / ``.artifacts.resource_usage`` / ``.artifacts.ptx`` of each."""
    from tests import launch_plans

    out = []
    for case, call in launch_plans.PLANS[module]():
        with record_launches(execute=False) as launches:
            call()
        if not launches:
            raise RuntimeError(f"{module}: {case} launched no Triton kernel")
        for launch in launches:
            out.append(LaunchedVariant(module, case, launch, compile_launch(launch, arch=arch)))
    return out


_VEC_RE = re.compile(r"\b(ld|st)\.global(?:\.[a-z0-9:]+)*?(?:\.v(\d))?\.(b|f|u|s)(\d+)\b")


def global_access_widths(ptx: str) -> dict[str, dict[int, int]]:
    """Bits per thread per global access in the PTX: ``{"ld": {128: 2, 16: 5}, "st": ...}``
    (``ld.global.v4.b32`` is 128 bits)."""
    out: dict[str, dict[int, int]] = {"ld": {}, "st": {}}
    for op, vec, _, bits in _VEC_RE.findall(ptx):
        width = int(bits) * int(vec or 1)
        out[op][width] = out[op].get(width, 0) + 1
    return out


_DIV64_RE = re.compile(r"\b(?:div|rem)\.(?:s|u)64\b")


def divides_64(ptx: str) -> int:
    """The number of 64-bit integer divides / remainders (div.s64, rem.u64, ...)
    in the PTX: each is a ~70-instruction software routine on sm_90."""
    return len(_DIV64_RE.findall(ptx))
