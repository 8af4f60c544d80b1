# Planted bugs in csrc/routing/codec.cu that tests/test_routing_codec.py must catch
# (CODEC_MUTANTS there), compiled into _C_emu by cmake/emu.cmake (compass_emu_mutant).
set(_rc csrc/routing/codec.cu)
compass_emu_mutant(codec_vals_no_barrier KERNEL ${_rc} FILE ${_rc} ENTRIES encode_sets_cuda
  FIND "  vals[threadIdx.x] = v<semicolon>\n  __syncthreads()<semicolon>"
  REPLACE "  vals[threadIdx.x] = v<semicolon>")
compass_emu_mutant(codec_table_scan_inclusive KERNEL ${_rc} FILE ${_rc} ENTRIES encode_sets_cuda
  FIND "threadIdx.x > 0 ? scan[threadIdx.x - 1] : 0"
  REPLACE "scan[threadIdx.x]")
compass_emu_mutant(codec_tail_word_dropped KERNEL ${_rc} FILE ${_rc} ENTRIES encode_sets_cuda
  FIND "const int64_t words = (block_bits + 63) / 64"
  REPLACE "const int64_t words = block_bits / 64")
compass_emu_mutant(codec_dup_check_off KERNEL ${_rc} FILE ${_rc} ENTRIES encode_sets_cuda
  FIND "ok = below_sum == kk * (kk - 1) / 2"
  REPLACE "ok = below_sum >= 0")
