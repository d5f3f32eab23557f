// Batches over repacked weights (Q4_1 from kMaxTile activation rows, Q8_0 from kMaxTile + 1),
// on the AVX2 and AVX-512 VNNI paths: the part of the quantized linear kernels that packed_batch
// (declared in kernels/quant_linear.h) runs for kernels/quant_linear.cpp.
//
// The tile kernels of quant_linear.cpp pay, for every block's product, a conversion and an FMA
// with its own scale per activation row, on top of the integer dot: the float work, not the
// dot, bounds a batch. Here 8 blocks share them. The weights are laid out "transposed" per
// group of 8 blocks: vector t of a group holds dword t (bytes 4t..4t+3) of each of its 8
// blocks, lane l for block l. The 8 integer dot instructions of a group then leave the full
// integer sum of block l in lane l, and one conversion and one or two FMAs finish 8 blocks. A
// thread repacks each sub-chunk of weight rows once (unpack, 8x8 dword transpose) and every
// tile of activation rows reuses it from L1.
//
// Q4_1: a group is 8 consecutive blocks of one weight row, and the activations are repacked
// alike once per call; d * da and m * sa are each a plain 8-float load.
// Q8_0: a group is block b of 8 consecutive weight rows, so lane l sums output row l and the
// activations stay as they are: dword t of the activation block is broadcast (one load) to
// all lanes. Nothing is padded along K (SmolLM2's K = 576 is 18 blocks, which groups of 8
// blocks would pad to 24), and the 8 lanes are 8 outputs, with no horizontal sum. The weights
// are signed, the dot instructions' left side unsigned: on VNNI the packed weights are w + 128
// and 128 * sum(qa), computed once per activation block, comes off the int32 sums, exactly
// (|sum| <= 32 * 255 * 127); on AVX2, whose vpmaddubsw int16 pair sums of (w + 128) * qa
// would saturate, the sign trick (|w| x qa with w's sign, pair sums <= 2 * 128 * 127).
// While the first tile of activation rows works on a sub-chunk, it prefetches the next one.

#include "quant_linear.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <memory>

namespace tq {

#ifdef TQ_X86

namespace {

constexpr int64_t kGroup = 8;                                    // blocks per group
constexpr int64_t kGroupBytes = kGroup * kBlock + 2 * kGroup * 4;  // 8 x 32 nibble bytes, 8 d, 8 m

// Rows of Q4_1 blocks -> per row, ceil(KB / 8) groups of kGroupBytes; blocks past KB are zero.
TQ_AVX2 void pack_q4_1(const uint8_t* w, int64_t row_bytes, int64_t rows, int64_t kb, uint8_t* out) {
  const int64_t groups = (kb + kGroup - 1) / kGroup;
  for (int64_t r = 0; r < rows; ++r) {
    const uint8_t* row = w + r * row_bytes;
    for (int64_t g = 0; g < groups; ++g) {
      uint8_t* dst = out + (r * groups + g) * kGroupBytes;
      float* dv = reinterpret_cast<float*>(dst + kGroup * kBlock);
      __m256i v[8];
      for (int l = 0; l < 8; ++l) {
        const int64_t b = g * kGroup + l;
        if (b < kb) {
          const uint8_t* blk = row + b * kQ4_1Bytes;
          v[l] = unpack_q4(blk);
          dv[l] = half_at_f16c(blk);
          dv[kGroup + l] = half_at_f16c(blk + 2);
        } else {
          v[l] = _mm256_setzero_si256();
          dv[l] = dv[kGroup + l] = 0.f;
        }
      }
      transpose8x8_epi32(v);
      for (int t = 0; t < 8; ++t) _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst) + t, v[t]);
    }
  }
}

// (The buffers are not 32-byte aligned: every load is unaligned.)
// Per group: 8 int32 lanes, lane l = sum of block l's 32 products. AVX2: a pair's products sum
// to at most 2 * 15 * 127 in int16, so eight vpmaddubsw results add up in int16 (30480 <
// 32767) before one vpmaddwd widens them.
TQ_AVX2 inline __m256i group_dot_avx2(const __m256i* w, const __m256i* a) {
  __m256i s = _mm256_maddubs_epi16(_mm256_loadu_si256(w), _mm256_loadu_si256(a));
  for (int t = 1; t < 8; ++t) s = _mm256_add_epi16(s, _mm256_maddubs_epi16(_mm256_loadu_si256(w + t), _mm256_loadu_si256(a + t)));
  return _mm256_madd_epi16(s, _mm256_set1_epi16(1));
}
TQ_VNNI inline __m256i group_dot_vnni(const __m256i* w, const __m256i* a) {
  // Two chains: one vpdpbusd after another in a single register waits out its latency.
  __m256i s0 = _mm256_setzero_si256(), s1 = _mm256_setzero_si256();
  for (int t = 0; t < 8; t += 2) {
    s0 = _mm256_dpbusd_epi32(s0, _mm256_loadu_si256(w + t), _mm256_loadu_si256(a + t));
    s1 = _mm256_dpbusd_epi32(s1, _mm256_loadu_si256(w + t + 1), _mm256_loadu_si256(a + t + 1));
  }
  return _mm256_add_epi32(s0, s1);
}

// Activations repacked like the weights: q [M, groups, 8 t, 8 l] dwords, d and s [M, groups * 8].
struct PackedActs {
  const int8_t* q;
  const float* d;
  const float* s;
  int64_t groups;
};

#define TQ_DEFINE_PACKED(ATTR, SUFFIX)                                                                           \
  template <int MT>                                                                                              \
  ATTR void q4_1_packed_##SUFFIX(const uint8_t* pw, int64_t rows, const PackedActs& a, int64_t m0, float* res) { \
    const int64_t gs = a.groups;                                                                                 \
    for (int64_t r = 0; r < rows; ++r) {                                                                         \
      __m256 acc[MT];                                                                                            \
      for (int i = 0; i < MT; ++i) acc[i] = _mm256_setzero_ps();                                                 \
      for (int64_t g = 0; g < gs; ++g) {                                                                         \
        const uint8_t* grp = pw + (r * gs + g) * kGroupBytes;                                                    \
        const __m256i* wv = reinterpret_cast<const __m256i*>(grp);                                               \
        const __m256 dw = _mm256_loadu_ps(reinterpret_cast<const float*>(grp + kGroup * kBlock));                \
        const __m256 mw = _mm256_loadu_ps(reinterpret_cast<const float*>(grp + kGroup * kBlock) + kGroup);       \
        for (int i = 0; i < MT; ++i) {                                                                           \
          const int64_t ag = (m0 + i) * gs + g;                                                                  \
          const __m256i* av = reinterpret_cast<const __m256i*>(a.q + ag * kGroup * kBlock);                      \
          const __m256 p = _mm256_cvtepi32_ps(group_dot_##SUFFIX(wv, av));                                       \
          acc[i] = _mm256_fmadd_ps(p, _mm256_mul_ps(dw, _mm256_loadu_ps(a.d + ag * kGroup)), acc[i]);            \
          acc[i] = _mm256_fmadd_ps(mw, _mm256_loadu_ps(a.s + ag * kGroup), acc[i]);                              \
        }                                                                                                        \
      }                                                                                                          \
      for (int i = 0; i < MT; ++i) res[i * rows + r] = hsum8(acc[i]);                                            \
    }                                                                                                            \
  }

TQ_DEFINE_PACKED(TQ_AVX2, avx2)
TQ_DEFINE_PACKED(TQ_VNNI, vnni)

// Q8_0 rows -> per 8 rows and block b, kQ8GroupBytes: 8 vectors (vector t: dword t of block b
// of each of the 8 rows, lane l for row l) of the int8 weights XORed with `flip` (0x80 on
// VNNI: w + 128, unsigned; 0 on AVX2), then the 8 rows' d. Rows past `rows` are zero (d = 0).
constexpr int64_t kQ8GroupBytes = kGroup * kBlock + kGroup * 4;

TQ_AVX2 void pack_q8_0(const uint8_t* w, int64_t row_bytes, int64_t rows, int64_t kb, uint8_t flip, uint8_t* out) {
  const __m256i flips = _mm256_set1_epi8(static_cast<char>(flip));
  for (int64_t r0 = 0; r0 < rows; r0 += kGroup)
    for (int64_t b = 0; b < kb; ++b) {
      uint8_t* dst = out + (r0 / kGroup * kb + b) * kQ8GroupBytes;
      float* dv = reinterpret_cast<float*>(dst + kGroup * kBlock);
      __m256i v[8];
      for (int l = 0; l < 8; ++l) {
        if (r0 + l < rows) {
          const uint8_t* blk = w + (r0 + l) * row_bytes + b * kQ8_0Bytes;
          v[l] = _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 2)), flips);
          dv[l] = half_at_f16c(blk);
        } else {
          v[l] = _mm256_setzero_si256();
          dv[l] = 0.f;
        }
      }
      transpose8x8_epi32(v);
      for (int t = 0; t < 8; ++t) _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst) + t, v[t]);
    }
}

// One step of a Q8_0 group's dot: s += the products of weights' dword t (w) and the activation
// dword broadcast (a), per lane; then the VNNI path takes 128 * sum(qa) (c) back.
TQ_AVX2 inline __m256i q8_step_avx2(__m256i s, __m256i w, __m256i a) {
  const __m256i p = _mm256_maddubs_epi16(_mm256_abs_epi8(w), _mm256_sign_epi8(a, w));
  return _mm256_add_epi32(s, _mm256_madd_epi16(p, _mm256_set1_epi16(1)));
}
TQ_AVX2 inline __m256i q8_fix_avx2(__m256i s, int32_t) { return s; }
TQ_VNNI inline __m256i q8_step_vnni(__m256i s, __m256i w, __m256i a) { return _mm256_dpbusd_epi32(s, w, a); }
TQ_VNNI inline __m256i q8_fix_vnni(__m256i s, int32_t c) { return _mm256_sub_epi32(s, _mm256_set1_epi32(c)); }

// Q8_0 over pack_q8_0's layout: res[i * rows + r] for activation rows m0 .. m0 + MT - 1; c is
// 128 * sum(qa) per activation block [M, KB].
#define TQ_DEFINE_Q8_0(ATTR, SUFFIX)                                                                               \
  template <int MT>                                                                                                \
  ATTR void q8_0_packed_##SUFFIX(const uint8_t* pw, int64_t rows, const Acts& a, const int32_t* c, int64_t m0,     \
                                 float* res, const uint8_t* ahead, int64_t ahead_bytes) {                          \
    const int64_t kb = a.kb;                                                                                       \
    /* The first tile also prefetches the next sub-chunk's weights (`ahead`), a few lines per    */                \
    /* group: pack_q8_0 reads 8 rows a block at a time, which the hardware prefetcher does not   */                \
    /* follow, and the reads then waited on memory apart from the work (+2 to 3 ms at M = 4).    */                \
    const int64_t ahead_step = (ahead_bytes + 63) / 64 / ((rows + kGroup - 1) / kGroup * kb) * 64 + 64;           \
    for (int64_t r0 = 0; r0 < rows; r0 += kGroup) {                                                                \
      __m256 acc[MT];                                                                                              \
      for (int i = 0; i < MT; ++i) acc[i] = _mm256_setzero_ps();                                                   \
      for (int64_t b = 0; b < kb; ++b) {                                                                           \
        const int64_t gi = r0 / kGroup * kb + b;                                                                   \
        const uint8_t* grp = pw + gi * kQ8GroupBytes;                                                              \
        for (int64_t o = gi * ahead_step; o < std::min(ahead_bytes, (gi + 1) * ahead_step); o += 64)               \
          _mm_prefetch(reinterpret_cast<const char*>(ahead + o), _MM_HINT_T0);                                     \
        __m256i s[MT];                                                                                             \
        for (int i = 0; i < MT; ++i) s[i] = _mm256_setzero_si256();                                                \
        for (int t = 0; t < 8; ++t) {                                                                              \
          const __m256i wt = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(grp) + t);                        \
          for (int i = 0; i < MT; ++i) {                                                                           \
            int32_t dw;                                                                                            \
            std::memcpy(&dw, a.q + (m0 + i) * a.k + b * kBlock + 4 * t, 4);                                        \
            s[i] = q8_step_##SUFFIX(s[i], wt, _mm256_set1_epi32(dw));                                              \
          }                                                                                                        \
        }                                                                                                          \
        const __m256 d = _mm256_loadu_ps(reinterpret_cast<const float*>(grp + kGroup * kBlock));                   \
        for (int i = 0; i < MT; ++i) {                                                                             \
          const int64_t ab = (m0 + i) * kb + b;                                                                    \
          const __m256 p = _mm256_cvtepi32_ps(q8_fix_##SUFFIX(s[i], c[ab]));                                       \
          acc[i] = _mm256_fmadd_ps(p, _mm256_mul_ps(d, _mm256_set1_ps(a.d[ab])), acc[i]);                          \
        }                                                                                                          \
      }                                                                                                            \
      const int64_t valid = std::min<int64_t>(kGroup, rows - r0);                                                  \
      for (int i = 0; i < MT; ++i) {                                                                               \
        float lanes[kGroup];                                                                                       \
        _mm256_storeu_ps(lanes, acc[i]);                                                                           \
        std::memcpy(res + i * rows + r0, lanes, valid * sizeof(float));                                            \
      }                                                                                                            \
    }                                                                                                              \
  }

TQ_DEFINE_Q8_0(TQ_AVX2, avx2)
TQ_DEFINE_Q8_0(TQ_VNNI, vnni)

// The activations in the packed path's layout (PackedActs); blocks past K are zero.
void pack_acts(const Acts& a, int64_t m, int64_t groups, int8_t* q, float* d, float* s) {
  at::parallel_for(0, m, std::max<int64_t>(1, 4096 / groups), [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i)
      for (int64_t g = 0; g < groups; ++g)
        for (int64_t l = 0; l < kGroup; ++l) {
          const int64_t b = g * kGroup + l, o = (i * groups + g) * kGroup + l;
          const bool in = b < a.kb;
          d[o] = in ? a.d[i * a.kb + b] : 0.f;
          s[o] = in ? a.s[i * a.kb + b] : 0.f;
          for (int64_t t = 0; t < 8; ++t) {
            int8_t* dst = q + (((i * groups + g) * 8 + t) * kGroup + l) * 4;
            if (in)
              std::memcpy(dst, a.q + i * a.k + b * kBlock + 4 * t, 4);
            else
              std::memset(dst, 0, 4);
          }
        }
  });
}

// Runs the tiles of activation rows over each sub-chunk of weight rows, packed once per thread
// by pack(n0, rows, buffer) into a buffer of `buf_bytes`.
template <typename Pack, typename Tile>
void run_batch(const uint8_t* w, int64_t row_bytes, int64_t m, int64_t n, int64_t sub, int64_t grain,
               int64_t buf_bytes, const Output& out, Pack pack, Tile tile) {
  at::parallel_for(0, n, grain, [&](int64_t begin, int64_t end) {
    float res[kMaxTile * kMaxSubRows];
    std::unique_ptr<uint8_t[]> pw(new uint8_t[buf_bytes]);
    for (int64_t n0 = begin; n0 < end; n0 += sub) {
      const int64_t rows = std::min(sub, end - n0);
      pack(n0, rows, pw.get());
      for (int64_t m0 = 0; m0 < m; m0 += kMaxTile) {
        const int mt = static_cast<int>(std::min<int64_t>(kMaxTile, m - m0));
        // The first tile may fetch the next sub-chunk's weights meanwhile.
        const int64_t ahead = m0 == 0 ? std::min(sub, end - n0 - rows) * row_bytes : 0;
        tile(mt, pw.get(), rows, m0, res, w + (n0 + rows) * row_bytes, ahead);
        store_tile(out, res, mt, rows, m0, n0);
      }
    }
  });
}

}  // namespace

bool packed_batch(bool q4, int isa, const Acts& a, int64_t m, const uint8_t* w, int64_t n, int64_t row_bytes,
                  int64_t sub, int64_t grain, const Output& out) {
  if ((isa != kAvx2 && isa != kVnni) || m < kMaxTile) return false;
  const int64_t kb = a.kb;
  // Q8_0 from 5 rows: at 4, one pass of the tile kernels over weights streamed from memory
  // (SmolLM2's lm_head, 30 MB) was 10 to 20% faster than packing them; from 5 on, packing is.
  if (!q4 && m <= kMaxTile) return false;
  if (!q4) {
    using Q8TileFn = void (*)(const uint8_t* pw, int64_t rows, const Acts& a, const int32_t* c, int64_t m0, float* res,
                              const uint8_t* ahead, int64_t ahead_bytes);
    static const Q8TileFn avx2[kMaxTile + 1] = {nullptr, &q8_0_packed_avx2<1>, &q8_0_packed_avx2<2>,
                                                &q8_0_packed_avx2<3>, &q8_0_packed_avx2<4>};
    static const Q8TileFn vnni[kMaxTile + 1] = {nullptr, &q8_0_packed_vnni<1>, &q8_0_packed_vnni<2>,
                                                &q8_0_packed_vnni<3>, &q8_0_packed_vnni<4>};
    const Q8TileFn* tiles = isa == kVnni ? vnni : avx2;
    const uint8_t flip = isa == kVnni ? 0x80 : 0;
    std::unique_ptr<int32_t[]> c(new int32_t[m * kb]);  // 128 * sum(qa) per activation block
    for (int64_t ab = 0; ab < m * kb; ++ab) {
      int32_t sum = 0;
      for (int64_t j = 0; j < kBlock; ++j) sum += a.q[ab * kBlock + j];
      c[ab] = 128 * sum;
    }
    // Sub-chunks of whole groups of 8 rows (a thread's last one may end in a partial group).
    const int64_t sub8 = std::max<int64_t>(kGroup, sub / kGroup * kGroup);
    run_batch(
        w, row_bytes, m, n, sub8, grain, sub8 / kGroup * kb * kQ8GroupBytes, out,
        [&](int64_t n0, int64_t rows, uint8_t* pw) { pack_q8_0(w + n0 * row_bytes, row_bytes, rows, kb, flip, pw); },
        [&](int mt, const uint8_t* pw, int64_t rows, int64_t m0, float* res, const uint8_t* ahead, int64_t bytes) {
          tiles[mt](pw, rows, a, c.get(), m0, res, ahead, bytes);
        });
    return true;
  }
  using PackedTileFn = void (*)(const uint8_t* pw, int64_t rows, const PackedActs& a, int64_t m0, float* res);
  static const PackedTileFn avx2[kMaxTile + 1] = {nullptr, &q4_1_packed_avx2<1>, &q4_1_packed_avx2<2>,
                                                  &q4_1_packed_avx2<3>, &q4_1_packed_avx2<4>};
  static const PackedTileFn vnni[kMaxTile + 1] = {nullptr, &q4_1_packed_vnni<1>, &q4_1_packed_vnni<2>,
                                                  &q4_1_packed_vnni<3>, &q4_1_packed_vnni<4>};
  const PackedTileFn* tiles = isa == kVnni ? vnni : avx2;
  const int64_t groups = (kb + kGroup - 1) / kGroup;
  std::unique_ptr<int8_t[]> pq(new int8_t[m * groups * kGroup * kBlock]);
  std::unique_ptr<float[]> pds(new float[2 * m * groups * kGroup]);
  pack_acts(a, m, groups, pq.get(), pds.get(), pds.get() + m * groups * kGroup);
  const PackedActs pa{pq.get(), pds.get(), pds.get() + m * groups * kGroup, groups};
  run_batch(
      w, row_bytes, m, n, sub, grain, sub * groups * kGroupBytes, out,
      [&](int64_t n0, int64_t rows, uint8_t* pw) { pack_q4_1(w + n0 * row_bytes, row_bytes, rows, kb, pw); },
      [&](int mt, const uint8_t* pw, int64_t rows, int64_t m0, float* res, const uint8_t*, int64_t) {
        tiles[mt](pw, rows, pa, m0, res);
      });
  return true;
}

#else  // no x86: every batch takes the tile kernels

bool packed_batch(bool, int, const Acts&, int64_t, const uint8_t*, int64_t, int64_t, int64_t, int64_t, const Output&) {
  return false;
}

#endif  // TQ_X86

}  // namespace tq
