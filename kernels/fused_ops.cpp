// RMSNorm, and the pre-norm transformer's "residual add, then the next norm", for the CPU.
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

}  // namespace

TORCH_LIBRARY(tandem_fused, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("add_rms_norm(Tensor x, Tensor residual, Tensor weight, float eps) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(tandem_fused, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("add_rms_norm", &add_rms_norm);
}

// The CPU kernels of the custom ops kernels/fused_ops.py defines (it loads this library after
// defining them): CPU calls then reach C++ straight from the dispatcher.
TORCH_LIBRARY_IMPL(tandem, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("add_rms_norm", &add_rms_norm);
}
