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

// Dequantize blocks to float32 [N, K]. Prefill-sized batches are compute-bound, and on AVX2 the float
// GEMM (MKL) outruns the integer kernel there; unpacking the weights per call costs far less than the
// GEMM it enables. Exactly the values of quant.py's dequantize_rows.
at::Tensor dequantize(const at::Tensor& w, int64_t n_out, int64_t K, int64_t fmt) {
  TORCH_CHECK(w.scalar_type() == at::kByte && w.is_contiguous() && w.device().is_cpu(),
              "tokenmill::dequantize takes contiguous uint8 blocks on the CPU");
  TORCH_CHECK((fmt == 0 || fmt == 1) && K % QK == 0, "tokenmill::dequantize: bad format or in_features");
  const int64_t nb = K / QK, bytes = fmt == 1 ? Q4_1_BYTES : Q8_0_BYTES;
  TORCH_CHECK(w.numel() == n_out * nb * bytes, "tokenmill::dequantize: weight size does not match [", n_out,
              ", ", K, "]");
  auto y = at::empty({n_out, K}, w.options().dtype(at::kFloat));
  const uint8_t* wp = w.data_ptr<uint8_t>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, n_out * nb, 256, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const uint8_t* blk = wp + i * bytes;
      float* out = yp + i * QK;
      const float d = h2f(blk);
      if (fmt == 1) {
        const float m = h2f(blk + 2);
        for (int j = 0; j < 16; ++j) {
          out[j] = d * static_cast<float>(blk[4 + j] & 0x0F) + m;
          out[j + 16] = d * static_cast<float>(blk[4 + j] >> 4) + m;
        }
      } else {
        for (int j = 0; j < QK; ++j) out[j] = d * static_cast<float>(static_cast<int8_t>(blk[2 + j]));
      }
    }
  });
  return y;
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
      for (int64_t i = 0; i < I; ++i) yp[t * I + i] = g[i] / (1.0f + std::exp(-g[i])) * u[i];
    }
  });
  return y;
}

// ---- decode attention over the paged KV cache, reading the blocks in place ---------------------------
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
  at::parallel_for(0, B * HKV, 1, [&](int64_t i0, int64_t i1) {
    std::vector<float> scores;
    std::vector<float> acc(G * D);
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t b = i / HKV, hk = i % HKV, L = lp[b];
      scores.assign(G * L, 0.0f);
      const float* qh = qp + b * ldq + hk * G * D;  // the G query heads of this KV head are adjacent
      for (int64_t j = 0; j < L; ++j) {
        const int64_t blk = tp[b * W + j / BS];
        TORCH_CHECK(blk >= 0 && blk < NB, "tokenmill::paged_decode_attention: block id ", blk, " out of range");
        const float* kj = kp + ((blk * BS + j % BS) * HKV + hk) * D;
        for (int64_t g = 0; g < G; ++g) {
          float dot = 0.0f;
          for (int64_t e = 0; e < D; ++e) dot += qh[g * D + e] * kj[e];
          scores[g * L + j] = dot * sc;
        }
      }
      std::fill(acc.begin(), acc.end(), 0.0f);
      std::vector<float> denom(G);
      for (int64_t g = 0; g < G; ++g) {
        float* sg = scores.data() + g * L;
        const float mx = *std::max_element(sg, sg + L);
        float sum = 0.0f;
        for (int64_t j = 0; j < L; ++j) {
          sg[j] = std::exp(sg[j] - mx);
          sum += sg[j];
        }
        denom[g] = 1.0f / sum;
      }
      for (int64_t j = 0; j < L; ++j) {
        const int64_t blk = tp[b * W + j / BS];
        const float* vj = vp + ((blk * BS + j % BS) * HKV + hk) * D;
        for (int64_t g = 0; g < G; ++g) {
          const float p = scores[g * L + j];
          float* a = acc.data() + g * D;
          for (int64_t e = 0; e < D; ++e) a[e] += p * vj[e];
        }
      }
      for (int64_t g = 0; g < G; ++g)
        for (int64_t e = 0; e < D; ++e) op[(b * H + hk * G + g) * D + e] = acc[g * D + e] * denom[g];
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY(tokenmill, m) {
  m.def("qlinear(Tensor x, Tensor w, int n_out, int fmt) -> Tensor");
  m.def("quantize_activations(Tensor x) -> Tensor[]");
  m.def("rms_norm(Tensor x, Tensor w, float eps) -> Tensor");
  m.def("rope_(Tensor(a!) x, Tensor cos, Tensor sin, int n_heads, int head_dim) -> ()");
  m.def("silu_mul(Tensor gu) -> Tensor");
  m.def("dequantize(Tensor w, int n_out, int k, int fmt) -> Tensor");
  m.def("paged_decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, Tensor seq_lens, "
        "float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(tokenmill, CPU, m) {
  m.impl("qlinear", &qlinear);
  m.impl("quantize_activations", &quantize_activations);
  m.impl("rms_norm", &rms_norm);
  m.impl("rope_", &rope_);
  m.impl("silu_mul", &silu_mul);
  m.impl("dequantize", &dequantize);
  m.impl("paged_decode_attention", &paged_decode_attention);
}
