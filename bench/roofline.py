"""A roofline model of GPU time, for shapes we cannot time on a GPU.

No GPU is available to development or CI, so a bench states GPU performance as
a *model*: the minimum time an op needs on a device given the bytes it must
move through HBM and the FLOPs it must execute, each over the device's
published ceiling, plus one kernel-launch floor per kernel. It is a lower
bound that a good kernel approaches, never a measurement; tables label it
"model".
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Device:
    """Published ceilings of one accelerator (dense math, no sparsity)."""

    name: str
    hbm_bytes_per_s: float
    flops_per_s: dict[str, float] = field(default_factory=dict)
    launch_s: float = 3e-6  # assumption: launch + tail of a tiny kernel, CUDA graphs off


# NVIDIA H100 SXM5 datasheet: HBM3 3.35 TB/s; dense tensor-core FP8 1979,
# BF16/FP16 989, TF32 494.5 TFLOP/s; CUDA-core FP32 67, FP64 34 TFLOP/s.
H100_SXM = Device(
    name="H100-SXM",
    hbm_bytes_per_s=3.35e12,
    flops_per_s={
        "fp8": 1979e12,
        "bf16": 989e12,
        "tf32": 494.5e12,
        "fp32": 67e12,
        "fp64": 34e12,
    },
)


@dataclass(frozen=True)
class Model:
    """What an op must do at one shape: HBM bytes, FLOPs (of ``precision``), kernels."""

    bytes: float
    flops: float = 0.0
    precision: str = "fp32"
    kernels: int = 1

    def seconds(self, device: Device = H100_SXM) -> float:
        """Roofline lower bound: max(memory time, math time) + launch floor per kernel."""
        if self.precision not in device.flops_per_s:
            raise ValueError(
                f"precision: expected one of {sorted(device.flops_per_s)}, got {self.precision!r}"
            )
        memory = self.bytes / device.hbm_bytes_per_s
        math = self.flops / device.flops_per_s[self.precision]
        return max(memory, math) + self.kernels * device.launch_s

    def bound(self, device: Device = H100_SXM) -> str:
        """Which ceiling binds: "memory", "compute" or "launch" (both below the floor)."""
        memory = self.bytes / device.hbm_bytes_per_s
        math = self.flops / device.flops_per_s[self.precision]
        if max(memory, math) < self.kernels * device.launch_s:
            return "launch"
        return "memory" if memory >= math else "compute"
