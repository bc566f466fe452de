// Float32 linear layers in one summation order (--quantization none).
// Included by cpu_kernels.cpp inside its namespace, after the files before it there.
#pragma once

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
