# Planted bugs in csrc/fp8/grouped_args.cu that tests/test_fp8_gemm_args.py must catch
# (MUTANTS there), compiled into _C_emu by cmake/emu.cmake (compass_emu_mutant).
set(_fp8g csrc/fp8/grouped_args.cu)
compass_emu_mutant(fp8_gemm_args_guard_off_by_one KERNEL ${_fp8g} FILE ${_fp8g}
  ENTRIES grouped_args_cuda
  FIND "if (e >= experts) return"
  REPLACE "if (e > experts) return")
compass_emu_mutant(fp8_gemm_args_runs_to_end KERNEL ${_fp8g} FILE ${_fp8g}
  ENTRIES grouped_args_cuda
  FIND "off[e], off[e + 1], shapes"
  REPLACE "off[e], off[experts], shapes")
