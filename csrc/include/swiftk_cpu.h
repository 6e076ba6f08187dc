/* swiftk CPU C ABI: the CPU decode kernels (kernels/cpu/: cpu_decode.cpp with the layer loop and the float matmul,
 * cpu_quant.cpp and cpu_qdot.cpp with the GGUF block matmuls, cpu_pool.cpp with their thread pool), callable from
 * any C/C++ host and any of its threads, no Python or torch needed. The sibling of swiftk.h (the CUDA kernels).
 *
 * Build: kernels/cpu/CMakeLists.txt, one shared library per ISA variant (kernels/cpu/variants.json: -march=native,
 * AVX-512 VNNI, AVX-VNNI, AVX2+FMA or portable; the vector width is chosen at compile time). swiftk's install builds
 * it into swiftk/_native/ and the Python runtime loads it through ctypes (swiftk/runtime/ops/native.py), filling the
 * layer table in swiftk/runtime/weights.py `fused_layer_table`; examples/CMakeLists.txt adds the same folder.
 *
 * Conventions: every tensor is dense, row-major, little-endian, and every shape is in ELEMENTS. Activations, norms,
 * biases and scales are float32, the KV cache float32 or float16 (SWK_KV_*); matrices are [N, K] (out, in) of a weight type below. Functions
 * return SWK_CPU_OK, or SWK_CPU_ERR_ARG when an argument is invalid (then nothing is written). nthreads >= 1
 * threads of the library's own pool (one per process, shared by every calling thread; the calling thread is one of
 * them). Results are batch invariant: a row's output never depends on M / T or the thread count.
 */
#ifndef SWIFTK_CPU_H_
#define SWIFTK_CPU_H_

#include <stdint.h>

#ifndef SWIFTK_API
#if defined(_WIN32)
#define SWIFTK_API __declspec(dllexport)
#else
#define SWIFTK_API __attribute__((visibility("default")))
#endif
#endif

#ifdef __cplusplus
extern "C" {
#endif

#define SWK_CPU_OK 0
#define SWK_CPU_ERR_ARG (-1)
#define SWK_CPU_ERR_NOMEM (-2)   /* swk_layers: a buffer could not be allocated (h and the cache partly written) */

/* Weight types of a matrix W [N, K]. */
#define SWK_W_FLOAT32 0  /* float32 */
#define SWK_W_BFLOAT16 1 /* bfloat16 bits (uint16, the top half of a float32) */
#define SWK_W_INT8 2     /* int8, row n times a float32 scale[n]: W ~= q * scale[:, None] (symmetric per row) */
#define SWK_W_BLOCKS 3   /* swk_layers only: GGUF block formats, the address an int64 descriptor (see swk_layers) */
/* In a block descriptor, a ggml type with this bit set runs with int8 activations (kernels/cpu/cpu_qdot.cpp: each
 * activation row quantized per 32 elements, integer dot products) instead of float32 ones (kernels/cpu/cpu_quant.cpp),
 * on rows packed by swk_qi_repack (kernels/cpu/cpu_qdot.cpp: int swk_qi_repack(int type, const void* src, int64_t N,
 * int64_t K, void* dst), the same bytes permuted: rows in groups of 8 with each block's fields side by side). */
#define SWK_Q_INT8_ACT 256

/* KV cache element types (swk_layers' kv_type). float16: k and v rounded to nearest even when written, widened
 * exactly to float32 when read, so attention runs the float32 arithmetic on the values the cache holds. */
#define SWK_KV_FLOAT32 0
#define SWK_KV_FLOAT16 1

/* Skinny matmul for decoding (M of a few rows up to ~32; any M works):
 *   y[M, N] = x[M, K] @ W[N, K]^T            (wt SWK_W_FLOAT32 / SWK_W_BFLOAT16, scale must be NULL)
 *   y[m, n] = scale[n] * sum_k x[m, k] q[n, k] (wt SWK_W_INT8, scale [N] float32 required)
 * x, y float32; W read once for all M rows. Returns SWK_CPU_ERR_ARG for NULL pointers, M/K/N < 1, an unknown wt,
 * or a scale given/missing against wt. */
SWIFTK_API int swk_linear(const float* x, int64_t M, int64_t K, const void* w, int wt, const float* scale,
                          int64_t N, float* y, int nthreads);

/* out[M, k] = indices of the k largest values of each row of x[M, V] (float32), larger first, equal values by
 * lower index, NaN above every number (torch.topk/argmax order); k = 1 is the greedy choice. 1 <= k <= min(V, 64);
 * else SWK_CPU_ERR_ARG. */
SWIFTK_API int swk_topk_rows(const float* x, int64_t M, int64_t V, int k, int64_t* out);

/* Greedy acceptance of a verified tree: node i (parents[0] = -1, 0 <= parents[i] < i) is accepted when its parent
 * was and tokens[i] is the argmax (the order above) of the parent's row of x[N, V]; the deepest accepted node wins,
 * the lowest index among equally deep ones. Writes path[0 .. L) = root .. deepest and *bonus = the deepest's argmax;
 * returns L, or -1 on bad arguments (nothing written). */
SWIFTK_API int64_t swk_greedy_path(const float* x, int64_t N, int64_t V, const int64_t* parents,
                                   const int64_t* tokens, int64_t* path, int64_t* bonus);

/* Float32 lanes per vector of this build: 16 (AVX-512) or 8 (AVX2). */
SWIFTK_API int swk_vector_width(void);

/* Layer table: per layer, SWK_LAYER_TABLE_WIDTH addresses (uint64_t, i.e. (uintptr_t)pointer) in this order.
 * D hidden, H query heads, KV kv heads (H % KV == 0), hd head_dim (even), I intermediate size, S_max max_slots. */
enum swk_layer_ptr {
  SWK_P_ATTN_NORM = 0,  /* float32 [D]: input_layernorm weight */
  SWK_P_WQKV = 1,       /* [(H + 2 KV) hd, D]: q_proj, k_proj, v_proj rows stacked (weight type wtypes[4l + 0]) */
  SWK_P_WQKV_SCALE = 2, /* float32 [(H + 2 KV) hd] for SWK_W_INT8, else 0 */
  SWK_P_BQKV = 3,       /* float32 [(H + 2 KV) hd] q|k|v bias (Qwen2), or 0 for none */
  SWK_P_WO = 4,         /* [D, H hd]: o_proj (wtypes[4l + 1]) */
  SWK_P_WO_SCALE = 5,   /* float32 [D] or 0 */
  SWK_P_MLP_NORM = 6,   /* float32 [D]: post_attention_layernorm weight */
  SWK_P_WGU = 7,        /* [2 I, D]: gate_proj rows then up_proj rows (wtypes[4l + 2]) */
  SWK_P_WGU_SCALE = 8,  /* float32 [2 I] or 0 */
  SWK_P_WDOWN = 9,      /* [D, I]: down_proj (wtypes[4l + 3]) */
  SWK_P_WDOWN_SCALE = 10, /* float32 [D] or 0 */
  SWK_P_KV = 11,        /* [2, KV, S_max, hd] of kv_type: this layer's cache, K plane then V plane (read, written) */
  SWK_LAYER_TABLE_WIDTH = 12
};

/* The decoder-layer loop of a LLaMA/Qwen2 model for T new tokens (1 <= T; made for T <= 32), all n_layers layers
 * of the table in one call, updating the residual stream h [T, D] in place. Per layer l (unless skipped):
 *   attention (skipped iff flags[2l]):   x = rmsnorm(h) * attn_norm; qkv = x @ Wqkv^T (+ bqkv); rotate-half RoPE
 *     (HF layout) of the q and k heads with cos/sin of the token; k, v written to cache slot slots[t];
 *     h += softmax(q . K^T * scale over the slots s < S with vis[t][s] != 0) V @ Wo^T   (GQA: head h uses kv h/(H/KV))
 *   MLP (skipped iff flags[2l + 1]):     x = rmsnorm(h) * mlp_norm; [g|u] = x @ Wgu^T; h += (silu(g) * u) @ Wdown^T
 * rmsnorm(h) = h / sqrt(mean(h^2) + eps). The final norm and LM head are the caller's (swk_linear).
 *   table   [n_layers, SWK_LAYER_TABLE_WIDTH] addresses (offset the pointer to start at a later layer)
 *   wtypes  [n_layers, 4] int: weight types (SWK_W_*) of Wqkv, Wo, Wgu, Wdown; SWK_W_BLOCKS: the weight address
 *           is an int64 descriptor {n_parts, (address, ggml type [| SWK_Q_INT8_ACT], rows) per part}: row groups
 *           of GGUF blocks stacked in order, computed by the library's swk_q_linear_ld
 *   flags   [n_layers, 2] bytes: attention / MLP sublayer skipped (all 0 for the full model)
 *   slots   [T] int64 in [0, max_slots): cache slot each new token's k, v are written to
 *   cos_t, sin_t [T, hd/2] float32: cos/sin(position[t] * inv_freq[i]), inv_freq[i] = theta^(-2i/hd)
 *   vis     [T, S] bytes: token t attends slot s; every row must see at least one slot; 1 <= S <= max_slots
 *           (a decode step at position p in slot p: T = 1, S = p + 1, all ones)
 *   scale   attention scale, usually 1/sqrt(hd); eps the RMSNorm epsilon
 *   kv_type SWK_KV_FLOAT32 or SWK_KV_FLOAT16: the element type of every cache the call reads and writes
 * Returns SWK_CPU_OK, SWK_CPU_ERR_ARG (bad shape, NULL pointer, slot out of range, a token seeing no slot; nothing
 * computed) or SWK_CPU_ERR_NOMEM. */
SWIFTK_API int swk_layers(int64_t n_layers, const uint64_t* table, const int* wtypes, const uint8_t* flags, int64_t T,
                          int64_t D, int64_t H, int64_t KV, int64_t hd, int64_t I, float eps, float scale,
                          int64_t max_slots, const int64_t* slots, const float* cos_t, const float* sin_t,
                          const uint8_t* vis, int64_t S, float* h, int nthreads, int kv_type);

/* swk_layers over the rows of several sequences, each with its own KV cache, in one pass (every weight read once for
 * all of them): row t reads and writes the caches kvs[row_cache[t] * n_layers + l] (layer l's [2, KV, max_slots,
 * hd] of kv_type; the table's KV entries are not read); slots[t] and vis[t] refer to its own cache's slots. row_cache
 * [T] is nondecreasing in [0, n_caches): each sequence's rows are contiguous. A row's result equals the one it gets
 * in a swk_layers pass of its own sequence. */
SWIFTK_API int swk_layers_multi(int64_t n_layers, const uint64_t* table, const int* wtypes, const uint8_t* flags,
                                int64_t T, int64_t D, int64_t H, int64_t KV, int64_t hd, int64_t I, float eps,
                                float scale, int64_t max_slots, const int64_t* slots, const float* cos_t,
                                const float* sin_t, const uint8_t* vis, int64_t S, float* h, int nthreads,
                                int64_t n_caches, const uint64_t* kvs, const int64_t* row_cache, int kv_type);

/* cache [planes, S, row_bytes] (planes = layers x 2 x KV heads, a row one slot's hd elements of any type): in every
 * plane, row src[i] -> row dst[i] for i < n, all sources read before any destination is written. 0, -1 on bad
 * arguments (nothing written), -2 out of memory. */
SWIFTK_API int swk_kv_commit(void* cache, int64_t planes, int64_t S, int64_t row_bytes, const int64_t* src,
                             const int64_t* dst, int64_t n);

/* 1 (the default): swk_layers attends for passes of several tokens in tiles of keys shared by their rows; 0: per
 * token, as a one-token step. The results are the same bits; the switch is for A/B timings. */
SWIFTK_API void swk_set_attention_tiles(int on);

/* SWK_LAYER_TABLE_WIDTH of the built library (check it against the header's before filling a table). */
SWIFTK_API int swk_layer_table_width(void);

/* One draft step of the MoA drafter (kernels/cpu/cpu_moa.cpp, swiftk/moa): w the drafter's 15 float32 tensors in
 * the order cpu_moa.cpp lists, dims {hidden, width, heads, mlp, lsa_dim}, emb [hidden] the token's embedding at position p,
 * sa_k / sa_v [> p, width] the stream's keys and values (row p written), ca_k / ca_v [n, width] the verified
 * states', anchor [width] or NULL; out [hidden]. 0, -1 on bad arguments, -2 out of memory. */
SWIFTK_API int swk_moa_step(const float* const* w, const int64_t* dims, const float* emb, int64_t p, int64_t n,
                            float* sa_k, float* sa_v, const float* ca_k, const float* ca_v, const float* anchor,
                            float* out);

/* The MoA drafter's catch-up on verified positions p0 .. p0 + t - 1 (same w and dims): feats [t, lsa_dim] their LSA
 * features, emb [t, hidden] their embeddings; writes those rows of ca_k / ca_v and sa_k / sa_v [>= p0 + t, width].
 * 0, -1 on bad arguments, -2 out of memory. */
SWIFTK_API int swk_moa_ingest(const float* const* w, const int64_t* dims, const float* feats, const float* emb,
                              int64_t p0, int64_t t, float* ca_k, float* ca_v, float* sa_k, float* sa_v);

/* Threads of the regions that take no count from their caller (the block matmuls); returns the previous value. */
SWIFTK_API int swk_set_threads(int n);

/* Worker threads the pool has started (regions from every host thread share them). */
SWIFTK_API int swk_pool_workers(void);

/* Token Recycling's update in one call: the top k of rows rows[m] of x[N, V] (float32, swk_topk_rows' order) go,
 * as int32, to row table_rows[m] of table[T, k] (m in order: a token read twice keeps its later row). 0, or -1 on
 * bad arguments, an index out of range or no memory (nothing written). */
SWIFTK_API int swk_topk_into(const float* x, int64_t N, int64_t V, const int64_t* rows, int64_t M, int k,
                             int32_t* table, int64_t T, const int64_t* table_rows);

/* The corpus n-gram chain (kernels/cpu/cpu_ngram.cpp): tables[4 (n - 1) + f] for n = 1..max_n are keys, next
 * token, its count and the key's count (int64, sorted keys, lens[n - 1] entries; `bits` bits a token); ctx the last
 * nctx <= max_n tokens; prob[nbuckets] the estimate per bucket, or NULL. Writes up to k tokens and their buckets
 * and returns how many (-1 on bad arguments); with prob it stops before a token whose chain value falls under
 * `floor` (the first token always stays). */
SWIFTK_API int swk_ngram_propose(const int64_t* const* tables, const int64_t* lens, int max_n, int bits,
                                 const int64_t* ctx, int nctx, int k, const double* prob, int nbuckets, double floor,
                                 int64_t* out_tok, int32_t* out_bucket);

/* GGUF blocks (kernels/cpu/cpu_quant.cpp): the elements per block and bytes per block of ggml type `type` (-1 for
 * a type the library does not handle), and the SIMD width the build was compiled for (512, 256 or 0). */
SWIFTK_API int swk_q_block_size(int type);
SWIFTK_API int swk_q_type_size(int type);
SWIFTK_API int swk_q_isa(void);

/* out[n] (float32) = the n elements that `blocks` of ggml type `type` hold; n a multiple of the block size.
 * 0; -1 bad pointer or size; -2 unknown type; -3 n not a multiple of the block size. */
SWIFTK_API int swk_q_dequant(int type, const void* blocks, int64_t n, float* out);

/* y[M, N] (row stride ldy >= N) = x[M, K] @ W^T for W [N, K] in ggml type `type`'s blocks, float32 activations;
 * type | SWK_Q_INT8_ACT: int8 activations on rows packed by swk_qi_repack (swk_qi_linear_ld). swk_q_linear: ldy = N.
 * Return codes as swk_q_dequant's, plus -4 out of memory (y incomplete). */
SWIFTK_API int swk_q_linear_ld(const float* x, int64_t M, int64_t K, const void* w, int type, int64_t N, float* y,
                               int64_t ldy);
SWIFTK_API int swk_q_linear(const float* x, int64_t M, int64_t K, const void* w, int type, int64_t N, float* y);

/* Int8 activations (kernels/cpu/cpu_qdot.cpp): the matmul on repacked rows, its scalar reference (the same bits),
 * the activation quantizer (q [M, K] int8, d [M, K / 32] float32 scales; simd 0: the reference path), the SIMD
 * level built (3 AVX-512, 2 VNNI, 1 AVX2, 0 none), the repacking of a [N, K] matrix, and the unpacking of rows
 * ids[n] of a repacked matrix back to the file's layout. Return codes as swk_q_linear_ld's. */
SWIFTK_API int swk_qi_linear_ld(const float* x, int64_t M, int64_t K, const void* w, int type, int64_t N, float* y,
                                int64_t ldy);
SWIFTK_API int swk_qi_linear_ref(const float* x, int64_t M, int64_t K, const void* w, int type, int64_t N, float* y,
                                 int64_t ldy);
SWIFTK_API int swk_qi_quantize(const float* x, int64_t M, int64_t K, int simd, int8_t* q, float* d);
SWIFTK_API int swk_qi_isa(void);
SWIFTK_API int swk_qi_repack(int type, const void* src, int64_t N, int64_t K, void* dst);
SWIFTK_API int swk_qi_unpack_rows(int type, const void* packed, int64_t N, int64_t K, const int64_t* ids, int64_t n,
                                  void* out);

#ifdef __cplusplus
}
#endif

#endif /* SWIFTK_CPU_H_ */
