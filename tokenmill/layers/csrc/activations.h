// Activations to int16 per token and block of 32 (every integer GEMM's input).
// Included by cpu_kernels.cpp inside its namespace, after the files before it there.
#pragma once

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
