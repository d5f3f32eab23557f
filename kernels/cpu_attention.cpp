// Paged attention for the CPU, reading K/V blocks where they lie in the cache.
//
// Built on first use by kernels/cpu_attention.py (torch.utils.cpp_extension.load), which
// wraps these ops in torch.library custom ops; see that module's docstring for the layout.
//
// Why it is shaped the way it is:
// * One work item is (sequence, KV head, tile of up to kTileRows query rows). Its g = nh / nkv
//   query heads (times the tile's rows) are handled together, so each K/V row is fetched
//   from memory once for every query vector that shares it, not g times.
// * Blocks are visited in table order up to the last position any row of the tile may see;
//   positions at or past a row's causal limit are never read, so padding entries of the
//   block table and the unwritten tail of the last block (stale, even NaN) cannot leak in.
// * Online softmax (FlashAttention): a running max and sum per query vector, the float32
//   accumulator rescaled when the max grows, so nothing of size context is materialised.
// * Keys are taken kChunk at a time (across block boundaries, through per-row pointers):
//   scores of every query vector against the chunk, one softmax step per vector, then P @ V
//   with kQB accumulator rows updated per V row load. bfloat16/float16 K/V rows are widened
//   to float32 once per chunk into a scratch buffer and shared by all those vectors.
// * Decode is bound by reading the cache (16 x 1024 tokens x 3 heads x 64 x 4 bytes x 2 is
//   25 MB a layer), so the next chunk's rows are prefetched while one is computed.
// * Items differ in cost (a prefill tile at position 900 reads 900 keys, one at 10 reads
//   10), so they are handed out longest first from a shared counter instead of in static
//   chunks: each thread of the parallel region pulls the next item when it finishes one.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <limits>
#include <numeric>
#include <type_traits>
#include <vector>

namespace {

using Vec = at::vec::Vectorized<float>;
constexpr int64_t kVS = Vec::size();
// Query rows per prefill tile: 16 rows x g heads x head_dim floats of queries and
// accumulators stay in L2 next to a chunk of K/V, and a 512-token chunk still splits into
// enough items to keep every thread busy.
constexpr int64_t kTileRows = 16;
// Keys per online-softmax step: the rescale of the accumulators and the bookkeeping of a step
// are paid once per kChunk keys, and a chunk's K and V rows (2 x 64 x 256 bytes at head_dim
// 64 in float32) stay in L1/L2 while every query vector of the item reads them.
constexpr int64_t kChunk = 64;
// Accumulator rows per V row load: 4 x 4 vectors at head_dim 64 leave registers for V.
constexpr int64_t kQB = 4;
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

inline void to_float(const float* src, float* dst, int64_t n) { std::memcpy(dst, src, n * sizeof(float)); }

template <typename T>  // c10::BFloat16 or c10::Half
inline void to_float(const T* src, float* dst, int64_t n) {
  int64_t d = 0;
  for (; d + kVS <= n; d += kVS) {
    Vec x;
    at::vec::load_to_float(src + d, x);
    x.store(dst + d);
  }
  for (; d < n; ++d) dst[d] = static_cast<float>(src[d]);
}

inline void from_float(const float* src, float* dst, int64_t n) { std::memcpy(dst, src, n * sizeof(float)); }

template <typename T>
inline void from_float(const float* src, T* dst, int64_t n) {
  for (int64_t d = 0; d < n; ++d) dst[d] = T(src[d]);  // round to nearest even
}

// Lane i of the result = the sum of the lanes of v[i], i < kVS. A horizontal sum per dot
// product would cost more than the dot product itself at head_dim 64; transposing the
// reduction shares its shuffles across kVS keys (46 instructions for 16 sums with AVX-512).
inline Vec hsum_transpose(const Vec* v) {
#if defined(CPU_CAPABILITY_AVX512)
  __m512 a[8], b[4], c[2];
  for (int i = 0; i < 8; ++i) {  // 256-bit halves: [v2i | v2i+1], 8 partial sums each
    const __m512 x = v[2 * i], y = v[2 * i + 1];
    a[i] = _mm512_add_ps(_mm512_shuffle_f32x4(x, y, _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_f32x4(x, y, _MM_SHUFFLE(3, 2, 3, 2)));
  }
  for (int i = 0; i < 4; ++i)  // 128-bit units: unit k holds 4 partial sums of v4i+k
    b[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], _MM_SHUFFLE(3, 1, 3, 1)));
  for (int i = 0; i < 2; ++i)  // unit k: 2 partial sums of vk+8i, then of vk+8i+4
    c[i] = _mm512_add_ps(_mm512_shuffle_ps(b[2 * i], b[2 * i + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_ps(b[2 * i], b[2 * i + 1], _MM_SHUFFLE(3, 1, 3, 1)));
  // Lane 4k + j now holds the sum of v[k + 4j]; put lane i at i.
  const __m512 d = _mm512_add_ps(_mm512_shuffle_ps(c[0], c[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                 _mm512_shuffle_ps(c[0], c[1], _MM_SHUFFLE(3, 1, 3, 1)));
  const __m512i idx = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
  return _mm512_permutexvar_ps(idx, d);
#elif defined(CPU_CAPABILITY_AVX2)
  const __m256 t0 = _mm256_hadd_ps(v[0], v[1]), t1 = _mm256_hadd_ps(v[2], v[3]);
  const __m256 t2 = _mm256_hadd_ps(v[4], v[5]), t3 = _mm256_hadd_ps(v[6], v[7]);
  const __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);  // per 128-bit half
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
#else
  float out[kVS];
  for (int64_t i = 0; i < kVS; ++i) {
    float lanes[kVS];
    v[i].store(lanes);
    out[i] = std::accumulate(lanes, lanes + kVS, 0.f);
  }
  return Vec::loadu(out);
#endif
}

// HD > 0 fixes head_dim at compile time, so the loops over it unroll and small arrays of
// vectors stay in registers; HD == 0 takes it at run time (any head_dim).
template <int HD>
inline float dot(const float* a, const float* b, int64_t hd_rt) {
  const int64_t hd = HD > 0 ? HD : hd_rt;
  Vec acc(0.f);
  int64_t d = 0;
  for (; d + kVS <= hd; d += kVS) acc = at::vec::fmadd(Vec::loadu(a + d), Vec::loadu(b + d), acc);
  float t = at::vec::vec_reduce_all<float>([](Vec& x, Vec& y) { return x + y; }, acc);
  for (; d < hd; ++d) t += a[d] * b[d];
  return t;
}

// s[i] = q . k[i] for i < n, k[i] a row of head_dim floats.
template <int HD>
inline void scores(const float* q, const float* const* k, int64_t n, float* s, int64_t hd_rt) {
  const int64_t hd = HD > 0 ? HD : hd_rt;
  int64_t i0 = 0;
  if (hd % kVS == 0) {
    for (; i0 + kVS <= n; i0 += kVS) {
      Vec part[kVS];
      for (int64_t i = 0; i < kVS; ++i) {
        const float* ki = k[i0 + i];
        Vec acc = Vec::loadu(q) * Vec::loadu(ki);
        for (int64_t d = kVS; d < hd; d += kVS) acc = at::vec::fmadd(Vec::loadu(q + d), Vec::loadu(ki + d), acc);
        part[i] = acc;
      }
      hsum_transpose(part).store(s + i0);
    }
  }
  for (; i0 < n; ++i0) s[i0] = dot<HD>(q, k[i0], hd);
}

// acc = acc * alpha + sum_i p[i] * v[i], over n rows of head_dim floats.
template <int HD>
inline void accumulate(float* acc, float alpha, const float* p, const float* const* v, int64_t n, int64_t hd_rt) {
  const int64_t hd = HD > 0 ? HD : hd_rt;
  const Vec va(alpha);
  if constexpr (HD > 0 && HD % kVS == 0 && HD / kVS <= 8) {
    constexpr int64_t NV = HD / kVS;
    Vec a[NV];
    for (int64_t c = 0; c < NV; ++c) a[c] = Vec::loadu(acc + c * kVS) * va;
    for (int64_t i = 0; i < n; ++i) {
      const Vec pi(p[i]);
      for (int64_t c = 0; c < NV; ++c) a[c] = at::vec::fmadd(pi, Vec::loadu(v[i] + c * kVS), a[c]);
    }
    for (int64_t c = 0; c < NV; ++c) a[c].store(acc + c * kVS);
    return;
  }
  int64_t d = 0;
  for (; d + kVS <= hd; d += kVS) {
    Vec a = Vec::loadu(acc + d) * va;
    for (int64_t i = 0; i < n; ++i) a = at::vec::fmadd(Vec(p[i]), Vec::loadu(v[i] + d), a);
    a.store(acc + d);
  }
  for (; d < hd; ++d) {
    float a = acc[d] * alpha;
    for (int64_t i = 0; i < n; ++i) a += p[i] * v[i][d];
    acc[d] = a;
  }
}

// acc[b] = acc[b] * alpha[b] + sum_i p[b * kChunk + i] * v[i] for QB accumulator rows: each V
// row is loaded once for all of them.
template <int HD, int QB>
inline void accumulate_qb(float* acc, const float* alpha, const float* p, const float* const* v, int64_t n,
                          int64_t hd_rt) {
  const int64_t hd = HD > 0 ? HD : hd_rt;
  constexpr int64_t NV = HD > 0 ? HD / kVS : 1;
  if constexpr (HD > 0 && HD % kVS == 0 && NV * QB <= 16) {
    Vec a[QB][NV];
    for (int b = 0; b < QB; ++b)
      for (int64_t c = 0; c < NV; ++c) a[b][c] = Vec::loadu(acc + b * HD + c * kVS) * Vec(alpha[b]);
    for (int64_t i = 0; i < n; ++i) {
      Vec vv[NV];
      for (int64_t c = 0; c < NV; ++c) vv[c] = Vec::loadu(v[i] + c * kVS);
      for (int b = 0; b < QB; ++b) {
        const Vec pb(p[b * kChunk + i]);
        for (int64_t c = 0; c < NV; ++c) a[b][c] = at::vec::fmadd(pb, vv[c], a[b][c]);
      }
    }
    for (int b = 0; b < QB; ++b)
      for (int64_t c = 0; c < NV; ++c) a[b][c].store(acc + b * HD + c * kVS);
  } else {
    for (int b = 0; b < QB; ++b) accumulate<HD>(acc + b * hd, alpha[b], p + b * kChunk, v, n, hd);
  }
}

template <int HD>
inline void accumulate_rows(int64_t qb, float* acc, const float* alpha, const float* p, const float* const* v,
                            int64_t n, int64_t hd) {
  switch (qb) {
    case 4: return accumulate_qb<HD, 4>(acc, alpha, p, v, n, hd);
    case 3: return accumulate_qb<HD, 3>(acc, alpha, p, v, n, hd);
    case 2: return accumulate_qb<HD, 2>(acc, alpha, p, v, n, hd);
    default: return accumulate_qb<HD, 1>(acc, alpha, p, v, n, hd);
  }
}

inline float max_of(const float* s, int64_t n, float init) {
  Vec mx(init);
  int64_t i = 0;
  for (; i + kVS <= n; i += kVS) mx = at::vec::maximum(mx, Vec::loadu(s + i));
  float m = at::vec::vec_reduce_all<float>([](Vec& x, Vec& y) { return at::vec::maximum(x, y); }, mx);
  for (; i < n; ++i) m = std::max(m, s[i]);
  return m;
}

// In place: s[i] = exp(s[i] - m) for i < n; returns their sum.
inline float exp_sum(float* s, int64_t n, float m) {
  const Vec vm(m);
  Vec sum(0.f);
  int64_t i = 0;
  for (; i + kVS <= n; i += kVS) {
    Vec e = (Vec::loadu(s + i) - vm).exp();
    e.store(s + i);
    sum = sum + e;
  }
  float total = at::vec::vec_reduce_all<float>([](Vec& x, Vec& y) { return x + y; }, sum);
  for (; i < n; ++i) {
    s[i] = std::exp(s[i] - m);
    total += s[i];
  }
  return total;
}

struct Item {
  int64_t seq, kv_head, row0, row1, cost;
};

struct Scratch {
  std::vector<float> q, acc, m, l, alpha, s, k, v;
  std::vector<const float*> kp, vp;
  Scratch(int64_t max_vecs, int64_t hd)
      : q(max_vecs * hd), acc(max_vecs * hd), m(max_vecs), l(max_vecs), alpha(max_vecs), s(max_vecs * kChunk),
        k(kChunk * hd), v(kChunk * hd), kp(kChunk), vp(kChunk) {}
};

template <typename T, int HD>
void attend_item(const Item& it, const T* q, int64_t q_s0, int64_t q_s1, const T* kc, const T* vc, const int32_t* bt,
                 int64_t bt_stride, const int32_t* cu, const int32_t* ctx, T* out, int64_t nh, int64_t nkv, int64_t bs,
                 int64_t hd_rt, float scale, Scratch& w) {
  const int64_t hd = HD > 0 ? HD : hd_rt;
  const int64_t g = nh / nkv;
  const int64_t rows = it.row1 - it.row0;
  const int64_t nvec = rows * g;
  // Position of batch row r: the chunk's rows are the last q_len positions of its context.
  const int64_t pos0 = static_cast<int64_t>(ctx[it.seq]) - (cu[it.seq + 1] - cu[it.seq]) + (it.row0 - cu[it.seq]);
  const int64_t kv_end = pos0 + rows;  // keys [0, kv_end) are visible to some row of the tile

  // Query vector j = (row j / g, head kv_head * g + j % g), pre-scaled.
  for (int64_t r = 0; r < rows; ++r) {
    const T* qr = q + (it.row0 + r) * q_s0 + it.kv_head * g * q_s1;
    for (int64_t j = 0; j < g; ++j) {
      float* dst = w.q.data() + (r * g + j) * hd;
      to_float(qr + j * q_s1, dst, hd);
      for (int64_t d = 0; d < hd; ++d) dst[d] *= scale;
    }
  }
  std::fill_n(w.acc.data(), nvec * hd, 0.f);
  std::fill_n(w.m.data(), nvec, kNegInf);
  std::fill_n(w.l.data(), nvec, 0.f);

  const int64_t row_stride = nkv * hd;  // between consecutive positions of one block
  const int32_t* table = bt + it.seq * bt_stride;
  for (int64_t c0 = 0; c0 < kv_end; c0 += kChunk) {
    const int64_t n = std::min(kChunk, kv_end - c0);
    // Row pointers of the chunk's keys, block by block.
    for (int64_t i = 0; i < n;) {
      const int64_t pos = c0 + i, o = pos % bs, cnt = std::min(bs - o, n - i);
      const int64_t off = ((static_cast<int64_t>(table[pos / bs]) * bs + o) * nkv + it.kv_head) * hd;
      for (int64_t t = 0; t < cnt; ++t, ++i) {
        if constexpr (std::is_same_v<T, float>) {
          w.kp[i] = kc + off + t * row_stride;
          w.vp[i] = vc + off + t * row_stride;
        } else {
          to_float(kc + off + t * row_stride, w.k.data() + i * hd, hd);
          to_float(vc + off + t * row_stride, w.v.data() + i * hd, hd);
          w.kp[i] = w.k.data() + i * hd;
          w.vp[i] = w.v.data() + i * hd;
        }
      }
    }
    // The next chunk's rows, while this one is computed: consecutive blocks of a sequence
    // lie anywhere in the cache, so the hardware prefetcher cannot see that far ahead.
    {
      const int64_t c1 = c0 + kChunk, n1 = std::min(kChunk, kv_end - c1);
      const int64_t row_bytes = hd * static_cast<int64_t>(sizeof(T));
      for (int64_t i = 0; i < n1;) {
        const int64_t pos = c1 + i, o = pos % bs, cnt = std::min(bs - o, n1 - i);
        const int64_t off = ((static_cast<int64_t>(table[pos / bs]) * bs + o) * nkv + it.kv_head) * hd;
        for (int64_t t = 0; t < cnt; ++t, ++i) {
          const char* kr = reinterpret_cast<const char*>(kc + off + t * row_stride);
          const char* vr = reinterpret_cast<const char*>(vc + off + t * row_stride);
          for (int64_t b = 0; b < row_bytes; b += 64) {
            __builtin_prefetch(kr + b);
            __builtin_prefetch(vr + b);
          }
        }
      }
    }
    // Scores of every query vector that sees the chunk, the softmax step of each, then P @ V.
    // Keys past a row's causal limit (inside the chunk, so real tokens) get weight 0.
    const int64_t first = std::max<int64_t>(0, (c0 - pos0) * g);  // earlier rows see none of it
    for (int64_t j = first; j < nvec; ++j) scores<HD>(w.q.data() + j * hd, w.kp.data(), n, w.s.data() + j * kChunk, hd);
    for (int64_t j = first; j < nvec; ++j) {
      const int64_t nv = std::min(n, pos0 + j / g - c0 + 1);
      float* s = w.s.data() + j * kChunk;
      const float mx = max_of(s, nv, w.m[j]);
      w.alpha[j] = std::exp(w.m[j] - mx);  // 0 on the first chunk (m = -inf)
      std::fill(s + nv, s + n, 0.f);
      w.l[j] = w.l[j] * w.alpha[j] + exp_sum(s, nv, mx);
      w.m[j] = mx;
    }
    for (int64_t j = first; j < nvec; j += kQB)
      accumulate_rows<HD>(std::min(kQB, nvec - j), w.acc.data() + j * hd, w.alpha.data() + j, w.s.data() + j * kChunk,
                         w.vp.data(), n, hd);
  }

  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t j = 0; j < g; ++j) {
      const int64_t jj = r * g + j;
      float* a = w.acc.data() + jj * hd;
      const float inv = 1.f / w.l[jj];  // l >= 1: every row sees position 0 at least
      for (int64_t d = 0; d < hd; ++d) a[d] *= inv;
      from_float(a, out + ((it.row0 + r) * nh + it.kv_head * g + j) * hd, hd);
    }
  }
}

template <typename T, int HD>
void run(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& bt,
         const at::Tensor& cu, const at::Tensor& ctx, at::Tensor& out, const std::vector<Item>& items, float scale) {
  const int64_t nh = q.size(1), hd = q.size(2), bs = k_cache.size(1), nkv = k_cache.size(2);
  const T* qp = q.const_data_ptr<T>();
  const T* kp = k_cache.const_data_ptr<T>();
  const T* vp = v_cache.const_data_ptr<T>();
  const int32_t* btp = bt.const_data_ptr<int32_t>();
  const int32_t* cup = cu.const_data_ptr<int32_t>();
  const int32_t* ctxp = ctx.const_data_ptr<int32_t>();
  T* op = out.mutable_data_ptr<T>();
  const int64_t q_s0 = q.stride(0), q_s1 = q.stride(1), bt_stride = bt.stride(0);
  const int64_t n_items = static_cast<int64_t>(items.size());
  const int64_t max_vecs = kTileRows * (nh / nkv);
  std::atomic<int64_t> next{0};
  const int64_t workers = std::min<int64_t>(at::get_num_threads(), n_items);
  at::parallel_for(0, workers, 1, [&](int64_t, int64_t) {
    Scratch w(max_vecs, hd);
    for (int64_t i = next.fetch_add(1); i < n_items; i = next.fetch_add(1))
      attend_item<T, HD>(items[i], qp, q_s0, q_s1, kp, vp, btp, bt_stride, cup, ctxp, op, nh, nkv, bs, hd, scale, w);
  });
}

template <typename T>
void run_dtype(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& bt,
               const at::Tensor& cu, const at::Tensor& ctx, at::Tensor& out, const std::vector<Item>& items,
               float scale) {
  switch (q.size(2)) {
    case 64:
      return run<T, 64>(q, k_cache, v_cache, bt, cu, ctx, out, items, scale);
    case 128:
      return run<T, 128>(q, k_cache, v_cache, bt, cu, ctx, out, items, scale);
    default:
      return run<T, 0>(q, k_cache, v_cache, bt, cu, ctx, out, items, scale);
  }
}

void check_cache(const at::Tensor& k_cache, const at::Tensor& v_cache) {
  TORCH_CHECK(k_cache.dim() == 4, "k_cache must be [num_blocks, block_size, num_kv_heads, head_dim], got ",
              k_cache.sizes());
  TORCH_CHECK(v_cache.sizes() == k_cache.sizes() && v_cache.dtype() == k_cache.dtype(),
              "v_cache must match k_cache in shape and dtype");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "k_cache and v_cache must be contiguous");
  TORCH_CHECK(k_cache.device().is_cpu() && v_cache.device().is_cpu(), "k_cache and v_cache must be CPU tensors");
}

at::Tensor paged_attention(const at::Tensor& q_in, const at::Tensor& k_cache, const at::Tensor& v_cache,
                           const at::Tensor& block_tables_in, const at::Tensor& cu_q_lens_in,
                           const at::Tensor& context_lens_in, double scale) {
  check_cache(k_cache, v_cache);
  TORCH_CHECK(q_in.dim() == 3 && q_in.device().is_cpu(), "q must be a CPU tensor [T, num_heads, head_dim]");
  TORCH_CHECK(q_in.scalar_type() == k_cache.scalar_type(), "q and the caches must have one dtype, got ",
              q_in.scalar_type(), " and ", k_cache.scalar_type());
  const auto dtype = q_in.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf,
              "dtype must be float32, bfloat16 or float16, got ", dtype);
  const int64_t nh = q_in.size(1), hd = q_in.size(2);
  const int64_t num_blocks = k_cache.size(0), bs = k_cache.size(1), nkv = k_cache.size(2);
  TORCH_CHECK(k_cache.size(3) == hd, "q's head_dim ", hd, " differs from the cache's ", k_cache.size(3));
  TORCH_CHECK(nh % nkv == 0, "num_heads ", nh, " must be a multiple of num_kv_heads ", nkv);
  // Rows are addressed with strides (q is often a view of a fused QKV projection); only the
  // head_dim elements of one head need to be contiguous.
  const at::Tensor q = q_in.stride(2) == 1 ? q_in : q_in.contiguous();
  const at::Tensor bt = block_tables_in.to(at::kInt).contiguous();
  const at::Tensor cu = cu_q_lens_in.to(at::kInt).contiguous();
  const at::Tensor ctx = context_lens_in.to(at::kInt).contiguous();
  TORCH_CHECK(bt.dim() == 2 && cu.dim() == 1 && ctx.dim() == 1,
              "block_tables must be 2-D, cu_q_lens and context_lens 1-D");
  const int64_t num_seqs = ctx.size(0);
  TORCH_CHECK(cu.size(0) == num_seqs + 1 && bt.size(0) == num_seqs,
              "need cu_q_lens [S + 1] and block_tables [S, *] for ", num_seqs, " sequences, got ", cu.size(0), " and ",
              bt.size(0));

  // Validated here, once and serially, so the kernel can trust every index it follows.
  const int32_t* cup = cu.const_data_ptr<int32_t>();
  const int32_t* ctxp = ctx.const_data_ptr<int32_t>();
  const int32_t* btp = bt.const_data_ptr<int32_t>();
  TORCH_CHECK(cup[0] == 0 && cup[num_seqs] == q.size(0), "cu_q_lens must run from 0 to q.shape[0] = ", q.size(0));
  const int64_t g = nh / nkv;
  std::vector<Item> items;
  for (int64_t s = 0; s < num_seqs; ++s) {
    const int64_t q_len = cup[s + 1] - cup[s], n = ctxp[s];
    TORCH_CHECK(q_len >= 0 && n >= q_len, "sequence ", s, ": need 0 <= q_len <= context_len, got q_len ", q_len,
                " and context_len ", n);
    TORCH_CHECK(n <= bt.size(1) * bs, "sequence ", s, ": context_len ", n, " exceeds its block table's ",
                bt.size(1), " blocks of ", bs);
    if (q_len == 0) continue;
    for (int64_t b = 0; b < (n + bs - 1) / bs; ++b) {
      const int64_t id = btp[s * bt.stride(0) + b];
      TORCH_CHECK(id >= 0 && id < num_blocks, "sequence ", s, ": block id ", id, " out of range [0, ", num_blocks, ")");
    }
    for (int64_t r0 = cup[s]; r0 < cup[s + 1]; r0 += kTileRows) {
      const int64_t r1 = std::min<int64_t>(r0 + kTileRows, cup[s + 1]);
      const int64_t keys = n - (cup[s + 1] - r1);  // keys visible to the tile's last row
      for (int64_t h = 0; h < nkv; ++h) items.push_back({s, h, r0, r1, keys * (r1 - r0) * g});
    }
  }
  std::stable_sort(items.begin(), items.end(), [](const Item& a, const Item& b) { return a.cost > b.cost; });

  at::Tensor out = at::empty({q.size(0), nh, hd}, q.options());
  if (items.empty()) return out;
  const float sc = static_cast<float>(scale);
  if (dtype == at::kFloat)
    run_dtype<float>(q, k_cache, v_cache, bt, cu, ctx, out, items, sc);
  else if (dtype == at::kBFloat16)
    run_dtype<c10::BFloat16>(q, k_cache, v_cache, bt, cu, ctx, out, items, sc);
  else
    run_dtype<c10::Half>(q, k_cache, v_cache, bt, cu, ctx, out, items, sc);
  return out;
}

void write_kv(at::Tensor& k_cache, at::Tensor& v_cache, const at::Tensor& k, const at::Tensor& v,
              const at::Tensor& slot_mapping_in) {
  check_cache(k_cache, v_cache);
  const int64_t nkv = k_cache.size(2), hd = k_cache.size(3);
  const int64_t n_slots = k_cache.size(0) * k_cache.size(1);
  for (const at::Tensor* t : {&k, &v}) {
    TORCH_CHECK(t->dim() == 3 && t->size(1) == nkv && t->size(2) == hd, "k and v must be [num_tokens, ", nkv, ", ",
                hd, "], got ", t->sizes());
    TORCH_CHECK(t->scalar_type() == k_cache.scalar_type() && t->device().is_cpu(),
                "k and v must be CPU tensors of the cache's dtype");
  }
  const at::Tensor slots = slot_mapping_in.to(at::kLong).contiguous();
  const int64_t n = k.size(0);
  TORCH_CHECK(v.size(0) == n && slots.dim() == 1 && slots.size(0) == n,
              "k, v and slot_mapping must have one row per token");
  const int64_t* sp = slots.const_data_ptr<int64_t>();
  for (int64_t t = 0; t < n; ++t)
    TORCH_CHECK(sp[t] < n_slots, "slot ", sp[t], " of token ", t, " is past the cache's ", n_slots, " slots");
  // A token's heads are one contiguous run of nkv * head_dim values in the cache; copy it
  // with one memcpy when the source token is laid out the same way.
  const at::Tensor kk = (k.stride(2) == 1 && k.stride(1) == hd) ? k : k.contiguous();
  const at::Tensor vv = (v.stride(2) == 1 && v.stride(1) == hd) ? v : v.contiguous();
  const int64_t row_bytes = nkv * hd * k_cache.element_size();
  const int64_t ks = kk.stride(0) * kk.element_size(), vs = vv.stride(0) * vv.element_size();
  const char* kp = static_cast<const char*>(kk.const_data_ptr());
  const char* vp = static_cast<const char*>(vv.const_data_ptr());
  char* kcp = static_cast<char*>(k_cache.mutable_data_ptr());
  char* vcp = static_cast<char*>(v_cache.mutable_data_ptr());
  // Small batches (decode) are cheaper copied on one thread than woken across several.
  at::parallel_for(0, n, 256, [&](int64_t b, int64_t e) {
    for (int64_t t = b; t < e; ++t) {
      if (sp[t] < 0) continue;  // a negative slot means "not cached" (as triton_attention.write_kv)
      std::memcpy(kcp + sp[t] * row_bytes, kp + t * ks, row_bytes);
      std::memcpy(vcp + sp[t] * row_bytes, vp + t * vs, row_bytes);
    }
  });
}

}  // namespace

TORCH_LIBRARY(tandem_cpu, m) {
  m.def(
      "paged_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, Tensor cu_q_lens, "
      "Tensor context_lens, float scale) -> Tensor");
  m.def("write_kv(Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor k, Tensor v, Tensor slot_mapping) -> ()");
}

TORCH_LIBRARY_IMPL(tandem_cpu, CPU, m) {
  m.impl("paged_attention", &paged_attention);
  m.impl("write_kv", &write_kv);
}

// The CPU kernels of the custom ops kernels/cpu_attention.py defines (it loads this library
// after defining them): CPU calls then reach C++ straight from the dispatcher instead of
// through the ops' Python implementation, about 10 us less per call.
TORCH_LIBRARY_IMPL(tandem, CPU, m) {
  m.impl("paged_attention", &paged_attention);
  m.impl("write_kv", &write_kv);
}
