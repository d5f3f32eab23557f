// The AMX int8 path of the quantized linear kernels (Q4_1 and Q8_0): amx_batch, declared in
// kernels/quant_linear.h, which quant_linear.cpp runs where the CPU has AMX and the rows pay.
//
// AMX multiplies tiles: C [16 x 16 int32] += A [16 rows x 64 bytes] . B (16 columns of 64
// bytes in the "VNNI" layout: B's row t holds bytes 4t..4t+3 of each column), one tile op
// doing the work of 16 AVX-512 vpdpbusd. Here, per block b of 32 inputs:
//   A  = 16 weight rows (N), their block b's 32 weights as bytes: Q8_0's straight from the
//        GGUF blocks (a row stride of the blocks' bytes), Q4_1's unpacked from nibbles once
//        per call into a buffer of 16 rows;
//   B  = 16 activation rows (M), block b, repacked once per call (a few KB);
//   C  = the 16 x 16 integer block sums, stored to L1 and finished in AVX-512, per weight row
//        n, across the 16 activation rows m in the lanes:
//        acc[n] += float(C[n]) * (d_w[n, b] * d_a[b])  (+ m_w[n, b] * s_a[b] for Q4_1).
// One block (K = 32, half a tile's depth) per tile op, because each block has its own scales:
// summing two blocks in int32 would mix them. The float finish costs more than the tile op
// (three or four AVX-512 ops per weight row per block, whatever the number of activation rows),
// which is why AMX pays only from several rows on, and decode (one row) stays on VNNI.
// Weights in the rows (not the lanes) spare them a transpose: only the activations, reused by
// every weight row, are laid out for B.
//
// Signs: AMX has every signedness of the byte products, so neither the sign trick nor the
// +128 offset of the AVX2 / VNNI paths is needed: Q4_1 multiplies unsigned nibbles 0..15 (A) by
// signed activations (B) with tdpbusd, Q8_0 signed by signed with tdpbssd. Sums are exact in
// int32 (|sum| <= 32 * 128 * 127).
//
// Threads split the weight rows in groups of 16 (at::parallel_for); each thread configures its
// own tiles (the configuration is per thread) and releases them when done.
//
// Linux hands out the tile state (8 KB of XSAVE area) only on request: amx_refusal asks once
// per process (arch_prctl ARCH_REQ_XCOMP_PERM, XTILEDATA), and the path is off, with the
// reason, where the kernel refuses or the CPU lacks it.

#include "quant_linear.h"

#include <ATen/Parallel.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <memory>
#include <string>
#include <utility>

#if defined(TQ_X86) && defined(__linux__)
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>
#define TQ_HAVE_AMX 1
#endif

namespace tq {

#ifdef TQ_HAVE_AMX

namespace {

#define TQ_AMX \
  __attribute__((target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni,amx-tile,amx-int8")))

constexpr int64_t kRows = 16;               // weight rows per group, activation rows per tile
constexpr int64_t kTileB = kRows * kBlock;  // 512 bytes: B for one block of 16 activation rows

// The tile configuration (palette 1): tmm0/1 C, tmm2/3 A, tmm4/5 B, two of each so that one
// block's tile op runs while the previous block's sums are finished in AVX-512. Fixed shapes:
// padding rows are zeros, and a tile op's time goes by A's rows (16 weight rows) anyway.
struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

TQ_AMX void configure() {
  TileConfig cfg;
  for (int t = 0; t < 2; ++t) {
    cfg.rows[t] = kRows;  // C: 16 weight rows x 16 activation rows (int32)
    cfg.colsb[t] = 64;
    cfg.rows[2 + t] = kRows;  // A: 16 weight rows x 32 bytes
    cfg.colsb[2 + t] = kBlock;
    cfg.rows[4 + t] = kBlock / 4;  // B: 8 x (16 activation rows x 4 bytes)
    cfg.colsb[4 + t] = 64;
  }
  // GCC's _tile_loadconfig tells the compiler it reads 8 bytes: the barrier makes it finish
  // writing all 64 first.
  asm volatile("" ::: "memory");
  _tile_loadconfig(&cfg);
}

TQ_AMX void release() { _tile_release(); }

// The activations for B, per tile of 16 rows T and block b: q at (T * kb + b) * 512, row t
// (64 bytes) = dword t of the block of each of the 16 rows (two 8 x 8 dword transposes); d and
// s at (T * kb + b) * 16. Rows past M are zero.
TQ_AMX void pack_acts(const Acts& a, int64_t m, int64_t tiles, int8_t* q, float* d, float* s) {
  const int64_t kb = a.kb;
  for (int64_t tile = 0; tile < tiles; ++tile)
    for (int64_t b = 0; b < kb; ++b) {
      const int64_t o = tile * kb + b;
      for (int h = 0; h < 2; ++h) {
        __m256i v[8];
        for (int l = 0; l < 8; ++l) {
          const int64_t i = tile * kRows + 8 * h + l;
          v[l] = i < m ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.q + i * a.k + b * kBlock))
                       : _mm256_setzero_si256();
          d[o * kRows + 8 * h + l] = i < m ? a.d[i * kb + b] : 0.f;
          s[o * kRows + 8 * h + l] = i < m ? a.s[i * kb + b] : 0.f;
        }
        transpose8x8_epi32(v);
        for (int t = 0; t < 8; ++t)
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + o * kTileB + 64 * t + 32 * h), v[t]);
      }
    }
}

// A group of up to 16 weight rows for A: Q4_1's unpacked into wq [16, K] bytes (rows past
// `rows` zero); the blocks' d (and m) as float32, ws[r * kbp + b] (and ws[(16 + r) * kbp + b]),
// zero past `rows`, kbp = kb rounded up to 16. Q8_0's rows are read in place, or (a short last
// group) copied into wq [16, row_bytes] with zero rows after them. Returns A's base and row
// stride.
TQ_AMX std::pair<const uint8_t*, int64_t> pack_weights(bool q4, const uint8_t* w, int64_t row_bytes, int64_t rows,
                                                       int64_t kb, uint8_t* wq, float* ws) {
  const int64_t block_bytes = q4 ? kQ4_1Bytes : kQ8_0Bytes, kbp = (kb + 15) / 16 * 16;
  // The scales of 16 blocks of a row in one gather (d, and m above it in Q4_1's dword), where
  // one float16 conversion each cost as much as unpacking the row's weights.
  const __m512i offsets = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                             _mm512_set1_epi32(static_cast<int>(block_bytes)));
  for (int64_t r = 0; r < kRows; ++r) {
    float* d = ws + r * kbp;
    float* mins = ws + (kRows + r) * kbp;
    for (int64_t b0 = 0; b0 < kbp; b0 += 16) {
      const __mmask16 mask = r >= rows ? 0 : kb - b0 >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << (kb - b0)) - 1);
      const __m512i v = _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), mask, offsets,
                                                    w + r * row_bytes + b0 * block_bytes, 1);
      _mm512_storeu_ps(d + b0, _mm512_cvtph_ps(_mm512_cvtepi32_epi16(v)));
      if (q4) _mm512_storeu_ps(mins + b0, _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(v, 16))));
    }
  }
  if (!q4) {
    if (rows == kRows) return {w + 2, row_bytes};
    std::memset(wq, 0, kRows * row_bytes);
    std::memcpy(wq, w, rows * row_bytes);
    return {wq + 2, row_bytes};
  }
  const int64_t k = kb * kBlock;
  for (int64_t r = 0; r < kRows; ++r) {
    uint8_t* dst = wq + r * k;
    if (r >= rows) {
      std::memset(dst, 0, k);
      continue;
    }
    const uint8_t* row = w + r * row_bytes;
    for (int64_t b = 0; b < kb; ++b)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + b * kBlock), unpack_q4(row + b * kQ4_1Bytes));
  }
  return {wq, k};
}

// acc[r] += float(c[r]) * (d_w[r] * d_a)  (+ m_w[r] * s_a), the activation rows in the lanes;
// d_w[r] at wd[r * kbp], m_w[r] at wd[(16 + r) * kbp].
template <bool Q4>
TQ_AMX inline void finish_block(const int32_t* c, const float* wd, int64_t kbp, const float* da, const float* sa,
                                __m512* acc) {
  const __m512 d = _mm512_loadu_ps(da);
  const __m512 s = _mm512_loadu_ps(sa);
#pragma GCC unroll 16
  for (int r = 0; r < kRows; ++r) {
    const __m512 p = _mm512_cvtepi32_ps(_mm512_load_si512(c + 16 * r));
    acc[r] = _mm512_fmadd_ps(p, _mm512_mul_ps(d, _mm512_set1_ps(wd[r * kbp])), acc[r]);
    if (Q4) acc[r] = _mm512_fmadd_ps(s, _mm512_set1_ps(wd[(kRows + r) * kbp]), acc[r]);
  }
}

// One group of 16 weight rows (A at wa, row stride lda; scales ws) against activation tile T:
// out[r * 16 + i] for weight row r and activation row i of the tile. Meanwhile it fetches
// `ahead_bytes` at `ahead` (the next group's weights) into L2, a few lines per block: packing a
// group reads memory and the tiles do not, so without it the two took turns (AMX at one row
// cost twice VNNI's time, which reads as it computes).
template <bool Q4>
TQ_AMX void group_tile(const uint8_t* wa, int64_t lda, const float* ws, const int8_t* bq, const float* bd,
                       const float* bs, int64_t kb, int64_t kbp, int64_t block_bytes, const uint8_t* ahead,
                       int64_t ahead_bytes, float* out) {
  alignas(64) int32_t c0[kRows * 16], c1[kRows * 16];
  __m512 acc[kRows];
  for (int r = 0; r < kRows; ++r) acc[r] = _mm512_setzero_ps();
  const int64_t lines = (ahead_bytes + 63) / 64, per_pair = 2 * ((lines + kb - 1) / kb);
  for (int64_t b = 0; b < kb; b += 2) {
    for (int64_t l = b / 2 * per_pair; l < std::min(lines, (b / 2 + 1) * per_pair); ++l)
      _mm_prefetch(reinterpret_cast<const char*>(ahead + 64 * l), _MM_HINT_T1);
    const bool two = b + 1 < kb;
    _tile_zero(0);
    _tile_loadd(2, wa + b * block_bytes, lda);
    _tile_loadd(4, bq + b * kTileB, 64);
    if (Q4)
      _tile_dpbusd(0, 2, 4);
    else
      _tile_dpbssd(0, 2, 4);
    if (two) {
      _tile_zero(1);
      _tile_loadd(3, wa + (b + 1) * block_bytes, lda);
      _tile_loadd(5, bq + (b + 1) * kTileB, 64);
      if (Q4)
        _tile_dpbusd(1, 3, 5);
      else
        _tile_dpbssd(1, 3, 5);
    }
    _tile_stored(0, c0, 64);
    finish_block<Q4>(c0, ws + b, kbp, bd + b * kRows, bs + b * kRows, acc);
    if (two) {
      _tile_stored(1, c1, 64);
      finish_block<Q4>(c1, ws + b + 1, kbp, bd + (b + 1) * kRows, bs + (b + 1) * kRows, acc);
    }
  }
  for (int r = 0; r < kRows; ++r) _mm512_storeu_ps(out + 16 * r, acc[r]);
}

std::string amx_refused() {
  __builtin_cpu_init();
  unsigned eax, ebx, ecx, edx;
  if (!__get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx) || !(edx & (1u << 24)) || !(edx & (1u << 25)))
    return "the CPU lacks AMX (amx_tile, amx_int8)";
  if (!(__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
        __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni")))
    return "the CPU has AMX but not AVX-512 VNNI, which finishes the tiles' sums";
  // Linux >= 5.16 enables the tile state in XCR0 but hands it to a process only on request.
  constexpr long kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
  if (syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) != 0)
    return std::string("Linux refused the AMX tile state (arch_prctl ARCH_REQ_XCOMP_PERM: ") +
           std::strerror(errno) + "; a kernel before 5.16?)";
  return "";
}

// The reason, said once where the CPU has AMX but this process cannot use it.
std::string amx_check() {
  std::string reason = amx_refused();
  if (!reason.empty() && reason.rfind("the CPU lacks", 0) != 0)
    TORCH_WARN("kernels.quant_linear: ", reason, "; the AMX path is off, VNNI runs instead");
  return reason;
}

}  // namespace

const std::string& amx_refusal() {
  static const std::string reason = amx_check();
  return reason;
}

void amx_batch(bool q4, const Acts& a, int64_t m, const uint8_t* w, int64_t n, int64_t row_bytes, int64_t grain,
               const Output& out) {
  const int64_t kb = a.kb, kbp = (kb + 15) / 16 * 16, tiles = (m + kRows - 1) / kRows;
  std::unique_ptr<int8_t[]> bq(new int8_t[tiles * kb * kTileB]);
  std::unique_ptr<float[]> bds(new float[2 * tiles * kb * kRows]);
  float* bd = bds.get();
  float* bs = bds.get() + tiles * kb * kRows;
  pack_acts(a, m, tiles, bq.get(), bd, bs);
  // Q4_1: A's 16 unpacked rows of K bytes; Q8_0: a short last group's 16 rows of blocks.
  const int64_t wq_bytes = kRows * std::max(kb * kBlock, row_bytes);
  const int64_t block_bytes = q4 ? kBlock : kQ8_0Bytes;  // A's step from one block to the next
  const auto group = q4 ? &group_tile<true> : &group_tile<false>;
  const int64_t groups = (n + kRows - 1) / kRows;
  at::parallel_for(0, groups, std::max<int64_t>(1, grain / kRows), [&](int64_t begin, int64_t end) {
    std::unique_ptr<uint8_t[]> wq(new uint8_t[wq_bytes]);
    std::unique_ptr<float[]> ws(new float[2 * kRows * kbp]);
    alignas(64) float sums[kRows * kRows];
    float res[kRows * kRows];
    configure();
    for (int64_t g = begin; g < end; ++g) {
      const int64_t n0 = g * kRows, valid = std::min(kRows, n - n0);
      const auto [wa, lda] = pack_weights(q4, w + n0 * row_bytes, row_bytes, valid, kb, wq.get(), ws.get());
      // The tile loads read the buffers behind the compiler's back (GCC's _tile_loadd declares
      // no memory operand): the barrier keeps the packing's stores before them.
      asm volatile("" ::: "memory");
      for (int64_t tile = 0; tile < tiles; ++tile) {
        const int64_t m0 = tile * kRows;
        const int mt = static_cast<int>(std::min(kRows, m - m0));
        const int64_t ahead = tile == 0 ? std::min(kRows, n - n0 - kRows) : 0;
        group(wa, lda, ws.get(), bq.get() + tile * kb * kTileB, bd + tile * kb * kRows, bs + tile * kb * kRows, kb,
              kbp, block_bytes, w + (n0 + kRows) * row_bytes, std::max<int64_t>(ahead, 0) * row_bytes, sums);
        // sums holds weight rows in rows, activation rows in lanes; y wants them the other way.
        for (int i = 0; i < mt; ++i)
          for (int64_t r = 0; r < valid; ++r) res[i * valid + r] = sums[r * kRows + i];
        store_tile(out, res, mt, valid, m0, n0);
      }
    }
    release();
  });
}

#else  // no AMX on this platform

const std::string& amx_refusal() {
  static const std::string reason = "AMX needs x86-64 Linux";
  return reason;
}

void amx_batch(bool, const Acts&, int64_t, const uint8_t*, int64_t, int64_t, int64_t, const Output&) {}

#endif  // TQ_HAVE_AMX

}  // namespace tq
