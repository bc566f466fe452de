// tokenmill CPU kernels (x86-64 AVX2 + FMA + F16C), registered as torch.ops.tokenmill.*.
//
// Quantized linear layers keep GGUF's block formats byte for byte (32 weights per block, along K):
//   Q8_0: { fp16 d; int8 q[32]; }                 34 bytes, w = d * q
//   Q4_1: { fp16 d; fp16 m; uint8 nibbles[16]; }  20 bytes, w = d * q + m, q in [0, 15];
//         weight j of the block is the low nibble of byte j, weight j + 16 its high nibble.
// A weight matrix [N, K] is N rows of K / 32 blocks. Activations are quantized per token and per
// block of 32 to int8 with one float scale (llama.cpp's Q8_0/Q8_1 activations), so every dot product
// runs on integer multiply-adds (vpmaddubsw + vpmaddwd) and is scaled once per block.
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

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// ---- activations: float [M, K] -> int8 [M, K], scale [M, K/32], scale * sum(q) [M, K/32] ----------

void quantize_rows(const float* x, int64_t M, int64_t K, int8_t* q, float* d, float* s) {
  const int64_t nb = K / QK;
  at::parallel_for(0, M * nb, 64, [&](int64_t begin, int64_t end) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    for (int64_t i = begin; i < end; ++i) {
      const float* src = x + (i / nb) * K + (i % nb) * QK;
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
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + i * QK), p);
      d[i] = dd;
      s[i] = dd * static_cast<float>(_mm_cvtsi128_si32(s4));
    }
  });
}

// ---- integer dot products of one weight block with one activation block --------------------------

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

// ---- the GEMM: y[M, N] = x[M, K] . W[N, K]^T, weights in Q4_1 or Q8_0 blocks ------------------------

template <bool Q4, int RN, int RM>
inline void tile(const uint8_t* W, int64_t row_bytes, int64_t nb, const int8_t* xq, const float* xd,
                 const float* xs, int64_t K, float* y, int64_t N) {
  __m256 acc[RN][RM];
  float macc[RN][RM];
  for (int n = 0; n < RN; ++n)
    for (int m = 0; m < RM; ++m) {
      acc[n][m] = _mm256_setzero_ps();
      macc[n][m] = 0.0f;
    }
  for (int64_t b = 0; b < nb; ++b) {
    __m256i w[RN];
    __m256i wabs[RN];
    float dw[RN];
    float mw[RN];
    for (int n = 0; n < RN; ++n) {
      const uint8_t* blk = W + n * row_bytes + b * (Q4 ? Q4_1_BYTES : Q8_0_BYTES);
      dw[n] = h2f(blk);
      if constexpr (Q4) {
        mw[n] = h2f(blk + 2);
        w[n] = unpack_q4(blk + 4);
      } else {
        const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 2));
        wabs[n] = _mm256_sign_epi8(raw, raw);  // |w| as unsigned bytes; the sign moves to x
        w[n] = raw;
      }
    }
    for (int m = 0; m < RM; ++m) {
      const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + m * K + b * QK));
      const __m256 dx = _mm256_broadcast_ss(xd + m * nb + b);
      for (int n = 0; n < RN; ++n) {
        __m256i isum;
        if constexpr (Q4) {
          isum = dot_u8s8(w[n], xv);
        } else {
          isum = dot_u8s8(wabs[n], _mm256_sign_epi8(xv, w[n]));
        }
        const __m256 f = _mm256_mul_ps(_mm256_cvtepi32_ps(isum), dx);
        acc[n][m] = _mm256_fmadd_ps(f, _mm256_set1_ps(dw[n]), acc[n][m]);
        if constexpr (Q4) macc[n][m] += mw[n] * xs[m * nb + b];
      }
    }
  }
  for (int n = 0; n < RN; ++n)
    for (int m = 0; m < RM; ++m) y[m * N + n] = hsum(acc[n][m]) + (Q4 ? macc[n][m] : 0.0f);
}

template <bool Q4, int RN>
inline void rows_all_tokens(const uint8_t* W, int64_t row_bytes, int64_t nb, const int8_t* xq, const float* xd,
                            const float* xs, int64_t m0, int64_t m1, int64_t K, float* y, int64_t N) {
  constexpr int RM = RN == 4 ? 2 : 4;
  int64_t m = m0;
  for (; m + RM <= m1; m += RM)
    tile<Q4, RN, RM>(W, row_bytes, nb, xq + m * K, xd + m * nb, xs + m * nb, K, y + m * N, N);
  for (; m < m1; ++m) tile<Q4, RN, 1>(W, row_bytes, nb, xq + m * K, xd + m * nb, xs + m * nb, K, y + m * N, N);
}

template <bool Q4>
void gemm(const uint8_t* W, int64_t N, int64_t K, const int8_t* xq, const float* xd, const float* xs, int64_t M,
          float* y) {
  const int64_t nb = K / QK;
  const int64_t row_bytes = nb * (Q4 ? Q4_1_BYTES : Q8_0_BYTES);
  // Tokens in chunks whose int8 activations stay in L2 while every row of this thread passes over them.
  const int64_t chunk = std::max<int64_t>(4, (256 * 1024) / std::max<int64_t>(K, 1));
  constexpr int RN_BIG = 2;  // rows per tile when several tokens share it (2 rows x 4 tokens)
  const int RN = M == 1 ? 4 : RN_BIG;
  const int64_t tiles = (N + RN - 1) / RN;
  at::parallel_for(0, tiles, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t mc = 0; mc < M; mc += chunk) {
      const int64_t mc1 = std::min(M, mc + chunk);
      for (int64_t t = t0; t < t1; ++t) {
        const int64_t n = t * RN;
        const int64_t rows = std::min<int64_t>(RN, N - n);
        const uint8_t* Wn = W + n * row_bytes;
        float* yn = y + n;
        if (rows == 4) {
          rows_all_tokens<Q4, 4>(Wn, row_bytes, nb, xq, xd, xs, mc, mc1, K, yn, N);
        } else if (rows == 2) {
          rows_all_tokens<Q4, 2>(Wn, row_bytes, nb, xq, xd, xs, mc, mc1, K, yn, N);
        } else {
          for (int64_t r = 0; r < rows; ++r)
            for (int64_t m = mc; m < mc1; ++m)
              tile<Q4, 1, 1>(Wn + r * row_bytes, row_bytes, nb, xq + m * K, xd + m * nb, xs + m * nb, K,
                             yn + r + m * N, N);
        }
      }
    }
  });
}

// fmt: 0 = Q8_0, 1 = Q4_1
at::Tensor qlinear(const at::Tensor& x, const at::Tensor& w, int64_t n_out, int64_t fmt) {
  TORCH_CHECK(x.device().is_cpu() && w.device().is_cpu(), "tokenmill::qlinear runs on the CPU");
  TORCH_CHECK(x.scalar_type() == at::kFloat, "tokenmill::qlinear takes float32 activations");
  TORCH_CHECK(w.scalar_type() == at::kByte && w.is_contiguous(), "tokenmill::qlinear takes contiguous uint8 blocks");
  TORCH_CHECK(fmt == 0 || fmt == 1, "tokenmill::qlinear: format must be 0 (Q8_0) or 1 (Q4_1)");
  const int64_t K = x.size(-1);
  TORCH_CHECK(K % QK == 0, "tokenmill::qlinear: in_features must be a multiple of 32, got ", K);
  const int64_t bytes = fmt == 1 ? Q4_1_BYTES : Q8_0_BYTES;
  TORCH_CHECK(w.numel() == n_out * (K / QK) * bytes, "tokenmill::qlinear: weight holds ", w.numel(),
              " bytes, expected ", n_out * (K / QK) * bytes, " for [", n_out, ", ", K, "]");
  auto xc = x.reshape({-1, K}).contiguous();
  const int64_t M = xc.size(0);
  auto out_shape = x.sizes().vec();
  out_shape.back() = n_out;
  auto y = at::empty({M, n_out}, x.options());
  if (M == 0) return y.view(out_shape);
  const int64_t nb = K / QK;
  auto q = at::empty({M, K}, x.options().dtype(at::kChar));
  auto d = at::empty({M, nb}, x.options());
  auto s = at::empty({M, nb}, x.options());
  quantize_rows(xc.data_ptr<float>(), M, K, q.data_ptr<int8_t>(), d.data_ptr<float>(), s.data_ptr<float>());
  if (fmt == 1)
    gemm<true>(w.data_ptr<uint8_t>(), n_out, K, q.data_ptr<int8_t>(), d.data_ptr<float>(), s.data_ptr<float>(), M,
               y.data_ptr<float>());
  else
    gemm<false>(w.data_ptr<uint8_t>(), n_out, K, q.data_ptr<int8_t>(), d.data_ptr<float>(), s.data_ptr<float>(), M,
                y.data_ptr<float>());
  return y.view(out_shape);
}

// Quantize activations only (for tests: the reference must round exactly like the kernel).
std::vector<at::Tensor> quantize_activations(const at::Tensor& x) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 2 && x.size(1) % QK == 0,
              "tokenmill::quantize_activations takes float32 [M, K] with K a multiple of 32");
  auto xc = x.contiguous();
  const int64_t M = xc.size(0), K = xc.size(1), nb = K / QK;
  auto q = at::empty({M, K}, x.options().dtype(at::kChar));
  auto d = at::empty({M, nb}, x.options());
  auto s = at::empty({M, nb}, x.options());
  quantize_rows(xc.data_ptr<float>(), M, K, q.data_ptr<int8_t>(), d.data_ptr<float>(), s.data_ptr<float>());
  return {q, d, s};
}

}  // namespace

TORCH_LIBRARY(tokenmill, m) {
  m.def("qlinear(Tensor x, Tensor w, int n_out, int fmt) -> Tensor");
  m.def("quantize_activations(Tensor x) -> Tensor[]");
}

TORCH_LIBRARY_IMPL(tokenmill, CPU, m) {
  m.impl("qlinear", &qlinear);
  m.impl("quantize_activations", &quantize_activations);
}
