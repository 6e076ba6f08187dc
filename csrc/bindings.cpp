// pybind11 module swiftk._C: the C ABI with Python ints for device pointers and the CUDA stream.
// Function names mirror the C ABI without the "swiftk_" prefix. Invalid arguments raise ValueError,
// CUDA failures RuntimeError.
#include <pybind11/pybind11.h>

#include <cstdint>
#include <stdexcept>
#include <string>

#include "swiftk.h"

namespace py = pybind11;

namespace {

template <typename T>
T* ptr(std::uintptr_t p) {
  return reinterpret_cast<T*>(p);
}

void check(int status) {
  if (status == SWIFTK_OK) return;
  const std::string msg = swiftk_last_error();
  if (status == SWIFTK_ERR_CUDA) throw std::runtime_error(msg);
  throw py::value_error(msg);
}

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "swiftk CUDA kernels (tree attention, KV commit, skip-aware residual+RMSNorm); see csrc/include/swiftk.h";
  m.attr("ABI_VERSION") = swiftk_abi_version();
  m.attr("FLOAT32") = static_cast<int>(SWIFTK_FLOAT32);
  m.attr("FLOAT16") = static_cast<int>(SWIFTK_FLOAT16);
  m.attr("BFLOAT16") = static_cast<int>(SWIFTK_BFLOAT16);
  m.attr("MAX_HEAD_DIM") = SWIFTK_MAX_HEAD_DIM;

  m.def(
      "tree_attention",
      [](std::uintptr_t q, std::uintptr_t k, std::uintptr_t v, std::uintptr_t out, std::uintptr_t bits, int64_t T,
         int64_t H, int64_t KV, int64_t hd, int64_t prefix_len, int64_t sqt, int64_t sqh, int64_t skh, int64_t sks,
         int64_t svh, int64_t svs, int64_t sot, int64_t soh, int64_t sbt, float scale, int dtype,
         std::uintptr_t stream) {
        check(swiftk_tree_attention(ptr<const void>(q), ptr<const void>(k), ptr<const void>(v), ptr<void>(out),
                                    ptr<const int32_t>(bits), T, H, KV, hd, prefix_len, sqt, sqh, skh, sks, svh, svs,
                                    sot, soh, sbt, scale, dtype, ptr<void>(stream)));
      },
      py::arg("q"), py::arg("k_cache"), py::arg("v_cache"), py::arg("out"), py::arg("tree_bits"), py::arg("T"),
      py::arg("H"), py::arg("KV"), py::arg("head_dim"), py::arg("prefix_len"), py::arg("q_stride_t"),
      py::arg("q_stride_h"), py::arg("k_stride_h"), py::arg("k_stride_s"), py::arg("v_stride_h"),
      py::arg("v_stride_s"), py::arg("out_stride_t"), py::arg("out_stride_h"), py::arg("bits_stride_t"),
      py::arg("scale"), py::arg("dtype"), py::arg("stream"));

  m.def(
      "kv_commit",
      [](std::uintptr_t cache, std::uintptr_t src, std::uintptr_t dst, int64_t n, int64_t L, int64_t KV, int64_t hd,
         int64_t s_l, int64_t s_c, int64_t s_h, int64_t s_s, int dtype, std::uintptr_t stream) {
        check(swiftk_kv_commit(ptr<void>(cache), ptr<const int64_t>(src), ptr<const int64_t>(dst), n, L, KV, hd, s_l,
                               s_c, s_h, s_s, dtype, ptr<void>(stream)));
      },
      py::arg("cache"), py::arg("src_slots"), py::arg("dst_slots"), py::arg("n"), py::arg("L"), py::arg("KV"),
      py::arg("head_dim"), py::arg("stride_l"), py::arg("stride_c"), py::arg("stride_h"), py::arg("stride_s"),
      py::arg("dtype"), py::arg("stream"));

  m.def(
      "fused_add_rmsnorm",
      [](std::uintptr_t delta, std::uintptr_t residual, std::uintptr_t weight, std::uintptr_t skip,
         std::uintptr_t normed, std::uintptr_t new_residual, int64_t rows, int64_t D, int64_t s_delta, int64_t s_res,
         int64_t s_normed, int64_t s_newres, float eps, int dtype, std::uintptr_t stream) {
        check(swiftk_fused_add_rmsnorm(ptr<const void>(delta), ptr<const void>(residual), ptr<const void>(weight),
                                       ptr<const uint8_t>(skip), ptr<void>(normed), ptr<void>(new_residual), rows, D,
                                       s_delta, s_res, s_normed, s_newres, eps, dtype, ptr<void>(stream)));
      },
      py::arg("delta"), py::arg("residual"), py::arg("weight"), py::arg("skip_flag"), py::arg("normed"),
      py::arg("new_residual"), py::arg("rows"), py::arg("D"), py::arg("delta_stride"), py::arg("residual_stride"),
      py::arg("normed_stride"), py::arg("new_residual_stride"), py::arg("eps"), py::arg("dtype"), py::arg("stream"));
}
