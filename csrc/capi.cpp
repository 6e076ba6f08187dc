// C ABI (csrc/include/swiftk.h): argument checks, then the launchers in kernels/cuda/*.cu.
#include "swiftk.h"

#include <cstdio>
#include <string>

#include "swiftk_cuda.cuh"

namespace {

thread_local std::string g_last_error;

int fail(int status, const std::string& msg) {
  g_last_error = msg;
  return status;
}

bool valid_dtype(int dtype) { return dtype == SWIFTK_FLOAT32 || dtype == SWIFTK_FLOAT16 || dtype == SWIFTK_BFLOAT16; }

int from_cuda(cudaError_t err, const char* op) {
  if (err == cudaSuccess) return SWIFTK_OK;
  return fail(SWIFTK_ERR_CUDA, std::string(op) + ": CUDA error " + cudaGetErrorName(err) + ": " +
                                   cudaGetErrorString(err));
}

}  // namespace

extern "C" {

SWIFTK_API int swiftk_abi_version(void) { return SWIFTK_ABI_VERSION; }

SWIFTK_API const char* swiftk_status_string(int status) {
  switch (status) {
    case SWIFTK_OK: return "ok";
    case SWIFTK_ERR_INVALID_ARGUMENT: return "invalid argument";
    case SWIFTK_ERR_UNSUPPORTED: return "unsupported";
    case SWIFTK_ERR_CUDA: return "CUDA error";
    default: return "unknown status";
  }
}

SWIFTK_API const char* swiftk_last_error(void) { return g_last_error.c_str(); }

SWIFTK_API int swiftk_tree_attention(const void* q, const void* k_cache, const void* v_cache, void* out,
                                     const int32_t* tree_bits, int64_t T, int64_t H, int64_t KV, int64_t head_dim,
                                     int64_t prefix_len, int64_t q_stride_t, int64_t q_stride_h,
                                     int64_t k_stride_h, int64_t k_stride_s, int64_t v_stride_h, int64_t v_stride_s,
                                     int64_t out_stride_t, int64_t out_stride_h, int64_t bits_stride_t, float scale,
                                     int dtype, void* stream) {
  const char* op = "swiftk_tree_attention";
  if (!valid_dtype(dtype)) return fail(SWIFTK_ERR_INVALID_ARGUMENT, std::string(op) + ": unknown dtype code");
  if (T < 0 || H <= 0 || KV <= 0 || head_dim <= 0 || prefix_len < 0)
    return fail(SWIFTK_ERR_INVALID_ARGUMENT, std::string(op) + ": negative or zero size");
  if (H % KV != 0)
    return fail(SWIFTK_ERR_INVALID_ARGUMENT, std::string(op) + ": query heads not a multiple of kv heads");
  if (head_dim > SWIFTK_MAX_HEAD_DIM)
    return fail(SWIFTK_ERR_UNSUPPORTED, std::string(op) + ": head_dim > " + std::to_string(SWIFTK_MAX_HEAD_DIM));
  if (T > 0x7fffffff || H > 65535) return fail(SWIFTK_ERR_UNSUPPORTED, std::string(op) + ": grid too large");
  if (T > 0 && (!q || !k_cache || !v_cache || !out || !tree_bits))
    return fail(SWIFTK_ERR_INVALID_ARGUMENT, std::string(op) + ": null pointer");
  if (bits_stride_t < (T + 31) / 32)
    return fail(SWIFTK_ERR_INVALID_ARGUMENT, std::string(op) + ": tree_bits row stride < ceil(T/32)");
  swiftk::TreeAttnParams p{q, k_cache, v_cache, out, tree_bits, T, H, KV, head_dim, prefix_len,
                           q_stride_t, q_stride_h, k_stride_h, k_stride_s, v_stride_h, v_stride_s,
                           out_stride_t, out_stride_h, bits_stride_t, scale};
  return from_cuda(swiftk::launch_tree_attention(dtype, p, static_cast<cudaStream_t>(stream)), op);
}

SWIFTK_API int swiftk_kv_commit(void* cache, const int64_t* src_slots, const int64_t* dst_slots, int64_t n,
                                int64_t L, int64_t KV, int64_t head_dim, int64_t stride_l, int64_t stride_c,
                                int64_t stride_h, int64_t stride_s, int dtype, void* stream) {
  const char* op = "swiftk_kv_commit";
  if (!valid_dtype(dtype)) return fail(SWIFTK_ERR_INVALID_ARGUMENT, std::string(op) + ": unknown dtype code");
  if (n < 0 || L < 0 || KV < 0 || head_dim <= 0)
    return fail(SWIFTK_ERR_INVALID_ARGUMENT, std::string(op) + ": negative or zero size");
  if (n == 0 || L == 0 || KV == 0) return SWIFTK_OK;
  if (!cache || !src_slots || !dst_slots) return fail(SWIFTK_ERR_INVALID_ARGUMENT, std::string(op) + ": null pointer");
  const int64_t elem = dtype == SWIFTK_FLOAT32 ? 4 : 2;
  if (n * elem > swiftk::kKvCommitSmemBytes)
    return fail(SWIFTK_ERR_UNSUPPORTED, std::string(op) + ": too many slots for one launch (" + std::to_string(n) +
                                            ")");
  if (L * 2 * KV > 0x7fffffff) return fail(SWIFTK_ERR_UNSUPPORTED, std::string(op) + ": grid too large");
  swiftk::KvCommitParams p{cache, src_slots, dst_slots, n, L, KV, head_dim, stride_l, stride_c, stride_h, stride_s};
  return from_cuda(swiftk::launch_kv_commit(dtype, p, static_cast<cudaStream_t>(stream)), op);
}

SWIFTK_API int swiftk_fused_add_rmsnorm(const void* delta, const void* residual, const void* weight,
                                        const uint8_t* skip_flag, void* normed, void* new_residual, int64_t rows,
                                        int64_t D, int64_t delta_stride, int64_t residual_stride,
                                        int64_t normed_stride, int64_t new_residual_stride, float eps, int dtype,
                                        void* stream) {
  const char* op = "swiftk_fused_add_rmsnorm";
  if (!valid_dtype(dtype)) return fail(SWIFTK_ERR_INVALID_ARGUMENT, std::string(op) + ": unknown dtype code");
  if (rows < 0 || D <= 0) return fail(SWIFTK_ERR_INVALID_ARGUMENT, std::string(op) + ": negative or zero size");
  if (rows == 0) return SWIFTK_OK;
  if (rows > 0x7fffffff) return fail(SWIFTK_ERR_UNSUPPORTED, std::string(op) + ": too many rows");
  if (!residual || !weight || !normed) return fail(SWIFTK_ERR_INVALID_ARGUMENT, std::string(op) + ": null pointer");
  if (delta && !new_residual)
    return fail(SWIFTK_ERR_INVALID_ARGUMENT, std::string(op) + ": new_residual is required when delta is given");
  swiftk::AddRmsNormParams p{delta, residual, weight, skip_flag, normed, new_residual, rows, D,
                             delta_stride, residual_stride, normed_stride, new_residual_stride, eps};
  return from_cuda(swiftk::launch_add_rmsnorm(dtype, p, static_cast<cudaStream_t>(stream)), op);
}

}  // extern "C"
