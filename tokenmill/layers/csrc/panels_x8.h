// ---- K-quants in panels of 8 rows ("x8"): one GEMM for every number of tokens ----------------------
// Included by cpu_kernels.cpp inside its namespace, after the shared helpers it uses (QK, TM_AVX512,
// g_use_vnni, h2f).
//
// Formats Q4_K_X8, Q6_K_X8, Q4_1_X8 and Q5_K_X8 hold Q4_K, Q6_K, Q4_1 and Q5_K matrices with 8 rows interleaved
// (layers/panels.py;
// N a multiple of 8, K of 256), so that one 32-byte load holds four
// consecutive weights of each of 8 rows, a row per 32-bit lane: the 8 rows advance together in the lanes,
// with no horizontal sums, and one unpacking serves all 8. (The row layout's tiles spend more on unpacking
// and reducing than on multiplying: a Q4_K GEMV ran at 24 GMAC/s a core, a third of memory speed.)
// Per panel of 8 rows and super-block of 256 weights:
//   Q4_K_X8, 1152 bytes (8 rows' own): fp16 d[8] | fp16 dmin[8] | scale bytes [12][8 rows] | qs[4][8][8][4]
//     qs[p][s][r][k] = row r's Q4_K quant byte 32 p + 4 s + k: its low nibble weight 4 s + k of block 2 p,
//     its high nibble the same weight of block 2 p + 1; the 12 bytes of 6-bit scales and mins as they are,
//     byte i of the 8 rows together (q4k_scales unpacks a block's for 8 rows at once).
//   Q6_K_X8, 1680 bytes: fp16 d[8] | int8 sc[16 halves][8 rows] | ql[4][8][8][4] | qh[2][8][8][4]
//     ql[p][s][r][k]: the low 4 bits of weight 4 s + k of block 2 p (low nibble) and of block 2 p + 1
//     (high); qh[t][s][r][k]: the top 2 bits of that weight of blocks 4 t .. 4 t + 3 (block 4 t + i in bits
//     2 i, 2 i + 1). The weight is q in 0..63; the file's q - 32 comes back through the token's sums of 16.
//   Q5_K_X8, 1408 bytes: Q4_K_X8's 1152 | qh[8][8][4]: qh[s][r][k] = row r's high-bit byte 4 s + k, whose bit j is
//     the fifth bit of weight 4 s + k of block j (the weight is q in 0..31: a Q4_K nibble plus 16 that bit).
//   Q4_1_X8, 1280 bytes per 8 blocks of 32: fp16 d[8 blocks][8 rows] | fp16 m[8][8] | qs[4][8][8][4] as Q4_K's
//     (weight 4 s + k of blocks 2 p and 2 p + 1). A "super-block" below is then 8 blocks: the chains by block
//     mod 8 are the row tiles' groups of 8.
// Integer arithmetic: a token's int16 activation q = 256 h + l (h = q >> 8 as int8, l = q & 255 as uint8),
// so a block's int32 sum of w q is 256 sum(w h) + sum(l w), from unsigned x signed byte products:
// vpmaddubsw on AVX2 (pairs of products as int16, none saturating: 2 * 63 * 128 and 2 * 255 * 63 are below
// 32768; summed over 4 steps in int16 only where that stays below too: see panels_x8_body.inc) or vpdpbusd on AVX512-VNNI (four products into int32). These are the row tiles' exact block sums,
// and the float steps after them (the min term, d_w d_x per block, eight chains by block mod 8, hsum()'s
// tree) are the row tiles' operations in their order: every (row, token) gets the row layout's bits, on
// either instruction set and for any number of tokens.

// int16 activations [n] -> h [n] int8, l [n] uint8 (not written for int8 steps, where it is all zeros) and,
// where s16 is given, the sums of each 16 (Q6_K's offset of 32 per weight)
inline void split_activations(const int16_t* q, int64_t n, int8_t* h, uint8_t* l, int32_t* s16, bool int8) {
  const __m256i lo8 = _mm256_set1_epi16(0xFF);
  for (int64_t i = 0; i < n; i += 32) {
    const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + i));
    const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + i + 16));
    // packs interleaves 128-bit lanes; permute4x64 restores the order
    const __m256i hh = _mm256_packs_epi16(_mm256_srai_epi16(a, 8), _mm256_srai_epi16(b, 8));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(h + i), _mm256_permute4x64_epi64(hh, 0xD8));
    if (int8) continue;
    const __m256i ll = _mm256_packus_epi16(_mm256_and_si256(a, lo8), _mm256_and_si256(b, lo8));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(l + i), _mm256_permute4x64_epi64(ll, 0xD8));
  }
  if (s16)
    for (int64_t i = 0; i < n; i += 16) {
      int32_t s = 0;
      for (int k = 0; k < 16; ++k) s += q[i + k];
      s16[i / 16] = s;
    }
}

inline __m256i bcast4(const void* p) {  // 4 bytes to every lane
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm256_set1_epi32(v);
}

// Block j's scale and min (6-bit integers, gguf's get_scale_min) for a super-block's 8 rows, as int32 lanes
inline void q4k_scales(const uint8_t* S, int j, __m256i& sc, __m256i& m) {
  const auto byte = [S](int i) {
    return _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(S + 32 + 8 * i)));
  };
  const __m256i k63 = _mm256_set1_epi32(63), k15 = _mm256_set1_epi32(15);
  if (j < 4) {
    sc = _mm256_and_si256(byte(j), k63);
    m = _mm256_and_si256(byte(j + 4), k63);
  } else {
    const __m256i b = byte(j + 4), top = _mm256_set1_epi32(0x30);
    sc = _mm256_or_si256(_mm256_and_si256(b, k15), _mm256_and_si256(_mm256_srli_epi32(byte(j - 4), 2), top));
    m = _mm256_or_si256(_mm256_srli_epi32(b, 4), _mm256_and_si256(_mm256_srli_epi32(byte(j), 2), top));
  }
}

// Weights 4 s .. 4 s + 3 of blocks 2 p and 2 p + 1 of a super-block's 8 rows, as bytes (Q4_K 0..15, Q5_K
// 0..31, Q6_K 0..63): the two blocks share their loads.
template <int F>
inline void x8_weights(const uint8_t* S, int p, int s, __m256i& w0, __m256i& w1) {
  const __m256i lo4 = _mm256_set1_epi8(0x0F);
  if constexpr (F != Q6_K_X8) {
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(S + (F == Q4_1_X8 ? 256 : 128) + 256 * p + 32 * s));
    w0 = _mm256_and_si256(v, lo4);
    w1 = _mm256_and_si256(_mm256_srli_epi16(v, 4), lo4);
    if constexpr (F == Q5_K_X8) {  // bits 2 p and 2 p + 1 of the high-bit bytes, to bit 4 of each weight
      const __m256i h = _mm256_srl_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(S + 1152 + 32 * s)),
                                         _mm_cvtsi32_si128(2 * p));
      const __m256i one = _mm256_set1_epi8(1);
      w0 = _mm256_or_si256(w0, _mm256_slli_epi16(_mm256_and_si256(h, one), 4));
      w1 = _mm256_or_si256(w1, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(h, 1), one), 4));
    }
  } else {
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(S + 144 + 256 * p + 32 * s));
    const __m256i h = _mm256_srl_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(S + 1168 + 256 * (p >> 1) + 32 * s)),
                                       _mm_cvtsi32_si128(4 * (p & 1)));
    const __m256i h3 = _mm256_set1_epi8(3);
    w0 = _mm256_or_si256(_mm256_and_si256(v, lo4), _mm256_slli_epi16(_mm256_and_si256(h, h3), 4));
    w1 = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(v, 4), lo4),
                         _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(h, 2), h3), 4));
  }
}

// One panel against RM tokens, in two forms: x8_panel_avx2 and x8_panel_vnni (the same source, compiled for
// each instruction set).
#define X8_NAME x8_panel_avx2
#define X8_VNNI 0
#include "panels_x8_body.inc"
#undef X8_NAME
#undef X8_VNNI
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")
#define X8_NAME x8_panel_vnni
#define X8_VNNI 1
#include "panels_x8_body.inc"
#undef X8_NAME
#undef X8_VNNI
#pragma GCC pop_options

// Many tokens on AVX512-VNNI: gemm_vnni's panels of 16 rows (two of ours) widened to int16 pairs, exactly what
// widen_panel makes of the row layout (Q6_K's q - 32 included), so panel_tokens runs on them unchanged.
template <int FX>
TM_AVX512 void widen_x8(const uint8_t* P, int64_t panel_bytes, int64_t nsb, int rows, int32_t* wp, float* dw,
                        float* mw) {
  const __m512i even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
  const __m512i odd = _mm512_add_epi32(even, _mm512_set1_epi32(1));
  const __m512 sign = _mm512_set1_ps(-0.0f);
  const bool two = rows > 8;  // a last panel of 8 rows: the other 8 lanes are zeros
  for (int64_t sb = 0; sb < nsb; ++sb) {
    const uint8_t* S[2] = {P + sb * x8_bytes(FX), P + panel_bytes + sb * x8_bytes(FX)};
    for (int p = 0; p < 4; ++p)
      for (int s = 0; s < 8; ++s) {
        __m512i w[2][2];  // [panel][block 2 p + e]: weights 4 s .. 4 s + 3 of 8 rows as int16, pairs in int32 lanes
        for (int h = 0; h < 2; ++h) {
          __m256i b0 = _mm256_setzero_si256(), b1 = _mm256_setzero_si256();
          if (h == 0 || two) x8_weights<FX>(S[h], p, s, b0, b1);
          w[h][0] = _mm512_cvtepu8_epi16(b0);
          w[h][1] = _mm512_cvtepu8_epi16(b1);
          if constexpr (FX == Q6_K_X8)
            for (int e = 0; e < 2; ++e) w[h][e] = _mm512_sub_epi16(w[h][e], _mm512_set1_epi16(h == 0 || two ? 32 : 0));
        }
        for (int e = 0; e < 2; ++e) {
          int32_t* out = wp + ((sb * 8 + 2 * p + e) * 16 + 2 * s) * PANEL;  // pairs 2 s and 2 s + 1 of the block
          _mm512_store_si512(out, _mm512_permutex2var_epi32(w[0][e], even, w[1][e]));
          _mm512_store_si512(out + PANEL, _mm512_permutex2var_epi32(w[0][e], odd, w[1][e]));
        }
      }
    for (int j = 0; j < 8; ++j) {
      const int64_t b = sb * 8 + j;
      for (int h = 0; h < 2; ++h) {
        __m256 d = _mm256_setzero_ps(), m = _mm256_setzero_ps();
        if (h == 0 || two) {
          const __m256 dd = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(S[h])));
          if constexpr (FX == Q4_1_X8) {  // as group_scales: the blocks' fp16 d and m
            d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(S[h] + 16 * j)));
            m = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(S[h] + 128 + 16 * j)));
          } else if constexpr (FX == Q4_K_X8 || FX == Q5_K_X8) {  // as group_scales: d sc and -dmin m, exact
            const __m256 ndmin = _mm256_xor_ps(_mm512_castps512_ps256(sign),
                                               _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(S[h] + 16))));
            __m256i sc, mn;
            q4k_scales(S[h], j, sc, mn);
            d = _mm256_mul_ps(dd, _mm256_cvtepi32_ps(sc));
            m = _mm256_mul_ps(ndmin, _mm256_cvtepi32_ps(mn));
          } else {  // the scales of the block's two halves
            d = _mm256_mul_ps(dd, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(
                                      _mm_loadl_epi64(reinterpret_cast<const __m128i*>(S[h] + 16 + 16 * j)))));
            m = _mm256_mul_ps(dd, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(
                                      _mm_loadl_epi64(reinterpret_cast<const __m128i*>(S[h] + 24 + 16 * j)))));
          }
        }
        _mm256_storeu_ps(dw + b * PANEL + 8 * h, d);
        _mm256_storeu_ps(mw + b * PANEL + 8 * h, m);
      }
    }
  }
}

// From this many tokens gemm_vnni's widened panels beat the panels read as they are (widen_x8 costs less than
// widen_panel, so this is below its crossing): on a Zen 4 EPYC, 2 threads, Q4_K 16384x2048 and 2048x8192,
// widened 0.7x at 2 tokens, 1.1x at 4, 1.2x at 8, 1.4-1.5x at 16; Q6_K 0.9x, 1.2-1.3x, 1.4-1.6x, 1.6-1.8x.
constexpr int64_t X8_WIDEN_MIN_TOKENS = 4;
// With int8 activations only Q6_K widens, from this many tokens: its panels as they are ran 1.2-1.6x the widened
// ones at 4-6 tokens, 0.96-1.13x at 8, 0.88-1.01x at 12 (Q6_K 16384x2048 and 2048x8192, the machine above).
constexpr int64_t X8_I8_WIDEN_MIN_TOKENS = 8;

// y[M, N] (=, or += with accumulate) x . W^T, W in panels; xq/xd/xs as the row GEMM takes them, and
// scratch for the split activations: xh, xl [M * K], s16 [M * K / 16] (Q6_K only).
template <int F>
void gemm_x8(const uint8_t* W, int64_t N, int64_t K, const int16_t* xq, const float* xd, const float* xs, int64_t ld,
             int64_t M, float* y, bool accumulate, int8_t* xh, uint8_t* xl, int32_t* s16, bool int8) {
  const bool vnni = g_use_vnni.load(std::memory_order_relaxed);
  // int8 activations: the panels as they are run Q4_K and Q4_1 faster than the widened ones (1.1-2.0x, Q4_K 4-256
  // tokens on a Zen 4 EPYC, 2 threads), Q6_K only below X8_I8_WIDEN_MIN_TOKENS (0.7-0.9x from 16 tokens: its
  // unpacking weighs more)
  if (vnni && (int8 ? F == Q6_K_X8 && M >= X8_I8_WIDEN_MIN_TOKENS : M >= X8_WIDEN_MIN_TOKENS))
    return gemm_vnni<x8_row_format(F), F>(W, N, K, xq, xd, xs, ld, M, y, accumulate);
  split_activations(xq, M * K, xh, xl, F == Q6_K_X8 ? s16 : nullptr, int8);
  const int64_t nsb = K / 256, panel_bytes = nsb * x8_bytes(F);
  // tokens in chunks whose split activations stay in L2 while this thread's panels pass over them
  const int64_t chunk = std::max<int64_t>(4, (256 * 1024) / (2 * K));
  const auto span = [&](int64_t p0, int64_t p1) {
    for (int64_t mc = 0; mc < M; mc += chunk) {
      const int64_t mc1 = std::min(M, mc + chunk);
      for (int64_t p = p0; p < p1; ++p) {
        const uint8_t* P = W + p * panel_bytes;
        int64_t m = mc;
        const auto run = [&](auto rm) {
          constexpr int RM = decltype(rm)::value;
          const int64_t o = m * K;
          const auto panel = vnni ? (int8 ? x8_panel_vnni<F, RM, true> : x8_panel_vnni<F, RM, false>)
                                  : (int8 ? x8_panel_avx2<F, RM, true> : x8_panel_avx2<F, RM, false>);
          panel(P, nsb, xh + o, xl + o, s16 + o / 16, K, xd + m * ld, xs + m * ld, ld, y + m * N + 8 * p, N, accumulate);
          m += RM;
        };
        // tiles of 4 tokens, the rest as one tile; 5 as one (a step verifying 1-4 speculative tokens reads and
        // unpacks each panel once)
        if (mc1 - m == 5) run(std::integral_constant<int, 5>{});
        while (m + 4 <= mc1) run(std::integral_constant<int, 4>{});
        if (mc1 - m == 3) run(std::integral_constant<int, 3>{});
        else if (mc1 - m == 2) run(std::integral_constant<int, 2>{});
        else if (mc1 - m == 1) run(std::integral_constant<int, 1>{});
      }
    }
  };
  const int64_t panels = N / 8;
  if (M >= 4 || panels * panel_bytes < (1 << 20)) return at::parallel_for(0, panels, 1, span);
  // A few tokens on a matrix of a MiB or more: the weights stream from memory once. Chunks taken in turn (as
  // ggml does) rather than one range per thread, so a thread slowed by the other side of a shared core leaves
  // its work to the other; each chunk asks for its first PF_DIST bytes at once (the panels prefetch PF_DIST
  // ahead from there). On the 1B Q4_K_M shape (Zen 4, 2 vCPUs) decode ran 4-19% faster than with one static
  // range per thread (4 pairs); on the embedded model's small matrices (and the row GEMV's) the chunks cost
  // more than they saved.
  const int64_t threads = at::get_num_threads();
  const int64_t per = std::max<int64_t>(1, (panels + 8 * threads - 1) / (8 * threads));
  std::atomic<int64_t> next{0};
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
    for (int64_t p0; (p0 = per * next.fetch_add(1, std::memory_order_relaxed)) < panels;) {
      const int64_t p1 = std::min(panels, p0 + per);
      for (int64_t o = 0; o < std::min<int64_t>(PF_DIST, (p1 - p0) * panel_bytes); o += 64)
        _mm_prefetch(reinterpret_cast<const char*>(W + p0 * panel_bytes + o), _MM_HINT_T0);
      span(p0, p1);
    }
  });
}

// ---- into panels: the file's row blocks -> a panel format (layers/panels.py's to_panels is the reference) ---
// data [n, row bytes] in GGUF's block layout; fmt a panel format; n a multiple of 8, k of 256. The bytes are
// only reordered (Q6_K's high bits and Q4_K's scales move as they are; the low nibbles of two blocks pair up).
at::Tensor to_panels(const at::Tensor& data, int64_t fmt, int64_t n, int64_t k) {
  TORCH_CHECK(is_x8(fmt), "tokenmill::to_panels: fmt must be a panel format (6 to 9), got ", fmt);
  TORCH_CHECK(n % 8 == 0 && k % 256 == 0, "tokenmill::to_panels: needs rows a multiple of 8 and in_features of 256, "
              "got [", n, ", ", k, "]");
  const int64_t per = row_bytes_of(x8_row_format(fmt), 8);  // a row's bytes per 256 weights
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
      if (fmt == Q4_K_X8 || fmt == Q5_K_X8) {
        for (int r = 0; r < 8; ++r) {
          std::memcpy(S + 2 * r, R[r], 2);
          std::memcpy(S + 16 + 2 * r, R[r] + 2, 2);
          for (int i = 0; i < 12; ++i) S[32 + 8 * i + r] = R[r][4 + i];
        }
        if (fmt == Q4_K_X8) {
          words(128, 16, 32);
        } else {  // Q5_K: its quants after the 32 high-bit bytes, which follow them here as they are
          words(128, 48, 32);
          words(1152, 16, 8);
        }
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

// ---- out of panels: rows ids of a matrix in panels, in the file's row blocks ---------------------------------
// to_panels' inverse for those rows only (layers/panels.py's from_panels is the reference): the embedding looked
// up from a tied head's panels, a row a token, without reordering whole panels.
at::Tensor panel_rows(const at::Tensor& panels, int64_t fmt, int64_t k, const at::Tensor& ids) {
  TORCH_CHECK(is_x8(fmt) && k % 256 == 0, "tokenmill::panel_rows: fmt must be a panel format (6 to 9) and "
              "in_features a multiple of 256, got ", fmt, " and ", k);
  const int64_t per = row_bytes_of(x8_row_format(fmt), 8), nsb = k / 256, sb_bytes = x8_bytes(fmt);
  TORCH_CHECK(panels.device().is_cpu() && panels.scalar_type() == at::kByte && panels.is_contiguous() &&
              panels.dim() == 2 && panels.size(1) == nsb * sb_bytes, "tokenmill::panel_rows: panels must be contiguous "
              "uint8 [rows / 8, ", nsb * sb_bytes, "]");
  TORCH_CHECK(ids.scalar_type() == at::kLong && ids.dim() == 1, "tokenmill::panel_rows: ids must be int64 [n]");
  const at::Tensor idc = ids.contiguous();
  const int64_t n = idc.numel(), rows = 8 * panels.size(0);
  at::Tensor out = at::zeros({n, nsb * per}, panels.options());
  const int64_t* id = idc.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i)
    TORCH_CHECK(id[i] >= 0 && id[i] < rows, "tokenmill::panel_rows: row ", id[i], " outside [0, ", rows, ")");
  const uint8_t* src = panels.data_ptr<uint8_t>();
  uint8_t* dst = out.data_ptr<uint8_t>();
  for (int64_t i = 0; i < n; ++i) {
    const int64_t p = id[i] / 8, r = id[i] % 8;
    for (int64_t sb = 0; sb < nsb; ++sb) {
      const uint8_t* S = src + (p * nsb + sb) * sb_bytes;
      uint8_t* R = dst + (i * nsb + sb) * per;
      if (fmt == Q4_K_X8 || fmt == Q5_K_X8) {
        std::memcpy(R, S + 2 * r, 2);
        std::memcpy(R + 2, S + 16 + 2 * r, 2);
        for (int b = 0; b < 12; ++b) R[4 + b] = S[32 + 8 * b + r];
        const int qs = fmt == Q4_K_X8 ? 16 : 48;  // Q5_K: the high-bit bytes first
        for (int w = 0; w < 32; ++w) std::memcpy(R + qs + 4 * w, S + 128 + 32 * w + 4 * r, 4);
        if (fmt == Q5_K_X8)
          for (int w = 0; w < 8; ++w) std::memcpy(R + 16 + 4 * w, S + 1152 + 32 * w + 4 * r, 4);
      } else if (fmt == Q6_K_X8) {
        std::memcpy(R + 208, S + 2 * r, 2);
        for (int h = 0; h < 16; ++h) R[192 + h] = S[16 + 8 * h + r];
        for (int q = 0; q < 2; ++q)  // ql bytes 64 q + j (low nibbles in panel pair 2 q, high in 2 q + 1)
          for (int j = 0; j < 32; ++j) {
            const uint8_t lo = S[144 + 512 * q + 32 * (j / 4) + 4 * r + j % 4];
            const uint8_t hi = S[144 + 512 * q + 256 + 32 * (j / 4) + 4 * r + j % 4];
            R[64 * q + j] = static_cast<uint8_t>((lo & 0x0F) | (hi << 4));
            R[64 * q + 32 + j] = static_cast<uint8_t>((lo >> 4) | (hi & 0xF0));
          }
        for (int w = 0; w < 16; ++w) std::memcpy(R + 128 + 4 * w, S + 1168 + 32 * w + 4 * r, 4);
      } else {
        for (int j = 0; j < 8; ++j) {
          std::memcpy(R + 20 * j, S + 16 * j + 2 * r, 2);
          std::memcpy(R + 20 * j + 2, S + 128 + 16 * j + 2 * r, 2);
        }
        for (int q = 0; q < 4; ++q)  // weight w of blocks 2 q (low nibble) and 2 q + 1 (high)
          for (int w = 0; w < 32; ++w) {
            const uint8_t b = S[256 + 256 * q + 32 * (w / 4) + 4 * r + w % 4];
            for (int e = 0; e < 2; ++e) {
              const uint8_t v = e ? b >> 4 : b & 0x0F;
              R[20 * (2 * q + e) + 4 + (w & 15)] |= static_cast<uint8_t>(w < 16 ? v : v << 4);
            }
          }
      }
    }
  }
  return out;
}
