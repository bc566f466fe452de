// The fused elementwise ops of a decoder layer: RMSNorm, RoPE, SwiGLU.
// Included by cpu_kernels.cpp inside its namespace, after the files before it there.
#pragma once

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
