/* swiftk C ABI: the CUDA kernels of swiftk callable from any C/C++ runtime, no Python needed.
 *
 * Every function takes raw device pointers, shapes and strides in ELEMENTS (not bytes), a dtype code and a
 * cudaStream_t passed as void* (NULL = default stream). It only enqueues work: nothing is synchronised.
 * The last dimension (head_dim / hidden) of every tensor must have unit stride.
 * Returns SWIFTK_OK or an error code; swiftk_last_error() gives this thread's message for the last failure.
 * Names mirror the Python module swiftk._C (swiftk_tree_attention <-> _C.tree_attention, ...).
 */
#ifndef SWIFTK_H_
#define SWIFTK_H_

#include <stdint.h>

#if defined(_WIN32)
#define SWIFTK_API __declspec(dllexport)
#else
#define SWIFTK_API __attribute__((visibility("default")))
#endif

#ifdef __cplusplus
extern "C" {
#endif

#define SWIFTK_ABI_VERSION 1

typedef enum swiftk_dtype {
  SWIFTK_FLOAT32 = 0,
  SWIFTK_FLOAT16 = 1,
  SWIFTK_BFLOAT16 = 2
} swiftk_dtype;

typedef enum swiftk_status {
  SWIFTK_OK = 0,
  SWIFTK_ERR_INVALID_ARGUMENT = 1, /* bad shape, stride, pointer or dtype */
  SWIFTK_ERR_UNSUPPORTED = 2,      /* valid but beyond the kernel's limits (e.g. head_dim > 256) */
  SWIFTK_ERR_CUDA = 3              /* the launch failed; see swiftk_last_error() */
} swiftk_status;

/* Maximum head_dim supported by swiftk_tree_attention. */
#define SWIFTK_MAX_HEAD_DIM 256

SWIFTK_API int swiftk_abi_version(void);
SWIFTK_API const char* swiftk_status_string(int status);
SWIFTK_API const char* swiftk_last_error(void);

/* Tree attention for T new tokens stored at cache slots [prefix_len, prefix_len + T).
 * q [T, H, head_dim]; k_cache, v_cache [KV, >= prefix_len + T, head_dim] (any head/slot strides, e.g. one layer of a
 * [L, 2, KV, S, hd] cache); out [T, H, head_dim]; tree_bits [T, ceil(T/32)] int32: query t sees new token j iff bit
 * j%32 of tree_bits[t][j/32] is set; every committed slot < prefix_len is visible. H % KV == 0 (GQA).
 * Decode is T = 1 with tree_bits = {1}; a causal chain is the lower triangle. */
SWIFTK_API int swiftk_tree_attention(const void* q, const void* k_cache, const void* v_cache, void* out,
                                     const int32_t* tree_bits, int64_t T, int64_t H, int64_t KV, int64_t head_dim,
                                     int64_t prefix_len, int64_t q_stride_t, int64_t q_stride_h,
                                     int64_t k_stride_h, int64_t k_stride_s, int64_t v_stride_h, int64_t v_stride_s,
                                     int64_t out_stride_t, int64_t out_stride_h, int64_t bits_stride_t, float scale,
                                     int dtype, void* stream);

/* KV commit: for every layer l, k|v c, kv head h and i < n: cache[l,c,h,dst[i]] = old cache[l,c,h,src[i]].
 * One launch for all layers; overlapping src/dst are safe (all reads of a plane precede its writes).
 * cache [L, 2, KV, S, head_dim] with the given strides; src_slots/dst_slots int64 [n] device arrays, values < S. */
SWIFTK_API int swiftk_kv_commit(void* cache, const int64_t* src_slots, const int64_t* dst_slots, int64_t n,
                                int64_t L, int64_t KV, int64_t head_dim, int64_t stride_l, int64_t stride_c,
                                int64_t stride_h, int64_t stride_s, int dtype, void* stream);

/* Skip-aware residual add + RMSNorm over `rows` rows of width D (all tensors of one dtype).
 *   new_residual = (skip_flag && *skip_flag) ? residual : residual + delta
 *   normed       = weight * round_to_dtype(new_residual * rsqrt(mean(new_residual^2) + eps))
 * delta == NULL gives plain RMSNorm of residual (new_residual unused, may be NULL). skip_flag: NULL or a device
 * byte read by the kernel, so one launch sequence serves every skip set. */
SWIFTK_API int swiftk_fused_add_rmsnorm(const void* delta, const void* residual, const void* weight,
                                        const uint8_t* skip_flag, void* normed, void* new_residual, int64_t rows,
                                        int64_t D, int64_t delta_stride, int64_t residual_stride,
                                        int64_t normed_stride, int64_t new_residual_stride, float eps, int dtype,
                                        void* stream);

#ifdef __cplusplus
}
#endif

#endif /* SWIFTK_H_ */
