// The integer GEMM on AVX512-VNNI for many tokens: panels of 16 rows widened once for all tokens.
// Included by cpu_kernels.cpp inside its namespace, after the files before it there.
#pragma once

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
