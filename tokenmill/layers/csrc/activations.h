// Activations to int16 per token and block of 32 (every integer GEMM's input), or to int8 steps held in them.
// Included by cpu_kernels.cpp inside its namespace, after the files before it there.
#pragma once

// ---- activations: float [M, K] -> int16 q [M, K], d [M, ld], d * sum(q) [M, ld] ----------------------
// q = round(x / d), d = amax / 32767 per token and block of 32, in natural order, against both weight
// formats: 32767 steps per block keep a layer's output within ~1e-5 of the float one, where int8 steps
// (llama.cpp's Q8_1 activations) flipped 2% of greedy choices. ld >= K / 32 is the row stride of d and s;
// the kernels pass a multiple of 8 with zeros past nb (the GEMM reads scales 8 at a time).
// int8 (g_int8_activations, TOKENMILL_ACTIVATIONS=int8): 127 steps per block, llama.cpp's Q8_0 activations,
// held as q = 256 q8 with d = (amax / 127) / 256, so every kernel takes them unchanged (the same products,
// d q = d8 q8 exactly) and the panel kernels, whose int16 input is split into a high and a low byte, skip
// the low byte's products: zero for every activation (half the multiply-adds on AVX2's vpmaddubsw).
std::atomic<bool> g_int8_activations{[] {
  const char* e = std::getenv("TOKENMILL_ACTIVATIONS");
  return e && std::string(e) == "int8";
}()};

void quantize_rows16(const float* x, int64_t M, int64_t K, int16_t* q, float* d, float* s, int64_t ld, bool int8) {
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
      const float d8 = _mm_cvtss_f32(m4) / 127.0f;
      const float dd = int8 ? d8 / 256.0f : _mm_cvtss_f32(m4) / 32767.0f;
      const __m256 vid = _mm256_set1_ps(int8 ? (d8 != 0.0f ? 1.0f / d8 : 0.0f) : dd != 0.0f ? 1.0f / dd : 0.0f);
      int16_t* dst = q + row * K + b * QK;
      __m256i sum = _mm256_setzero_si256();
      for (int j = 0; j < 2; ++j) {  // packs interleaves 128-bit lanes; permute4x64 restores the order
        __m256i a = _mm256_cvtps_epi32(_mm256_mul_ps(v[2 * j], vid));  // round half to even
        __m256i c = _mm256_cvtps_epi32(_mm256_mul_ps(v[2 * j + 1], vid));
        if (int8) {
          a = _mm256_slli_epi32(a, 8);
          c = _mm256_slli_epi32(c, 8);
        }
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
