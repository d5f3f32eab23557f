// What the parts of the quantized linear kernels share: kernels/quant_linear.cpp (the
// activations' quantization, the per-block tile kernels, dispatch and the ops),
// kernels/quant_linear_batch.cpp (Q4_1 and Q8_0 batches over repacked weights) and
// kernels/quant_linear_amx.cpp (the AMX int8 path). The design notes are at the top of
// quant_linear.cpp; kernels/quant_linear.py gives the block layouts and the math.

#pragma once

#include <c10/util/Half.h>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define TQ_X86 1
#endif

#include <cstdint>
#include <cstring>
#include <string>

namespace tq {

constexpr int64_t kBlock = 32;
constexpr int64_t kQ4_1Bytes = 20;  // fp16 d, fp16 m, 16 bytes of nibbles
constexpr int64_t kQ8_0Bytes = 34;  // fp16 d, 32 int8
constexpr int kMaxTile = 4;         // activation rows per pass over a sub-chunk of weights
constexpr int64_t kMaxSubRows = 64;
// Weight bytes per sub-chunk: re-read by every tile of activation rows, so kept within L1.
constexpr int64_t kSubChunkBytes = 16 * 1024;

enum Isa : int { kScalar = 0, kAvx2 = 1, kVnni = 2, kAmx = 3 };

// Quantized activations, row-major: q [M, K], d and s [M, K / 32] (s = d * sum(q), Q4_1 only).
struct Acts {
  const int8_t* q;
  const float* d;
  const float* s;
  int64_t k;
  int64_t kb;
};

// Where a call's results go: y [M, ldy] in float32 or bfloat16, plus bias [N] (or null).
struct Output {
  void* y;
  bool bf16;
  int64_t ldy;
  const float* bias;
};

// Stores the partial results of one tile, res[i * rows + r] for output row n0 + r of
// activation row m0 + i (i < mt), adding the bias (quant_linear.cpp).
void store_tile(const Output& out, const float* res, int mt, int64_t rows, int64_t m0, int64_t n0);

// Q4_1 (q4) or Q8_0 over repacked weights, for M >= kMaxTile activation rows (Q4_1) or
// M > kMaxTile (Q8_0), on the avx2 or vnni path (quant_linear_batch.cpp): false, having done
// nothing, where it has no such path. The threads split the N outputs with
// at::parallel_for(grain), each taking sub-chunks of `sub` weight rows.
bool packed_batch(bool q4, int isa, const Acts& a, int64_t m, const uint8_t* w, int64_t n, int64_t row_bytes,
                  int64_t sub, int64_t grain, const Output& out);

// The AMX int8 path (quant_linear_amx.cpp), Q4_1 (q4) or Q8_0, any M: the threads split the N
// outputs in groups of 16 with at::parallel_for(grain / 16). Only where amx_refusal() is empty.
void amx_batch(bool q4, const Acts& a, int64_t m, const uint8_t* w, int64_t n, int64_t row_bytes, int64_t grain,
               const Output& out);

// Why this process cannot run the AMX path ("" when it can): the CPU lacks it, or Linux refused
// the tile state. Asks Linux for it once per process, on the first call.
const std::string& amx_refusal();

#ifdef TQ_X86

#define TQ_AVX2 __attribute__((target("avx2,fma,f16c")))
#define TQ_VNNI __attribute__((target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")))

TQ_AVX2 inline float half_at_f16c(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return _cvtsh_ss(h);
}

TQ_AVX2 inline float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// A Q4_1 block's 32 nibbles as bytes 0..15, in the activations' order: low nibbles (weights
// 0..15) in the low half, high nibbles (16..31) in the high half.
TQ_AVX2 inline __m256i unpack_q4(const uint8_t* blk) {
  const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 4));
  const __m256i both = _mm256_set_m128i(_mm_srli_epi16(q, 4), q);
  return _mm256_and_si256(both, _mm256_set1_epi8(0x0F));
}

// 8 vectors of 8 dwords, transposed in place: dword l of vector t <-> dword t of vector l.
TQ_AVX2 inline void transpose8x8_epi32(__m256i* r) {
  __m256i t[8], u[8];
  for (int i = 0; i < 8; i += 2) {
    t[i] = _mm256_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm256_unpackhi_epi32(r[i], r[i + 1]);
  }
  for (int i = 0; i < 8; i += 4) {
    u[i] = _mm256_unpacklo_epi64(t[i], t[i + 2]);
    u[i + 1] = _mm256_unpackhi_epi64(t[i], t[i + 2]);
    u[i + 2] = _mm256_unpacklo_epi64(t[i + 1], t[i + 3]);
    u[i + 3] = _mm256_unpackhi_epi64(t[i + 1], t[i + 3]);
  }
  for (int i = 0; i < 4; ++i) {
    r[i] = _mm256_permute2x128_si256(u[i], u[i + 4], 0x20);
    r[i + 4] = _mm256_permute2x128_si256(u[i], u[i + 4], 0x31);
  }
}

#endif  // TQ_X86

}  // namespace tq
