// tokenmill CPU kernels (x86-64 AVX2 + FMA + F16C), registered as torch.ops.tokenmill.*.
//
// Quantized linear layers hold GGUF's block formats (32 weights per block, along K):
//   Q8_0: fp16 d, int8 q[32]                      34 bytes, w = d * q
//   Q4_1: fp16 d, fp16 m, 16 bytes of nibbles     20 bytes, w = d * q + m, q in [0, 15];
//         weight j of the block is the low nibble of byte j, weight j + 16 its high nibble.
// The kernels take them in a kernel layout (quant.py's QuantizedTensor.kernel_layout(); the same
// bytes, reordered within each row) so that eight block scales load in one instruction and two
// blocks' nibbles in one 32-byte load:
//   Q4_1 row: fp16 d[nb] | fp16 m[nb] | nibbles[nb][16]
//   Q8_0 row: fp16 d[nb] | int8 q[nb][32]
// Activations are quantized per token and per block of 32 with one float scale, so every dot product
// runs on integer multiply-adds and is scaled once per block: to int8 against Q4_1 weights (llama.cpp's
// Q8_1 activations; vpmaddubsw + vpmaddwd), to int16 against Q8_0 weights (vpmovsxbw + vpmaddwd, as
// many instructions per block as int8 with its sign tricks, and 256 times finer: int8 weights then
// behave as weight-only quantization, their activations all but exact).
//
// Built and loaded by tokenmill/layers/kernels.py; tokenmill/layers/quant.py holds the pure-torch
// reference of every op here (the tests compare the two).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

namespace {

constexpr int QK = 32;
constexpr int Q8_0_BYTES = 34;
constexpr int Q4_1_BYTES = 20;

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

// lane permutations that broadcast a group's scale j to all lanes (single blocks) and scales
// (j, j + 1) to lanes 0-3 and 4-7 (pairs of blocks, j even)
alignas(32) const int32_t kOneIdx[8][8] = {
    {0, 0, 0, 0, 0, 0, 0, 0}, {1, 1, 1, 1, 1, 1, 1, 1}, {2, 2, 2, 2, 2, 2, 2, 2}, {3, 3, 3, 3, 3, 3, 3, 3},
    {4, 4, 4, 4, 4, 4, 4, 4}, {5, 5, 5, 5, 5, 5, 5, 5}, {6, 6, 6, 6, 6, 6, 6, 6}, {7, 7, 7, 7, 7, 7, 7, 7}};
alignas(32) const int32_t kPairIdx[4][8] = {
    {0, 0, 0, 0, 1, 1, 1, 1}, {2, 2, 2, 2, 3, 3, 3, 3}, {4, 4, 4, 4, 5, 5, 5, 5}, {6, 6, 6, 6, 7, 7, 7, 7}};

inline __m256i load_idx(const int32_t* p) { return _mm256_load_si256(reinterpret_cast<const __m256i*>(p)); }

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

inline int64_t round8(int64_t n) { return (n + 7) / 8 * 8; }

// ---- activations: float [M, K] -> int8 [M, K], scale [M, ld], scale * sum(q) [M, ld] ---------------
// paired: for each full pair of blocks (2p, 2p + 1) store x[0:16] of both, then x[16:32] of both, the
// order in which one 32-byte load of the pair's nibbles unpacks (low nibbles, then high nibbles).
// ld >= K / 32 is the row stride of d and s; the kernels pass a multiple of 8 with zeros past nb.

void quantize_rows(const float* x, int64_t M, int64_t K, int8_t* q, float* d, float* s, int64_t ld, bool paired) {
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
      const float am = _mm_cvtss_f32(m4);
      const float dd = am / 127.0f;
      const float id = dd != 0.0f ? 1.0f / dd : 0.0f;
      const __m256 vid = _mm256_set1_ps(id);
      __m256i iv[4];
      for (int j = 0; j < 4; ++j) iv[j] = _mm256_cvtps_epi32(_mm256_mul_ps(v[j], vid));  // round half to even
      __m256i sum = _mm256_add_epi32(_mm256_add_epi32(iv[0], iv[1]), _mm256_add_epi32(iv[2], iv[3]));
      __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(sum), _mm256_extracti128_si256(sum, 1));
      s4 = _mm_hadd_epi32(s4, s4);
      s4 = _mm_hadd_epi32(s4, s4);
      // pack int32 -> int16 -> int8 (saturating; values are within [-127, 127]), then undo the lane interleave
      __m256i p01 = _mm256_packs_epi32(iv[0], iv[1]);
      __m256i p23 = _mm256_packs_epi32(iv[2], iv[3]);
      __m256i p = _mm256_packs_epi16(p01, p23);
      p = _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
      int8_t* dst = q + row * K + b * QK;
      if (paired && (b % 2 == 1 || b + 1 < nb)) {
        // block 2p: its halves go to [0:16] and [32:48] of the pair; block 2p + 1 to [16:32] and [48:64]
        int8_t* pair = q + row * K + (b / 2) * 2 * QK + (b % 2) * 16;
        _mm_storeu_si128(reinterpret_cast<__m128i*>(pair), _mm256_castsi256_si128(p));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(pair + QK), _mm256_extracti128_si256(p, 1));
      } else {
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), p);
      }
      d[row * ld + b] = dd;
      s[row * ld + b] = dd * static_cast<float>(_mm_cvtsi128_si32(s4));
      if (b == nb - 1)  // zeros past nb: the GEMM reads scales 8 at a time
        for (int64_t c = nb; c < ld; ++c) d[row * ld + c] = s[row * ld + c] = 0.0f;
    }
  });
}

// int16 activations for Q8_0 weights: q = round(x / d), d = amax / 32767 per block, natural order.
void quantize_rows16(const float* x, int64_t M, int64_t K, int16_t* q, float* d, int64_t ld) {
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
      for (int j = 0; j < 2; ++j) {  // packs interleaves 128-bit lanes; permute4x64 restores the order
        const __m256i p = _mm256_packs_epi32(_mm256_cvtps_epi32(_mm256_mul_ps(v[2 * j], vid)),
                                             _mm256_cvtps_epi32(_mm256_mul_ps(v[2 * j + 1], vid)));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + 16 * j), _mm256_permute4x64_epi64(p, 0xD8));
      }
      d[row * ld + b] = dd;
      if (b == nb - 1)
        for (int64_t c = nb; c < ld; ++c) d[row * ld + c] = 0.0f;
    }
  });
}

// the activation type of each weight format: int8 for Q4_1, int16 for Q8_0
template <bool Q4>
using XQ = std::conditional_t<Q4, int8_t, int16_t>;

// ---- integer dot products ------------------------------------------------------------------------

// one block's nibbles in natural order: weights 0..15 in the low lane, 16..31 in the high lane
inline __m256i unpack_q4(const uint8_t* nibbles) {
  const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(nibbles));
  const __m128i lo = _mm_and_si128(b, _mm_set1_epi8(0x0F));
  const __m128i hi = _mm_and_si128(_mm_srli_epi16(b, 4), _mm_set1_epi8(0x0F));
  return _mm256_set_m128i(hi, lo);
}

// sum over pairs of u8 * s8, as 8 int32 lanes
inline __m256i dot_u8s8(__m256i u, __m256i s) {
  return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
}

// A full group of 8 Q4_1 blocks (4 pairs) against pair-interleaved int8 activations: the integer sums of
// the 8 blocks, as floats in the lane order kGroupIdx gives the scales. Each pair's vpmaddubsw sums are
// int16 with |v| <= 2 * 2 * 15 * 127 = 7620 (block 2p in the low 128 bits, 2p + 1 in the high); two
// rounds of vphaddw add neighbours four at a time (|v| <= 30480, no overflow) and leave each block's
// sums in two int16 lanes, which one vpmaddwd adds. This replaces four convert-permute-FMA rounds.
alignas(32) const int32_t kGroupIdx[8] = {0, 2, 4, 6, 1, 3, 5, 7};

inline __m256 group_q4(const uint8_t* nibbles, const int8_t* x) {
  const __m256i nib_mask = _mm256_set1_epi8(0x0F);
  __m256i s16[4];
  for (int p = 0; p < 4; ++p) {
    const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(nibbles + 32 * p));
    const __m256i lo = _mm256_and_si256(raw, nib_mask);
    const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), nib_mask);
    const __m256i xlo = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + 64 * p));
    const __m256i xhi = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + 64 * p + QK));
    s16[p] = _mm256_add_epi16(_mm256_maddubs_epi16(lo, xlo), _mm256_maddubs_epi16(hi, xhi));
  }
  // lanes after the two rounds, per 128 bits: low [b0 b0 b2 b2 b4 b4 b6 b6], high [b1 b1 b3 b3 ... b7 b7]
  const __m256i h = _mm256_hadd_epi16(_mm256_hadd_epi16(s16[0], s16[1]), _mm256_hadd_epi16(s16[2], s16[3]));
  return _mm256_cvtepi32_ps(_mm256_madd_epi16(h, _mm256_set1_epi16(1)));
}

// A full group of 8 Q8_0 blocks against int16 activations: the 8 blocks' integer sums (|v| <= 32 * 127 *
// 32767 < 2^31) as floats in natural order. Six vphaddd and one cross-lane add reduce the 8 vectors of
// int32 partial sums, instead of a convert-permute-FMA round per block.
inline __m256 group_q8(const uint8_t* wq, const int16_t* x) {
  __m256i s[8];
  for (int b = 0; b < 8; ++b) {
    const __m256i w0 = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(wq + QK * b)));
    const __m256i w1 = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(wq + QK * b + 16)));
    s[b] = _mm256_add_epi32(_mm256_madd_epi16(w0, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + QK * b))),
                            _mm256_madd_epi16(w1, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + QK * b + 16))));
  }
  // per 128 bits after two rounds: a = [b0 b1 b2 b3] (low half of each block, then high), c = [b4 .. b7]
  const __m256i a = _mm256_hadd_epi32(_mm256_hadd_epi32(s[0], s[1]), _mm256_hadd_epi32(s[2], s[3]));
  const __m256i c = _mm256_hadd_epi32(_mm256_hadd_epi32(s[4], s[5]), _mm256_hadd_epi32(s[6], s[7]));
  const __m256i sum = _mm256_add_epi32(_mm256_permute2x128_si256(a, c, 0x20), _mm256_permute2x128_si256(a, c, 0x31));
  return _mm256_cvtepi32_ps(sum);
}

// ---- the GEMM: y[M, N] = x[M, K] . W[N, K]^T, weights in the kernel layout --------------------------
// A tile is RN weight rows x RM tokens. Per group of 8 blocks it loads each row's 8 scales (and mins)
// at once and forms the 8 combined scales d_w * d_x per (row, token); per pair of blocks the int32
// lanes hold block 2p in lanes 0-3 and 2p + 1 in lanes 4-7, scaled by a lane permutation of those.
// The Q4_1 min term, sum_b m_b * d_x,b * sum(q_x,b), is a dot product of 8-lane vectors per group.

// Accumulate: y += x . W^T (a residual add with no extra pass or tensor; the sum is the same float
// add as y + (x . W^T) done afterwards).
// pf (GEMVs only, else null): software prefetch of the bytes PF_DIST ahead of this tile, pf_lines cache
// lines per group of blocks, spread over the tile so that a long row's lines are not asked for in one
// burst (more than the core's miss buffers hold: those are dropped or stall the loads behind them).
template <bool Q4, int RN, int RM>
inline void tile(const uint8_t* W, int64_t row_bytes, int64_t nb, const XQ<Q4>* xq, int64_t K, const float* xd,
                 const float* xs, int64_t ld, float* y, int64_t N, bool accumulate, const uint8_t* pf = nullptr,
                 int64_t pf_lines = 0) {
  [[maybe_unused]] const __m256i nib_mask = _mm256_set1_epi8(0x0F);
  [[maybe_unused]] const __m256i ones = _mm256_set1_epi16(1);
  const int64_t quants = (Q4 ? 4 : 2) * nb;  // byte offset of a row's quants
  __m256 acc[RN][RM];
  for (int n = 0; n < RN; ++n)
    for (int m = 0; m < RM; ++m) acc[n][m] = _mm256_setzero_ps();
  for (int64_t g = 0; g < nb; g += 8) {
    const int gn = static_cast<int>(std::min<int64_t>(8, nb - g));
    if (pf)  // past the end of W is harmless: prefetches never fault
      for (int64_t i = 0; i < pf_lines; ++i) _mm_prefetch(reinterpret_cast<const char*>(pf + (g / 8 * pf_lines + i) * 64), _MM_HINT_T0);
    if constexpr (Q4 && RM == 1) {
      if (gn == 8) {  // a full group: reduce the 8 blocks' int16 sums first, scale once (see group_q4)
        // GEMV tiles form the scales row by row, not for all rows up front: with every row's scales live
        // the compiler ran out of the 16 ymm registers and spilled inside the group reduction (-15% time).
        // Multi-token tiles measured faster with the scales up front (below).
        for (int n = 0; n < RN; ++n) {
          const uint8_t* row = W + n * row_bytes;
          const __m256 dw = load_f16x8(row + 2 * g, 8);
          const __m256 mw = load_f16x8(row + 2 * nb + 2 * g, 8);
          for (int m = 0; m < RM; ++m) {
            const __m256 sc = _mm256_permutevar8x32_ps(_mm256_mul_ps(dw, _mm256_loadu_ps(xd + m * ld + g)),
                                                       load_idx(kGroupIdx));
            acc[n][m] = _mm256_fmadd_ps(mw, _mm256_loadu_ps(xs + m * ld + g), acc[n][m]);
            acc[n][m] = _mm256_fmadd_ps(group_q4(row + quants + 16 * g, xq + m * K + QK * g), sc, acc[n][m]);
          }
        }
        continue;
      }
    }
    if constexpr (!Q4 && RM == 1) {
      if (gn == 8) {  // the same for Q8_0 GEMVs (see group_q8)
        for (int n = 0; n < RN; ++n) {
          const uint8_t* row = W + n * row_bytes;
          const __m256 dw = load_f16x8(row + 2 * g, 8);
          acc[n][0] = _mm256_fmadd_ps(group_q8(row + quants + QK * g, xq + QK * g),
                                      _mm256_mul_ps(dw, _mm256_loadu_ps(xd + g)), acc[n][0]);
        }
        continue;
      }
    }
    __m256 sc[RN][RM];
    for (int n = 0; n < RN; ++n) {
      const uint8_t* row = W + n * row_bytes;
      const __m256 dw = load_f16x8(row + 2 * g, gn);
      for (int m = 0; m < RM; ++m) sc[n][m] = _mm256_mul_ps(dw, _mm256_loadu_ps(xd + m * ld + g));
      if constexpr (Q4) {
        const __m256 mw = load_f16x8(row + 2 * nb + 2 * g, gn);
        for (int m = 0; m < RM; ++m) acc[n][m] = _mm256_fmadd_ps(mw, _mm256_loadu_ps(xs + m * ld + g), acc[n][m]);
      }
    }
    int j = 0;
    if constexpr (Q4) {
      if (gn == 8) {  // multi-token tiles: the full group's reduction with the scales formed above
        for (int n = 0; n < RN; ++n) {
          const uint8_t* nib = W + n * row_bytes + quants + 16 * g;
          for (int m = 0; m < RM; ++m)
            acc[n][m] = _mm256_fmadd_ps(group_q4(nib, xq + m * K + QK * g),
                                        _mm256_permutevar8x32_ps(sc[n][m], load_idx(kGroupIdx)), acc[n][m]);
        }
        j = 8;
      }
      for (; j + 2 <= gn; j += 2) {
        const int64_t b = g + j;
        const __m256i idx = load_idx(kPairIdx[j / 2]);
        for (int n = 0; n < RN; ++n) {
          const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(W + n * row_bytes + quants + 16 * b));
          const __m256i lo = _mm256_and_si256(raw, nib_mask);
          const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), nib_mask);
          for (int m = 0; m < RM; ++m) {
            const int8_t* xp = xq + m * K + QK * b;
            const __m256i xlo = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xp));
            const __m256i xhi = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xp + QK));
            // |products| <= 15 * 127 * 2 per int16 lane, so the two halves add without overflow
            const __m256i s16 = _mm256_add_epi16(_mm256_maddubs_epi16(lo, xlo), _mm256_maddubs_epi16(hi, xhi));
            const __m256 f = _mm256_cvtepi32_ps(_mm256_madd_epi16(s16, ones));
            acc[n][m] = _mm256_fmadd_ps(f, _mm256_permutevar8x32_ps(sc[n][m], idx), acc[n][m]);
          }
        }
      }
    }
    for (; j < gn; ++j) {  // Q8_0 blocks, and an odd last Q4_1 block (natural order)
      const int64_t b = g + j;
      const __m256i idx = load_idx(kOneIdx[j]);
      for (int n = 0; n < RN; ++n) {
        const uint8_t* row = W + n * row_bytes;
        if constexpr (Q4) {
          const __m256i w = unpack_q4(row + quants + 16 * b);
          for (int m = 0; m < RM; ++m) {
            const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + m * K + QK * b));
            acc[n][m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot_u8s8(w, xv)),
                                        _mm256_permutevar8x32_ps(sc[n][m], idx), acc[n][m]);
          }
        } else {  // int8 weights widened to int16 against int16 activations: |lane| <= 4 * 127 * 32767 < 2^24
          const uint8_t* wq = row + quants + QK * b;
          const __m256i w0 = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(wq)));
          const __m256i w1 = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(wq + 16)));
          for (int m = 0; m < RM; ++m) {
            const int16_t* xp = xq + m * K + QK * b;
            const __m256i isum =
                _mm256_add_epi32(_mm256_madd_epi16(w0, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xp))),
                                 _mm256_madd_epi16(w1, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xp + 16))));
            acc[n][m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), _mm256_permutevar8x32_ps(sc[n][m], idx), acc[n][m]);
          }
        }
      }
    }
  }
  for (int n = 0; n < RN; ++n)
    for (int m = 0; m < RM; ++m) y[m * N + n] = accumulate ? y[m * N + n] + hsum(acc[n][m]) : hsum(acc[n][m]);
}

template <bool Q4, int RN>
inline void rows_all_tokens(const uint8_t* W, int64_t row_bytes, int64_t nb, const XQ<Q4>* xq, const float* xd,
                            const float* xs, int64_t ld, int64_t m0, int64_t m1, int64_t K, float* y, int64_t N,
                            bool accumulate, const uint8_t* pf, int64_t pf_lines) {
  constexpr int RM = RN == 4 ? 1 : 4;
  int64_t m = m0;
  for (; m + RM <= m1; m += RM, pf = nullptr)  // the first tile over these rows prefetches
    tile<Q4, RN, RM>(W, row_bytes, nb, xq + m * K, K, xd + m * ld, xs + m * ld, ld, y + m * N, N, accumulate, pf,
                     pf_lines);
  for (; m < m1; ++m, pf = nullptr)
    tile<Q4, RN, 1>(W, row_bytes, nb, xq + m * K, K, xd + m * ld, xs + m * ld, ld, y + m * N, N, accumulate, pf,
                    pf_lines);
}

// Software prefetch distance for GEMVs (a few tokens): the weights stream from DRAM once per step
// and, without it, one Zen 1 core waits on memory instead of overlapping it with the multiply-adds
// (single-thread Q8_0 head 5.9 -> 4.4 ms, a streaming Q4_1 matrix 6.3 -> 4.9 ms; 4-16 KiB all alike).
constexpr int64_t PF_DIST = 8192;
template <bool Q4>
void gemm(const uint8_t* W, int64_t N, int64_t K, const XQ<Q4>* xq, const float* xd, const float* xs, int64_t ld,
          int64_t M, float* y, bool accumulate) {
  const int64_t nb = K / QK;
  const int64_t row_bytes = nb * (Q4 ? Q4_1_BYTES : Q8_0_BYTES);
  // Tokens in chunks whose quantized activations stay in L2 while every row of this thread passes over them.
  const int64_t chunk = std::max<int64_t>(4, (256 * 1024) / std::max<int64_t>(K * sizeof(XQ<Q4>), 1));
  const int RN = M == 1 ? 4 : 2;  // one token: 4 rows per tile; several: 2 rows x 4 tokens
  const int64_t tiles = (N + RN - 1) / RN;
  const bool prefetch = M < 8;
  const int64_t groups = (nb + 7) / 8;
  const int64_t pf_lines = (RN * row_bytes + 64 * groups - 1) / (64 * groups);  // a tile's lines, per group
  at::parallel_for(0, tiles, 1, [&](int64_t t0, int64_t t1) {
    if (prefetch)  // the first PF_DIST bytes of this thread's rows, which the loop below does not prefetch
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
          rows_all_tokens<Q4, 4>(Wn, row_bytes, nb, xq, xd, xs, ld, mc, mc1, K, yn, N, accumulate, pf, pf_lines);
        } else if (rows == 2) {
          rows_all_tokens<Q4, 2>(Wn, row_bytes, nb, xq, xd, xs, ld, mc, mc1, K, yn, N, accumulate, pf, pf_lines);
        } else {
          for (int64_t r = 0; r < rows; ++r)
            for (int64_t m = mc; m < mc1; ++m)
              tile<Q4, 1, 1>(Wn + r * row_bytes, row_bytes, nb, xq + m * K, K, xd + m * ld, xs + m * ld, ld,
                             yn + r + m * N, N, accumulate);
        }
      }
    }
  });
}

void check_blocks(const at::Tensor& w, int64_t n_out, int64_t K, int64_t fmt, const char* op) {
  TORCH_CHECK(w.device().is_cpu() && w.scalar_type() == at::kByte && w.is_contiguous(), "tokenmill::", op,
              " takes contiguous uint8 blocks on the CPU (QuantizedTensor.kernel_layout())");
  TORCH_CHECK(fmt == 0 || fmt == 1, "tokenmill::", op, ": format must be 0 (Q8_0) or 1 (Q4_1)");
  TORCH_CHECK(K % QK == 0, "tokenmill::", op, ": in_features must be a multiple of 32, got ", K);
  const int64_t bytes = fmt == 1 ? Q4_1_BYTES : Q8_0_BYTES;
  TORCH_CHECK(w.numel() == n_out * (K / QK) * bytes, "tokenmill::", op, ": weight holds ", w.numel(),
              " bytes, expected ", n_out * (K / QK) * bytes, " for [", n_out, ", ", K, "]");
}

// The quantized activations of one GEMM input: scratch that decode_layers reuses across its GEMMs.
struct ActivationBuffers {
  at::Tensor q, d, s;  // q: raw bytes, int8 or int16 values
  void fit(int64_t M, int64_t K, int64_t ld, const at::TensorOptions& opt) {
    if (!q.defined() || q.numel() < 2 * M * K) q = at::empty({2 * M * K}, opt.dtype(at::kByte));
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
  uint8_t* q = buf.q.data_ptr<uint8_t>();
  float* d = buf.d.data_ptr<float>();
  float* s = buf.s.data_ptr<float>();
  if (fmt == 1) {
    quantize_rows(x.data_ptr<float>(), M, K, reinterpret_cast<int8_t*>(q), d, s, ld, true);
    gemm<true>(w.data_ptr<uint8_t>(), n_out, K, reinterpret_cast<int8_t*>(q), d, s, ld, M, y.data_ptr<float>(),
               accumulate);
  } else {
    quantize_rows16(x.data_ptr<float>(), M, K, reinterpret_cast<int16_t*>(q), d, ld);
    gemm<false>(w.data_ptr<uint8_t>(), n_out, K, reinterpret_cast<int16_t*>(q), d, d, ld, M,  // no mins: xs unused
                y.data_ptr<float>(), accumulate);
  }
}

// fmt: 0 = Q8_0, 1 = Q4_1; w in the kernel layout
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

// Quantize activations only, in natural order (for tests: the reference must round exactly like the kernel).
// bits 8: (q int8, d, d * sum(q)), as for Q4_1 weights; bits 16: (q int16, d), as for Q8_0 weights.
std::vector<at::Tensor> quantize_activations(const at::Tensor& x, int64_t bits) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 2 && x.size(1) % QK == 0,
              "tokenmill::quantize_activations takes float32 [M, K] with K a multiple of 32");
  TORCH_CHECK(bits == 8 || bits == 16, "tokenmill::quantize_activations: bits must be 8 or 16, got ", bits);
  auto xc = x.contiguous();
  const int64_t M = xc.size(0), K = xc.size(1), nb = K / QK;
  auto d = at::empty({M, nb}, x.options());
  if (bits == 16) {
    auto q = at::empty({M, K}, x.options().dtype(at::kShort));
    quantize_rows16(xc.data_ptr<float>(), M, K, q.data_ptr<int16_t>(), d.data_ptr<float>(), nb);
    return {q, d};
  }
  auto q = at::empty({M, K}, x.options().dtype(at::kChar));
  auto s = at::empty({M, nb}, x.options());
  quantize_rows(xc.data_ptr<float>(), M, K, q.data_ptr<int8_t>(), d.data_ptr<float>(), s.data_ptr<float>(), nb,
                false);
  return {q, d, s};
}

// Dequantize blocks (kernel layout) to float32 [N, K]. Prefill-sized batches are compute-bound, and on
// AVX2 the float GEMM (MKL) outruns the integer kernel there; unpacking the weights per call costs far
// less than the GEMM it enables. Exactly the values of quant.py's dequantize_rows.
at::Tensor dequantize(const at::Tensor& w, int64_t n_out, int64_t K, int64_t fmt) {
  check_blocks(w, n_out, K, fmt, "dequantize");
  const int64_t nb = K / QK, row_bytes = nb * (fmt == 1 ? Q4_1_BYTES : Q8_0_BYTES);
  auto y = at::empty({n_out, K}, w.options().dtype(at::kFloat));
  const uint8_t* wp = w.data_ptr<uint8_t>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, n_out * nb, 256, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t r = i / nb, b = i % nb;
      const uint8_t* row = wp + r * row_bytes;
      float* out = yp + i * QK;
      const float d = h2f(row + 2 * b);
      if (fmt == 1) {
        const float m = h2f(row + 2 * nb + 2 * b);
        const uint8_t* nib = row + 4 * nb + 16 * b;
        for (int j = 0; j < 16; ++j) {
          out[j] = d * static_cast<float>(nib[j] & 0x0F) + m;
          out[j + 16] = d * static_cast<float>(nib[j] >> 4) + m;
        }
      } else {
        const int8_t* q = reinterpret_cast<const int8_t*>(row + 2 * nb + QK * b);
        for (int j = 0; j < QK; ++j) out[j] = d * static_cast<float>(q[j]);
      }
    }
  });
  return y;
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

// One query token per sequence (q [B, H, D]) against that sequence's first seq_lens[b] cached tokens,
// found through its block table; no gathered copy of the context. Query heads sharing a KV head
// (grouped-query attention) are handled together so each key and value is read once per group.
at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                  const at::Tensor& block_tables, const at::Tensor& seq_lens, double scale) {
  TORCH_CHECK(q.device().is_cpu() && q.scalar_type() == at::kFloat && q.dim() == 3 && q.stride(2) == 1 &&
                  q.stride(1) == q.size(2),
              "tokenmill::paged_decode_attention: q must be float32 [B, H, D] with contiguous heads");
  TORCH_CHECK(k_cache.scalar_type() == at::kFloat && v_cache.scalar_type() == at::kFloat && k_cache.dim() == 4 &&
                  k_cache.is_contiguous() && v_cache.is_contiguous() && k_cache.sizes() == v_cache.sizes(),
              "tokenmill::paged_decode_attention: caches must be contiguous float32 [blocks, block_size, Hkv, D]");
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && block_tables.is_contiguous() &&
                  seq_lens.scalar_type() == at::kLong && seq_lens.is_contiguous(),
              "tokenmill::paged_decode_attention: block_tables and seq_lens must be contiguous int64");
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2), ldq = q.stride(0);
  const int64_t NB = k_cache.size(0), BS = k_cache.size(1), HKV = k_cache.size(2);
  TORCH_CHECK(k_cache.size(3) == D && H % HKV == 0, "tokenmill::paged_decode_attention: head layout mismatch");
  const int64_t G = H / HKV, W = block_tables.size(1);
  const float* qp = q.data_ptr<float>();
  const float* kp = k_cache.data_ptr<float>();
  const float* vp = v_cache.data_ptr<float>();
  const int64_t* tp = block_tables.data_ptr<int64_t>();
  const int64_t* lp = seq_lens.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b)
    TORCH_CHECK(lp[b] >= 1 && lp[b] <= W * BS, "tokenmill::paged_decode_attention: seq_len ", lp[b],
                " does not fit the block table of ", W, " blocks");
  auto out = at::empty({B, H, D}, q.options());
  float* op = out.data_ptr<float>();
  const float sc = static_cast<float>(scale);
  // The G query heads of KV head hk over tokens [j0, j1) of sequence b: acc = sum_j e_j v_j (not yet
  // divided), mx = max score, sum = sum_j e_j, with e_j = exp(score_j - mx). s: the scratch of one thread.
  // The cached rows come from DRAM (a decode step streams ~100 MB of weights between two visits to a
  // layer's KV), strided by Hkv * D floats: each row is prefetched PF_ROWS tokens ahead, as the hardware
  // prefetcher does not follow the block table.
  constexpr int64_t PF_ROWS = 16;
  const int64_t row_floats = HKV * D;
  auto attend = [&](int64_t b, int64_t hk, int64_t j0, int64_t j1, AttendScratch& s, float* acc, float* mx,
                    float* sum) {
    const int64_t L = j1 - j0;
    std::fill(acc, acc + G * D, 0.0f);
    if (L <= 0) {
      for (int64_t g = 0; g < G; ++g) mx[g] = -std::numeric_limits<float>::infinity(), sum[g] = 0.0f;
      return;
    }
    s.scores.assign(G * L, 0.0f);
    s.rows.resize(L);
    int64_t* rows = s.rows.data();  // float offset of token j0 + i's row for this head, in either cache
    for (int64_t i = 0; i < L; ++i) {
      const int64_t j = j0 + i, blk = tp[b * W + j / BS];
      TORCH_CHECK(blk >= 0 && blk < NB, "tokenmill::paged_decode_attention: block id ", blk, " out of range");
      rows[i] = (blk * BS + j % BS) * row_floats + hk * D;
    }
    auto prefetch_row = [&](const float* base, int64_t i) {
      if (i < L)
        for (int64_t o = 0; o < D; o += 16) _mm_prefetch(reinterpret_cast<const char*>(base + rows[i] + o), _MM_HINT_T0);
    };
    for (int64_t i = 0; i < std::min(L, PF_ROWS); ++i) prefetch_row(kp, i), prefetch_row(vp, i);
    const float* qh = qp + b * ldq + hk * G * D;  // the G query heads of this KV head are adjacent
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
  // Fewer (sequence, KV head) pairs than twice the threads (one long sequence, say): split each
  // context into P parts of at least 64 tokens, attend to the parts in parallel and merge them by
  // their maxima and sums (flash-decoding), so no thread waits on another's whole head.
  const int64_t items = B * HKV, threads = at::get_num_threads();
  const int64_t max_len = *std::max_element(lp, lp + B);
  const int64_t P = items >= 2 * threads ? 1
                                          : std::max<int64_t>(1, std::min((2 * threads + items - 1) / items,
                                                                          (max_len + 63) / 64));
  if (P == 1) {
    at::parallel_for(0, items, 1, [&](int64_t i0, int64_t i1) {
      AttendScratch scratch;
      std::vector<float> acc(G * D), mx(G), sum(G);
      for (int64_t i = i0; i < i1; ++i) {
        const int64_t b = i / HKV, hk = i % HKV;
        attend(b, hk, 0, lp[b], scratch, acc.data(), mx.data(), sum.data());
        for (int64_t g = 0; g < G; ++g) {
          const float inv = 1.0f / sum[g];
          for (int64_t e = 0; e < D; ++e) op[(b * H + hk * G + g) * D + e] = acc[g * D + e] * inv;
        }
      }
    });
    return out;
  }
  std::vector<float> part_acc(items * P * G * D), part_mx(items * P * G), part_sum(items * P * G);
  at::parallel_for(0, items * P, 1, [&](int64_t i0, int64_t i1) {
    AttendScratch scratch;
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t item = i / P, part = i % P, b = item / HKV, hk = item % HKV;
      const int64_t chunk = (lp[b] + P - 1) / P;
      attend(b, hk, part * chunk, std::min(lp[b], (part + 1) * chunk), scratch, part_acc.data() + i * G * D,
             part_mx.data() + i * G, part_sum.data() + i * G);
    }
  });
  for (int64_t item = 0; item < items; ++item) {
    const int64_t b = item / HKV, hk = item % HKV;
    for (int64_t g = 0; g < G; ++g) {
      float m = -std::numeric_limits<float>::infinity();
      for (int64_t part = 0; part < P; ++part) m = std::max(m, part_mx[(item * P + part) * G + g]);
      float total = 0.0f;
      float* o = op + (b * H + hk * G + g) * D;
      std::fill(o, o + D, 0.0f);
      for (int64_t part = 0; part < P; ++part) {
        const int64_t at = (item * P + part) * G + g;
        if (part_sum[at] == 0.0f) continue;  // an empty part (a context shorter than P tokens)
        const float w = std::exp(part_mx[at] - m);
        total += w * part_sum[at];
        const float* a = part_acc.data() + at * D;
        for (int64_t e = 0; e < D; ++e) o[e] += w * a[e];
      }
      const float inv = 1.0f / total;
      for (int64_t e = 0; e < D; ++e) o[e] *= inv;
    }
  }
  return out;
}

// ---- every decoder layer of a decode-only step, in one call -----------------------------------------
// At one token per sequence a decoder layer is about twenty small ops, and dispatching them from
// Python costs more than their arithmetic. This runs all layers of such a step with the kernels
// above, called directly, in the order of the Python path (models/llama.py with fused ops on), so
// the two give the same bits.
// weights: 7 per layer: input norm, qkv (kernel layout), qkv bias (empty: none), o_proj,
// post-attention norm, gate_up, down_proj; fmts: 4 per layer (qkv, o_proj, gate_up, down_proj).
int64_t rows_of(const at::Tensor& w, int64_t K, int64_t fmt) {
  TORCH_CHECK(K % QK == 0, "tokenmill::decode_layers: in_features must be a multiple of 32");
  return w.numel() / ((K / QK) * (fmt == 1 ? Q4_1_BYTES : Q8_0_BYTES));
}

at::Tensor decode_layers(const at::Tensor& x_in, at::TensorList weights, at::IntArrayRef fmts,
                         at::TensorList k_caches, at::TensorList v_caches, const at::Tensor& cos, const at::Tensor& sin,
                         const at::Tensor& slot_mapping, const at::Tensor& block_tables, const at::Tensor& seq_lens,
                         int64_t n_heads, int64_t n_kv_heads, int64_t head_dim, double eps, double scale) {
  check_f32_rows(x_in, "decode_layers");
  const int64_t L = static_cast<int64_t>(k_caches.size());
  TORCH_CHECK(static_cast<int64_t>(weights.size()) == 7 * L && static_cast<int64_t>(fmts.size()) == 4 * L &&
                  static_cast<int64_t>(v_caches.size()) == L,
              "tokenmill::decode_layers: need 7 weights, 4 formats and a K and V cache per layer");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.is_contiguous() &&
                  slot_mapping.numel() == x_in.size(0),
              "tokenmill::decode_layers: slot_mapping must be contiguous int64 [T]");
  const int64_t T = x_in.size(0), hidden = x_in.size(1), H = n_heads, HKV = n_kv_heads, D = head_dim;
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  at::Tensor x = x_in.clone();  // the residual stream, updated in place by the o_proj and down_proj GEMMs
  ActivationBuffers buf;
  auto project = [&](const at::Tensor& in, const at::Tensor& w, int64_t fmt) {  // in . W^T, a new tensor
    const int64_t n_out = rows_of(w, in.size(1), fmt);
    check_blocks(w, n_out, in.size(1), fmt, "decode_layers");
    at::Tensor out = at::empty({T, n_out}, x.options());
    qlinear_into(in, w, n_out, fmt, out, false, buf);
    return out;
  };
  auto add_projection = [&](const at::Tensor& in, const at::Tensor& w, int64_t fmt) {  // x += in . W^T
    check_blocks(w, hidden, in.size(1), fmt, "decode_layers");
    qlinear_into(in, w, hidden, fmt, x, true, buf);
  };
  for (int64_t l = 0; l < L; ++l) {
    const at::Tensor* w = weights.data() + 7 * l;
    const int64_t* f = fmts.data() + 4 * l;
    const at::Tensor& kc = k_caches[l];
    const at::Tensor& vc = v_caches[l];
    TORCH_CHECK(kc.scalar_type() == at::kFloat && vc.scalar_type() == at::kFloat && kc.is_contiguous() &&
                    vc.is_contiguous() && kc.dim() == 4 && kc.size(2) == HKV && kc.size(3) == D,
                "tokenmill::decode_layers: caches must be contiguous float32 [blocks, block_size, Hkv, D]");
    const int64_t num_slots = kc.size(0) * kc.size(1), row = HKV * D;
    // attention
    at::Tensor h = rms_norm(x, w[0], eps);
    at::Tensor qkv = project(h, w[1], f[0]);
    if (w[2].numel() > 0) qkv = qkv + w[2];
    TORCH_CHECK(qkv.size(1) == (H + 2 * HKV) * D, "tokenmill::decode_layers: qkv width does not match the heads");
    rope_(qkv, cos, sin, H + HKV, D);
    const float* qp = qkv.data_ptr<float>();
    float* kp = kc.data_ptr<float>();
    float* vp = vc.data_ptr<float>();
    const int64_t ld = qkv.stride(0);
    for (int64_t t = 0; t < T; ++t) {  // the new token's K and V into its cache slot
      TORCH_CHECK(slots[t] >= 0 && slots[t] < num_slots, "tokenmill::decode_layers: slot ", slots[t],
                  " outside the cache");
      std::memcpy(kp + slots[t] * row, qp + t * ld + H * D, row * sizeof(float));
      std::memcpy(vp + slots[t] * row, qp + t * ld + (H + HKV) * D, row * sizeof(float));
    }
    at::Tensor q = qkv.narrow(1, 0, H * D).view({T, H, D});
    at::Tensor o = paged_decode_attention(q, kc, vc, block_tables, seq_lens, scale).view({T, H * D});
    add_projection(o, w[3], f[1]);
    // MLP
    h = rms_norm(x, w[4], eps);
    at::Tensor act = silu_mul(project(h, w[5], f[2]));
    add_projection(act, w[6], f[3]);
  }
  return x;
}

}  // namespace

TORCH_LIBRARY(tokenmill, m) {
  m.def("qlinear(Tensor x, Tensor w, int n_out, int fmt) -> Tensor");
  m.def("quantize_activations(Tensor x, int bits=8) -> Tensor[]");
  m.def("rms_norm(Tensor x, Tensor w, float eps) -> Tensor");
  m.def("rope_(Tensor(a!) x, Tensor cos, Tensor sin, int n_heads, int head_dim) -> ()");
  m.def("silu_mul(Tensor gu) -> Tensor");
  m.def("dequantize(Tensor w, int n_out, int k, int fmt) -> Tensor");
  m.def("paged_decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, Tensor seq_lens, "
        "float scale) -> Tensor");
  m.def("decode_layers(Tensor x, Tensor[] weights, int[] fmts, Tensor[] k_caches, Tensor[] v_caches, Tensor cos, "
        "Tensor sin, Tensor slot_mapping, Tensor block_tables, Tensor seq_lens, int n_heads, int n_kv_heads, "
        "int head_dim, float eps, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(tokenmill, CPU, m) {
  m.impl("qlinear", &qlinear);
  m.impl("quantize_activations", &quantize_activations);
  m.impl("rms_norm", &rms_norm);
  m.impl("rope_", &rope_);
  m.impl("silu_mul", &silu_mul);
  m.impl("dequantize", &dequantize);
  m.impl("paged_decode_attention", &paged_decode_attention);
  m.impl("decode_layers", &decode_layers);
}
