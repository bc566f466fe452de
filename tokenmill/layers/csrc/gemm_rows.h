// The integer GEMM on the row layout, AVX2: unpacking a block, its scales, the tiles.
// Included by cpu_kernels.cpp inside its namespace, after the files before it there.
#pragma once

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
