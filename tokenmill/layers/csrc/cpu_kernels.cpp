// tokenmill CPU kernels (x86-64 AVX2 + FMA + F16C), registered as torch.ops.tokenmill.*.
//
// Quantized linear layers hold GGUF's block formats (weights along K in blocks of 32; the K-quants in
// super-blocks of 256 = 8 blocks of 32), with the format ids of quant.py's FORMAT_IDS:
//   0 Q8_0: fp16 d, int8 q[32]                             34 bytes, w = d * q
//   1 Q4_1: fp16 d, fp16 m, 16 bytes of nibbles            20 bytes, w = d * q + m, q in [0, 15];
//           weight j of the block is the low nibble of byte j, weight j + 16 its high nibble.
//   2 Q5_0: fp16 d, 4 bytes qh, 16 bytes of nibbles        22 bytes, w = d * (q - 16), q in [0, 31]: the
//           nibbles as Q4_1's, bit j of qh (little-endian uint32) the fifth bit of weight j.
//   3 Q4_K: per 256: fp16 d, fp16 dmin, 12 bytes of 6-bit scales sc[8] and mins m[8], 128 bytes of
//           nibbles                                       144 bytes, block j: w = d sc_j q - dmin m_j;
//           block j's weights are nibble j % 2 of bytes 32 (j / 2) .. 32 (j / 2) + 31.
//   4 Q5_K: Q4_K with 32 bytes qh after the scales        176 bytes, bit j of qh[l]: fifth bit of block j's weight l
//   5 Q6_K: per 256: ql[128], qh[64], int8 sc[16], fp16 d 210 bytes, w = d sc_i (q - 32) per 16 weights
//           (i = weight / 16), q: 4 bits from ql and 2 from qh (gguf's Q6_K layout, see unpack_block).
// The kernels take them in a kernel layout (quant.py's QuantizedTensor.kernel_layout(); the same
// bytes, reordered within each row) so that eight block scales load in one instruction:
//   Q8_0 row: fp16 d[nb] | int8 q[nb][32]
//   Q4_1 row: fp16 d[nb] | fp16 m[nb] | nibbles[nb][16]
//   Q5_0 row: fp16 d[nb] | (qh[4], nibbles[16])[nb]
//   K-quant rows: the super-blocks as they are (a super-block's header holds its eight blocks' scales).
// Activations are quantized per token and per block of 32 to int16 with one float scale (32767 steps:
// the weights' rounding is then all the error there is), so every dot product runs on integer
// multiply-adds (vpmaddwd on weights widened to int16) and is scaled once per block.
//
// Batch invariance: every op here computes a token's result from that token's inputs alone, in an
// order that does not depend on how many tokens share the call, how they are tiled or how threads
// split the work. A request's output is then the same bits alone or batched, prefilled in one chunk
// or many, or with its prefix from the cache.
//
// Built and loaded by tokenmill/layers/kernels.py; tokenmill/layers/quant.py holds the pure-torch
// reference of every op here (the tests compare the two).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <immintrin.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <optional>
#include <string>
#include <type_traits>
#include <vector>

namespace {

constexpr int QK = 32;
enum : int { Q8_0 = 0, Q4_1 = 1, Q5_0 = 2, Q4_K = 3, Q5_K = 4, Q6_K = 5, NUM_FORMATS = 6 };
// Q4_K, Q6_K and Q4_1 in panels of 8 rows (panels_x8.h)
enum : int { Q4_K_X8 = NUM_FORMATS, Q6_K_X8, Q4_1_X8, NUM_FORMATS_X8 };
constexpr bool is_x8(int64_t f) { return f >= Q4_K_X8 && f < NUM_FORMATS_X8; }
// bytes per 8 rows and 256 weights (a super-block, or 8 blocks of Q4_1)
constexpr int64_t x8_bytes(int64_t f) { return f == Q4_K_X8 ? 1152 : f == Q6_K_X8 ? 1680 : 1280; }
constexpr int x8_row_format(int f) { return f == Q4_K_X8 ? Q4_K : f == Q6_K_X8 ? Q6_K : Q4_1; }
constexpr bool is_super(int64_t f) { return f >= Q4_K; }  // super-blocks of 256 weights
// bytes per block of 32 weights (per super-block of 256 for the K-quants)
constexpr int64_t block_bytes(int64_t f) {
  return f == Q8_0 ? 34 : f == Q4_1 ? 20 : f == Q5_0 ? 22 : f == Q4_K ? 144 : f == Q5_K ? 176 : 210;
}
constexpr int64_t row_bytes_of(int64_t f, int64_t nb) { return is_super(f) ? nb / 8 * block_bytes(f) : nb * block_bytes(f); }
template <int F> constexpr bool kMin = F == Q4_1 || F == Q4_K || F == Q5_K;  // w = d q + m: a min term
template <int F> constexpr bool kSplit = F == Q6_K;  // a scale per 16 weights: a block's halves scale apart

inline float h2f(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return _cvtsh_ss(h);
}

// 8 fp16 values at p as float lanes, lanes from n on zeroed. Reads 16 bytes even when n < 8: the
// callers' scale arrays are followed by more of the same row (mins or quants), so the read stays in
// bounds, and the mask turns whatever it finds there (possibly NaN patterns) into zeros.
alignas(32) const int32_t kLaneMask[9][8] = {
    {0, 0, 0, 0, 0, 0, 0, 0},         {-1, 0, 0, 0, 0, 0, 0, 0},        {-1, -1, 0, 0, 0, 0, 0, 0},
    {-1, -1, -1, 0, 0, 0, 0, 0},      {-1, -1, -1, -1, 0, 0, 0, 0},     {-1, -1, -1, -1, -1, 0, 0, 0},
    {-1, -1, -1, -1, -1, -1, 0, 0},   {-1, -1, -1, -1, -1, -1, -1, 0},  {-1, -1, -1, -1, -1, -1, -1, -1}};

inline __m256 load_f16x8(const uint8_t* p, int n) {
  const __m256 v = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  if (n == 8) return v;
  return _mm256_and_ps(v, _mm256_load_ps(reinterpret_cast<const float*>(kLaneMask[n])));
}


inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

inline int64_t round8(int64_t n) { return (n + 7) / 8 * 8; }

// ---- activations: float [M, K] -> int16 q [M, K], d [M, ld], d * sum(q) [M, ld] ----------------------
// q = round(x / d), d = amax / 32767 per token and block of 32, in natural order, against both weight
// formats: 32767 steps per block keep a layer's output within ~1e-5 of the float one, where int8 steps
// (llama.cpp's Q8_1 activations) flipped 2% of greedy choices. ld >= K / 32 is the row stride of d and s;
// the kernels pass a multiple of 8 with zeros past nb (the GEMM reads scales 8 at a time).
void quantize_rows16(const float* x, int64_t M, int64_t K, int16_t* q, float* d, float* s, int64_t ld) {
  const int64_t nb = K / QK;
  at::parallel_for(0, M * nb, 64, [&](int64_t begin, int64_t end) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    for (int64_t i = begin; i < end; ++i) {
      const int64_t row = i / nb, b = i % nb;
      const float* src = x + row * K + b * QK;
      __m256 v[4];
      __m256 amax = _mm256_setzero_ps();
      for (int j = 0; j < 4; ++j) {
        v[j] = _mm256_loadu_ps(src + 8 * j);
        amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, v[j]));
      }
      __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
      m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
      m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
      const float dd = _mm_cvtss_f32(m4) / 32767.0f;
      const __m256 vid = _mm256_set1_ps(dd != 0.0f ? 1.0f / dd : 0.0f);
      int16_t* dst = q + row * K + b * QK;
      __m256i sum = _mm256_setzero_si256();
      for (int j = 0; j < 2; ++j) {  // packs interleaves 128-bit lanes; permute4x64 restores the order
        const __m256i a = _mm256_cvtps_epi32(_mm256_mul_ps(v[2 * j], vid));  // round half to even
        const __m256i c = _mm256_cvtps_epi32(_mm256_mul_ps(v[2 * j + 1], vid));
        sum = _mm256_add_epi32(sum, _mm256_add_epi32(a, c));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + 16 * j),
                            _mm256_permute4x64_epi64(_mm256_packs_epi32(a, c), 0xD8));
      }
      __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(sum), _mm256_extracti128_si256(sum, 1));
      s4 = _mm_hadd_epi32(s4, s4);
      s4 = _mm_hadd_epi32(s4, s4);
      d[row * ld + b] = dd;
      s[row * ld + b] = dd * static_cast<float>(_mm_cvtsi128_si32(s4));
      if (b == nb - 1)
        for (int64_t c = nb; c < ld; ++c) d[row * ld + c] = s[row * ld + c] = 0.0f;
    }
  });
}

// ---- integer dot products ------------------------------------------------------------------------
// One arithmetic for every batch size (batch invariance): a block's 32 weights widen to int16 and meet
// the token's int16 activations in vpmaddwd; the int32 sums are exact, so how tiles group tokens or
// rows cannot change them, and every (row, token) then scales and adds its blocks in the same order.

// One block's weights as int16: w[0] = weights 0..15, w[1] = weights 16..31 of block g + j of a row (the
// row's first byte; see the layouts at the top), g a multiple of 8: for the K-quants, block j of super-block
// g / 8 (the tiles pass j as a constant, so the K-quants' shifts are immediates).
template <int F>
inline void unpack_block(const uint8_t* row, int64_t nb, int64_t g, int j, __m256i w[2]) {
  const __m256i lo4 = _mm256_set1_epi8(0x0F);
  const int64_t b = g + j;
  if constexpr (F == Q8_0) {
    const uint8_t* q = row + 2 * nb + QK * b;
    w[0] = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q)));
    w[1] = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + 16)));
  } else if constexpr (F == Q4_1) {
    const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + 4 * nb + 16 * b));
    const __m128i mask = _mm_set1_epi8(0x0F);
    w[0] = _mm256_cvtepu8_epi16(_mm_and_si128(v, mask));
    w[1] = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(v, 4), mask));
  } else if constexpr (F == Q5_0) {
    const uint8_t* q = row + 2 * nb + 20 * b;
    uint32_t qh;
    std::memcpy(&qh, q, 4);
    // the 16 nibble bytes in both halves, the upper shifted by 4: weight j's nibble in byte j
    const __m256i v = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + 4)));
    const __m256i nib = _mm256_and_si256(_mm256_srlv_epi32(v, _mm256_setr_epi32(0, 0, 0, 0, 4, 4, 4, 4)), lo4);
    // bit j of qh into byte j: byte j / 8 of qh to byte j, then its bit j % 8
    const __m256i sel = _mm256_shuffle_epi8(_mm256_set1_epi32(static_cast<int>(qh)),
                                            _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202,
                                                              0x0101010101010101, 0));
    const __m256i bit = _mm256_set1_epi64x(static_cast<int64_t>(0x8040201008040201ULL));
    const __m256i high = _mm256_cmpeq_epi8(_mm256_and_si256(sel, bit), bit);  // 0xFF where the fifth bit is set
    // q - 16 as int8: the nibble where the fifth bit is set, else nibble - 16 (the nibble with 0xF0 set)
    const __m256i q8 = _mm256_or_si256(nib, _mm256_andnot_si256(high, _mm256_set1_epi8(static_cast<char>(0xF0))));
    w[0] = _mm256_cvtepi8_epi16(_mm256_castsi256_si128(q8));
    w[1] = _mm256_cvtepi8_epi16(_mm256_extracti128_si256(q8, 1));
  } else if constexpr (F == Q4_K || F == Q5_K) {
    // sub-block j of a super-block: nibble j % 2 of the 32 quant bytes 32 (j / 2) .. 32 (j / 2) + 31, in order
    const uint8_t* sb = row + block_bytes(F) * (g >> 3);
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(sb + (F == Q4_K ? 16 : 48) + 32 * (j >> 1)));
    __m256i q8 = _mm256_and_si256(_mm256_srl_epi16(v, _mm_cvtsi32_si128(4 * (j & 1))), lo4);
    if constexpr (F == Q5_K) {  // the fifth bit: bit j of the super-block's 32 high-bit bytes, one per weight
      const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(sb + 16));
      q8 = _mm256_or_si256(q8, _mm256_slli_epi16(
                                   _mm256_and_si256(_mm256_srl_epi16(h, _mm_cvtsi32_si128(j)), _mm256_set1_epi8(1)), 4));
    }
    w[0] = _mm256_cvtepu8_epi16(_mm256_castsi256_si128(q8));
    w[1] = _mm256_cvtepu8_epi16(_mm256_extracti128_si256(q8, 1));
  } else {  // Q6_K: block j of a half h = j / 4: low nibbles from ql, two high bits from qh, minus 32
    static_assert(F == Q6_K);
    const uint8_t* sb = row + block_bytes(F) * (g >> 3);
    const int h = j >> 2, r = j & 3;
    const __m256i lo = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(sb + 64 * h + 32 * (r & 1)));
    const __m256i hi = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(sb + 128 + 32 * h));
    const __m256i q8 = _mm256_or_si256(
        _mm256_and_si256(_mm256_srl_epi16(lo, _mm_cvtsi32_si128(4 * (r >> 1))), lo4),
        _mm256_slli_epi16(_mm256_and_si256(_mm256_srl_epi16(hi, _mm_cvtsi32_si128(2 * r)), _mm256_set1_epi8(3)), 4));
    const __m256i s8 = _mm256_sub_epi8(q8, _mm256_set1_epi8(32));
    w[0] = _mm256_cvtepi8_epi16(_mm256_castsi256_si128(s8));
    w[1] = _mm256_cvtepi8_epi16(_mm256_extracti128_si256(s8, 1));
  }
}

// The float scales of blocks g .. g + gn - 1 of a row as 8 lanes (lanes from gn on zero): dw[j] the scale of
// block g + j, mw[j] its min (Q4_1, Q4_K, Q5_K: w = dw q + mw) or, for Q6_K, the scale of its second 16
// weights (dw is then that of its first 16). A K-quant group is one super-block; its scales are an fp16
// times a 6-bit (8-bit for Q6_K) integer, so the float32 products are exact: the file's values.
template <int F>
inline void group_scales(const uint8_t* row, int64_t nb, int64_t g, int gn, __m256& dw, __m256& mw) {
  if constexpr (F == Q8_0 || F == Q5_0) {
    dw = load_f16x8(row + 2 * g, gn);
  } else if constexpr (F == Q4_1) {
    dw = load_f16x8(row + 2 * g, gn);
    mw = load_f16x8(row + 2 * nb + 2 * g, gn);
  } else if constexpr (F == Q4_K || F == Q5_K) {
    // fp16 d, fp16 dmin, then 12 bytes of 6-bit scales and mins (gguf's Q4_K.get_scale_min): w = d sc q - dmin m
    const uint8_t* sb = row + block_bytes(F) * (g >> 3);
    uint32_t u[3];
    std::memcpy(u, sb + 4, 12);
    const uint32_t k6 = 0x3f3f3f3f, k4 = 0x0f0f0f0f, k2 = 0x03030303;
    const __m128i sm = _mm_setr_epi32(static_cast<int>(u[0] & k6),
                                      static_cast<int>((u[2] & k4) | (((u[0] >> 6) & k2) << 4)),
                                      static_cast<int>(u[1] & k6),
                                      static_cast<int>(((u[2] >> 4) & k4) | (((u[1] >> 6) & k2) << 4)));
    dw = _mm256_mul_ps(_mm256_set1_ps(h2f(sb)), _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(sm)));
    mw = _mm256_mul_ps(_mm256_set1_ps(-h2f(sb + 2)), _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(sm, 8))));
  } else {  // Q6_K: int8 scales[16] at 192 (one per 16 weights), fp16 d at 208
    static_assert(F == Q6_K);
    const uint8_t* sb = row + block_bytes(F) * (g >> 3);
    const __m128i sc = _mm_shuffle_epi8(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sb + 192)),
                                        _mm_setr_epi8(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15));
    const __m256 d = _mm256_set1_ps(h2f(sb + 208));
    dw = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(sc)));
    mw = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(sc, 8))));
  }
}

// 8 blocks' partial sums -> the 8 block sums as floats in natural order: six vphaddd and one cross-lane
// add instead of a convert-permute-FMA round per block. Blocks past a short last group are zero vectors.
inline __m256 reduce8(const __m256i s[8]) {
  // per 128 bits after two rounds: a = [b0 b1 b2 b3] (low half of each block, then high), c = [b4 .. b7]
  const __m256i a = _mm256_hadd_epi32(_mm256_hadd_epi32(s[0], s[1]), _mm256_hadd_epi32(s[2], s[3]));
  const __m256i c = _mm256_hadd_epi32(_mm256_hadd_epi32(s[4], s[5]), _mm256_hadd_epi32(s[6], s[7]));
  return _mm256_cvtepi32_ps(
      _mm256_add_epi32(_mm256_permute2x128_si256(a, c, 0x20), _mm256_permute2x128_si256(a, c, 0x31)));
}

// ---- the GEMM: y[M, N] = x[M, K] . W[N, K]^T, weights in the kernel layout --------------------------
// A tile is RN weight rows x RM tokens. Per group of 8 blocks and (row, token): the min term of Q4_1, Q4_K
// and Q5_K (sum_b m_b * d_x,b * sum(q_x,b), one FMA of 8-lane vectors), then the 8 block sums times
// d_w * d_x. A block's int32 sum is exact (|sum| <= 32 * 127 * 32767 < 2^31). Q6_K has a scale per 16
// weights: its two halves' sums (each |sum| <= 16 * 32 * 32767 < 2^24, exact as floats too) are scaled
// apart, first halves then second halves, in float.
// Multi-token tiles widen each row's group once into a stack buffer that their tokens reuse.
// Accumulate: y += x . W^T (a residual add with no extra pass or tensor; the sum is the same float
// add as y + (x . W^T) done afterwards).
// pf (GEMVs only, else null): software prefetch of the bytes PF_DIST ahead of this tile, pf_lines cache
// lines per group of blocks, spread over the tile so that a long row's lines are not asked for in one
// burst (more than the core's miss buffers hold: those are dropped or stall the loads behind them).
template <int F, int RN, int RM>
inline void tile(const uint8_t* W, int64_t row_bytes, int64_t nb, const int16_t* xq, int64_t K, const float* xd,
                 const float* xs, int64_t ld, float* y, int64_t N, bool accumulate, const uint8_t* pf = nullptr,
                 int64_t pf_lines = 0) {
  __m256 acc[RN][RM];
  for (int n = 0; n < RN; ++n)
    for (int m = 0; m < RM; ++m) acc[n][m] = _mm256_setzero_ps();
  alignas(32) int16_t wide[RM == 1 ? 1 : RN][8][QK];  // multi-token tiles: the rows' group as int16
  for (int64_t g = 0; g < nb; g += 8) {
    const int gn = static_cast<int>(std::min<int64_t>(8, nb - g));
    if (pf)  // past the end of W is harmless: prefetches never fault
      for (int64_t i = 0; i < pf_lines; ++i) _mm_prefetch(reinterpret_cast<const char*>(pf + (g / 8 * pf_lines + i) * 64), _MM_HINT_T0);
    if constexpr (RM > 1)
      for (int n = 0; n < RN; ++n)
        for (int b = 0; b < gn; ++b) {
          __m256i w[2];
          unpack_block<F>(W + n * row_bytes, nb, g, b, w);
          _mm256_store_si256(reinterpret_cast<__m256i*>(wide[n][b]), w[0]);
          _mm256_store_si256(reinterpret_cast<__m256i*>(wide[n][b] + 16), w[1]);
        }
    for (int n = 0; n < RN; ++n) {
      const uint8_t* row = W + n * row_bytes;
      __m256 dw = _mm256_setzero_ps(), mw = _mm256_setzero_ps();
      group_scales<F>(row, nb, g, gn, dw, mw);
      for (int m = 0; m < RM; ++m) {
        const int16_t* x = xq + m * K + QK * g;
        __m256i s[8], s1[kSplit<F> ? 8 : 1];  // s1: Q6_K's second halves
        for (int b = 0; b < 8; ++b) {
          if (b >= gn) {
            s[b] = _mm256_setzero_si256();
            if constexpr (kSplit<F>) s1[b] = _mm256_setzero_si256();
            continue;
          }
          __m256i w[2];
          if constexpr (RM == 1) {
            unpack_block<F>(row, nb, g, b, w);
          } else {
            w[0] = _mm256_load_si256(reinterpret_cast<const __m256i*>(wide[n][b]));
            w[1] = _mm256_load_si256(reinterpret_cast<const __m256i*>(wide[n][b] + 16));
          }
          const __m256i p0 = _mm256_madd_epi16(w[0], _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + QK * b)));
          const __m256i p1 = _mm256_madd_epi16(w[1], _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + QK * b + 16)));
          if constexpr (kSplit<F>) {
            s[b] = p0;
            s1[b] = p1;
          } else {
            s[b] = _mm256_add_epi32(p0, p1);
          }
        }
        const __m256 xdv = _mm256_loadu_ps(xd + m * ld + g);
        if constexpr (kMin<F>) acc[n][m] = _mm256_fmadd_ps(mw, _mm256_loadu_ps(xs + m * ld + g), acc[n][m]);
        acc[n][m] = _mm256_fmadd_ps(reduce8(s), _mm256_mul_ps(dw, xdv), acc[n][m]);
        if constexpr (kSplit<F>) acc[n][m] = _mm256_fmadd_ps(reduce8(s1), _mm256_mul_ps(mw, xdv), acc[n][m]);
      }
    }
  }
  for (int n = 0; n < RN; ++n)
    for (int m = 0; m < RM; ++m) y[m * N + n] = accumulate ? y[m * N + n] + hsum(acc[n][m]) : hsum(acc[n][m]);
}

// ---- the same GEMM on AVX512-VNNI, for many tokens ------------------------------------------------
// Outer-product form: a panel of 16 weight rows in the lanes of a zmm, two int16 weights per lane (a pair
// along K), against one token's activation pair broadcast to every lane: one vpdpwssd adds 32 products
// into 16 rows' exact int32 block sums, with no horizontal reduction. The block sums are the same integers
// as the AVX2 tile's; the float steps after them (scales, the min term, Q6_K's two halves, eight
// accumulators by block mod 8, their final tree) are the same operations in the same order. So every
// (row, token) gets the AVX2 kernel's bits and the choice between the two (by batch size and CPU) cannot
// change a result.
#define TM_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")))
constexpr int PANEL = 16;

// A panel's weights widened once for all tokens: wp[b][p][n] = rows n's weights 2p, 2p+1 of block b (int16
// pair), dw/mw[b][n] their scales and mins (Q6_K: second scales) as floats, from group_scales, the AVX2
// tile's own; rows past `rows` are zeros.
template <int F>
TM_AVX512 void widen_panel(const uint8_t* W, int64_t row_bytes, int64_t nb, int rows, int32_t* wp, float* dw,
                           float* mw) {
  alignas(64) int16_t tmp[PANEL][QK];
  alignas(32) float sd[8], sm[8];
  const __m512i stride = _mm512_setr_epi32(0, 16, 32, 48, 64, 80, 96, 112, 128, 144, 160, 176, 192, 208, 224, 240);
  for (int64_t g = 0; g < nb; g += 8) {
    const int gn = static_cast<int>(std::min<int64_t>(8, nb - g));
    for (int n = 0; n < PANEL; ++n) {
      __m256 d = _mm256_setzero_ps(), m = _mm256_setzero_ps();
      if (n < rows) group_scales<F>(W + n * row_bytes, nb, g, gn, d, m);
      _mm256_store_ps(sd, d);
      _mm256_store_ps(sm, m);
      for (int j = 0; j < gn; ++j) dw[(g + j) * PANEL + n] = sd[j], mw[(g + j) * PANEL + n] = sm[j];
    }
  }
  for (int64_t b = 0; b < nb; ++b) {
    for (int n = 0; n < PANEL; ++n) {
      __m256i w[2] = {_mm256_setzero_si256(), _mm256_setzero_si256()};
      if (n < rows) unpack_block<F>(W + n * row_bytes, nb, b & ~int64_t{7}, static_cast<int>(b & 7), w);
      _mm256_store_si256(reinterpret_cast<__m256i*>(tmp[n]), w[0]);
      _mm256_store_si256(reinterpret_cast<__m256i*>(tmp[n] + 16), w[1]);
    }
    const int32_t* t32 = reinterpret_cast<const int32_t*>(tmp);  // [16 rows][16 pairs]
    for (int p = 0; p < QK / 2; ++p)
      _mm512_store_si512(wp + (b * 16 + p) * PANEL, _mm512_i32gather_epi32(stride, t32 + p, 4));
  }
}

// RM tokens against one widened panel: y[m, n0 .. n0 + rows)
template <int F, int RM>
TM_AVX512 inline void panel_tokens(const int32_t* wp, const float* dw, const float* mw, int64_t nb, const int16_t* xq,
                                   int64_t K, const float* xd, const float* xs, int64_t ld, float* y, int64_t N,
                                   __mmask16 rows, bool accumulate) {
  __m512 acc[RM][8];
  for (int m = 0; m < RM; ++m)
    for (int j = 0; j < 8; ++j) acc[m][j] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    // two chains per token (weights 0..15 and 16..31) to hide vpdpwssd's latency: integer adds, so their sum
    // is the AVX2 tile's block sum, and for Q6_K they are its two halves
    __m512i s0[RM], s1[RM];
    for (int m = 0; m < RM; ++m) s0[m] = s1[m] = _mm512_setzero_si512();
    const int32_t* wb = wp + b * 16 * PANEL;
#pragma GCC unroll 8
    for (int p = 0; p < QK / 4; ++p) {
      const __m512i w0 = _mm512_load_si512(wb + p * PANEL);
      const __m512i w1 = _mm512_load_si512(wb + (p + QK / 4) * PANEL);
#pragma GCC unroll 4
      for (int m = 0; m < RM; ++m) {
        const int32_t* x = reinterpret_cast<const int32_t*>(xq + m * K + QK * b);  // the token's pairs
        s0[m] = _mm512_dpwssd_epi32(s0[m], w0, _mm512_set1_epi32(x[p]));
        s1[m] = _mm512_dpwssd_epi32(s1[m], w1, _mm512_set1_epi32(x[p + QK / 4]));
      }
    }
    const __m512 dwb = _mm512_loadu_ps(dw + b * PANEL);
    [[maybe_unused]] __m512 mwb;
    if constexpr (kMin<F> || kSplit<F>) mwb = _mm512_loadu_ps(mw + b * PANEL);
    const int j = static_cast<int>(b & 7);
    for (int m = 0; m < RM; ++m) {
      if constexpr (kMin<F>) acc[m][j] = _mm512_fmadd_ps(mwb, _mm512_set1_ps(xs[m * ld + b]), acc[m][j]);
      const __m512 xdb = _mm512_set1_ps(xd[m * ld + b]);
      if constexpr (kSplit<F>) {
        acc[m][j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s0[m]), _mm512_mul_ps(dwb, xdb), acc[m][j]);
        acc[m][j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s1[m]), _mm512_mul_ps(mwb, xdb), acc[m][j]);
      } else {
        const __m512 sum = _mm512_cvtepi32_ps(_mm512_add_epi32(s0[m], s1[m]));
        acc[m][j] = _mm512_fmadd_ps(sum, _mm512_mul_ps(dwb, xdb), acc[m][j]);
      }
    }
  }
  // the AVX2 tile adds 0 * 0 into the lanes of a short last group (which turns -0 into +0): so do we
  const __m512 zero = _mm512_setzero_ps();
  for (int64_t b = nb; b % 8 != 0; ++b)
    for (int m = 0; m < RM; ++m) {
      if constexpr (kMin<F> || kSplit<F>) acc[m][b & 7] = _mm512_add_ps(acc[m][b & 7], zero);
      acc[m][b & 7] = _mm512_add_ps(acc[m][b & 7], zero);
    }
  for (int m = 0; m < RM; ++m) {  // hsum()'s tree: ((a0 + a4) + (a2 + a6)) + ((a1 + a5) + (a3 + a7))
    const __m512 t0 = _mm512_add_ps(_mm512_add_ps(acc[m][0], acc[m][4]), _mm512_add_ps(acc[m][2], acc[m][6]));
    const __m512 t1 = _mm512_add_ps(_mm512_add_ps(acc[m][1], acc[m][5]), _mm512_add_ps(acc[m][3], acc[m][7]));
    __m512 r = _mm512_add_ps(t0, t1);
    float* ym = y + m * N;
    if (accumulate) r = _mm512_add_ps(_mm512_maskz_loadu_ps(rows, ym), r);
    _mm512_mask_storeu_ps(ym, rows, r);
  }
}

// Forward declaration: the panel formats' widening (panels_x8.h, included below)
template <int FX>
TM_AVX512 void widen_x8(const uint8_t* P, int64_t panel_bytes, int64_t nsb, int rows, int32_t* wp, float* dw, float* mw);

// FX >= 0: W holds format F in panels of 8 rows (FX, panels_x8.h), widened by widen_x8 instead
template <int F, int FX = -1>
TM_AVX512 void gemm_vnni(const uint8_t* W, int64_t N, int64_t K, const int16_t* xq, const float* xd, const float* xs,
                         int64_t ld, int64_t M, float* y, bool accumulate) {
  const int64_t nb = K / QK;
  const int64_t row_bytes = row_bytes_of(F, nb);
  const int64_t panels = (N + PANEL - 1) / PANEL;
  at::parallel_for(0, panels, 1, [&](int64_t p0, int64_t p1) {
    std::vector<int32_t> wbuf(nb * 16 * PANEL + 16);  // nb blocks x 16 pairs x 16 lanes, 64-byte aligned below
    std::vector<float> scales(2 * nb * PANEL);
    int32_t* wp = reinterpret_cast<int32_t*>((reinterpret_cast<uintptr_t>(wbuf.data()) + 63) & ~uintptr_t{63});
    float* dw = scales.data();
    float* mw = dw + nb * PANEL;
    for (int64_t p = p0; p < p1; ++p) {
      const int64_t n0 = p * PANEL;
      const int rows = static_cast<int>(std::min<int64_t>(PANEL, N - n0));
      const __mmask16 mask = static_cast<__mmask16>((1u << rows) - 1);
      if constexpr (FX >= 0) {
        const int64_t panel_bytes = nb / 8 * x8_bytes(FX);
        widen_x8<FX>(W + n0 / 8 * panel_bytes, panel_bytes, nb / 8, rows, wp, dw, mw);
      } else {
        widen_panel<F>(W + n0 * row_bytes, row_bytes, nb, rows, wp, dw, mw);
      }
      int64_t m = 0;
      for (; m + 4 <= M; m += 4)
        panel_tokens<F, 4>(wp, dw, mw, nb, xq + m * K, K, xd + m * ld, xs + m * ld, ld, y + m * N + n0, N, mask,
                           accumulate);
      for (; m < M; ++m)
        panel_tokens<F, 1>(wp, dw, mw, nb, xq + m * K, K, xd + m * ld, xs + m * ld, ld, y + m * N + n0, N, mask,
                           accumulate);
    }
  });
}

// Which GEMM runs many-token calls: "avx512vnni" where the CPU has it (unless TOKENMILL_CPU_ISA=avx2 or
// kernel_isa("avx2") says otherwise), else "avx2". Results are the same bits either way; only speed differs.
bool cpu_has_vnni() {
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni");
}
// Atomics: a test or the load-time timing may switch them while another thread runs a GEMM (relaxed: the
// bits are the same either way, only which form runs changes).
std::atomic<bool> g_use_vnni{[] {
  const char* e = std::getenv("TOKENMILL_CPU_ISA");
  return cpu_has_vnni() && !(e && std::string(e) == "avx2");
}()};
// Below this many tokens the AVX2 tiles win: widening a panel costs about as much as a few tokens' work.
// Measured (benchmarks/linear_kernels.py, the model's shapes, 2 threads): on a Sapphire Rapids-class Xeon
// VNNI ran 0.7x at M=2, 1.2-1.5x at M=8, 3-4x at M=512; on a Zen 5 EPYC 0.9x at M=8 (0.5x on the output
// head), 1.4x at M=16, 2.7x at M=64, 3.4x at M=512. The crossing differs by machine: kernels.py times it
// when it loads the kernels and sets it with vnni_min_tokens().
std::atomic<int64_t> g_vnni_min_tokens{16};

template <int F, int RN>
inline void rows_all_tokens(const uint8_t* W, int64_t row_bytes, int64_t nb, const int16_t* xq, const float* xd,
                            const float* xs, int64_t ld, int64_t m0, int64_t m1, int64_t K, float* y, int64_t N,
                            bool accumulate, const uint8_t* pf, int64_t pf_lines) {
  constexpr int RM = RN == 4 ? 1 : 4;
  int64_t m = m0;
  for (; m + RM <= m1; m += RM, pf = nullptr)  // the first tile over these rows prefetches
    tile<F, RN, RM>(W, row_bytes, nb, xq + m * K, K, xd + m * ld, xs + m * ld, ld, y + m * N, N, accumulate, pf,
                     pf_lines);
  for (; m < m1; ++m, pf = nullptr)
    tile<F, RN, 1>(W, row_bytes, nb, xq + m * K, K, xd + m * ld, xs + m * ld, ld, y + m * N, N, accumulate, pf,
                    pf_lines);
}

// Software prefetch distance for GEMVs (a few tokens): the weights stream from DRAM once per step
// and, without it, one Zen 1 core waits on memory instead of overlapping it with the multiply-adds
// (single-thread Q8_0 head 5.9 -> 4.4 ms, a streaming Q4_1 matrix 6.3 -> 4.9 ms; 4-16 KiB all alike).
constexpr int64_t PF_DIST = 8192;
template <int F>
void gemm(const uint8_t* W, int64_t N, int64_t K, const int16_t* xq, const float* xd, const float* xs, int64_t ld,
          int64_t M, float* y, bool accumulate) {
  if (g_use_vnni.load(std::memory_order_relaxed) && M >= g_vnni_min_tokens.load(std::memory_order_relaxed))
    return gemm_vnni<F>(W, N, K, xq, xd, xs, ld, M, y, accumulate);
  const int64_t nb = K / QK;
  const int64_t row_bytes = row_bytes_of(F, nb);
  // Tokens in chunks whose quantized activations stay in L2 while every row of this thread passes over them.
  const int64_t chunk = std::max<int64_t>(4, (256 * 1024) / std::max<int64_t>(K * sizeof(int16_t), 1));
  const int RN = M == 1 ? 4 : 2;  // one token: 4 rows per tile; several: 2 rows x 4 tokens
  const int64_t tiles = (N + RN - 1) / RN;
  const bool prefetch = M < 8;
  const int64_t groups = (nb + 7) / 8;
  const int64_t pf_lines = (RN * row_bytes + 64 * groups - 1) / (64 * groups);  // a tile's lines, per group
  const auto span = [&](int64_t t0, int64_t t1) {
    if (prefetch)  // the first PF_DIST bytes of these rows, which the loop below does not prefetch
      for (int64_t o = 0; o < std::min<int64_t>(PF_DIST, (t1 - t0) * RN * row_bytes); o += 64)
        _mm_prefetch(reinterpret_cast<const char*>(W + t0 * RN * row_bytes + o), _MM_HINT_T0);
    for (int64_t mc = 0; mc < M; mc += chunk) {
      const int64_t mc1 = std::min(M, mc + chunk);
      for (int64_t t = t0; t < t1; ++t) {
        const int64_t n = t * RN;
        const int64_t rows = std::min<int64_t>(RN, N - n);
        const uint8_t* Wn = W + n * row_bytes;
        const uint8_t* pf = prefetch && mc == 0 ? Wn + PF_DIST : nullptr;
        float* yn = y + n;
        if (rows == 4) {
          rows_all_tokens<F, 4>(Wn, row_bytes, nb, xq, xd, xs, ld, mc, mc1, K, yn, N, accumulate, pf, pf_lines);
        } else if (rows == 2) {
          rows_all_tokens<F, 2>(Wn, row_bytes, nb, xq, xd, xs, ld, mc, mc1, K, yn, N, accumulate, pf, pf_lines);
        } else {
          for (int64_t r = 0; r < rows; ++r)
            for (int64_t m = mc; m < mc1; ++m)
              tile<F, 1, 1>(Wn + r * row_bytes, row_bytes, nb, xq + m * K, K, xd + m * ld, xs + m * ld, ld,
                             yn + r + m * N, N, accumulate);
        }
      }
    }
  };
  at::parallel_for(0, tiles, 1, span);
}

#include "panels_x8.h"

constexpr int64_t matrix_bytes(int64_t f, int64_t n, int64_t nb) {
  return is_x8(f) ? n / 8 * (nb / 8) * x8_bytes(f) : n * row_bytes_of(f, nb);
}

void check_format(int64_t K, int64_t fmt, const char* op) {
  TORCH_CHECK(fmt >= 0 && fmt < NUM_FORMATS_X8, "tokenmill::", op,
              ": format must be 0 (Q8_0), 1 (Q4_1), 2 (Q5_0), 3 (Q4_K), 4 (Q5_K), 5 (Q6_K), 6 (Q4_K in panels of 8 rows), "
              "7 (Q6_K in panels) or 8 (Q4_1 in panels), got ", fmt);
  const int64_t unit = is_super(fmt) ? 8 * QK : QK;  // the panel formats included: groups of 256
  TORCH_CHECK(K % unit == 0, "tokenmill::", op, ": in_features must be a multiple of ", unit, " for this format, got ", K);
}

void check_blocks(const at::Tensor& w, int64_t n_out, int64_t K, int64_t fmt, const char* op) {
  TORCH_CHECK(w.device().is_cpu() && w.scalar_type() == at::kByte && w.is_contiguous(), "tokenmill::", op,
              " takes contiguous uint8 blocks on the CPU (QuantizedTensor.kernel_layout())");
  check_format(K, fmt, op);
  TORCH_CHECK(!is_x8(fmt) || n_out % 8 == 0, "tokenmill::", op, ": a matrix in panels of 8 rows needs out_features a "
              "multiple of 8, got ", n_out);
  const int64_t bytes = matrix_bytes(fmt, n_out, K / QK);
  TORCH_CHECK(w.numel() == bytes, "tokenmill::", op, ": weight holds ", w.numel(), " bytes, expected ", bytes,
              " for [", n_out, ", ", K, "]");
}

// The quantized activations of one GEMM input: scratch that forward_layers reuses across its GEMMs.
struct ActivationBuffers {
  at::Tensor q, d, s, h, l, s16;  // h, l, s16: their split for the panel formats (panels_x8.h)
  void fit(int64_t M, int64_t K, int64_t ld, const at::TensorOptions& opt) {
    if (!q.defined() || q.numel() < M * K) {
      q = at::empty({M * K}, opt.dtype(at::kShort));
      h = at::empty({M * K}, opt.dtype(at::kChar));
      l = at::empty({M * K}, opt.dtype(at::kByte));
      s16 = at::empty({M * K / 16}, opt.dtype(at::kInt));
    }
    if (!d.defined() || d.numel() < M * ld) {
      d = at::empty({M * ld}, opt.dtype(at::kFloat));
      s = at::empty({M * ld}, opt.dtype(at::kFloat));
    }
  }
};

// y[M, n_out] (=, or += with accumulate) x[M, K] . W^T; x contiguous float32 rows
void qlinear_into(const at::Tensor& x, const at::Tensor& w, int64_t n_out, int64_t fmt, at::Tensor& y, bool accumulate,
                  ActivationBuffers& buf) {
  const int64_t M = x.size(0), K = x.size(1);
  if (M == 0) return;
  const int64_t nb = K / QK, ld = round8(nb);
  buf.fit(M, K, ld, x.options());
  int16_t* q = buf.q.data_ptr<int16_t>();
  float* d = buf.d.data_ptr<float>();
  float* s = buf.s.data_ptr<float>();
  quantize_rows16(x.data_ptr<float>(), M, K, q, d, s, ld);
  const uint8_t* wp = w.data_ptr<uint8_t>();
  float* yp = y.data_ptr<float>();
  switch (fmt) {
    case Q8_0: return gemm<Q8_0>(wp, n_out, K, q, d, s, ld, M, yp, accumulate);
    case Q4_1: return gemm<Q4_1>(wp, n_out, K, q, d, s, ld, M, yp, accumulate);
    case Q5_0: return gemm<Q5_0>(wp, n_out, K, q, d, s, ld, M, yp, accumulate);
    case Q4_K: return gemm<Q4_K>(wp, n_out, K, q, d, s, ld, M, yp, accumulate);
    case Q5_K: return gemm<Q5_K>(wp, n_out, K, q, d, s, ld, M, yp, accumulate);
    case Q6_K: return gemm<Q6_K>(wp, n_out, K, q, d, s, ld, M, yp, accumulate);
    case Q4_K_X8:
      return gemm_x8<Q4_K_X8>(wp, n_out, K, q, d, s, ld, M, yp, accumulate, buf.h.data_ptr<int8_t>(),
                              buf.l.data_ptr<uint8_t>(), buf.s16.data_ptr<int32_t>());
    case Q6_K_X8:
      return gemm_x8<Q6_K_X8>(wp, n_out, K, q, d, s, ld, M, yp, accumulate, buf.h.data_ptr<int8_t>(),
                              buf.l.data_ptr<uint8_t>(), buf.s16.data_ptr<int32_t>());
    case Q4_1_X8:
      return gemm_x8<Q4_1_X8>(wp, n_out, K, q, d, s, ld, M, yp, accumulate, buf.h.data_ptr<int8_t>(),
                              buf.l.data_ptr<uint8_t>(), buf.s16.data_ptr<int32_t>());
    default: TORCH_CHECK(false, "tokenmill: unknown weight format ", fmt);
  }
}



// ---- into panels: the file's row blocks -> a panel format (layers/panels.py's to_panels is the reference) ---
// data [n, row bytes] in GGUF's block layout; fmt a panel format; n a multiple of 8, k of 256. The bytes are
// only reordered (Q6_K's high bits and Q4_K's scales move as they are; the low nibbles of two blocks pair up).
at::Tensor to_panels(const at::Tensor& data, int64_t fmt, int64_t n, int64_t k) {
  TORCH_CHECK(is_x8(fmt), "tokenmill::to_panels: fmt must be a panel format (6, 7 or 8), got ", fmt);
  TORCH_CHECK(n % 8 == 0 && k % 256 == 0, "tokenmill::to_panels: needs rows a multiple of 8 and in_features of 256, "
              "got [", n, ", ", k, "]");
  const int64_t per = fmt == Q4_K_X8 ? 144 : fmt == Q6_K_X8 ? 210 : 160;  // a row's bytes per 256 weights
  const int64_t nsb = k / 256, row_bytes = nsb * per, sb_bytes = x8_bytes(fmt);
  TORCH_CHECK(data.device().is_cpu() && data.scalar_type() == at::kByte && data.is_contiguous() &&
              data.numel() == n * row_bytes, "tokenmill::to_panels: data must be contiguous uint8 [", n, ", ",
              row_bytes, "]");
  at::Tensor out = at::empty({n / 8, nsb * sb_bytes}, data.options());
  const uint8_t* src = data.data_ptr<uint8_t>();
  uint8_t* dst = out.data_ptr<uint8_t>();
  at::parallel_for(0, n / 8 * nsb, 16, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t p = b / nsb, sb = b % nsb;
      uint8_t* S = dst + b * sb_bytes;
      const uint8_t* R[8];
      for (int r = 0; r < 8; ++r) R[r] = src + (8 * p + r) * row_bytes + sb * per;
      const auto words = [&](int64_t to, int64_t from, int count) {  // 4-byte words of each row, row-interleaved
        for (int w = 0; w < count; ++w)
          for (int r = 0; r < 8; ++r) std::memcpy(S + to + 32 * w + 4 * r, R[r] + from + 4 * w, 4);
      };
      if (fmt == Q4_K_X8) {
        for (int r = 0; r < 8; ++r) {
          std::memcpy(S + 2 * r, R[r], 2);
          std::memcpy(S + 16 + 2 * r, R[r] + 2, 2);
          for (int i = 0; i < 12; ++i) S[32 + 8 * i + r] = R[r][4 + i];
        }
        words(128, 16, 32);
      } else if (fmt == Q6_K_X8) {
        for (int r = 0; r < 8; ++r) {
          std::memcpy(S + 2 * r, R[r] + 208, 2);
          for (int h = 0; h < 16; ++h) S[16 + 8 * h + r] = R[r][192 + h];
        }
        // low nibbles of blocks 2 q, 2 q + 1: ql bytes 64 (q / 2) + i and + 32, nibble q % 2 of each
        for (int q = 0; q < 4; ++q)
          for (int s = 0; s < 8; ++s)
            for (int r = 0; r < 8; ++r)
              for (int kk = 0; kk < 4; ++kk) {
                const uint8_t a = R[r][64 * (q >> 1) + 4 * s + kk], c = R[r][64 * (q >> 1) + 32 + 4 * s + kk];
                S[144 + 256 * q + 32 * s + 4 * r + kk] =
                    q & 1 ? static_cast<uint8_t>((a >> 4) | (c & 0xF0)) : static_cast<uint8_t>((a & 0x0F) | (c << 4));
              }
        words(1168, 128, 16);  // the high bit pairs of blocks 4 t .. 4 t + 3 are qh byte 32 t + i as it is
      } else {
        for (int r = 0; r < 8; ++r)
          for (int j = 0; j < 8; ++j) {
            std::memcpy(S + 16 * j + 2 * r, R[r] + 20 * j, 2);
            std::memcpy(S + 128 + 16 * j + 2 * r, R[r] + 20 * j + 2, 2);
          }
        const auto w = [&](int r, int j, int i) {  // weight i of block j: nibble i / 16 of byte i % 16
          const uint8_t v = R[r][20 * j + 4 + (i & 15)];
          return i < 16 ? v & 0x0F : v >> 4;
        };
        for (int q = 0; q < 4; ++q)
          for (int s = 0; s < 8; ++s)
            for (int r = 0; r < 8; ++r)
              for (int kk = 0; kk < 4; ++kk)
                S[256 + 256 * q + 32 * s + 4 * r + kk] =
                    static_cast<uint8_t>(w(r, 2 * q, 4 * s + kk) | (w(r, 2 * q + 1, 4 * s + kk) << 4));
      }
    }
  });
  return out;
}

// fmt: a FORMAT_IDS value (see the top); w in the kernel layout
at::Tensor qlinear(const at::Tensor& x, const at::Tensor& w, int64_t n_out, int64_t fmt) {
  TORCH_CHECK(x.device().is_cpu(), "tokenmill::qlinear runs on the CPU");
  TORCH_CHECK(x.scalar_type() == at::kFloat, "tokenmill::qlinear takes float32 activations");
  const int64_t K = x.size(-1);
  check_blocks(w, n_out, K, fmt, "qlinear");
  auto xc = x.reshape({-1, K}).contiguous();
  auto out_shape = x.sizes().vec();
  out_shape.back() = n_out;
  auto y = at::empty({xc.size(0), n_out}, x.options());
  ActivationBuffers buf;
  qlinear_into(xc, w, n_out, fmt, y, false, buf);
  return y.view(out_shape);
}

// Quantize activations only (for tests: the reference must round exactly like the kernel): (q int16, d, d * sum(q)).
std::vector<at::Tensor> quantize_activations(const at::Tensor& x) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 2 && x.size(1) % QK == 0,
              "tokenmill::quantize_activations takes float32 [M, K] with K a multiple of 32");
  auto xc = x.contiguous();
  const int64_t M = xc.size(0), K = xc.size(1), nb = K / QK;
  auto d = at::empty({M, nb}, x.options());
  auto s = at::empty({M, nb}, x.options());
  auto q = at::empty({M, K}, x.options().dtype(at::kShort));
  quantize_rows16(xc.data_ptr<float>(), M, K, q.data_ptr<int16_t>(), d.data_ptr<float>(), s.data_ptr<float>(), nb);
  return {q, d, s};
}

// ---- float32 linear layers in one summation order (--quantization none) ----------------------------
// torch's float GEMM picks its blocking by batch size, so a row's result changes with M. Here
// y[m, n] = sum_k x[m, k] w[n, k] is always eight FMA chains, chain j over k = j, j + 8, j + 16, ... in
// order, then hsum()'s tree over the chains, whatever M, the thread split or the instruction set.
// Weights are panels of 16 output columns, [P, K, 16] float32 (columns past N zero): a panel row is one
// zmm (two ymm), so the chains of 16 (8) columns advance together with no horizontal sums.
constexpr int FP = 16;

template <int RM>
TM_AVX512 void fpanel_avx512(const float* wp, int64_t K, const float* x, int64_t ldx, const float* bias, float* y,
                             int64_t ldy, int cols) {
  __m512 acc[RM][8];
  for (int m = 0; m < RM; ++m)
    for (int j = 0; j < 8; ++j) acc[m][j] = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 8 <= K; k += 8)
#pragma GCC unroll 8
    for (int j = 0; j < 8; ++j) {
      const __m512 w = _mm512_load_ps(wp + (k + j) * FP);
      for (int m = 0; m < RM; ++m) acc[m][j] = _mm512_fmadd_ps(_mm512_set1_ps(x[m * ldx + k + j]), w, acc[m][j]);
    }
  for (; k < K; ++k) {
    const __m512 w = _mm512_load_ps(wp + k * FP);
    for (int m = 0; m < RM; ++m) acc[m][k & 7] = _mm512_fmadd_ps(_mm512_set1_ps(x[m * ldx + k]), w, acc[m][k & 7]);
  }
  const __mmask16 mask = static_cast<__mmask16>((1u << cols) - 1);
  for (int m = 0; m < RM; ++m) {
    const __m512 t0 = _mm512_add_ps(_mm512_add_ps(acc[m][0], acc[m][4]), _mm512_add_ps(acc[m][2], acc[m][6]));
    const __m512 t1 = _mm512_add_ps(_mm512_add_ps(acc[m][1], acc[m][5]), _mm512_add_ps(acc[m][3], acc[m][7]));
    __m512 r = _mm512_add_ps(t0, t1);
    if (bias) r = _mm512_add_ps(r, _mm512_maskz_loadu_ps(mask, bias));
    _mm512_mask_storeu_ps(y + m * ldy, mask, r);
  }
}

// The same on AVX2, one token and one half panel (8 columns) at a time: 8 chains fill half the ymm registers.
inline void fpanel_avx2(const float* wp, int64_t K, const float* x, const float* bias, float* y, int cols) {
  for (int h = 0; h < 2 && 8 * h < cols; ++h) {
    __m256 acc[8];
    for (int j = 0; j < 8; ++j) acc[j] = _mm256_setzero_ps();
    const float* w = wp + 8 * h;
    int64_t k = 0;
    for (; k + 8 <= K; k += 8)
#pragma GCC unroll 8
      for (int j = 0; j < 8; ++j)
        acc[j] = _mm256_fmadd_ps(_mm256_set1_ps(x[k + j]), _mm256_load_ps(w + (k + j) * FP), acc[j]);
    for (; k < K; ++k) acc[k & 7] = _mm256_fmadd_ps(_mm256_set1_ps(x[k]), _mm256_load_ps(w + k * FP), acc[k & 7]);
    const __m256 t0 = _mm256_add_ps(_mm256_add_ps(acc[0], acc[4]), _mm256_add_ps(acc[2], acc[6]));
    const __m256 t1 = _mm256_add_ps(_mm256_add_ps(acc[1], acc[5]), _mm256_add_ps(acc[3], acc[7]));
    __m256 r = _mm256_add_ps(t0, t1);
    const int n = std::min(8, cols - 8 * h);
    alignas(32) float out[8] = {};
    if (bias) {
      std::memcpy(out, bias + 8 * h, n * sizeof(float));
      r = _mm256_add_ps(r, _mm256_load_ps(out));
    }
    _mm256_store_ps(out, r);
    std::memcpy(y + 8 * h, out, n * sizeof(float));
  }
}

// y [M, N] = x [M, K] . W^T (+ bias) with W as panels [ceil(N / 16), K, 16]
at::Tensor flinear(const at::Tensor& x, const at::Tensor& w, int64_t n_out, const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat, "tokenmill::flinear takes float32 activations on the CPU");
  const int64_t K = x.size(-1), P = (n_out + FP - 1) / FP;
  TORCH_CHECK(w.scalar_type() == at::kFloat && w.is_contiguous() && w.dim() == 3 && w.size(0) == P && w.size(1) == K &&
                  w.size(2) == FP && reinterpret_cast<uintptr_t>(w.data_ptr()) % 64 == 0,
              "tokenmill::flinear: weight must be 64-byte aligned contiguous float32 panels [", P, ", ", K, ", 16] ",
              "(tokenmill.layers.panel_linear.to_panels)");
  const float* b = nullptr;
  if (bias.has_value()) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == n_out,
                "tokenmill::flinear: bias must be contiguous float32 [", n_out, "]");
    b = bias->data_ptr<float>();
  }
  auto xc = x.reshape({-1, K}).contiguous();
  const int64_t M = xc.size(0);
  auto out_shape = x.sizes().vec();
  out_shape.back() = n_out;
  auto y = at::empty({M, n_out}, x.options());
  const float* xp = xc.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const bool wide = g_use_vnni.load(std::memory_order_relaxed);  // AVX512 where the many-token GEMM uses it; the same bits either way
  at::parallel_for(0, P, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p) {
      const int cols = static_cast<int>(std::min<int64_t>(FP, n_out - p * FP));
      const float* wpp = wp + p * K * FP;
      const float* bp = b ? b + p * FP : nullptr;
      float* yo = yp + p * FP;
      int64_t m = 0;
      if (wide) {
        for (; m + 3 <= M; m += 3) fpanel_avx512<3>(wpp, K, xp + m * K, K, bp, yo + m * n_out, n_out, cols);
        for (; m < M; ++m) fpanel_avx512<1>(wpp, K, xp + m * K, K, bp, yo + m * n_out, n_out, cols);
      } else {
        for (; m < M; ++m) fpanel_avx2(wpp, K, xp + m * K, bp, yo + m * n_out, cols);
      }
    }
  });
  return y.view(out_shape);
}

// e^x on eight lanes: x = n ln2 + r, e^r from Cephes' expf polynomial (about 1 ulp), times 2^n.
// Inputs are clamped to [-87.3, 88.3], where the result is a normal float.
inline __m256 exp256(__m256 x) {
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.3f)), _mm256_set1_ps(88.3f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);  // ln2 in two parts: r stays exact
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

// ---- fused elementwise ops of a decoder layer ----------------------------------------------------
// At decode sizes every torch op costs several microseconds of dispatch, more than its arithmetic;
// these replace the RMSNorm, RoPE and SwiGLU chains (7, ~20 and 3 ops) with one call each.
// Same arithmetic as the torch reference in tokenmill/models/llama.py and layers/rotary.py.

void check_f32_rows(const at::Tensor& x, const char* op) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.dim() == 2 && x.stride(1) == 1,
              "tokenmill::", op, " takes a float32 CPU tensor [T, D] with unit column stride");
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w, double eps) {
  check_f32_rows(x, "rms_norm");
  const int64_t T = x.size(0), D = x.size(1), ld = x.stride(0);
  TORCH_CHECK(w.scalar_type() == at::kFloat && w.is_contiguous() && w.numel() == D,
              "tokenmill::rms_norm: weight must be float32 [", D, "]");
  auto y = at::empty({T, D}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, T, 16, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const float* r = xp + t * ld;
      float ss = 0.0f;
      for (int64_t i = 0; i < D; ++i) ss += r[i] * r[i];
      const float inv = 1.0f / std::sqrt(ss / static_cast<float>(D) + static_cast<float>(eps));
      for (int64_t i = 0; i < D; ++i) yp[t * D + i] = wp[i] * (r[i] * inv);
    }
  });
  return y;
}

// Rotate-half RoPE, in place, on the first n_heads heads of each row of x (a fused q|k|v projection
// output: the query heads then the key heads are rotated, the value heads are left alone).
void rope_(at::Tensor x, const at::Tensor& cos, const at::Tensor& sin, int64_t n_heads, int64_t head_dim) {
  check_f32_rows(x, "rope_");
  const int64_t T = x.size(0), ld = x.stride(0), half = head_dim / 2;
  TORCH_CHECK(head_dim % 2 == 0 && n_heads * head_dim <= x.size(1), "tokenmill::rope_: bad head layout");
  TORCH_CHECK(cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat && cos.is_contiguous() &&
                  sin.is_contiguous() && cos.numel() == T * half && sin.numel() == T * half,
              "tokenmill::rope_: cos/sin must be contiguous float32 [T, head_dim / 2]");
  float* xp = x.data_ptr<float>();
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  at::parallel_for(0, T, 16, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const float* c = cp + t * half;
      const float* sn = sp + t * half;
      for (int64_t h = 0; h < n_heads; ++h) {
        float* a = xp + t * ld + h * head_dim;
        float* b = a + half;
        for (int64_t i = 0; i < half; ++i) {
          const float x1 = a[i], x2 = b[i];
          a[i] = x1 * c[i] - x2 * sn[i];
          b[i] = x2 * c[i] + x1 * sn[i];
        }
      }
    }
  });
}

// SwiGLU on a fused gate|up projection output [T, 2I] -> silu(gate) * up, [T, I].
at::Tensor silu_mul(const at::Tensor& gu) {
  check_f32_rows(gu, "silu_mul");
  const int64_t T = gu.size(0), I = gu.size(1) / 2, ld = gu.stride(0);
  TORCH_CHECK(gu.size(1) % 2 == 0, "tokenmill::silu_mul: the last dimension must be even");
  auto y = at::empty({T, I}, gu.options());
  const float* gp = gu.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, T, 16, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const float* g = gp + t * ld;
      const float* u = g + I;
      float* y = yp + t * I;
      int64_t i = 0;
      for (; i + 8 <= I; i += 8) {
        const __m256 gv = _mm256_loadu_ps(g + i);
        const __m256 den = _mm256_add_ps(_mm256_set1_ps(1.0f), exp256(_mm256_sub_ps(_mm256_setzero_ps(), gv)));
        _mm256_storeu_ps(y + i, _mm256_mul_ps(_mm256_div_ps(gv, den), _mm256_loadu_ps(u + i)));
      }
      for (; i < I; ++i) y[i] = g[i] / (1.0f + std::exp(-g[i])) * u[i];
    }
  });
  return y;
}

// sum of a[i] * b[i], eight lanes at a time (the scalar loop does not vectorize: FP sums do not reassociate)
inline float dot_f32(const float* a, const float* b, int64_t n) {
  __m256 s0 = _mm256_setzero_ps(), s1 = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    s0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), s0);
    s1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), _mm256_loadu_ps(b + i + 8), s1);
  }
  for (; i + 8 <= n; i += 8) s0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), s0);
  float r = hsum(_mm256_add_ps(s0, s1));
  for (; i < n; ++i) r += a[i] * b[i];
  return r;
}

// ---- decode attention over the paged KV cache, reading the blocks in place ---------------------------
// per-thread scratch of attend (below): scores [G, L] and the L rows' offsets
struct AttendScratch {
  std::vector<float> scores;
  std::vector<int64_t> rows;
  std::vector<float> k, v;  // a quantized cache's rows of one part, dequantized
};

// out[0:8 NV] = sum_i p[i] * base[rows[i] + 0:8 NV] in NV registers (a running sum in memory was bound by
// its stores); prefetches the row pf rows ahead (pf = 0: none)
template <int NV>
inline void accumulate_rows(const float* base, const int64_t* rows, int64_t L, const float* p, float* out, int64_t pf) {
  __m256 a[NV];
  for (int v = 0; v < NV; ++v) a[v] = _mm256_setzero_ps();
  for (int64_t i = 0; i < L; ++i) {
    if (pf && i + pf < L)
      for (int o = 0; o < 8 * NV; o += 16) _mm_prefetch(reinterpret_cast<const char*>(base + rows[i + pf] + o), _MM_HINT_T0);
    const __m256 pi = _mm256_set1_ps(p[i]);
    const float* r = base + rows[i];
    for (int v = 0; v < NV; ++v) a[v] = _mm256_fmadd_ps(pi, _mm256_loadu_ps(r + 8 * v), a[v]);
  }
  for (int v = 0; v < NV; ++v) _mm256_storeu_ps(out + 8 * v, a[v]);
}

// the same for any n <= 64 columns: registers where n is a multiple of 8, else a scalar loop
inline void accumulate_rows(const float* base, const int64_t* rows, int64_t L, const float* p, int64_t n, float* out,
                            int64_t pf) {
  switch (n % 8 == 0 ? n / 8 : 0) {
    case 1: return accumulate_rows<1>(base, rows, L, p, out, pf);
    case 2: return accumulate_rows<2>(base, rows, L, p, out, pf);
    case 3: return accumulate_rows<3>(base, rows, L, p, out, pf);
    case 4: return accumulate_rows<4>(base, rows, L, p, out, pf);
    case 5: return accumulate_rows<5>(base, rows, L, p, out, pf);
    case 6: return accumulate_rows<6>(base, rows, L, p, out, pf);
    case 7: return accumulate_rows<7>(base, rows, L, p, out, pf);
    case 8: return accumulate_rows<8>(base, rows, L, p, out, pf);
    default:
      std::fill(out, out + n, 0.0f);
      for (int64_t i = 0; i < L; ++i)
        for (int64_t e = 0; e < n; ++e) out[e] += p[i] * base[rows[i] + e];
  }
}

// the dot products of q [D] (D a multiple of 8) with the 8 rows at base + rows[0..7], as 8 lanes: one
// reduction tree for all eight instead of a horizontal sum per row
inline __m256 dot8_rows(const float* q, const float* base, const int64_t* rows, int64_t D) {
  __m256 s[8];
  for (int r = 0; r < 8; ++r) s[r] = _mm256_setzero_ps();
  for (int64_t d = 0; d < D; d += 8) {
    const __m256 qv = _mm256_loadu_ps(q + d);
    for (int r = 0; r < 8; ++r) s[r] = _mm256_fmadd_ps(qv, _mm256_loadu_ps(base + rows[r] + d), s[r]);
  }
  // per 128 bits after two rounds: a = [r0 r1 r2 r3] (low half of D's lanes, then high), c = [r4 .. r7]
  const __m256 a = _mm256_hadd_ps(_mm256_hadd_ps(s[0], s[1]), _mm256_hadd_ps(s[2], s[3]));
  const __m256 c = _mm256_hadd_ps(_mm256_hadd_ps(s[4], s[5]), _mm256_hadd_ps(s[6], s[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(a, c, 0x20), _mm256_permute2f128_ps(a, c, 0x31));
}

// Attention for every token of a step, prefill or decode alike: query token t (q [T, H, D]) attends to
// the first ctx_lens[t] cached tokens of its sequence, found through block_tables[seq_of[t]]; its own
// K/V are in the cache already. No gathered copy of the context. Query heads sharing a KV head
// (grouped-query attention) are handled together so each key and value is read once per group.
//
// Batch invariance: a token's output is a function of its query and its context only. The context is
// cut into parts of PART tokens at fixed offsets (0, PART, 2 PART, ...), each part reduced the same way,
// and the parts merged in order by their maxima and sums (flash-decoding); how many tokens share the
// step, whether this token came in a prefill chunk or as a decode, and how the parts are spread over
// threads change nothing. One long sequence still spreads over the threads through its parts.
// A sliding window (Mistral, Gemma 2, Phi-3) starts token t's context at ctx_lens[t] - window: the parts
// keep their fixed offsets, the first one cut at that start. A soft cap (Gemma 2) turns each score s into
// cap * tanh(s / cap) before the softmax.
constexpr int64_t PART = 256;

// fp8 e4m3 (finite, NaN at 0x7f/0xff) to float, exactly as torch converts it: 256 entries, built once
const std::array<float, 256> kE4M3 = [] {
  std::array<float, 256> t{};
  for (int b = 0; b < 256; ++b) {
    const int e = (b >> 3) & 15, m = b & 7;
    float v = e == 0 ? std::ldexp(static_cast<float>(m), -9) : std::ldexp(1.0f + m / 8.0f, e - 7);
    if (e == 15 && m == 7) v = std::numeric_limits<float>::quiet_NaN();
    t[b] = (b & 128) ? -v : v;
  }
  return t;
}();

// A quantized cache (--kv-cache-dtype int8|fp8): 1-byte values [blocks, block_size, Hkv, D] and one float32
// scale per token and KV head [blocks, block_size, Hkv]. Rows are dequantized as value * scale, the one
// float multiply attention.py's dequantize_kv does, so the kernel sees the values the torch path would.
struct QuantizedCache {
  const uint8_t* values = nullptr;  // int8 or e4m3 bits
  const float* scales = nullptr;
  bool fp8 = false;
  inline void row(int64_t slot_row, int64_t scale_idx, int64_t D, float* out) const {
    const uint8_t* v = values + slot_row;
    const float s = scales[scale_idx];
    if (fp8)
      for (int64_t e = 0; e < D; ++e) out[e] = kE4M3[v[e]] * s;
    else
      for (int64_t e = 0; e < D; ++e) out[e] = static_cast<float>(static_cast<int8_t>(v[e])) * s;
  }
};

at::Tensor paged_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                           const at::Tensor& block_tables, const at::Tensor& seq_of, const at::Tensor& ctx_lens,
                           double scale, const std::optional<at::Tensor>& k_scale = std::nullopt,
                           const std::optional<at::Tensor>& v_scale = std::nullopt, int64_t window = 0,
                           double softcap = 0.0) {
  TORCH_CHECK(q.device().is_cpu() && q.scalar_type() == at::kFloat && q.dim() == 3 && q.stride(2) == 1 &&
                  q.stride(1) == q.size(2),
              "tokenmill::paged_attention: q must be float32 [T, H, D] with contiguous heads");
  const bool quantized = k_scale.has_value();
  TORCH_CHECK(quantized == v_scale.has_value(), "tokenmill::paged_attention: give both k_scale and v_scale, or neither");
  const auto store = k_cache.scalar_type();
  TORCH_CHECK(quantized ? (store == at::kChar || store == at::kByte) : store == at::kFloat,
              "tokenmill::paged_attention: caches must be float32, or int8/uint8 (fp8 e4m3 bits) with scales");
  TORCH_CHECK(v_cache.scalar_type() == store && k_cache.dim() == 4 && k_cache.is_contiguous() &&
                  v_cache.is_contiguous() && k_cache.sizes() == v_cache.sizes(),
              "tokenmill::paged_attention: caches must be contiguous [blocks, block_size, Hkv, D] of one dtype");
  QuantizedCache kq, vq;
  if (quantized) {
    for (const at::Tensor* sc : {&*k_scale, &*v_scale})
      TORCH_CHECK(sc->scalar_type() == at::kFloat && sc->is_contiguous() &&
                      sc->numel() * k_cache.size(3) == k_cache.numel(),
                  "tokenmill::paged_attention: scales must be contiguous float32 [blocks, block_size, Hkv]");
    kq = {static_cast<const uint8_t*>(k_cache.data_ptr()), k_scale->data_ptr<float>(), store == at::kByte};
    vq = {static_cast<const uint8_t*>(v_cache.data_ptr()), v_scale->data_ptr<float>(), store == at::kByte};
  }
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && block_tables.is_contiguous() && block_tables.dim() == 2 &&
                  seq_of.scalar_type() == at::kLong && seq_of.is_contiguous() &&
                  ctx_lens.scalar_type() == at::kLong && ctx_lens.is_contiguous() &&
                  seq_of.numel() == q.size(0) && ctx_lens.numel() == q.size(0),
              "tokenmill::paged_attention: block_tables [S, W], seq_of [T] and ctx_lens [T] must be contiguous int64");
  const int64_t T = q.size(0), H = q.size(1), D = q.size(2), ldq = q.stride(0);
  const int64_t NB = k_cache.size(0), BS = k_cache.size(1), HKV = k_cache.size(2);
  TORCH_CHECK(k_cache.size(3) == D && H % HKV == 0, "tokenmill::paged_attention: head layout mismatch");
  const int64_t G = H / HKV, S = block_tables.size(0), W = block_tables.size(1);
  const float* qp = q.data_ptr<float>();
  const float* kp_float = quantized ? nullptr : k_cache.data_ptr<float>();
  const float* vp_float = quantized ? nullptr : v_cache.data_ptr<float>();
  const int64_t* tp = block_tables.data_ptr<int64_t>();
  const int64_t* sp = seq_of.data_ptr<int64_t>();
  const int64_t* lp = ctx_lens.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t) {
    TORCH_CHECK(sp[t] >= 0 && sp[t] < S, "tokenmill::paged_attention: token ", t, " names block-table row ", sp[t],
                " of ", S);
    TORCH_CHECK(lp[t] >= 1 && lp[t] <= W * BS, "tokenmill::paged_attention: context length ", lp[t],
                " does not fit the block table of ", W, " blocks");
  }
  auto out = at::empty({T, H, D}, q.options());
  float* op = out.data_ptr<float>();
  if (T == 0) return out;
  TORCH_CHECK(window >= 0 && softcap >= 0, "tokenmill::paged_attention: window and softcap must be >= 0");
  const float sc = static_cast<float>(scale), cap = static_cast<float>(softcap);
  // The G query heads of KV head hk over context tokens [j0, j1) of token t: acc = sum_j e_j v_j (not yet
  // divided), mx = max score, sum = sum_j e_j, with e_j = exp(score_j - mx). s: the scratch of one thread.
  // The cached rows come from DRAM (a decode step streams ~100 MB of weights between two visits to a
  // layer's KV), strided by Hkv * D floats: each row is prefetched PF_ROWS tokens ahead, as the hardware
  // prefetcher does not follow the block table.
  constexpr int64_t PF_ROWS = 16;
  const int64_t row_floats = HKV * D;
  auto attend = [&](int64_t t, int64_t hk, int64_t j0, int64_t j1, AttendScratch& s, float* acc, float* mx,
                    float* sum) {
    const int64_t L = j1 - j0, b = sp[t];
    s.scores.assign(G * L, 0.0f);
    s.rows.resize(L);
    int64_t* rows = s.rows.data();  // float offset of context token j0 + i's row for this head, in either cache
    for (int64_t i = 0; i < L; ++i) {
      const int64_t j = j0 + i, blk = tp[b * W + j / BS];
      TORCH_CHECK(blk >= 0 && blk < NB, "tokenmill::paged_attention: block id ", blk, " out of range");
      rows[i] = (blk * BS + j % BS) * row_floats + hk * D;
    }
    const float* kp = kp_float;
    const float* vp = vp_float;
    if (quantized) {  // the part's rows dequantized into scratch; everything below then reads floats alike
      s.k.resize(L * D), s.v.resize(L * D);
      for (int64_t i = 0; i < L; ++i) {
        const int64_t scale_idx = rows[i] / D;  // (slot * Hkv + hk): one scale per token and KV head
        kq.row(rows[i], scale_idx, D, s.k.data() + i * D);
        vq.row(rows[i], scale_idx, D, s.v.data() + i * D);
        rows[i] = i * D;
      }
      kp = s.k.data(), vp = s.v.data();
    }
    auto prefetch_row = [&](const float* base, int64_t i) {
      if (i < L)
        for (int64_t o = 0; o < D; o += 16) _mm_prefetch(reinterpret_cast<const char*>(base + rows[i] + o), _MM_HINT_T0);
    };
    for (int64_t i = 0; i < std::min(L, PF_ROWS); ++i) prefetch_row(kp, i), prefetch_row(vp, i);
    const float* qh = qp + t * ldq + hk * G * D;  // the G query heads of this KV head are adjacent
    float* scores = s.scores.data();
    int64_t i = 0;
    if (D % 8 == 0)
      for (; i + 8 <= L; i += 8) {
        for (int64_t r = 0; r < 8; ++r) prefetch_row(kp, i + r + PF_ROWS);
        for (int64_t g = 0; g < G; ++g)
          _mm256_storeu_ps(scores + g * L + i, _mm256_mul_ps(dot8_rows(qh + g * D, kp, rows + i, D), _mm256_set1_ps(sc)));
      }
    for (; i < L; ++i) {
      prefetch_row(kp, i + PF_ROWS);
      const float* kj = kp + rows[i];
      for (int64_t g = 0; g < G; ++g) scores[g * L + i] = dot_f32(qh + g * D, kj, D) * sc;
    }
    if (cap > 0)
      for (int64_t e = 0; e < G * L; ++e) scores[e] = cap * std::tanh(scores[e] / cap);
    for (int64_t g = 0; g < G; ++g) {
      float* sg = scores + g * L;
      const float m = *std::max_element(sg, sg + L);
      __m256 vsum = _mm256_setzero_ps();
      int64_t j = 0;
      for (; j + 8 <= L; j += 8) {
        const __m256 e = exp256(_mm256_sub_ps(_mm256_loadu_ps(sg + j), _mm256_set1_ps(m)));
        _mm256_storeu_ps(sg + j, e);
        vsum = _mm256_add_ps(vsum, e);
      }
      float total = hsum(vsum);
      for (; j < L; ++j) {
        sg[j] = std::exp(sg[j] - m);
        total += sg[j];
      }
      mx[g] = m;
      sum[g] = total;
    }
    // acc_g = sum_i e_gi v_i, 64 columns at a time in registers (a running sum in memory was bound by
    // its stores); the first head's pass over the rows also prefetches the rows ahead
    for (int64_t g = 0; g < G; ++g)
      for (int64_t d0 = 0; d0 < D; d0 += 64)
        accumulate_rows(vp + d0, rows, L, scores + g * L, std::min<int64_t>(64, D - d0), acc + g * D + d0,
                        g == 0 ? PF_ROWS : 0);
  };
  // The parts' results, merged in order: o = sum_p w_p acc_p / sum_p w_p sum_p, w_p = exp(mx_p - max).
  // With one part w = 1 exactly, so this is acc / sum.
  auto merge = [&](int64_t t, int64_t hk, int64_t P, const float* acc, const float* mx, const float* sum) {
    for (int64_t g = 0; g < G; ++g) {
      float m = -std::numeric_limits<float>::infinity();
      for (int64_t p = 0; p < P; ++p) m = std::max(m, mx[p * G + g]);
      float total = 0.0f;
      float* o = op + (t * H + hk * G + g) * D;
      std::fill(o, o + D, 0.0f);
      for (int64_t p = 0; p < P; ++p) {
        const float w = std::exp(mx[p * G + g] - m);
        total += w * sum[p * G + g];
        const float* a = acc + (p * G + g) * D;
        for (int64_t e = 0; e < D; ++e) o[e] += w * a[e];
      }
      const float inv = 1.0f / total;
      for (int64_t e = 0; e < D; ++e) o[e] *= inv;
    }
  };
  // token t's context is [first_pos(t), lp[t]); its parts are the PART-aligned pieces of that range
  auto first_pos = [&](int64_t t) { return window > 0 ? std::max<int64_t>(0, lp[t] - window) : int64_t{0}; };
  auto parts_of = [&](int64_t t) { return (lp[t] + PART - 1) / PART - first_pos(t) / PART; };
  auto part_range = [&](int64_t t, int64_t part) {  // [j0, j1) of the part-th part of token t's context
    const int64_t p = first_pos(t) / PART + part;
    return std::make_pair(std::max(first_pos(t), p * PART), std::min(lp[t], (p + 1) * PART));
  };
  const int64_t items = T * HKV, threads = at::get_num_threads();
  if (items >= 2 * threads) {  // enough (token, KV head) pairs: each thread takes whole pairs
    at::parallel_for(0, items, 1, [&](int64_t i0, int64_t i1) {
      AttendScratch scratch;
      std::vector<float> acc, mx, sum;
      for (int64_t i = i0; i < i1; ++i) {
        const int64_t t = i / HKV, hk = i % HKV, P = parts_of(t);
        acc.resize(P * G * D), mx.resize(P * G), sum.resize(P * G);
        for (int64_t p = 0; p < P; ++p) {
          const auto [j0, j1] = part_range(t, p);
          attend(t, hk, j0, j1, scratch, acc.data() + p * G * D, mx.data() + p * G, sum.data() + p * G);
        }
        merge(t, hk, P, acc.data(), mx.data(), sum.data());
      }
    });
    return out;
  }
  // Few pairs (a decode step of one or two sequences): the parts themselves go to the threads.
  std::vector<int64_t> first(items + 1, 0);  // pair i's parts are [first[i], first[i + 1])
  for (int64_t i = 0; i < items; ++i) first[i + 1] = first[i] + parts_of(i / HKV);
  const int64_t total_parts = first[items];
  std::vector<float> acc(total_parts * G * D), mx(total_parts * G), sum(total_parts * G);
  at::parallel_for(0, total_parts, 1, [&](int64_t p0, int64_t p1) {
    AttendScratch scratch;
    for (int64_t p = p0; p < p1; ++p) {
      const int64_t i = std::upper_bound(first.begin(), first.end(), p) - first.begin() - 1;
      const int64_t t = i / HKV, hk = i % HKV, part = p - first[i];
      const auto [j0, j1] = part_range(t, part);
      attend(t, hk, j0, j1, scratch, acc.data() + p * G * D, mx.data() + p * G, sum.data() + p * G);
    }
  });
  for (int64_t i = 0; i < items; ++i)
    merge(i / HKV, i % HKV, first[i + 1] - first[i], acc.data() + first[i] * G * D, mx.data() + first[i] * G,
          sum.data() + first[i] * G);
  return out;
}

// ---- every decoder layer of a step, in one call ---------------------------------------------------
// At a few tokens a step a decoder layer is about twenty small ops, and dispatching them from Python
// costs more than their arithmetic. This runs all layers of a float32-cache step (decodes, prefill
// chunks, or both) with the kernels above, called directly, in the order of the Python path
// (models/llama.py with fused ops on), so the two give the same bits.
// weights: 7 per layer: input norm, qkv (kernel layout), qkv bias (empty: none), o_proj,
// post-attention norm, gate_up, down_proj; fmts: 4 per layer (qkv, o_proj, gate_up, down_proj).
int64_t rows_of(const at::Tensor& w, int64_t K, int64_t fmt) {
  check_format(K, fmt, "forward_layers");
  return is_x8(fmt) ? w.numel() / matrix_bytes(fmt, 8, K / QK) * 8 : w.numel() / row_bytes_of(fmt, K / QK);
}

// One decoder layer's two halves, the only definition of the layer the kernels have: forward_layers runs
// them for every layer in one call, and a tensor-parallel rank calls them one at a time (attention_half,
// mlp_half) with the all-reduce of each half's row-parallel output between them.
//
// attention half: out (+)= o_proj(attention(rope(qkv(rms_norm(x))))), the new tokens' K and V into their
// cache slots. w: norm, qkv, qkv bias (empty: none), o_proj; f: the two projections' formats.
// mlp half: out (+)= down(silu(gate) * up(rms_norm(x))). w: norm, gate_up, down; f: their formats.
// accumulate: out is the residual stream (x itself), added to in place; else out is written.
struct LayerArgs {
  const at::Tensor& cos;
  const at::Tensor& sin;
  const at::Tensor& slot_mapping;
  const at::Tensor& block_tables;
  const at::Tensor& seq_of;
  const at::Tensor& ctx_lens;
  int64_t H, HKV, D;
  double eps, scale;
};

void project_into(const at::Tensor& in, const at::Tensor& w, int64_t fmt, at::Tensor& out, bool accumulate,
                  ActivationBuffers& buf, const char* what) {
  check_blocks(w, out.size(1), in.size(1), fmt, what);
  qlinear_into(in, w, out.size(1), fmt, out, accumulate, buf);
}

at::Tensor project_new(const at::Tensor& in, const at::Tensor& w, int64_t fmt, ActivationBuffers& buf,
                       const char* what) {
  const int64_t n_out = rows_of(w, in.size(1), fmt);
  at::Tensor out = at::empty({in.size(0), n_out}, in.options());
  project_into(in, w, fmt, out, false, buf, what);
  return out;
}

void attention_half_into(const at::Tensor& x, const at::Tensor* w, const int64_t* f, const at::Tensor& kc,
                         const at::Tensor& vc, const LayerArgs& a, at::Tensor& out, bool accumulate,
                         ActivationBuffers& buf, const char* what) {
  const int64_t T = x.size(0), H = a.H, HKV = a.HKV, D = a.D;
  TORCH_CHECK(kc.scalar_type() == at::kFloat && vc.scalar_type() == at::kFloat && kc.is_contiguous() &&
                  vc.is_contiguous() && kc.dim() == 4 && kc.size(2) == HKV && kc.size(3) == D,
              "tokenmill::", what, ": caches must be contiguous float32 [blocks, block_size, Hkv, D]");
  TORCH_CHECK(a.slot_mapping.scalar_type() == at::kLong && a.slot_mapping.is_contiguous() &&
                  a.slot_mapping.numel() == T,
              "tokenmill::", what, ": slot_mapping must be contiguous int64 [T]");
  const int64_t num_slots = kc.size(0) * kc.size(1), row = HKV * D;
  const int64_t* slots = a.slot_mapping.data_ptr<int64_t>();
  at::Tensor h = rms_norm(x, w[0], a.eps);
  at::Tensor qkv = project_new(h, w[1], f[0], buf, what);
  if (w[2].numel() > 0) qkv = qkv + w[2];
  TORCH_CHECK(qkv.size(1) == (H + 2 * HKV) * D, "tokenmill::", what, ": qkv width does not match the heads");
  rope_(qkv, a.cos, a.sin, H + HKV, D);
  const float* qp = qkv.data_ptr<float>();
  float* kp = kc.data_ptr<float>();
  float* vp = vc.data_ptr<float>();
  const int64_t ld = qkv.stride(0);
  for (int64_t t = 0; t < T; ++t) {  // the new token's K and V into its cache slot
    TORCH_CHECK(slots[t] >= 0 && slots[t] < num_slots, "tokenmill::", what, ": slot ", slots[t],
                " outside the cache");
    std::memcpy(kp + slots[t] * row, qp + t * ld + H * D, row * sizeof(float));
    std::memcpy(vp + slots[t] * row, qp + t * ld + (H + HKV) * D, row * sizeof(float));
  }
  at::Tensor q = qkv.narrow(1, 0, H * D).view({T, H, D});
  at::Tensor o = paged_attention(q, kc, vc, a.block_tables, a.seq_of, a.ctx_lens, a.scale).view({T, H * D});
  project_into(o, w[3], f[1], out, accumulate, buf, what);
}

void mlp_half_into(const at::Tensor& x, const at::Tensor* w, const int64_t* f, double eps, at::Tensor& out,
                   bool accumulate, ActivationBuffers& buf, const char* what) {
  at::Tensor h = rms_norm(x, w[0], eps);
  at::Tensor act = silu_mul(project_new(h, w[1], f[0], buf, what));
  project_into(act, w[2], f[1], out, accumulate, buf, what);
}

at::Tensor forward_layers(const at::Tensor& x_in, at::TensorList weights, at::IntArrayRef fmts,
                          at::TensorList k_caches, at::TensorList v_caches, const at::Tensor& cos, const at::Tensor& sin,
                          const at::Tensor& slot_mapping, const at::Tensor& block_tables, const at::Tensor& seq_of,
                          const at::Tensor& ctx_lens, int64_t n_heads, int64_t n_kv_heads, int64_t head_dim, double eps,
                          double scale) {
  check_f32_rows(x_in, "forward_layers");
  const int64_t L = static_cast<int64_t>(k_caches.size());
  TORCH_CHECK(static_cast<int64_t>(weights.size()) == 7 * L && static_cast<int64_t>(fmts.size()) == 4 * L &&
                  static_cast<int64_t>(v_caches.size()) == L,
              "tokenmill::forward_layers: need 7 weights, 4 formats and a K and V cache per layer");
  const LayerArgs args{cos, sin, slot_mapping, block_tables, seq_of, ctx_lens, n_heads, n_kv_heads, head_dim, eps, scale};
  at::Tensor x = x_in.clone();  // the residual stream, updated in place by the o_proj and down_proj GEMMs
  ActivationBuffers buf;
  for (int64_t l = 0; l < L; ++l) {
    const at::Tensor* w = weights.data() + 7 * l;
    const int64_t* f = fmts.data() + 4 * l;
    attention_half_into(x, w, f, k_caches[l], v_caches[l], args, x, true, buf, "forward_layers");
    mlp_half_into(x, w + 4, f + 2, eps, x, true, buf, "forward_layers");
  }
  return x;
}

// One layer's attention half alone: its o_proj output [T, hidden] (a tensor-parallel rank's partial sum),
// not added to x. weights: norm, qkv, qkv bias (empty: none), o_proj; fmts: qkv's and o_proj's.
at::Tensor attention_half(const at::Tensor& x, at::TensorList weights, at::IntArrayRef fmts, const at::Tensor& k_cache,
                          const at::Tensor& v_cache, const at::Tensor& cos, const at::Tensor& sin,
                          const at::Tensor& slot_mapping, const at::Tensor& block_tables, const at::Tensor& seq_of,
                          const at::Tensor& ctx_lens, int64_t n_heads, int64_t n_kv_heads, int64_t head_dim, double eps,
                          double scale) {
  check_f32_rows(x, "attention_half");
  TORCH_CHECK(weights.size() == 4 && fmts.size() == 2, "tokenmill::attention_half: need 4 weights and 2 formats");
  const LayerArgs args{cos, sin, slot_mapping, block_tables, seq_of, ctx_lens, n_heads, n_kv_heads, head_dim, eps, scale};
  thread_local ActivationBuffers buf;  // (reused across layers, as forward_layers does)
  at::Tensor out = at::empty({x.size(0), x.size(1)}, x.options());
  attention_half_into(x, weights.data(), fmts.data(), k_cache, v_cache, args, out, false, buf, "attention_half");
  return out;
}

// One layer's MLP half alone: its down_proj output [T, hidden], not added to x. weights: norm, gate_up, down.
at::Tensor mlp_half(const at::Tensor& x, at::TensorList weights, at::IntArrayRef fmts, double eps) {
  check_f32_rows(x, "mlp_half");
  TORCH_CHECK(weights.size() == 3 && fmts.size() == 2, "tokenmill::mlp_half: need 3 weights and 2 formats");
  thread_local ActivationBuffers buf;
  at::Tensor out = at::empty({x.size(0), x.size(1)}, x.options());
  mlp_half_into(x, weights.data(), fmts.data(), eps, out, false, buf, "mlp_half");
  return out;
}

// The many-token GEMM's instruction set: "" reports it, "avx2" or "avx512vnni" selects it (for tests and
// benchmarks; the results are the same bits).
std::string kernel_isa(std::string name) {
  if (name == "avx2") g_use_vnni.store(false);
  else if (name == "avx512vnni") {
    TORCH_CHECK(cpu_has_vnni(), "tokenmill::kernel_isa: this CPU lacks AVX512-VNNI (avx512f/bw/vl/vnni)");
    g_use_vnni.store(true);
  } else TORCH_CHECK(name.empty(), "tokenmill::kernel_isa: name must be '', 'avx2' or 'avx512vnni', got '", name, "'");
  return g_use_vnni.load() ? "avx512vnni" : "avx2";
}

// The fewest tokens the many-token GEMM takes VNNI for: n > 0 sets it, 0 reports it.
int64_t vnni_min_tokens(int64_t n) {
  TORCH_CHECK(n >= 0, "tokenmill::vnni_min_tokens: n must be >= 0, got ", n);
  if (n > 0) g_vnni_min_tokens.store(n);
  return g_vnni_min_tokens.load();
}

}  // namespace

TORCH_LIBRARY(tokenmill, m) {
  m.def("kernel_isa(str name) -> str", &kernel_isa);
  m.def("vnni_min_tokens(int n) -> int", &vnni_min_tokens);
  m.def("qlinear(Tensor x, Tensor w, int n_out, int fmt) -> Tensor");
  m.def("flinear(Tensor x, Tensor w, int n_out, Tensor? bias=None) -> Tensor");
  m.def("quantize_activations(Tensor x) -> Tensor[]");
  m.def("rms_norm(Tensor x, Tensor w, float eps) -> Tensor");
  m.def("rope_(Tensor(a!) x, Tensor cos, Tensor sin, int n_heads, int head_dim) -> ()");
  m.def("silu_mul(Tensor gu) -> Tensor");
  m.def("paged_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, Tensor seq_of, "
        "Tensor ctx_lens, float scale, Tensor? k_scale=None, Tensor? v_scale=None, int window=0, "
        "float softcap=0.0) -> Tensor");
  m.def("forward_layers(Tensor x, Tensor[] weights, int[] fmts, Tensor[] k_caches, Tensor[] v_caches, Tensor cos, "
        "Tensor sin, Tensor slot_mapping, Tensor block_tables, Tensor seq_of, Tensor ctx_lens, int n_heads, "
        "int n_kv_heads, int head_dim, float eps, float scale) -> Tensor");
  m.def("attention_half(Tensor x, Tensor[] weights, int[] fmts, Tensor k_cache, Tensor v_cache, Tensor cos, "
        "Tensor sin, Tensor slot_mapping, Tensor block_tables, Tensor seq_of, Tensor ctx_lens, int n_heads, "
        "int n_kv_heads, int head_dim, float eps, float scale) -> Tensor");
  m.def("mlp_half(Tensor x, Tensor[] weights, int[] fmts, float eps) -> Tensor");
  m.def("to_panels(Tensor data, int fmt, int n, int k) -> Tensor");
}

TORCH_LIBRARY_IMPL(tokenmill, CPU, m) {
  m.impl("qlinear", &qlinear);
  m.impl("flinear", &flinear);
  m.impl("quantize_activations", &quantize_activations);
  m.impl("rms_norm", &rms_norm);
  m.impl("rope_", &rope_);
  m.impl("silu_mul", &silu_mul);
  m.impl("paged_attention", &paged_attention);
  m.impl("forward_layers", &forward_layers);
  m.impl("attention_half", &attention_half);
  m.impl("mlp_half", &mlp_half);
  m.impl("to_panels", &to_panels);
}
