"""ck.packing.plan's output pinned byte for byte (order and offsets, hashed) on
the bench's cases and the tests' random cases: the planner's host code may be
rewritten for clarity or speed, but a plan changes only by a deliberate change
of the algorithm (then print the new pins with ``python -m
tests.test_packing_plan_pins`` and say why in the commit)."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest

import compass_kernels as ck
from compass_kernels.packing import reference as ref
from compass_kernels.packing.planner import ModelConfig

CFG = ModelConfig(
    hidden_size=4096, ffn_hidden_size=1536, num_layers=48, num_attention_heads=32, moe_top_k=8
)
BENCH_SHAPES = ((256, 8), (512, 16), (4096, 64), (8192, 8), (16384, 128), (65536, 256))
OPTIONS = {
    "tokens": {},
    "attention": {"cost": "attention", "model_config": CFG},
    "equal": {"equal_samples": True},
    "mbm4-pad8": {"micro_batch_multiple": 4, "pad_multiple": 8},
}


def _bench_case(dist: str, n: int, dp: int, option: str):
    lengths = ref.DISTRIBUTIONS[dist](n, n + dp)
    return lengths, dict(dp_size=dp, max_tokens=65536, **OPTIONS[option])


def _random_case(seed: int):
    """The shapes of test_packing_plan's random cases: few to many sequences
    per rank, groups, equal samples, caps from the longest sequence up."""
    g = np.random.default_rng(10_000 + seed)
    dp = int(g.choice([1, 2, 3, 5, 8, 16]))
    n = int(g.integers(dp * 4, dp * 200))
    long = g.random(n) < g.uniform(0.05, 0.5)
    lengths = np.where(long, g.integers(2000, 9000, n), g.integers(1, 600, n)).astype(np.int64)
    kw = dict(dp_size=dp, max_tokens=int(lengths.max() * g.choice([1.0, 1.2, 2.0, 8.0])))
    kw["micro_batch_multiple"] = int(g.choice([1, 1, 2, 3]))
    kw["equal_samples"] = bool(seed % 2)
    if seed % 3 == 0:
        size = int(g.choice([1, 2, 4]))
        groups = max(n // size, dp)
        lengths = np.resize(lengths, groups * size)
        kw["group_ids"] = g.permutation(np.repeat(np.arange(groups) * 5 + 1, size))
    if seed % 5 == 0:
        kw["cost"], kw["model_config"] = "attention", CFG
    return lengths, kw


CASES = {
    **{
        f"{d}-{n}-{dp}-{o}": (lambda d=d, n=n, dp=dp, o=o: _bench_case(d, n, dp, o))
        for d in ref.DISTRIBUTIONS
        for n, dp in BENCH_SHAPES
        for o in OPTIONS
    },
    **{f"random-{s}": (lambda s=s: _random_case(s)) for s in range(40)},
}


def _digest(lengths, kw) -> str:
    try:
        p = ck.packing.plan(lengths, **kw)
    except ValueError as e:
        return "refused: " + str(e).split(":")[0]
    h = hashlib.sha256(p.order.numpy().tobytes() + p.offsets.numpy().tobytes())
    return h.hexdigest()[:16]


PINS = {
    "lognormal-256-8-tokens": "d9355bb260f519ea",
    "lognormal-256-8-attention": "29dd03ad0a7a3c0c",
    "lognormal-256-8-equal": "f30012daa74d7c99",
    "lognormal-256-8-mbm4-pad8": "a4919aa48a3a3b13",
    "lognormal-512-16-tokens": "9a237273ed91287d",
    "lognormal-512-16-attention": "0dbcb5f57ffb6a30",
    "lognormal-512-16-equal": "b7140744bff4f9f6",
    "lognormal-512-16-mbm4-pad8": "1a9d13d3811562d6",
    "lognormal-4096-64-tokens": "225115ba06017790",
    "lognormal-4096-64-attention": "734498aea23acce4",
    "lognormal-4096-64-equal": "e245236deb061f54",
    "lognormal-4096-64-mbm4-pad8": "569b3e9743df97c3",
    "lognormal-8192-8-tokens": "e58df5647a865df8",
    "lognormal-8192-8-attention": "96b24b8beda90f7d",
    "lognormal-8192-8-equal": "7740a737b28a2e60",
    "lognormal-8192-8-mbm4-pad8": "0ada536ace2a43d6",
    "lognormal-16384-128-tokens": "eab69fedd5b7ae44",
    "lognormal-16384-128-attention": "8844340a0e45a364",
    "lognormal-16384-128-equal": "1f4c2ed919bc01af",
    "lognormal-16384-128-mbm4-pad8": "00badc396df673c7",
    "lognormal-65536-256-tokens": "919a19feaf7187f9",
    "lognormal-65536-256-attention": "c38470035b8ee9d3",
    "lognormal-65536-256-equal": "8f86ab1aea155d28",
    "lognormal-65536-256-mbm4-pad8": "07926285967d4282",
    "bimodal-256-8-tokens": "258d91ac0522c505",
    "bimodal-256-8-attention": "8dbbfab6985a542c",
    "bimodal-256-8-equal": "4143eb3a25a9b833",
    "bimodal-256-8-mbm4-pad8": "024f2c1c843008da",
    "bimodal-512-16-tokens": "fd8011ac6572d40a",
    "bimodal-512-16-attention": "5971d4f1a7113a58",
    "bimodal-512-16-equal": "3ece53df9fa7c821",
    "bimodal-512-16-mbm4-pad8": "d02410a3c035321c",
    "bimodal-4096-64-tokens": "80e350e6c579ef3e",
    "bimodal-4096-64-attention": "6647b92f62e169d5",
    "bimodal-4096-64-equal": "5048507b8a52f948",
    "bimodal-4096-64-mbm4-pad8": "f73acf5a41080371",
    "bimodal-8192-8-tokens": "04c18b2a5064fc1e",
    "bimodal-8192-8-attention": "2bdee567625f61bb",
    "bimodal-8192-8-equal": "e69f85086f67fc07",
    "bimodal-8192-8-mbm4-pad8": "d48ab556e9ea39c7",
    "bimodal-16384-128-tokens": "5e67e0f04d783e69",
    "bimodal-16384-128-attention": "fa2cc82fc3b9ebed",
    "bimodal-16384-128-equal": "ff0b94d04da20714",
    "bimodal-16384-128-mbm4-pad8": "07b18f2f33c5ba29",
    "bimodal-65536-256-tokens": "513bfa733a78b4db",
    "bimodal-65536-256-attention": "1e7e0802e6653527",
    "bimodal-65536-256-equal": "42eb6e78f32c3626",
    "bimodal-65536-256-mbm4-pad8": "34330086956171de",
    "random-0": "c1e9dcb77e9d74f6",
    "random-1": "eadea375d9dc0e9c",
    "random-2": "f38b8d015089ac5a",
    "random-3": "b9e32c6121024049",
    "random-4": "5c948625c1ae162a",
    "random-5": "8b7a9b808a11d81f",
    "random-6": "faacddf17d557269",
    "random-7": "9384306b2f8e28db",
    "random-8": "c892b82abc4780ee",
    "random-9": "27386e3158f798c3",
    "random-10": "31ed62623ce232ab",
    "random-11": "44adaaaecd2a5dd7",
    "random-12": "3bea58d777351224",
    "random-13": "9246b6c59d3f2487",
    "random-14": "80ccd99fea1fd0e7",
    "random-15": "2aa4dff05866eb50",
    "random-16": "0eb235951d87e411",
    "random-17": "d44b7936e63e9c8a",
    "random-18": "57ad5c76dc231af1",
    "random-19": "34e05e9a6f731f67",
    "random-20": "ac38c504d81baa39",
    "random-21": "0fe6151c63bc24c8",
    "random-22": "5d4713a442e31033",
    "random-23": "13893330d51f5b91",
    "random-24": "c8753c2109b7463d",
    "random-25": "0275724fd76b0b57",
    "random-26": "0b369a1b33d3eefa",
    "random-27": "c192125106835608",
    "random-28": "52cabf59d8783f06",
    "random-29": "afeeb346fb1a953b",
    "random-30": "2e62302068f03f4d",
    "random-31": "e2e2c41a3e2ae5e6",
    "random-32": "5fabc134decc1d8b",
    "random-33": "e74df3b5b6671f92",
    "random-34": "024afad4af5c3e3d",
    "random-35": "48a1b019d0d40bfd",
    "random-36": "1e8475be88271690",
    "random-37": "b4f3097c3242b7d1",
    "random-38": "2d4059396b8855f6",
    "random-39": "c13d152c06223ea2",
}


@pytest.mark.parametrize("name", list(CASES))
def test_plan_pinned(name):
    assert _digest(*CASES[name]()) == PINS[name]


if __name__ == "__main__":
    for name, make in CASES.items():
        print(f"    {name!r}: {_digest(*make())!r},")
