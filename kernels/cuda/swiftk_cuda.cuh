// Shared device helpers and the launcher declarations the C ABI (csrc/capi.cpp) calls.
#pragma once

#ifdef __CUDACC_RTC__
// NVRTC (the CuPy backend, swiftk/runtime/ops/cupy_ops.py) has no host headers: the fixed-width types are all it needs.
typedef signed char int8_t;
typedef int int32_t;
typedef long long int64_t;
typedef unsigned char uint8_t;
#else
#include <cstdint>

#include <cuda_runtime_api.h>
#endif

namespace swiftk {

struct TreeAttnParams {
  const void* q;
  const void* k;
  const void* v;
  void* out;
  const int32_t* bits;
  int64_t T, H, KV, hd, prefix_len;
  int64_t sqt, sqh, skh, sks, svh, svs, sot, soh, sbt;
  float scale;
};

struct KvCommitParams {
  void* cache;
  const int64_t* src;
  const int64_t* dst;
  int64_t n, L, KV, hd;
  int64_t s_l, s_c, s_h, s_s;
};

struct AddRmsNormParams {
  const void* delta;
  const void* residual;
  const void* weight;
  const uint8_t* skip;
  void* normed;
  void* new_residual;
  int64_t rows, D;
  int64_t s_delta, s_res, s_normed, s_newres;
  float eps;
};

#ifndef __CUDACC_RTC__
// dtype codes are swiftk_dtype values; each returns the launch's cudaError_t.
cudaError_t launch_tree_attention(int dtype, const TreeAttnParams& p, cudaStream_t stream);
cudaError_t launch_kv_commit(int dtype, const KvCommitParams& p, cudaStream_t stream);
cudaError_t launch_add_rmsnorm(int dtype, const AddRmsNormParams& p, cudaStream_t stream);
#endif

// Shared memory budget of one kv_commit block (bytes); n * sizeof(dtype) must fit.
constexpr int64_t kKvCommitSmemBytes = 32 * 1024;

}  // namespace swiftk

#ifdef __CUDACC__
#include <cuda_bf16.h>
#include <cuda_fp16.h>

namespace swiftk {

template <typename T>
__device__ __forceinline__ float to_float(T x);
template <>
__device__ __forceinline__ float to_float<float>(float x) { return x; }
template <>
__device__ __forceinline__ float to_float<__half>(__half x) { return __half2float(x); }
template <>
__device__ __forceinline__ float to_float<__nv_bfloat16>(__nv_bfloat16 x) { return __bfloat162float(x); }

template <typename T>
__device__ __forceinline__ T from_float(float x);
template <>
__device__ __forceinline__ float from_float<float>(float x) { return x; }
template <>
__device__ __forceinline__ __half from_float<__half>(float x) { return __float2half_rn(x); }
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }

__device__ __forceinline__ float warp_sum(float v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// Sum over the block; every thread gets the result. `scratch` holds >= 32 floats.
__device__ __forceinline__ float block_sum(float v, float* scratch) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = (blockDim.x + 31) >> 5;
  v = warp_sum(v);
  __syncthreads();  // scratch may still be read from a previous call
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  float total = 0.f;
  for (int w = 0; w < nwarps; ++w) total += scratch[w];
  return total;
}

// Runs the statement with scalar_t bound to the dtype code; an unknown code returns cudaErrorInvalidValue.
#define SWIFTK_DISPATCH_DTYPE(code, ...)             \
  switch (code) {                                    \
    case 0: { using scalar_t = float; __VA_ARGS__; break; }         \
    case 1: { using scalar_t = __half; __VA_ARGS__; break; }        \
    case 2: { using scalar_t = __nv_bfloat16; __VA_ARGS__; break; } \
    default: return cudaErrorInvalidValue;           \
  }

}  // namespace swiftk
#endif  // __CUDACC__
