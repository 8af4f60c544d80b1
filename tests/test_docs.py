"""The docs stay true to the tree: README.md, docs/**/*.md and the package's docstrings
name only repository paths that exist, modules and public symbols that exist
(``compass_kernels.x.y``, ``ck.x.y``), and nothing outside the repository (no
``../shared``, no brief documents). docs/design.md stays within 800 lines.

Names are read from code spans (`...`) and markdown links; docstrings are read with
``ast`` (no module is imported for it, so the engine modules need not load)."""

from __future__ import annotations

import ast
import importlib
import importlib.util
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOCS = sorted([ROOT / "README.md", *(ROOT / "docs").rglob("*.md")])
PACKAGE = ROOT / "compass_kernels"
#: Top-level entries a path in the docs may start with.
TOP = (
    "compass_kernels",
    "docs",
    "tests",
    "scripts",
    "bench",
    "csrc",
    "examples",
    "cmake",
    ".ci",
    "Makefile",
    "pyproject.toml",
    "setup.py",
    "CMakeLists.txt",
    "MANIFEST.in",
    "README.md",
)
#: Files and folders that exist only after a build or a run (named in the docs as outputs).
GENERATED = ("build/", "rl_out", "dist/", ".venv", "compass_kernels/_C", "compass_kernels/_C_emu")
#: What lies outside the repository and must not be cited: the brief behind the project.
OUTSIDE = re.compile(
    r"\.\./shared|\bshared/(DESIGN|ANCHORS|STYLE)\.md|\b(DESIGN|ANCHORS|STYLE)\.md\b"
)

_SPAN = re.compile(r"`([^`\n]+)`")
_LINK = re.compile(r"\]\(([^)\s#]+)(?:#[^)]*)?\)")
_PATH = re.compile(r"^(?:\./)?([A-Za-z0-9_.\-]+(?:/[A-Za-z0-9_.\-*{}]+)*/?)(?::\d+)?$")
_DOTTED = re.compile(r"\b((?:compass_kernels|ck)(?:\.[A-Za-z_][A-Za-z0-9_]*)+)")


def _docstrings() -> list[tuple[str, str]]:
    """(where, text) of every module, class and function docstring in the package."""
    out = []
    for path in sorted(PACKAGE.rglob("*.py")):
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
                doc = ast.get_docstring(node, clean=False)
                if doc:
                    line = getattr(node, "lineno", 1)
                    out.append((f"{path.relative_to(ROOT)}:{line}", doc))
    return out


def _sources() -> list[tuple[str, str, Path]]:
    """(where, text, folder relative links resolve against)."""
    docs = [(str(p.relative_to(ROOT)), p.read_text(), p.parent) for p in DOCS]
    return docs + [(w, t, ROOT) for w, t in _docstrings()]


SOURCES = _sources()


def _repo_path(token: str) -> str | None:
    """The repository path a code span names, or None when it names none."""
    token = token.strip().split()[0] if token.strip() else ""
    m = _PATH.match(token)
    if not m or "/" not in m.group(1) and m.group(1) not in TOP:
        return None
    path = m.group(1)
    if path.split("/")[0] not in TOP or "*" in path or "{" in path or "<" in path:
        return None
    return path


def missing_paths(text: str, base: Path) -> list[str]:
    bad = []
    for span in _SPAN.findall(text):
        path = _repo_path(span)
        if path and not any(path.startswith(g) for g in GENERATED) and not (ROOT / path).exists():
            bad.append(path)
    for link in _LINK.findall(text):
        if "://" in link or link.startswith("mailto:"):
            continue
        target = (base / link).resolve()
        if not target.is_relative_to(ROOT):
            bad.append(f"{link} (outside the repository)")
        elif not target.exists():
            bad.append(link)
    return bad


def _resolves(dotted: str) -> bool:
    """Whether ``compass_kernels.a.b`` (or ``ck.a.b``) is a module or an attribute chain."""
    parts = dotted.split(".")
    if parts[0] == "ck":
        parts[0] = "compass_kernels"
    i = max(k for k in range(1, len(parts) + 1) if k == 1 or _is_module(parts[:k]))
    if parts[i - 1].endswith("plugin"):
        # an import hook (verl's VERL_USE_EXTERNAL_MODULES): importing it registers
        # or activates for the rest of the process, so its source is read instead
        src = _module_path(parts[:i]).read_text()
        return (
            i == len(parts)
            or re.search(rf"^(?:def|class) {parts[i]}\b|^{parts[i]}\b.*=", src, re.M) is not None
        )
    try:
        obj = importlib.import_module(".".join(parts[:i]))
    except ImportError:  # an engine module without its engine: read its top-level names
        if i == len(parts):
            return True
        src = _module_path(parts[:i]).read_text()
        return re.search(rf"^(?:def|class) {parts[i]}\b|^{parts[i]}\b.*=", src, re.M) is not None
    for attr in parts[i:]:
        if not hasattr(obj, attr):
            return False
        obj = getattr(obj, attr)
    return True


def _module_path(parts: list[str]) -> Path:
    base = ROOT / Path(*parts)
    return base / "__init__.py" if base.is_dir() else base.with_suffix(".py")


def _is_module(parts: list[str]) -> bool:
    """A module of the package: a source file, a package, or a compiled extension."""
    if _module_path(parts).exists():
        return True
    try:
        return importlib.util.find_spec(".".join(parts)) is not None
    except ImportError:
        return False


def missing_symbols(text: str) -> list[str]:
    names = set()
    for span in _SPAN.findall(text):
        names.update(_DOTTED.findall(span))
    return sorted(n for n in names if not _resolves(n.rstrip(".")))


def test_named_paths_exist():
    bad = [f"{w}: {p}" for w, t, base in SOURCES for p in missing_paths(t, base)]
    assert not bad, "paths that do not exist:\n" + "\n".join(bad)


def test_named_modules_and_symbols_exist():
    bad = [f"{w}: {n}" for w, t, _ in SOURCES for n in missing_symbols(t)]
    assert not bad, "modules / symbols that do not exist:\n" + "\n".join(bad)


_MACRO = re.compile(r"^COMPASS_[A-Z0-9_]+$")
#: Where a COMPASS_* macro, CMake option or environment variable is defined or read.
_CODE = [
    p
    for d in ("csrc", "cmake", "compass_kernels", "scripts", "tests", "bench", ".ci", "examples")
    for p in (ROOT / d).rglob("*")
    if p.is_file() and p.suffix in {".h", ".cpp", ".cu", ".cuh", ".cmake", ".py", ".sh", ""}
] + [ROOT / n for n in ("CMakeLists.txt", "setup.py", "Makefile", "pyproject.toml")]


def unknown_macros(text: str, code: str) -> list[str]:
    """COMPASS_* names in code spans (macros, CMake options, environment variables) that no
    source file mentions: a deleted macro or a renamed variable."""
    names = {t for span in _SPAN.findall(text) for t in re.findall(r"\bCOMPASS_[A-Z0-9_]+\b", span)}
    return sorted(n for n in names if _MACRO.match(n) and n not in code)


def test_named_macros_and_variables_exist():
    this = Path(__file__).resolve()
    code = "\n".join(p.read_text(errors="replace") for p in _CODE if p.resolve() != this)
    bad = [f"{w}: {n}" for w, t, _ in SOURCES for n in unknown_macros(t, code)]
    assert not bad, "COMPASS_* names no source defines or reads:\n" + "\n".join(bad)


def test_nothing_outside_the_repository_is_cited():
    bad = [(w, m.group(0)) for w, t, _ in SOURCES for m in OUTSIDE.finditer(t)]
    assert not bad, f"references outside the repository: {bad}"


def test_design_is_at_most_800_lines():
    n = len((ROOT / "docs" / "design.md").read_text().splitlines())
    assert n <= 800, f"docs/design.md has {n} lines (at most 800)"


def test_the_check_catches_what_it_is_for(tmp_path):
    """The checks themselves: a missing path, module, symbol and an outside reference."""
    text = (
        "see `compass_kernels/nothere.py`, `docs/perf/install.md`, [x](nothere.md), "
        "`ck.packing.plan`, `ck.packing.no_such_fn`, `compass_kernels.no_such_module`, "
        "[brief](../../shared/DESIGN.md)"
    )
    outside = "../../shared/DESIGN.md (outside the repository)"
    assert missing_paths(text, ROOT / "docs") == [
        "compass_kernels/nothere.py",
        "nothere.md",
        outside,
    ]
    assert missing_symbols(text) == ["ck.packing.no_such_fn", "compass_kernels.no_such_module"]
    assert OUTSIDE.search(text) and not OUTSIDE.search("docs/design.md")
    assert unknown_macros("`COMPASS_GONE_ARGS` and `COMPASS_CUDA=OFF`", "COMPASS_CUDA") == [
        "COMPASS_GONE_ARGS"
    ]
