// ck.routing entry points: one line per backend.
#include "compass_pybind.h"
#include <tuple>

#include "routing/codec_args.h"
#include "routing/routing_api.h"

namespace compass {
namespace routing {

namespace {
// The encode op's checks alone, for its GPU backend (Triton:
// compass_kernels/routing/triton_setcode.py): -> (rows per pack, bits per pack,
// C(num_experts, top_k)).
std::tuple<int64_t, int64_t, uint64_t> check_encode_sets(COMPASS_ENCODE_SETS_ARGS) {
  COMPASS_NAME_ARGS(ids, missing, payload, status, table);
  const setcode::PackLayout l =
      check_encode_sets_args(ids, num_experts, missing, payload, status, table);
  return {l.group, l.bits, l.n};
}
}  // namespace

void bind(pybind11::module_& root) {
  auto m = root.def_submodule("routing", "route set codec");
  COMPASS_DEF_NOGIL(m, encode_sets_cpu, "(ids [rows, K] uint8|int16, num_experts, missing [rows] bool|None, out uint8, impl 0 auto|1 "
                    "baseline): set coding");
  COMPASS_DEF_NOGIL(m, decode_sets_cpu, "(data uint8, num_experts, ids [rows, K] out, impl 0 auto|1 baseline|2 AVX2 without R12)");
  const char* enc = "(ids [rows, K] uint8|int16, num_experts, missing [rows] bool|None, payload "
                    "uint8, status int64[2], table int64[K*E][, stream]): the encode op";
  COMPASS_DEF_NOGIL(m, encode_sets_op_cpu, enc);
  COMPASS_DEF(m, check_encode_sets,
              "(the encode op's arguments and outputs) -> (rows per pack, bits per pack, "
              "C(num_experts, top_k)): its checks alone (the Triton backend)");
  m.def("set_code_group", &set_code_group, "(num_experts, top_k) -> rows per pack");
  m.def("set_code_threads", &set_code_threads, "(threads, 0: OpenMP default) -> the previous");
  m.def("set_code_pack_bits", &set_code_pack_bits, "(num_experts, top_k) -> bits per pack");
  m.def("set_code_bytes", &set_code_bytes, "(rows, num_experts, top_k) -> payload bytes");
  m.def("set_code_decode_path", &set_code_decode_path,
        "(num_experts, top_k, uint8_ids, impl) -> the unrank decode runs: r12|hint|bisect|none");
}

}  // namespace routing
}  // namespace compass
