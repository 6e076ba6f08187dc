// One decode step of a LLaMA/Qwen2 model through swiftk's CPU C ABI (csrc/include/swiftk_cpu.h), no Python:
// swk_layers over every layer for one token (T = 1), the final RMSNorm here, swk_linear for the LM head; the
// logits are compared with reference logits.
//
// Usage: decode_step DIR [THREADS]. DIR holds manifest.txt (key=value lines) and raw little-endian arrays
// (tests/test_embed.py writes them from a swiftk model):
//   manifest: n_layers hidden heads kv_heads head_dim intermediate vocab max_slots pos eps scale tol
//             wtype (weight type of every matrix, SWK_W_*) qkv_bias (0/1)
//   x.bin [hidden] the token's embedding row; cos.bin, sin.bin [head_dim/2] at position pos;
//   layer<l>.{attn_norm,mlp_norm}.bin [hidden]; layer<l>.{wqkv,wo,wgu,wdown}.bin matrices of type wtype (+ .scale.bin
//   float32 per row for int8); layer<l>.bqkv.bin when qkv_bias; layer<l>.kv.bin [2, kv_heads, max_slots, head_dim]
//   the cache holding slots [0, pos); norm.bin [hidden]; lm_head.bin [vocab, hidden] (+ lm_head.scale.bin);
//   expected_logits.bin [vocab].
// Prints "max_abs_diff=<d> tol=<t>" and "argmax=<token>"; exits 0 when the logits match within tol, 1 when not,
// 2 on bad input.
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <fstream>
#include <map>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include "swiftk_cpu.h"

namespace {

struct Dir {
  std::string path;
  std::map<std::string, std::string> kv;

  explicit Dir(const std::string& p) : path(p) {
    std::ifstream f(p + "/manifest.txt");
    if (!f) throw std::runtime_error("cannot open " + p + "/manifest.txt");
    std::string line;
    while (std::getline(f, line)) {
      const size_t eq = line.find('=');
      if (line.empty() || line[0] == '#' || eq == std::string::npos) continue;
      kv[line.substr(0, eq)] = line.substr(eq + 1);
    }
  }
  std::string str(const std::string& k) const {
    auto it = kv.find(k);
    if (it == kv.end()) throw std::runtime_error("manifest.txt lacks " + k);
    return it->second;
  }
  int64_t i(const std::string& k) const { return std::stoll(str(k)); }
  float f(const std::string& k) const { return std::stof(str(k)); }

  // The whole file, which must hold exactly `bytes` bytes (a shape mismatch is an error, not a silent misread).
  std::vector<char> read(const std::string& name, size_t bytes) const {
    std::ifstream f(path + "/" + name, std::ios::binary | std::ios::ate);
    if (!f) throw std::runtime_error("cannot open " + name);
    const size_t n = (size_t)f.tellg();
    if (n != bytes)
      throw std::runtime_error(name + ": " + std::to_string(n) + " bytes, expected " + std::to_string(bytes));
    std::vector<char> buf(n);
    f.seekg(0);
    f.read(buf.data(), (std::streamsize)n);
    return buf;
  }
  std::vector<float> floats(const std::string& name, size_t n) const {
    std::vector<char> b = read(name, n * sizeof(float));
    std::vector<float> out(n);
    memcpy(out.data(), b.data(), b.size());
    return out;
  }
};

size_t wsize(int wt) { return wt == SWK_W_FLOAT32 ? 4 : wt == SWK_W_BFLOAT16 ? 2 : 1; }

// Every buffer a layer table points to; kept alive (and never reallocated) for as long as the table is used.
struct Store {
  std::vector<std::vector<char>> bufs;
  uint64_t keep(std::vector<char> b) {
    bufs.push_back(std::move(b));
    return (uint64_t)(uintptr_t)bufs.back().data();
  }
  uint64_t keep(std::vector<float> v) {
    std::vector<char> b(v.size() * sizeof(float));
    memcpy(b.data(), v.data(), b.size());
    return keep(std::move(b));
  }
};

int run(const std::string& dir_path, int nthreads) {
  const Dir d(dir_path);
  const int64_t L = d.i("n_layers"), D = d.i("hidden"), H = d.i("heads"), KV = d.i("kv_heads"), hd = d.i("head_dim");
  const int64_t I = d.i("intermediate"), V = d.i("vocab"), S_max = d.i("max_slots"), pos = d.i("pos");
  const float eps = d.f("eps"), scale = d.f("scale"), tol = d.f("tol");
  const int wt = (int)d.i("wtype");
  const bool bias = d.i("qkv_bias") != 0;
  if (wt < SWK_W_FLOAT32 || wt > SWK_W_INT8) throw std::runtime_error("wtype must be 0, 1 or 2");
  if (pos < 0 || pos >= S_max) throw std::runtime_error("pos must lie in [0, max_slots)");
  if (swk_layer_table_width() != SWK_LAYER_TABLE_WIDTH)
    throw std::runtime_error("the library's layer table differs from swiftk_cpu.h");

  // The layer table: SWK_LAYER_TABLE_WIDTH addresses per layer in SWK_P_* order, 0 for an absent bias or scale.
  Store st;
  std::vector<uint64_t> table(L * SWK_LAYER_TABLE_WIDTH, 0);
  std::vector<int> wtypes(L * 4, wt);
  const int64_t NQKV = (H + 2 * KV) * hd;
  for (int64_t l = 0; l < L; l++) {
    uint64_t* P = table.data() + l * SWK_LAYER_TABLE_WIDTH;
    const std::string p = "layer" + std::to_string(l) + ".";
    auto matrix = [&](const char* name, int64_t N, int64_t K, int slot, int scale_slot) {
      P[slot] = st.keep(d.read(p + name + ".bin", (size_t)(N * K) * wsize(wt)));
      if (wt == SWK_W_INT8) P[scale_slot] = st.keep(d.floats(p + name + ".scale.bin", N));
    };
    P[SWK_P_ATTN_NORM] = st.keep(d.floats(p + "attn_norm.bin", D));
    matrix("wqkv", NQKV, D, SWK_P_WQKV, SWK_P_WQKV_SCALE);
    if (bias) P[SWK_P_BQKV] = st.keep(d.floats(p + "bqkv.bin", NQKV));
    matrix("wo", D, H * hd, SWK_P_WO, SWK_P_WO_SCALE);
    P[SWK_P_MLP_NORM] = st.keep(d.floats(p + "mlp_norm.bin", D));
    matrix("wgu", 2 * I, D, SWK_P_WGU, SWK_P_WGU_SCALE);
    matrix("wdown", D, I, SWK_P_WDOWN, SWK_P_WDOWN_SCALE);
    P[SWK_P_KV] = st.keep(d.floats(p + "kv.bin", 2 * KV * S_max * hd));
  }

  // One token at position pos, written to slot pos, attending every slot <= pos.
  std::vector<float> h = d.floats("x.bin", D);
  const std::vector<float> cos_t = d.floats("cos.bin", hd / 2), sin_t = d.floats("sin.bin", hd / 2);
  const std::vector<uint8_t> flags(L * 2, 0), vis(pos + 1, 1);
  const int64_t slot = pos;
  int rc = swk_layers(L, table.data(), wtypes.data(), flags.data(), 1, D, H, KV, hd, I, eps, scale, S_max, &slot,
                      cos_t.data(), sin_t.data(), vis.data(), pos + 1, h.data(), nthreads, SWK_KV_FLOAT32);
  if (rc != SWK_CPU_OK)
    throw std::runtime_error(rc == SWK_CPU_ERR_NOMEM ? "swk_layers: out of memory"
                                                     : "swk_layers rejected its arguments");

  // Final RMSNorm (as the kernel normalises: h / sqrt(mean(h^2) + eps) * w), then the LM head.
  const std::vector<float> norm = d.floats("norm.bin", D);
  double ss = 0.0;
  for (float v : h) ss += (double)v * v;
  const float r = 1.0f / sqrtf((float)(ss / D) + eps);
  std::vector<float> x(D);
  for (int64_t i = 0; i < D; i++) x[i] = norm[i] * (h[i] * r);
  const std::vector<char> head = d.read("lm_head.bin", (size_t)(V * D) * wsize(wt));
  std::vector<float> head_scale;
  if (wt == SWK_W_INT8) head_scale = d.floats("lm_head.scale.bin", V);
  std::vector<float> logits(V);
  rc = swk_linear(x.data(), 1, D, head.data(), wt, wt == SWK_W_INT8 ? head_scale.data() : nullptr, V,
                  logits.data(), nthreads);
  if (rc != SWK_CPU_OK) throw std::runtime_error("swk_linear rejected its arguments");

  const std::vector<float> want = d.floats("expected_logits.bin", V);
  float diff = 0.0f;
  bool nan = false;   // a NaN logit is a mismatch whatever the others
  int64_t best = 0;
  for (int64_t v = 0; v < V; v++) {
    const float e = fabsf(logits[v] - want[v]);
    if (isnan(e)) nan = true;
    else if (e > diff) diff = e;
    if (logits[v] > logits[best]) best = v;
  }
  printf("vector_width=%d\nmax_abs_diff=%g tol=%g\nargmax=%lld\n", swk_vector_width(), nan ? NAN : diff, tol,
         (long long)best);
  const bool ok = !nan && diff <= tol;
  printf("%s\n", ok ? "MATCH" : "MISMATCH");
  return ok ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) {
    fprintf(stderr, "usage: %s DIR [THREADS]\n", argv[0]);
    return 2;
  }
  try {
    return run(argv[1], argc > 2 ? atoi(argv[2]) : 1);
  } catch (const std::exception& e) {
    fprintf(stderr, "decode_step: %s\n", e.what());
    return 2;
  }
}
