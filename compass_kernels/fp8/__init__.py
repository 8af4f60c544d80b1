"""FP8 blockwise quantization and the FP8 grouped expert GEMM (ck.fp8)."""

from compass_kernels.fp8.grouped_gemm import grouped_gemm  # noqa: F401
