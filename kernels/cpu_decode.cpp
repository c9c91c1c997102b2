// CPU decode fast path: a whole Llama decoder stack in one call.
//
// Small batches on CPU (decode, speculative verification) are bound by reading the weights
// once per step and, in eager PyTorch, by the dispatch of the ~25 small operators each layer
// runs. This file runs every layer of the stack for M <= a few dozen rows without returning to
// Python: RMSNorm (+ residual), fused QKV, rotary, the paged KV write, attention over the paged
// cache, O projection, gate/up, SiLU-and-mul and down, with matrix-vector products that read
// each weight row once for all M rows (AVX-512 BF16 dot products for bfloat16, AVX-512 FMA for
// float32). Values are rounded to the model dtype at the same points as the eager modules in
// models/llama.py and models/layers.py (their reference). Built at first use by
// kernels/cpu_decode.py.

#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/extension.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

// ---------------------------------------------------------------- element access

inline float ld(const float* p) { return *p; }
inline float ld(const uint16_t* p) {
  uint32_t u = static_cast<uint32_t>(*p) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// Round to the storage type (round to nearest even for bfloat16, as c10::BFloat16 does).
inline void st(float* p, float v) { *p = v; }
inline void st(uint16_t* p, float v) {
  uint32_t u;
  std::memcpy(&u, &v, 4);
  if (std::isnan(v)) {
    *p = 0x7FC0;
    return;
  }
  u += 0x7FFF + ((u >> 16) & 1);
  *p = static_cast<uint16_t>(u >> 16);
}
template <typename T>
inline float rnd(float v) {  // v rounded through T
  T t;
  st(&t, v);
  return ld(&t);
}

// ---------------------------------------------------------------- matrix-vector products

// Dot products of one weight row with R activation rows (fp32 accumulation): the weight
// vector is loaded once for all R rows, and the R independent accumulator chains hide the FMA
// latency. Tails (n not a multiple of the vector width) are summed in scalar code. (Blocking
// several weight rows as well measured slower for bfloat16 on the development machine.)
template <int R>
inline void dots(const float* w, const float* x, int64_t n, float* out) {
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    __m512 a = _mm512_loadu_ps(w + i);
    for (int r = 0; r < R; ++r) {
      acc[r] = _mm512_fmadd_ps(a, _mm512_loadu_ps(x + r * n + i), acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) {
    float s = _mm512_reduce_add_ps(acc[r]);
    for (int64_t j = i; j < n; ++j) s += w[j] * x[r * n + j];
    out[r] = s;
  }
}
template <int R>
inline void dots(const uint16_t* w, const uint16_t* x, int64_t n, float* out) {
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  int64_t i = 0;
  for (; i + 32 <= n; i += 32) {
    __m512bh a = (__m512bh)_mm512_loadu_si512(w + i);
    for (int r = 0; r < R; ++r) {
      __m512bh b = (__m512bh)_mm512_loadu_si512(x + r * n + i);
      acc[r] = _mm512_dpbf16_ps(acc[r], a, b);
    }
  }
  for (int r = 0; r < R; ++r) {
    float s = _mm512_reduce_add_ps(acc[r]);
    for (int64_t j = i; j < n; ++j) s += ld(w + j) * ld(x + r * n + j);
    out[r] = s;
  }
}

// y[m .. m+R, o] for weight row o.
template <typename T, int R>
inline void tile(const T* x, const T* w, T* y, int64_t m, int64_t o, int64_t I, int64_t O) {
  float r[R];
  dots<R>(w + o * I, x + m * I, I, r);
  for (int b = 0; b < R; ++b) st(y + (m + b) * O + o, r[b]);
}

// y[m, o] = sum_i x[m, i] * w[o, i] for m < M: each weight row is read once for all rows.
// Every (m, o) product is summed in the same order whatever M is (batch-invariant results).
template <typename T>
void matvec(const T* x, const T* w, T* y, int64_t M, int64_t I, int64_t O) {
  at::parallel_for(0, O, 32, [&](int64_t begin, int64_t end) {
    for (int64_t o = begin; o < end; ++o) {
      int64_t m = 0;
      for (; m + 4 <= M; m += 4) tile<T, 4>(x, w, y, m, o, I, O);
      for (; m + 2 <= M; m += 2) tile<T, 2>(x, w, y, m, o, I, O);
      for (; m < M; ++m) tile<T, 1>(x, w, y, m, o, I, O);
    }
  });
}

// ---------------------------------------------------------------- elementwise

// out = w * rms_norm(x) (fp32 math; bfloat16: the normalised value is rounded before the
// weight multiply, as in the eager RMSNorm).
template <typename T>
void rms_norm(const T* x, const T* w, T* out, int64_t M, int64_t H, float eps) {
  for (int64_t m = 0; m < M; ++m) {
    const T* xr = x + m * H;
    float ss = 0.f;
    for (int64_t i = 0; i < H; ++i) {
      float v = ld(xr + i);
      ss += v * v;
    }
    float inv = 1.f / std::sqrt(ss / static_cast<float>(H) + eps);
    for (int64_t i = 0; i < H; ++i) {
      float n = rnd<T>(ld(xr + i) * inv);
      st(out + m * H + i, ld(w + i) * n);
    }
  }
}

// residual = round(h + residual) in place.
template <typename T>
void add_into(const T* h, T* residual, int64_t n) {
  for (int64_t i = 0; i < n; ++i) st(residual + i, ld(h + i) + ld(residual + i));
}

// Neox rotary on the first (num_heads + num_kv_heads) heads of each qkv row, in place.
template <typename T>
void rotary(T* qkv, const int64_t* positions, const float* cos_sin, int64_t M, int64_t heads,
            int64_t D, int64_t row_stride) {
  const int64_t half = D / 2;
  for (int64_t m = 0; m < M; ++m) {
    const float* cs = cos_sin + positions[m] * D;
    for (int64_t h = 0; h < heads; ++h) {
      T* x = qkv + m * row_stride + h * D;
      for (int64_t i = 0; i < half; ++i) {
        float x1 = ld(x + i), x2 = ld(x + half + i), c = cs[i], s = cs[half + i];
        st(x + i, x1 * c - x2 * s);
        st(x + half + i, x2 * c + x1 * s);
      }
    }
  }
}

// out = round(round(silu(gate)) * up), gate_up rows = [gate | up].
template <typename T>
void silu_mul(const T* gu, T* out, int64_t M, int64_t I) {
  for (int64_t m = 0; m < M; ++m) {
    const T* g = gu + m * 2 * I;
    for (int64_t i = 0; i < I; ++i) {
      float a = ld(g + i);
      float s = rnd<T>(a / (1.f + std::exp(-a)));
      st(out + m * I + i, s * ld(g + I + i));
    }
  }
}

// ---------------------------------------------------------------- attention

struct Paged {
  const int32_t* block_tables;
  int64_t bt_stride;
  const int64_t* row_seq;  // [M] sequence of each row
  const int64_t* kv_len;   // [M] keys each row sees (causal, this step's keys included)
  int64_t block_size;
};

inline int64_t slot_of(const Paged& p, int64_t seq, int64_t j) {
  return static_cast<int64_t>(p.block_tables[seq * p.bt_stride + j / p.block_size]) *
             p.block_size +
         j % p.block_size;
}

// out[m, h, :] = softmax(q k^T * scale) v over the row's keys; query head h reads kv head
// h / (H / Hkv). fp32 scores and accumulation; probabilities rounded to T before the value sum
// (as the CPU flash-attention kernel does for reduced precision).
template <typename T>
void attention(const T* qkv, int64_t row_stride, const T* k_cache, const T* v_cache, T* out,
               const Paged& p, int64_t M, int64_t H, int64_t Hkv, int64_t D, float scale) {
  const int64_t group = H / Hkv;
  at::parallel_for(0, M * H, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> q(D), acc(D), scores;
    for (int64_t mh = begin; mh < end; ++mh) {
      const int64_t m = mh / H, h = mh % H, kvh = h / group;
      const int64_t seq = p.row_seq[m], L = p.kv_len[m];
      const T* qr = qkv + m * row_stride + h * D;
      for (int64_t d = 0; d < D; ++d) q[d] = ld(qr + d);
      scores.resize(L);
      float mx = -INFINITY;
      for (int64_t j = 0; j < L; ++j) {
        const T* kr = k_cache + (slot_of(p, seq, j) * Hkv + kvh) * D;
        float s = 0.f;
        for (int64_t d = 0; d < D; ++d) s += q[d] * ld(kr + d);
        s *= scale;
        scores[j] = s;
        mx = s > mx ? s : mx;
      }
      float sum = 0.f;
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t j = 0; j < L; ++j) {
        float e = std::exp(scores[j] - mx);
        sum += e;
        float pe = rnd<T>(e);
        const T* vr = v_cache + (slot_of(p, seq, j) * Hkv + kvh) * D;
        for (int64_t d = 0; d < D; ++d) acc[d] += pe * ld(vr + d);
      }
      T* o = out + (m * H + h) * D;
      for (int64_t d = 0; d < D; ++d) st(o + d, acc[d] / sum);
    }
  });
}

// ---------------------------------------------------------------- the stack

template <typename T>
T* ptr(const torch::Tensor& t) {
  return reinterpret_cast<T*>(t.data_ptr());
}

template <typename T>
std::vector<torch::Tensor> run_stack(const torch::Tensor& x, const torch::Tensor& positions,
                                     const torch::Tensor& slots, const Paged& p,
                                     const std::vector<torch::Tensor>& weights,
                                     const std::vector<torch::Tensor>& caches,
                                     const torch::Tensor& final_norm,
                                     const torch::Tensor& cos_sin, int64_t H, int64_t Hkv,
                                     int64_t D, double eps, double scale,
                                     const std::vector<int64_t>& capture) {
  const int64_t M = x.size(0), hidden = x.size(1);
  const int64_t layers = static_cast<int64_t>(caches.size() / 2);
  const int64_t qkv_width = (H + 2 * Hkv) * D;
  const int64_t inter = weights[5].size(1);
  auto opts = x.options();
  torch::Tensor residual = x.clone();
  torch::Tensor h = torch::empty({M, hidden}, opts);
  torch::Tensor qkv = torch::empty({M, qkv_width}, opts);
  torch::Tensor attn = torch::empty({M, H * D}, opts);
  torch::Tensor gu = torch::empty({M, 2 * inter}, opts);
  torch::Tensor act = torch::empty({M, inter}, opts);
  torch::Tensor mlp_out = torch::empty({M, hidden}, opts);
  std::vector<torch::Tensor> result(1 + capture.size());
  const float feps = static_cast<float>(eps);
  const int64_t* pos = positions.data_ptr<int64_t>();
  const int64_t* slot = slots.data_ptr<int64_t>();
  for (int64_t l = 0; l < layers; ++l) {
    const torch::Tensor* w = &weights[l * 6];
    T* k_cache = ptr<T>(caches[2 * l]);
    T* v_cache = ptr<T>(caches[2 * l + 1]);
    if (l > 0) add_into(ptr<T>(mlp_out), ptr<T>(residual), M * hidden);
    rms_norm(ptr<T>(residual), ptr<T>(w[0]), ptr<T>(h), M, hidden, feps);
    matvec(ptr<T>(h), ptr<T>(w[1]), ptr<T>(qkv), M, hidden, qkv_width);
    rotary(ptr<T>(qkv), pos, cos_sin.data_ptr<float>(), M, H + Hkv, D, qkv_width);
    for (int64_t m = 0; m < M; ++m) {
      const T* row = ptr<T>(qkv) + m * qkv_width;
      std::memcpy(k_cache + slot[m] * Hkv * D, row + H * D, Hkv * D * sizeof(T));
      std::memcpy(v_cache + slot[m] * Hkv * D, row + (H + Hkv) * D, Hkv * D * sizeof(T));
    }
    attention(ptr<T>(qkv), qkv_width, k_cache, v_cache, ptr<T>(attn), p, M, H, Hkv, D,
              static_cast<float>(scale));
    matvec(ptr<T>(attn), ptr<T>(w[2]), ptr<T>(h), M, H * D, hidden);
    add_into(ptr<T>(h), ptr<T>(residual), M * hidden);
    rms_norm(ptr<T>(residual), ptr<T>(w[3]), ptr<T>(h), M, hidden, feps);
    matvec(ptr<T>(h), ptr<T>(w[4]), ptr<T>(gu), M, hidden, 2 * inter);
    silu_mul(ptr<T>(gu), ptr<T>(act), M, inter);
    matvec(ptr<T>(act), ptr<T>(w[5]), ptr<T>(mlp_out), M, inter, hidden);
    for (size_t c = 0; c < capture.size(); ++c) {
      if (capture[c] == l) {
        torch::Tensor cap = residual.clone();
        add_into(ptr<T>(mlp_out), ptr<T>(cap), M * hidden);
        result[1 + c] = cap;
      }
    }
  }
  add_into(ptr<T>(mlp_out), ptr<T>(residual), M * hidden);
  torch::Tensor out = torch::empty({M, hidden}, opts);
  rms_norm(ptr<T>(residual), ptr<T>(final_norm), ptr<T>(out), M, hidden, feps);
  result[0] = out;
  return result;
}

}  // namespace

// Returns [final normed hidden [M, hidden], the residual stream after each capture layer].
std::vector<torch::Tensor> llama_stack(
    torch::Tensor x, torch::Tensor positions, torch::Tensor slots, torch::Tensor row_seq,
    torch::Tensor kv_len, torch::Tensor block_tables, std::vector<torch::Tensor> weights,
    std::vector<torch::Tensor> caches, torch::Tensor final_norm, torch::Tensor cos_sin,
    int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t block_size, double eps,
    double scale, std::vector<int64_t> capture) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "x must be a contiguous [M, hidden] tensor");
  TORCH_CHECK(weights.size() == caches.size() * 3, "6 weights and 2 caches per layer");
  TORCH_CHECK(cos_sin.scalar_type() == torch::kFloat32 && cos_sin.size(1) == head_dim,
              "cos_sin must be float32 [positions, head_dim]");
  TORCH_CHECK(block_tables.scalar_type() == torch::kInt32, "block_tables must be int32");
  for (const auto& t : weights) {
    TORCH_CHECK(t.is_contiguous() && t.scalar_type() == x.scalar_type(),
                "weights must be contiguous and in the activation dtype");
  }
  for (const auto& t : caches) {
    TORCH_CHECK(t.is_contiguous() && t.scalar_type() == x.scalar_type(),
                "KV caches must be contiguous and in the activation dtype");
  }
  TORCH_CHECK(caches.size() >= 2 && positions.size(0) == x.size(0) &&
                  slots.size(0) == x.size(0) && row_seq.size(0) == x.size(0) &&
                  kv_len.size(0) == x.size(0),
              "positions, slots, row_seq and kv_len need one entry per row");
  const int64_t num_slots = caches[0].numel() / (num_kv_heads * head_dim);
  const int64_t max_keys = block_tables.size(1) * block_size;
  for (int64_t m = 0; m < x.size(0); ++m) {
    const int64_t pos = positions.data_ptr<int64_t>()[m], slot = slots.data_ptr<int64_t>()[m];
    const int64_t seq = row_seq.data_ptr<int64_t>()[m], len = kv_len.data_ptr<int64_t>()[m];
    TORCH_CHECK(pos >= 0 && pos < cos_sin.size(0), "position ", pos, " is out of range");
    TORCH_CHECK(slot >= 0 && slot < num_slots, "KV slot ", slot, " is out of range");
    TORCH_CHECK(seq >= 0 && seq < block_tables.size(0), "row sequence is out of range");
    TORCH_CHECK(len >= 1 && len <= max_keys, "key count ", len, " is out of range");
  }
  Paged p{block_tables.data_ptr<int32_t>(), block_tables.size(1), row_seq.data_ptr<int64_t>(),
          kv_len.data_ptr<int64_t>(), block_size};
  if (x.scalar_type() == torch::kBFloat16) {
    return run_stack<uint16_t>(x, positions, slots, p, weights, caches, final_norm, cos_sin,
                               num_heads, num_kv_heads, head_dim, eps, scale, capture);
  }
  TORCH_CHECK(x.scalar_type() == torch::kFloat32, "dtype must be bfloat16 or float32");
  return run_stack<float>(x, positions, slots, p, weights, caches, final_norm, cos_sin,
                          num_heads, num_kv_heads, head_dim, eps, scale, capture);
}

// x [M, I] @ w[O, I]^T → [M, O] in x's dtype (each weight row read once for all M rows).
torch::Tensor linear(torch::Tensor x, torch::Tensor w) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1),
              "linear: x [M, I] and w [O, I] expected");
  TORCH_CHECK(x.scalar_type() == w.scalar_type(), "linear: x and w dtypes differ");
  x = x.contiguous();
  w = w.contiguous();
  auto y = torch::empty({x.size(0), w.size(0)}, x.options());
  if (x.scalar_type() == torch::kBFloat16) {
    matvec(ptr<uint16_t>(x), ptr<uint16_t>(w), ptr<uint16_t>(y), x.size(0), x.size(1), w.size(0));
  } else {
    TORCH_CHECK(x.scalar_type() == torch::kFloat32, "dtype must be bfloat16 or float32");
    matvec(ptr<float>(x), ptr<float>(w), ptr<float>(y), x.size(0), x.size(1), w.size(0));
  }
  return y;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("llama_stack", &llama_stack, "Llama decoder stack for small batches (CPU)");
  m.def("linear", &linear, "x @ w.T for a few rows, reading w once (CPU)");
}
