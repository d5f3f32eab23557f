// Linear layers over GGUF's quantized weight blocks (Q4_1, Q8_0), with integer dot products.
//
// Built on first use by kernels/quant_linear.py, which wraps these kernels in torch.library
// custom ops; its docstring gives the block layouts and the math. In short: y[m, n] is a sum
// over blocks b of 32 inputs of  d_w * d_a * sum_j(q_w[j] * q_a[j])  (+ m_w * s_a for Q4_1),
// where the activations x[m] are quantized per block to 8 bits (d_a = max|x| / 127) once per
// call, before any weight is read.
//
// Why it is shaped the way it is:
// * Decode (one activation row) reads every weight once per call and does 2 multiply-adds per
//   weight: it is bound by memory. The weights stay in GGUF's blocks (20 bytes per 32 Q4_1
//   weights, against 128 in float32) and are unpacked in registers, never in memory.
// * Per block the integer dot is exact in 32 bits (|sum| <= 32 * 128 * 127); the block's two
//   scales are applied in float32 to the 8 int32 lanes, kept in a vector accumulator and
//   reduced horizontally once per output.
// * One library holds every instruction-set path, each compiled for its own target by a
//   function attribute and chosen at run time from CPUID, so the build is the same on every
//   x86-64 CPU: AMX int8 (tile products, kernels/quant_linear_amx.cpp; from kAmxMinRows rows),
//   AVX-512 VNNI (vpdpbusd: u8 x s8 products summed into int32 in one instruction), AVX2
//   (vpmaddubsw then vpmaddwd with ones), and portable C++.
// * The unsigned x signed products of those instructions fit Q4_1 directly (nibbles 0..15 x
//   int8 activations). Q8_0's weights are signed: |w| x (x with w's sign) is the same product
//   with an unsigned left side (the "sign trick"); |w| <= 128 and |q_a| <= 127 keep vpmaddubsw's
//   int16 pair sums (<= 2 * 128 * 127) clear of saturation.
// * Threads split the outputs N (at::parallel_for). A thread walks its rows in sub-chunks of a
//   few KiB of weights, and for each tile of up to kMaxTile activation rows reads the
//   sub-chunk's blocks once, unpacks each block once and uses it for every row of the tile;
//   the sub-chunk is in L1 when the next tile re-reads it, so a batch of M rows costs one
//   pass over the weights from memory, not M.
// * With one or two activation rows, each row's blocks alternate between two accumulators:
//   one chain of dependent FMAs (4 cycles each) would otherwise bound the loop below the
//   memory's rate.
//
// Files: kernels/quant_linear.h (what the parts share), this file (quantization, the
// per-block tile kernels, dispatch, the ops), kernels/quant_linear_batch.cpp (Q4_1 and Q8_0
// batches over repacked weights), kernels/quant_linear_amx.cpp (the AMX path).

#include "quant_linear.h"

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

namespace tq {
namespace {

const char* const kIsaNames[] = {"scalar", "avx2", "vnni", "amx"};
constexpr int kNumIsas = 4;

// "auto" takes the AMX path from this many activation rows, VNNI below: AMX's fixed work per
// block of 16 weight rows (unpacking them, finishing 16 lanes of sums whatever the rows) is not
// paid back by one row. SmolLM2's linear layers, on a Xeon with AMX (issue 30), AMX's time over
// VNNI's: one thread 1.51 at 1 row, 0.77 to 0.97 at 4, 0.78 at 5, 0.46 at 16; two threads 1.04
// to 1.25 at 4 (where VNNI's batch path runs exactly one of its 4-row tiles), 0.9 at 5, 0.5
// at 16.
constexpr int64_t kAmxMinRows = 5;

enum class Format { kQ4_1, kQ8_0 };


// Partial results of one tile: res[i * rows + r] is output row n0 + r of activation row m0 + i.
using TileFn = void (*)(const uint8_t* w, int64_t row_bytes, int64_t rows, const Acts& a, int64_t m0, float* res);
using QuantizeFn = void (*)(const void* x, bool bf16, int64_t m_begin, int64_t m_end, int64_t k, int8_t* q, float* d,
                            float* s);

inline float half_at(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return c10::detail::fp16_ieee_to_fp32_value(h);
}

inline float load_float(const void* x, bool bf16, int64_t i) {
  return bf16 ? static_cast<float>(static_cast<const c10::BFloat16*>(x)[i]) : static_cast<const float*>(x)[i];
}

// ---------------------------------------------------------------------------------------------
// Portable path. The arithmetic of the activations' quantization is the reference every other
// path (and kernels/quant_linear.py's torch path) reproduces bit for bit: d = amax / 127 in
// float32, q = nearest-even(x * (1 / d)), s = d * sum(q).

void quantize_scalar(const void* x, bool bf16, int64_t m_begin, int64_t m_end, int64_t k, int8_t* q, float* d,
                     float* s) {
  const int64_t kb = k / kBlock;
  for (int64_t m = m_begin; m < m_end; ++m) {
    for (int64_t b = 0; b < kb; ++b) {
      const int64_t base = m * k + b * kBlock;
      float amax = 0.f;
      for (int64_t j = 0; j < kBlock; ++j) amax = std::max(amax, std::fabs(load_float(x, bf16, base + j)));
      const float db = amax / 127.f;
      const float id = db != 0.f ? 1.f / db : 0.f;
      int32_t sum = 0;
      for (int64_t j = 0; j < kBlock; ++j) {
        // nearbyint rounds half to even in the default rounding mode, as cvtps2dq and torch.round.
        const int32_t v = static_cast<int32_t>(std::nearbyint(load_float(x, bf16, base + j) * id));
        q[base + j] = static_cast<int8_t>(v);
        sum += v;
      }
      d[m * kb + b] = db;
      s[m * kb + b] = db * static_cast<float>(sum);
    }
  }
}

template <int MT>
void q4_1_scalar(const uint8_t* w, int64_t row_bytes, int64_t rows, const Acts& a, int64_t m0, float* res) {
  for (int64_t r = 0; r < rows; ++r) {
    const uint8_t* row = w + r * row_bytes;
    for (int i = 0; i < MT; ++i) {
      const int8_t* qa = a.q + (m0 + i) * a.k;
      const float* da = a.d + (m0 + i) * a.kb;
      const float* sa = a.s + (m0 + i) * a.kb;
      float acc = 0.f;
      for (int64_t b = 0; b < a.kb; ++b) {
        const uint8_t* blk = row + b * kQ4_1Bytes;
        const int8_t* qb = qa + b * kBlock;
        int32_t dot = 0;
        for (int j = 0; j < 16; ++j) dot += (blk[4 + j] & 15) * qb[j] + (blk[4 + j] >> 4) * qb[j + 16];
        acc += half_at(blk) * da[b] * static_cast<float>(dot) + half_at(blk + 2) * sa[b];
      }
      res[i * rows + r] = acc;
    }
  }
}

template <int MT>
void q8_0_scalar(const uint8_t* w, int64_t row_bytes, int64_t rows, const Acts& a, int64_t m0, float* res) {
  for (int64_t r = 0; r < rows; ++r) {
    const uint8_t* row = w + r * row_bytes;
    for (int i = 0; i < MT; ++i) {
      const int8_t* qa = a.q + (m0 + i) * a.k;
      const float* da = a.d + (m0 + i) * a.kb;
      float acc = 0.f;
      for (int64_t b = 0; b < a.kb; ++b) {
        const uint8_t* blk = row + b * kQ8_0Bytes;
        const int8_t* qw = reinterpret_cast<const int8_t*>(blk + 2);
        const int8_t* qb = qa + b * kBlock;
        int32_t dot = 0;
        for (int j = 0; j < kBlock; ++j) dot += qw[j] * qb[j];
        acc += half_at(blk) * da[b] * static_cast<float>(dot);
      }
      res[i * rows + r] = acc;
    }
  }
}

#ifdef TQ_X86

// ---------------------------------------------------------------------------------------------
// AVX2 (also used by the VNNI path for what VNNI does not change: unpacking, quantizing)

TQ_AVX2 inline __m256i load32(const int8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }

TQ_AVX2 inline __m256 load8_float(const void* x, bool bf16, int64_t i) {
  if (!bf16) return _mm256_loadu_ps(static_cast<const float*>(x) + i);
  // bfloat16 is the high half of a float32: widen, shift into place.
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const c10::BFloat16*>(x) + i));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

TQ_AVX2 void quantize_avx2(const void* x, bool bf16, int64_t m_begin, int64_t m_end, int64_t k, int8_t* q, float* d,
                           float* s) {
  const int64_t kb = k / kBlock;
  const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  for (int64_t m = m_begin; m < m_end; ++m) {
    for (int64_t b = 0; b < kb; ++b) {
      const int64_t base = m * k + b * kBlock;
      __m256 v[4];
      for (int j = 0; j < 4; ++j) v[j] = load8_float(x, bf16, base + 8 * j);
      __m256 mx = _mm256_max_ps(_mm256_max_ps(_mm256_and_ps(v[0], abs_mask), _mm256_and_ps(v[1], abs_mask)),
                                _mm256_max_ps(_mm256_and_ps(v[2], abs_mask), _mm256_and_ps(v[3], abs_mask)));
      __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
      m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
      m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
      const float db = _mm_cvtss_f32(m4) / 127.f;
      const __m256 id = _mm256_set1_ps(db != 0.f ? 1.f / db : 0.f);
      __m256i iv[4];
      // cvtps2dq rounds half to even (MXCSR's default), as the scalar path's nearbyint.
      for (int j = 0; j < 4; ++j) iv[j] = _mm256_cvtps_epi32(_mm256_mul_ps(v[j], id));
      const __m256i sum4 = _mm256_add_epi32(_mm256_add_epi32(iv[0], iv[1]), _mm256_add_epi32(iv[2], iv[3]));
      __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(sum4), _mm256_extracti128_si256(sum4, 1));
      s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, _MM_SHUFFLE(1, 0, 3, 2)));
      s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, _MM_SHUFFLE(2, 3, 0, 1)));
      // The packs interleave 128-bit lanes; the permutation puts the 4-byte groups back in order.
      const __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(iv[0], iv[1]), _mm256_packs_epi32(iv[2], iv[3]));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + base), _mm256_permutevar8x32_epi32(p, order));
      d[m * kb + b] = db;
      s[m * kb + b] = db * static_cast<float>(_mm_cvtsi128_si32(s4));
    }
  }
}

// The 8 int32 partial sums of a block's products u8 x s8, AVX2 and VNNI.
TQ_AVX2 inline __m256i dot_avx2(__m256i u, __m256i s) {
  return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
}
TQ_VNNI inline __m256i dot_vnni(__m256i u, __m256i s) { return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s); }

// One tile kernel per (format, ISA); they differ only in the dot above, but a function
// compiled for one target cannot inline intrinsics of another, so the bodies are stamped
// out per target by this macro. U: accumulators per row, alternated across blocks.
#define TQ_DEFINE_TILES(ATTR, SUFFIX, DOT)                                                                            \
  template <int MT>                                                                                                   \
  ATTR void q4_1_##SUFFIX(const uint8_t* w, int64_t row_bytes, int64_t rows, const Acts& a, int64_t m0, float* res) { \
    constexpr int U = MT <= 2 ? 2 : 1;                                                                                \
    const int8_t* qa[MT];                                                                                             \
    const float* da[MT];                                                                                              \
    const float* sa[MT];                                                                                              \
    for (int i = 0; i < MT; ++i) {                                                                                    \
      qa[i] = a.q + (m0 + i) * a.k;                                                                                   \
      da[i] = a.d + (m0 + i) * a.kb;                                                                                  \
      sa[i] = a.s + (m0 + i) * a.kb;                                                                                  \
    }                                                                                                                 \
    for (int64_t r = 0; r < rows; ++r) {                                                                              \
      const uint8_t* row = w + r * row_bytes;                                                                         \
      __m256 acc[U][MT];                                                                                              \
      float ms[U][MT];                                                                                                \
      for (int u = 0; u < U; ++u)                                                                                     \
        for (int i = 0; i < MT; ++i) {                                                                                \
          acc[u][i] = _mm256_setzero_ps();                                                                            \
          ms[u][i] = 0.f;                                                                                             \
        }                                                                                                             \
      for (int64_t b0 = 0; b0 < a.kb; b0 += U) {                                                                      \
        for (int u = 0; u < U; ++u) {                                                                                 \
          const int64_t b = b0 + u;                                                                                   \
          if (U > 1 && b >= a.kb) break;                                                                              \
          const uint8_t* blk = row + b * kQ4_1Bytes;                                                                  \
          const __m256i qw = unpack_q4(blk);                                                                          \
          const float dw = half_at_f16c(blk), mw = half_at_f16c(blk + 2);                                             \
          for (int i = 0; i < MT; ++i) {                                                                              \
            const __m256 p = _mm256_cvtepi32_ps(DOT(qw, load32(qa[i] + b * kBlock)));                                 \
            acc[u][i] = _mm256_fmadd_ps(p, _mm256_set1_ps(dw * da[i][b]), acc[u][i]);                                 \
            ms[u][i] += mw * sa[i][b];                                                                                \
          }                                                                                                           \
        }                                                                                                             \
      }                                                                                                               \
      for (int i = 0; i < MT; ++i) {                                                                                  \
        __m256 t = acc[0][i];                                                                                         \
        float mt = ms[0][i];                                                                                          \
        for (int u = 1; u < U; ++u) {                                                                                 \
          t = _mm256_add_ps(t, acc[u][i]);                                                                            \
          mt += ms[u][i];                                                                                             \
        }                                                                                                             \
        res[i * rows + r] = hsum8(t) + mt;                                                                            \
      }                                                                                                               \
    }                                                                                                                 \
  }                                                                                                                   \
                                                                                                                      \
  template <int MT>                                                                                                   \
  ATTR void q8_0_##SUFFIX(const uint8_t* w, int64_t row_bytes, int64_t rows, const Acts& a, int64_t m0, float* res) { \
    constexpr int U = MT <= 2 ? 2 : 1;                                                                                \
    const int8_t* qa[MT];                                                                                             \
    const float* da[MT];                                                                                              \
    for (int i = 0; i < MT; ++i) {                                                                                    \
      qa[i] = a.q + (m0 + i) * a.k;                                                                                   \
      da[i] = a.d + (m0 + i) * a.kb;                                                                                  \
    }                                                                                                                 \
    for (int64_t r = 0; r < rows; ++r) {                                                                              \
      const uint8_t* row = w + r * row_bytes;                                                                         \
      __m256 acc[U][MT];                                                                                              \
      for (int u = 0; u < U; ++u)                                                                                     \
        for (int i = 0; i < MT; ++i) acc[u][i] = _mm256_setzero_ps();                                                 \
      for (int64_t b0 = 0; b0 < a.kb; b0 += U) {                                                                      \
        for (int u = 0; u < U; ++u) {                                                                                 \
          const int64_t b = b0 + u;                                                                                   \
          if (U > 1 && b >= a.kb) break;                                                                              \
          const uint8_t* blk = row + b * kQ8_0Bytes;                                                                  \
          const __m256i qw = load32(reinterpret_cast<const int8_t*>(blk + 2));                                        \
          const __m256i aw = _mm256_abs_epi8(qw);                                                                     \
          const float dw = half_at_f16c(blk);                                                                         \
          for (int i = 0; i < MT; ++i) {                                                                              \
            const __m256i sx = _mm256_sign_epi8(load32(qa[i] + b * kBlock), qw);                                      \
            const __m256 p = _mm256_cvtepi32_ps(DOT(aw, sx));                                                         \
            acc[u][i] = _mm256_fmadd_ps(p, _mm256_set1_ps(dw * da[i][b]), acc[u][i]);                                 \
          }                                                                                                           \
        }                                                                                                             \
      }                                                                                                               \
      for (int i = 0; i < MT; ++i) {                                                                                  \
        __m256 t = acc[0][i];                                                                                         \
        for (int u = 1; u < U; ++u) t = _mm256_add_ps(t, acc[u][i]);                                                  \
        res[i * rows + r] = hsum8(t);                                                                                 \
      }                                                                                                               \
    }                                                                                                                 \
  }

TQ_DEFINE_TILES(TQ_AVX2, avx2, dot_avx2)
TQ_DEFINE_TILES(TQ_VNNI, vnni, dot_vnni)

#endif  // TQ_X86

// ---------------------------------------------------------------------------------------------
// Dispatch

struct Paths {
  QuantizeFn quantize;
  TileFn q4_1[kMaxTile + 1];  // by tile height 1..kMaxTile
  TileFn q8_0[kMaxTile + 1];
};

#define TQ_TILES(NAME) {nullptr, &NAME<1>, &NAME<2>, &NAME<3>, &NAME<4>}

const Paths& paths(int isa) {
  static const Paths scalar{&quantize_scalar, TQ_TILES(q4_1_scalar), TQ_TILES(q8_0_scalar)};
#ifdef TQ_X86
  static const Paths avx2{&quantize_avx2, TQ_TILES(q4_1_avx2), TQ_TILES(q8_0_avx2)};
  static const Paths vnni{&quantize_avx2, TQ_TILES(q4_1_vnni), TQ_TILES(q8_0_vnni)};
  if (isa == kVnni || isa == kAmx) return vnni;  // AMX quantizes as VNNI does
  if (isa == kAvx2) return avx2;
#endif
  return scalar;
}

bool supported(int isa) {
  if (isa == kScalar) return true;
#ifdef TQ_X86
  __builtin_cpu_init();
  const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  if (isa == kAvx2) return avx2;
  const bool vnni = avx2 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                    __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni");
  if (isa == kVnni) return vnni;
  if (isa == kAmx) return vnni && amx_refusal().empty();  // asks Linux for the tile state once
#endif
  return false;
}

int best_isa() {
  static const int best = supported(kAmx)    ? kAmx
                          : supported(kVnni) ? kVnni
                          : supported(kAvx2) ? kAvx2
                                             : kScalar;
  return best;
}

std::atomic<int> g_isa{-1};  // -1: the best the CPU runs

int current_isa() {
  const int isa = g_isa.load(std::memory_order_relaxed);
  return isa < 0 ? best_isa() : isa;
}

// The path of a call with m activation rows: the forced one, else the best, but VNNI rather
// than AMX below kAmxMinRows.
int isa_for_rows(int64_t m) {
  const int isa = current_isa();
  return isa == kAmx && g_isa.load(std::memory_order_relaxed) < 0 && m < kAmxMinRows ? kVnni : isa;
}

std::string set_isa(const std::string& name) {
  const int before = g_isa.load();
  const std::string previous = before < 0 ? "auto" : kIsaNames[before];
  if (name == "auto") {
    g_isa.store(-1);
    return previous;
  }
  for (int isa = 0; isa < kNumIsas; ++isa) {
    if (name != kIsaNames[isa]) continue;
    TORCH_CHECK_VALUE(supported(isa), "set_isa: this CPU cannot run the ", name, " path");
    g_isa.store(isa);
    return previous;
  }
  TORCH_CHECK_VALUE(false, "set_isa: isa must be auto, amx, vnni, avx2 or scalar, got '", name, "'");
  return previous;
}

std::vector<std::string> available_isas() {
  std::vector<std::string> out;
  for (int isa = kNumIsas - 1; isa >= 0; --isa)
    if (supported(isa)) out.emplace_back(kIsaNames[isa]);
  return out;
}

std::string isa_in_use() { return kIsaNames[current_isa()]; }

std::string amx_refusal_op() { return amx_refusal(); }

// ---------------------------------------------------------------------------------------------
// The ops

void check_args(const char* op, const at::Tensor& x, const at::Tensor& blocks, const std::optional<at::Tensor>& bias,
                int64_t block_bytes) {
  TORCH_CHECK_VALUE(x.dim() == 2, op, ": x must have 2 dimensions [M, K], got shape ", x.sizes());
  TORCH_CHECK_VALUE(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, op,
                    ": x must have dtype float32 or bfloat16, got ", x.scalar_type());
  const int64_t k = x.size(1);
  TORCH_CHECK_VALUE(k > 0 && k % kBlock == 0, op, ": x.shape[1] (K) must be a positive multiple of 32, got ", k);
  TORCH_CHECK_VALUE(blocks.dim() == 2, op, ": blocks must have 2 dimensions [N, K / 32 * ", block_bytes,
                    "], got shape ", blocks.sizes());
  TORCH_CHECK_VALUE(blocks.scalar_type() == at::kByte, op, ": blocks must have dtype uint8, got ",
                    blocks.scalar_type());
  TORCH_CHECK_VALUE(blocks.size(1) == k / kBlock * block_bytes, op, ": blocks must have shape [N, K / 32 * ",
                    block_bytes, "] = [N, ", k / kBlock * block_bytes, "] for K = ", k, ", got ", blocks.sizes());
  TORCH_CHECK_VALUE(blocks.is_contiguous(), op, ": blocks must be contiguous");
  TORCH_CHECK_VALUE(x.device() == blocks.device(), op, ": x and blocks must be on one device, got ", x.device(),
                    " and ", blocks.device());
  if (bias.has_value()) {
    const at::Tensor& b = *bias;
    TORCH_CHECK_VALUE(b.dim() == 1 && b.size(0) == blocks.size(0), op, ": bias must have shape [N] = [",
                      blocks.size(0), "], got ", b.sizes());
    TORCH_CHECK_VALUE(b.scalar_type() == at::kFloat || b.scalar_type() == x.scalar_type(), op,
                      ": bias must have dtype float32 or x's, got ", b.scalar_type());
    TORCH_CHECK_VALUE(b.device() == x.device(), op, ": bias must be on x's device, got ", b.device());
  }
}

// The activations' quantization, shared by the linear ops and the op that exposes it. Rows
// are split between threads only when there are enough of them to pay for waking them.
void quantize_into(const at::Tensor& x, const Paths& p, int8_t* q, float* d, float* s) {
  const int64_t m = x.size(0), k = x.size(1);
  const bool bf16 = x.scalar_type() == at::kBFloat16;
  const void* xp = x.const_data_ptr();
  const int64_t grain = std::max<int64_t>(1, (64 * 1024) / k);
  at::parallel_for(0, m, grain, [&](int64_t b, int64_t e) { p.quantize(xp, bf16, b, e, k, q, d, s); });
}

template <typename T>
void store(const float* res, int mt, int64_t rows, T* y, int64_t ldy, int64_t m0, int64_t n0, const float* bias) {
  for (int i = 0; i < mt; ++i) {
    T* out = y + (m0 + i) * ldy + n0;
    const float* src = res + i * rows;
    for (int64_t r = 0; r < rows; ++r) out[r] = static_cast<T>(src[r] + (bias ? bias[n0 + r] : 0.f));
  }
}

at::Tensor quant_linear(const char* op, Format format, const at::Tensor& x_in, const at::Tensor& blocks,
                        const std::optional<at::Tensor>& bias) {
  const int64_t block_bytes = format == Format::kQ4_1 ? kQ4_1Bytes : kQ8_0Bytes;
  check_args(op, x_in, blocks, bias, block_bytes);
  const at::Tensor x = x_in.contiguous();
  const int64_t m = x.size(0), k = x.size(1), n = blocks.size(0), kb = k / kBlock;
  at::Tensor y = at::empty({m, n}, x.options());
  if (m == 0 || n == 0) return y;

  const int isa = isa_for_rows(m);
  const Paths& p = paths(isa);
  std::unique_ptr<int8_t[]> q(new int8_t[m * k]);
  std::unique_ptr<float[]> ds(new float[2 * m * kb]);
  quantize_into(x, p, q.get(), ds.get(), ds.get() + m * kb);
  const Acts acts{q.get(), ds.get(), ds.get() + m * kb, k, kb};

  at::Tensor bias32;
  if (bias.has_value()) bias32 = bias->to(at::kFloat).contiguous();
  const Output out{y.mutable_data_ptr(), x.scalar_type() == at::kBFloat16, n,
                   bias32.defined() ? bias32.const_data_ptr<float>() : nullptr};
  const uint8_t* w = blocks.const_data_ptr<uint8_t>();
  const int64_t row_bytes = blocks.size(1);
  const int64_t sub = std::clamp<int64_t>(kSubChunkBytes / row_bytes, 1, kMaxSubRows);
  // A thread's share is at least a few sub-chunks of work, so a small layer is not split
  // across threads that each do less than waking them costs.
  const int64_t grain = std::max<int64_t>(1, (32 * 1024) / (row_bytes * std::min<int64_t>(m, kMaxTile)));

  if (isa == kAmx) {  // kernels/quant_linear_amx.cpp
    amx_batch(format == Format::kQ4_1, acts, m, w, n, row_bytes, grain, out);
    return y;
  }
  // Batches on the SIMD paths: kernels/quant_linear_batch.cpp.
  if (packed_batch(format == Format::kQ4_1, isa, acts, m, w, n, row_bytes, sub, grain, out)) return y;

  const TileFn* tiles = format == Format::kQ4_1 ? p.q4_1 : p.q8_0;
  at::parallel_for(0, n, grain, [&](int64_t begin, int64_t end) {
    float res[kMaxTile * kMaxSubRows];
    for (int64_t n0 = begin; n0 < end; n0 += sub) {
      const int64_t rows = std::min(sub, end - n0);
      for (int64_t m0 = 0; m0 < m; m0 += kMaxTile) {
        const int mt = static_cast<int>(std::min<int64_t>(kMaxTile, m - m0));
        tiles[mt](w + n0 * row_bytes, row_bytes, rows, acts, m0, res);
        store_tile(out, res, mt, rows, m0, n0);
      }
    }
  });
  return y;
}

at::Tensor q4_1_linear(const at::Tensor& x, const at::Tensor& blocks, const std::optional<at::Tensor>& bias) {
  return quant_linear("q4_1_linear", Format::kQ4_1, x, blocks, bias);
}

at::Tensor q8_0_linear(const at::Tensor& x, const at::Tensor& blocks, const std::optional<at::Tensor>& bias) {
  return quant_linear("q8_0_linear", Format::kQ8_0, x, blocks, bias);
}

// (q int8 [M, K], d float32 [M, K / 32], s float32 [M, K / 32]) as the linear ops compute
// them, on the path in use: for tests to hold every path to the torch path's bits.
std::tuple<at::Tensor, at::Tensor, at::Tensor> quantize_activations(const at::Tensor& x_in) {
  TORCH_CHECK_VALUE(x_in.dim() == 2 && x_in.size(1) % kBlock == 0, "quantize_activations: x must be [M, K], ",
                    "K a multiple of 32, got shape ", x_in.sizes());
  TORCH_CHECK_VALUE(x_in.scalar_type() == at::kFloat || x_in.scalar_type() == at::kBFloat16,
                    "quantize_activations: x must have dtype float32 or bfloat16, got ", x_in.scalar_type());
  const at::Tensor x = x_in.contiguous();
  const int64_t m = x.size(0), kb = x.size(1) / kBlock;
  at::Tensor q = at::empty({m, x.size(1)}, x.options().dtype(at::kChar));
  at::Tensor d = at::empty({m, kb}, x.options().dtype(at::kFloat));
  at::Tensor s = at::empty({m, kb}, x.options().dtype(at::kFloat));
  if (m > 0 && kb > 0)
    quantize_into(x, paths(current_isa()), q.mutable_data_ptr<int8_t>(), d.mutable_data_ptr<float>(),
                  s.mutable_data_ptr<float>());
  return {q, d, s};
}

}  // namespace

void store_tile(const Output& out, const float* res, int mt, int64_t rows, int64_t m0, int64_t n0) {
  if (out.bf16)
    store(res, mt, rows, static_cast<c10::BFloat16*>(out.y), out.ldy, m0, n0, out.bias);
  else
    store(res, mt, rows, static_cast<float*>(out.y), out.ldy, m0, n0, out.bias);
}

}  // namespace tq


TORCH_LIBRARY(tandem_quant, m) {
  m.def("q4_1_linear(Tensor x, Tensor blocks, Tensor? bias=None) -> Tensor");
  m.def("q8_0_linear(Tensor x, Tensor blocks, Tensor? bias=None) -> Tensor");
  m.def("quantize_activations(Tensor x) -> (Tensor, Tensor, Tensor)");
  m.def("set_isa(str isa) -> str", &tq::set_isa);
  m.def("available_isas() -> str[]", &tq::available_isas);
  m.def("isa() -> str", &tq::isa_in_use);
  m.def("amx_refusal() -> str", &tq::amx_refusal_op);
}

TORCH_LIBRARY_IMPL(tandem_quant, CPU, m) {
  m.impl("q4_1_linear", &tq::q4_1_linear);
  m.impl("q8_0_linear", &tq::q8_0_linear);
  m.impl("quantize_activations", &tq::quantize_activations);
}

// The CPU kernels of the custom ops kernels/quant_linear.py defines (it loads this library
// after defining them): CPU calls then reach C++ straight from the dispatcher.
TORCH_LIBRARY_IMPL(tandem, CPU, m) {
  m.impl("q4_1_linear", &tq::q4_1_linear);
  m.impl("q8_0_linear", &tq::q8_0_linear);
}
