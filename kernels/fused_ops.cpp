// The decode step's small ops, fused for the CPU: RMSNorm, the pre-norm transformer's "residual
// add, then the next norm", SiLU(gate) * up, and RoPE (alone, or with the K/V write into the
// paged cache).
//
// Built on first use by kernels/fused_ops.py (torch.utils.cpp_extension.load), which wraps
// these kernels in torch.library custom ops; see that module's docstring.
//
// Why it is shaped the way it is:
// * A decode step norms one to a few rows of 576 values, 61 times: ATen's rms_norm is six
//   dispatches there (pow, mean = sum + div, add, rsqrt, mul, the casts), ~30 us; one pass
//   over the row here is ~1 us. Rows are split over threads only when there are enough of
//   them (kGrainValues values per thread), so decode rows stay on the calling thread.
// * The float32 sum of squares is ATen's, bit for bit: its cascade sum of a contiguous row
//   (aten/src/ATen/native/cpu/SumKernel.cpp: vectorized_inner_sum -> row_sum ->
//   multi_row_sum, 8 lanes, 4 interleaved accumulators, levelled partial
//   sums) is reproduced step for step below, over a buffer of the squares, then divided by H
//   (ATen's mean on CPU is sum then div), plus eps, 1 / sqrt, (x * r) * w. So in float32 the
//   result equals F.rms_norm's (and Hugging Face's written-out LlamaRMSNorm) exactly, which
//   the float32 parity tests against Hugging Face rely on. (ATen's sum runs its AVX2
//   kernel even where it dispatches other ops to AVX512: 8 lanes either way.)
// * The squares are stored to the buffer and read back behind a compiler barrier: otherwise
//   -O3 -mfma may contract x * x + acc into one FMA (one rounding instead of two), and the
//   sum would no longer be ATen's.
// * bfloat16: computed in float32 and rounded once at the end, as F.rms_norm does; the
//   residual sum is rounded to bfloat16 first (it is the residual stream, held in bfloat16),
//   and that rounded value is what is normed.
// * SiLU(gate) * up and RoPE replace 2 and ~12 dispatches a layer (silu, mul; slices, four
//   muls, sub, add, cat) with one each, and give the torch formulas' bits in both dtypes: the
//   same operations rounded at the same points (bfloat16: each torch op's float32 result
//   rounded to bfloat16, as torch does op by op). SiLU's exp is ATen's too: its vectorized
//   kernel (Activation.cpp, silu_kernel) runs two vectors a step with Sleef's exp (what
//   Vectorized<float>::exp calls) and the row's rest with std::exp, and so does this one, row
//   by row (ATen's loop over a [T, I] slice of the fused gate_up output is per row as well).
//   RoPE's products pass through opaque() below: -O3 -mfma would otherwise contract
//   x1 * c - x2 * s into an FMA (measured: the float32 tests then fail).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <tuple>
#include <vector>

namespace {

using Vec = at::vec::Vectorized<float>;
constexpr int64_t kVS = Vec::size();
// Values per thread before rows are split over threads: a [16, 576] decode batch stays on
// one thread (waking the pool costs more than the norm), a 300-token prefill chunk does not.
constexpr int64_t kGrainValues = 1 << 15;

inline int64_t ceil_log2(int64_t x) {  // c10::utils' CeilLog2
  if (x <= 2) return 1;
  return 64 - __builtin_clzll(static_cast<uint64_t>(x - 1));
}

// ATen's sum kernel is dispatched without AVX512 (REGISTER_DISPATCH leaves it out), so its
// accumulators are Vectorized<float> of AVX2 (and of the generic build): 8 lanes.
constexpr int64_t kSumLanes = 8;
struct Lanes {
  float v[kSumLanes];
};
inline Lanes add(const Lanes& a, const Lanes& b) {
  Lanes r;
  for (int64_t k = 0; k < kSumLanes; ++k) r.v[k] = a.v[k] + b.v[k];
  return r;
}
inline float add(float a, float b) { return a + b; }
template <typename A>
inline A zero() {
  if constexpr (std::is_same_v<A, float>) {
    return 0.f;
  } else {
    return Lanes{};
  }
}

// ATen's multi_row_sum + row_sum (ilp 4, 4 levels) over `size` items, item i = load(i)
// (Lanes of kSumLanes floats or one float).
template <typename A, typename Load>
A row_sum(const Load& load, int64_t size) {
  constexpr int64_t ilp = 4, levels = 4;
  const int64_t size_ilp = size / ilp;
  const int64_t level_power = std::max<int64_t>(4, ceil_log2(size_ilp) / levels);
  const int64_t level_step = int64_t(1) << level_power, level_mask = level_step - 1;
  A acc[levels][ilp];
  for (auto& lv : acc)
    for (auto& a : lv) a = zero<A>();
  int64_t i = 0;
  for (; i + level_step <= size_ilp;) {
    for (int64_t j = 0; j < level_step; ++j, ++i)
      for (int64_t k = 0; k < ilp; ++k) acc[0][k] = add(acc[0][k], load(i * ilp + k));
    for (int64_t j = 1; j < levels; ++j) {
      for (int64_t k = 0; k < ilp; ++k) {
        acc[j][k] = add(acc[j][k], acc[j - 1][k]);
        acc[j - 1][k] = zero<A>();
      }
      if ((i & (level_mask << (j * level_power))) != 0) break;
    }
  }
  for (; i < size_ilp; ++i)
    for (int64_t k = 0; k < ilp; ++k) acc[0][k] = add(acc[0][k], load(i * ilp + k));
  for (int64_t j = 1; j < levels; ++j)
    for (int64_t k = 0; k < ilp; ++k) acc[0][k] = add(acc[0][k], acc[j][k]);
  for (int64_t t = size_ilp * ilp; t < size; ++t) acc[0][0] = add(acc[0][0], load(t));
  for (int64_t k = 1; k < ilp; ++k) acc[0][0] = add(acc[0][0], acc[0][k]);
  return acc[0][0];
}

// x.sum(-1) of one contiguous float32 row as ATen computes it (cascade_sum's branches for an
// inner reduction: vectorized when the row holds at least one vector, scalar otherwise).
float aten_row_sum(const float* p, int64_t n) {
  if (n < kSumLanes) return row_sum<float>([p](int64_t i) { return p[i]; }, n);
  const int64_t nvec = n / kSumLanes;
  const Lanes v = row_sum<Lanes>(
      [p](int64_t i) {
        Lanes l;
        std::memcpy(l.v, p + i * kSumLanes, sizeof(l.v));
        return l;
      },
      nvec);
  float acc = 0.f;
  for (int64_t k = nvec * kSumLanes; k < n; ++k) acc += p[k];
  for (int64_t k = 0; k < kSumLanes; ++k) acc += v.v[k];
  return acc;
}

inline Vec load_f(const float* p) { return Vec::loadu(p); }
inline Vec load_f(const c10::BFloat16* p) {
  Vec v;
  at::vec::load_to_float(p, v);
  return v;
}
inline float to_f(float v) { return v; }
inline float to_f(c10::BFloat16 v) { return static_cast<float>(v); }

inline void store_f(const Vec& v, float* p) { v.store(p); }
inline void store_f(const Vec& v, c10::BFloat16* p) {
  alignas(64) std::array<float, kVS> tmp;
  v.store(tmp.data());
  for (int64_t k = 0; k < kVS; ++k) p[k] = c10::BFloat16(tmp[k]);  // round to nearest even
}

// One row: f[] holds the row's values in float32 (already rounded to T when they are a
// residual sum); writes y = f * r * w in T.
template <typename T, typename W>
void norm_row(const float* f, float* sq, const W* w, T* y, int64_t h, float eps) {
  int64_t d = 0;
  for (; d + kVS <= h; d += kVS) {
    const Vec v = Vec::loadu(f + d);
    (v * v).store(sq + d);
  }
  for (; d < h; ++d) sq[d] = f[d] * f[d];
  asm volatile("" ::: "memory");  // no x * x + acc contraction into an FMA (see the top)
  const float mean = aten_row_sum(sq, h) / static_cast<float>(h);
  const float r = 1.f / std::sqrt(mean + eps);
  const Vec rv(r);
  for (d = 0; d + kVS <= h; d += kVS) store_f(Vec::loadu(f + d) * rv * load_f(w + d), y + d);
  for (; d < h; ++d) y[d] = T(f[d] * r * to_f(w[d]));
}

template <typename T, typename W>
void run(const at::Tensor& x, const at::Tensor* res, const at::Tensor& w, at::Tensor& y, at::Tensor* new_res,
         float eps) {
  const int64_t rows = x.size(0), h = x.size(1);
  const T* xp = x.const_data_ptr<T>();
  const T* rp = res ? res->const_data_ptr<T>() : nullptr;
  const W* wp = w.const_data_ptr<W>();
  T* yp = y.mutable_data_ptr<T>();
  T* np = new_res ? new_res->mutable_data_ptr<T>() : nullptr;
  const int64_t xs = x.stride(0), rs = res ? res->stride(0) : 0;
  const int64_t grain = std::max<int64_t>(1, kGrainValues / std::max<int64_t>(h, 1));
  at::parallel_for(0, rows, grain, [&](int64_t b, int64_t e) {
    std::vector<float> buf(2 * h);
    float* f = buf.data();
    float* sq = f + h;
    for (int64_t t = b; t < e; ++t) {
      const T* xr = xp + t * xs;
      if (rp) {
        const T* rr = rp + t * rs;
        T* nr = np + t * h;
        int64_t d = 0;
        if constexpr (std::is_same_v<T, float>) {
          for (; d + kVS <= h; d += kVS) {
            const Vec s = Vec::loadu(xr + d) + Vec::loadu(rr + d);
            s.store(nr + d);
            s.store(f + d);
          }
          for (; d < h; ++d) f[d] = nr[d] = xr[d] + rr[d];
        } else {
          for (; d < h; ++d) {
            nr[d] = T(to_f(xr[d]) + to_f(rr[d]));
            f[d] = to_f(nr[d]);
          }
        }
      } else {
        if constexpr (std::is_same_v<T, float>) {
          std::copy(xr, xr + h, f);
        } else {
          for (int64_t d = 0; d < h; ++d) f[d] = to_f(xr[d]);
        }
      }
      norm_row<T, W>(f, sq, wp, yp + t * h, h, eps);
    }
  });
}

void check(const char* op, const at::Tensor& x, const at::Tensor* res, const at::Tensor& w) {
  TORCH_CHECK(x.device().is_cpu(), op, ": x must be a CPU tensor");
  TORCH_CHECK(x.dim() == 2, op, ": x must have 2 dimensions [T, H], got shape ", x.sizes());
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, op,
              ": x must have dtype float32 or bfloat16, got ", x.scalar_type());
  const int64_t h = x.size(1);
  if (res) {
    TORCH_CHECK(res->device().is_cpu(), op, ": residual must be a CPU tensor");
    TORCH_CHECK(res->sizes() == x.sizes(), op, ": residual must have x's shape ", x.sizes(), ", got ",
                res->sizes());
    TORCH_CHECK(res->scalar_type() == x.scalar_type(), op, ": residual must have x's dtype ", x.scalar_type(),
                ", got ", res->scalar_type());
  }
  TORCH_CHECK(w.device().is_cpu(), op, ": weight must be a CPU tensor");
  TORCH_CHECK(w.dim() == 1 && w.size(0) == h, op, ": weight must have shape [H] = [", h, "], got ", w.sizes());
  TORCH_CHECK(w.scalar_type() == x.scalar_type() || w.scalar_type() == at::kFloat, op,
              ": weight must have x's dtype or float32, got ", w.scalar_type());
}

// Rows are read with their stride; the values of one row must be contiguous.
inline at::Tensor rows_of(const at::Tensor& t) { return t.stride(1) == 1 ? t : t.contiguous(); }

template <typename F>
void dispatch(const at::Tensor& x, const at::Tensor& w, const F& f) {
  if (x.scalar_type() == at::kFloat)
    f(float{}, float{});
  else if (w.scalar_type() == at::kFloat)
    f(c10::BFloat16{}, float{});
  else
    f(c10::BFloat16{}, c10::BFloat16{});
}

at::Tensor rms_norm(const at::Tensor& x_in, const at::Tensor& w_in, double eps) {
  check("rms_norm", x_in, nullptr, w_in);
  const at::Tensor x = rows_of(x_in), w = w_in.contiguous();
  at::Tensor y = at::empty(x.sizes(), x.options().memory_format(at::MemoryFormat::Contiguous));
  dispatch(x, w, [&](auto t, auto wt) {
    run<decltype(t), decltype(wt)>(x, nullptr, w, y, nullptr, static_cast<float>(eps));
  });
  return y;
}

std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x_in, const at::Tensor& res_in,
                                                const at::Tensor& w_in, double eps) {
  check("add_rms_norm", x_in, &res_in, w_in);
  const at::Tensor x = rows_of(x_in), res = rows_of(res_in), w = w_in.contiguous();
  const auto opts = x.options().memory_format(at::MemoryFormat::Contiguous);
  at::Tensor y = at::empty(x.sizes(), opts), new_res = at::empty(x.sizes(), opts);
  dispatch(x, w, [&](auto t, auto wt) {
    run<decltype(t), decltype(wt)>(x, &res, w, y, &new_res, static_cast<float>(eps));
  });
  return {y, new_res};
}

// ---------------------------------------------------------------------------------------------
// SiLU(gate) * up, and RoPE

using BVec = at::vec::Vectorized<c10::BFloat16>;

// v as a float32 value the compiler cannot see through: a product passed through it is not
// folded into an FMA with the add or sub that follows (torch rounds each product on its own).
inline Vec opaque(Vec v) {
#if defined(CPU_CAPABILITY_AVX512)
  __m512 r = v;
  asm("" : "+v"(r));
  return Vec(r);
#elif defined(CPU_CAPABILITY_AVX2)
  __m256 r = v;
  asm("" : "+x"(r));
  return Vec(r);
#else
  asm volatile("" : "+m"(v));
  return v;
#endif
}
inline float opaque(float v) {
  asm volatile("" : "+m"(v));
  return v;
}

// Values rounded to bfloat16 and read back: one torch op's bfloat16 result.
inline void round_bf16(Vec& a, Vec& b) {
  std::tie(a, b) = at::vec::convert_to_float<c10::BFloat16>(at::vec::convert_from_float<c10::BFloat16>(a, b));
}
inline float round_bf16(float x) { return static_cast<float>(c10::BFloat16(x)); }
inline std::tuple<Vec, Vec> load2(const c10::BFloat16* p) {
  return at::vec::convert_to_float<c10::BFloat16>(BVec::loadu(p));
}

// y = silu(g) * u over one row of n values. F.silu(gate) * up: silu rounded to the dtype, then
// the product. ATen's silu loop takes two vectors a step (Sleef's exp) and the rest of the
// row one value at a time (std::exp); so does this one, so that the bits are its bits.
void silu_mul_row(const float* g, const float* u, float* y, int64_t n) {
  const Vec one(1.f);
  const int64_t nv = n - n % (2 * kVS);
  int64_t d = 0;
  for (; d < nv; d += kVS) {
    const Vec x = Vec::loadu(g + d);
    (x / (one + x.neg().exp()) * Vec::loadu(u + d)).store(y + d);
  }
  for (; d < n; ++d) y[d] = g[d] / (1.f + std::exp(-g[d])) * u[d];
}

void silu_mul_row(const c10::BFloat16* g, const c10::BFloat16* u, c10::BFloat16* y, int64_t n) {
  constexpr int64_t kB = BVec::size();
  const Vec one(1.f);
  const int64_t nv = n - n % (2 * kB);  // ATen's step for bfloat16: two bfloat16 vectors
  int64_t d = 0;
  for (; d < nv; d += kB) {
    auto [x0, x1] = load2(g + d);
    Vec s0 = x0 / (one + x0.neg().exp()), s1 = x1 / (one + x1.neg().exp());
    round_bf16(s0, s1);  // F.silu's bfloat16 output
    const auto [u0, u1] = load2(u + d);
    at::vec::convert_from_float<c10::BFloat16>(s0 * u0, s1 * u1).store(y + d);
  }
  for (; d < n; ++d) {
    const float x = static_cast<float>(g[d]);
    y[d] = c10::BFloat16(round_bf16(x / (1.f + std::exp(-x))) * static_cast<float>(u[d]));
  }
}

// One head of RoPE, HF's rotate_half convention with half-width tables:
// o[:h] = x1 * c - x2 * s, o[h:] = x2 * c + x1 * s (x1, x2 the halves of x, h = head_dim / 2),
// rounded where torch's ops round (each product, then the sum).
void rope_head(const float* x, const float* c, const float* s, float* o, int64_t h) {
  int64_t d = 0;
  for (; d + kVS <= h; d += kVS) {
    const Vec x1 = Vec::loadu(x + d), x2 = Vec::loadu(x + h + d), cv = Vec::loadu(c + d), sv = Vec::loadu(s + d);
    (opaque(x1 * cv) - opaque(x2 * sv)).store(o + d);
    (opaque(x2 * cv) + opaque(x1 * sv)).store(o + h + d);
  }
  for (; d < h; ++d) {
    o[d] = opaque(x[d] * c[d]) - opaque(x[h + d] * s[d]);
    o[h + d] = opaque(x[h + d] * c[d]) + opaque(x[d] * s[d]);
  }
}

void rope_head(const c10::BFloat16* x, const c10::BFloat16* c, const c10::BFloat16* s, c10::BFloat16* o, int64_t h) {
  constexpr int64_t kB = BVec::size();
  int64_t d = 0;
  for (; d + kB <= h; d += kB) {
    const auto [x1a, x1b] = load2(x + d);
    const auto [x2a, x2b] = load2(x + h + d);
    const auto [ca, cb] = load2(c + d);
    const auto [sa, sb] = load2(s + d);
    Vec p0 = x1a * ca, p1 = x1b * cb, q0 = x2a * sa, q1 = x2b * sb;
    round_bf16(p0, p1);
    round_bf16(q0, q1);
    at::vec::convert_from_float<c10::BFloat16>(p0 - q0, p1 - q1).store(o + d);
    p0 = x2a * ca, p1 = x2b * cb, q0 = x1a * sa, q1 = x1b * sb;
    round_bf16(p0, p1);
    round_bf16(q0, q1);
    at::vec::convert_from_float<c10::BFloat16>(p0 + q0, p1 + q1).store(o + h + d);
  }
  for (; d < h; ++d) {
    const float x1 = static_cast<float>(x[d]), x2 = static_cast<float>(x[h + d]);
    const float cv = static_cast<float>(c[d]), sv = static_cast<float>(s[d]);
    o[d] = c10::BFloat16(round_bf16(x1 * cv) - round_bf16(x2 * sv));
    o[h + d] = c10::BFloat16(round_bf16(x2 * cv) + round_bf16(x1 * sv));
  }
}

template <typename T>
void silu_mul_run(const at::Tensor& gu, at::Tensor& y) {
  const int64_t rows = gu.size(0), n = y.size(1), gs = gu.stride(0);
  const T* gp = gu.const_data_ptr<T>();
  T* yp = y.mutable_data_ptr<T>();
  const int64_t grain = std::max<int64_t>(1, kGrainValues / std::max<int64_t>(n, 1));
  at::parallel_for(0, rows, grain, [&](int64_t b, int64_t e) {
    for (int64_t t = b; t < e; ++t) silu_mul_row(gp + t * gs, gp + t * gs + n, yp + t * n, n);
  });
}

at::Tensor silu_mul(const at::Tensor& gu_in) {
  TORCH_CHECK(gu_in.device().is_cpu(), "silu_mul: gate_up must be a CPU tensor");
  TORCH_CHECK(gu_in.dim() == 2 && gu_in.size(1) % 2 == 0,
              "silu_mul: gate_up must have 2 dimensions [T, 2 * I], got shape ", gu_in.sizes());
  TORCH_CHECK(gu_in.scalar_type() == at::kFloat || gu_in.scalar_type() == at::kBFloat16,
              "silu_mul: gate_up must have dtype float32 or bfloat16, got ", gu_in.scalar_type());
  const at::Tensor gu = rows_of(gu_in);
  at::Tensor y = at::empty({gu.size(0), gu.size(1) / 2}, gu.options().memory_format(at::MemoryFormat::Contiguous));
  if (gu.scalar_type() == at::kFloat)
    silu_mul_run<float>(gu, y);
  else
    silu_mul_run<c10::BFloat16>(gu, y);
  return y;
}

// The rope ops' common checks; returns head_dim (twice the tables' width). `exact`: qkv holds
// exactly the q, k and v heads (rope_write_kv); else at least the q and k heads.
int64_t check_rope(const char* op, const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin, int64_t nh,
                   int64_t nkv, bool exact) {
  TORCH_CHECK(qkv.device().is_cpu() && cos.device().is_cpu() && sin.device().is_cpu(), op,
              ": qkv, cos and sin must be CPU tensors");
  TORCH_CHECK(qkv.dim() == 2, op, ": qkv must have 2 dimensions [T, heads * head_dim], got shape ", qkv.sizes());
  TORCH_CHECK(qkv.scalar_type() == at::kFloat || qkv.scalar_type() == at::kBFloat16, op,
              ": qkv must have dtype float32 or bfloat16, got ", qkv.scalar_type());
  TORCH_CHECK(cos.dim() == 2 && cos.size(0) == qkv.size(0) && cos.size(1) > 0 && sin.sizes() == cos.sizes(), op,
              ": cos and sin must be [T, head_dim / 2] with T = ", qkv.size(0), ", got ", cos.sizes(), " and ",
              sin.sizes());
  TORCH_CHECK(cos.scalar_type() == qkv.scalar_type() && sin.scalar_type() == qkv.scalar_type(), op,
              ": cos and sin must have qkv's dtype ", qkv.scalar_type(), ", got ", cos.scalar_type(), " and ",
              sin.scalar_type());
  TORCH_CHECK(nh > 0 && nkv > 0, op, ": num_heads and num_kv_heads must be > 0, got ", nh, " and ", nkv);
  const int64_t hd = 2 * cos.size(1);
  if (exact) {
    TORCH_CHECK(qkv.size(1) == (nh + 2 * nkv) * hd, op, ": qkv must have (num_heads + 2 * num_kv_heads) * head_dim = ",
                (nh + 2 * nkv) * hd, " columns, got ", qkv.size(1));
  } else {
    TORCH_CHECK(qkv.size(1) >= (nh + nkv) * hd, op, ": qkv must have at least (num_heads + num_kv_heads) * head_dim = ",
                (nh + nkv) * hd, " columns, got ", qkv.size(1));
  }
  return hd;
}

// Rotates the q and k heads of T rows of qkv: each token's heads go to qk_out (q and k heads,
// contiguous [T, nh + nkv, hd]); with caches, q heads to q_out [T, nh, hd] and the k heads
// (rotated) and v heads (copied) to the cache row slots[t], skipped where it is negative.
template <typename T, typename S>
void rope_run(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin, int64_t nh, int64_t nkv, int64_t hd,
              T* out, T* kc, T* vc, const S* slots) {
  const int64_t rows = qkv.size(0), h = hd / 2, qs = qkv.stride(0), cs = cos.stride(0), ss = sin.stride(0);
  const int64_t heads_out = kc ? nh : nh + nkv;
  const T* xp = qkv.const_data_ptr<T>();
  const T* cp = cos.const_data_ptr<T>();
  const T* sp = sin.const_data_ptr<T>();
  const int64_t grain = std::max<int64_t>(1, kGrainValues / ((nh + 2 * nkv) * hd));
  at::parallel_for(0, rows, grain, [&](int64_t b, int64_t e) {
    for (int64_t t = b; t < e; ++t) {
      const T* x = xp + t * qs;
      const T* c = cp + t * cs;
      const T* s = sp + t * ss;
      T* o = out + t * heads_out * hd;
      for (int64_t j = 0; j < heads_out; ++j) rope_head(x + j * hd, c, s, o + j * hd, h);
      if (!kc || slots[t] < 0) continue;
      const int64_t row = static_cast<int64_t>(slots[t]) * nkv * hd;
      for (int64_t j = 0; j < nkv; ++j) rope_head(x + (nh + j) * hd, c, s, kc + row + j * hd, h);
      std::memcpy(vc + row, x + (nh + nkv) * hd, nkv * hd * sizeof(T));
    }
  });
}

template <typename F>
void dispatch_dtype(const at::Tensor& x, const F& f) {
  if (x.scalar_type() == at::kFloat)
    f(float{});
  else
    f(c10::BFloat16{});
}

at::Tensor rope(const at::Tensor& qkv_in, const at::Tensor& cos_in, const at::Tensor& sin_in, int64_t nh,
                int64_t nkv) {
  const int64_t hd = check_rope("rope", qkv_in, cos_in, sin_in, nh, nkv, false);
  const at::Tensor qkv = rows_of(qkv_in), cos = rows_of(cos_in), sin = rows_of(sin_in);
  at::Tensor qk = at::empty({qkv.size(0), nh + nkv, hd}, qkv.options().memory_format(at::MemoryFormat::Contiguous));
  dispatch_dtype(qkv, [&](auto t) {
    using T = decltype(t);
    rope_run<T, int64_t>(qkv, cos, sin, nh, nkv, hd, qk.mutable_data_ptr<T>(), nullptr, nullptr, nullptr);
  });
  return qk;
}

at::Tensor rope_write_kv(const at::Tensor& qkv_in, const at::Tensor& cos_in, const at::Tensor& sin_in,
                         at::Tensor& k_cache, at::Tensor& v_cache, const at::Tensor& slot_mapping_in, int64_t nh) {
  const char* op = "rope_write_kv";
  TORCH_CHECK(k_cache.dim() == 4, op, ": k_cache must be [num_blocks, block_size, num_kv_heads, head_dim], got ",
              k_cache.sizes());
  TORCH_CHECK(v_cache.sizes() == k_cache.sizes() && v_cache.scalar_type() == k_cache.scalar_type(), op,
              ": v_cache must match k_cache in shape and dtype");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && k_cache.device().is_cpu() &&
                  v_cache.device().is_cpu(),
              op, ": k_cache and v_cache must be contiguous CPU tensors");
  const int64_t nkv = k_cache.size(2);
  const int64_t hd = check_rope(op, qkv_in, cos_in, sin_in, nh, nkv, true);
  TORCH_CHECK(k_cache.size(3) == hd, op, ": the caches' head_dim ", k_cache.size(3), " must be twice cos' width ",
              cos_in.size(1));
  TORCH_CHECK(k_cache.scalar_type() == qkv_in.scalar_type(), op, ": the caches must have qkv's dtype ",
              qkv_in.scalar_type(), ", got ", k_cache.scalar_type());
  TORCH_CHECK(slot_mapping_in.dim() == 1 && slot_mapping_in.size(0) == qkv_in.size(0) &&
                  (slot_mapping_in.scalar_type() == at::kInt || slot_mapping_in.scalar_type() == at::kLong) &&
                  slot_mapping_in.device().is_cpu(),
              op, ": slot_mapping must be a CPU int32 or int64 tensor [T] with T = ", qkv_in.size(0), ", got ",
              slot_mapping_in.scalar_type(), " ", slot_mapping_in.sizes());
  const at::Tensor qkv = rows_of(qkv_in), cos = rows_of(cos_in), sin = rows_of(sin_in);
  const at::Tensor slots = slot_mapping_in.contiguous();
  const int64_t n_slots = k_cache.size(0) * k_cache.size(1);
  at::Tensor q = at::empty({qkv.size(0), nh, hd}, qkv.options().memory_format(at::MemoryFormat::Contiguous));
  auto with_slots = [&](auto s) {
    using S = decltype(s);
    const S* sp = slots.const_data_ptr<S>();
    for (int64_t t = 0; t < slots.size(0); ++t)
      TORCH_CHECK(sp[t] < n_slots, op, ": slot ", sp[t], " of token ", t, " is past the cache's ", n_slots, " slots");
    dispatch_dtype(qkv, [&](auto t) {
      using T = decltype(t);
      rope_run<T, S>(qkv, cos, sin, nh, nkv, hd, q.mutable_data_ptr<T>(), k_cache.mutable_data_ptr<T>(),
                     v_cache.mutable_data_ptr<T>(), sp);
    });
  };
  if (slots.scalar_type() == at::kInt)
    with_slots(int32_t{});
  else
    with_slots(int64_t{});
  return q;
}

}  // namespace

TORCH_LIBRARY(tandem_fused, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("add_rms_norm(Tensor x, Tensor residual, Tensor weight, float eps) -> (Tensor, Tensor)");
  m.def("silu_mul(Tensor gate_up) -> Tensor");
  m.def("rope(Tensor qkv, Tensor cos, Tensor sin, int num_heads, int num_kv_heads) -> Tensor");
  m.def(
      "rope_write_kv(Tensor qkv, Tensor cos, Tensor sin, Tensor(a!) k_cache, Tensor(b!) v_cache, "
      "Tensor slot_mapping, int num_heads) -> Tensor");
}

TORCH_LIBRARY_IMPL(tandem_fused, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("add_rms_norm", &add_rms_norm);
  m.impl("silu_mul", &silu_mul);
  m.impl("rope", &rope);
  m.impl("rope_write_kv", &rope_write_kv);
}

// The CPU kernels of the custom ops kernels/fused_ops.py defines (it loads this library after
// defining them): CPU calls then reach C++ straight from the dispatcher.
TORCH_LIBRARY_IMPL(tandem, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("add_rms_norm", &add_rms_norm);
  m.impl("silu_mul", &silu_mul);
  m.impl("rope", &rope);
  m.impl("rope_write_kv", &rope_write_kv);
}
