// The formats' ids and sizes and small helpers every kernel uses.
// Included by cpu_kernels.cpp inside its namespace, after the files before it there.
#pragma once


constexpr int QK = 32;
enum : int { Q8_0 = 0, Q4_1 = 1, Q5_0 = 2, Q4_K = 3, Q5_K = 4, Q6_K = 5, NUM_FORMATS = 6 };
// Q4_K, Q6_K, Q4_1 and Q5_K in panels of 8 rows (panels_x8.h)
enum : int { Q4_K_X8 = NUM_FORMATS, Q6_K_X8, Q4_1_X8, Q5_K_X8, NUM_FORMATS_X8 };
constexpr bool is_x8(int64_t f) { return f >= Q4_K_X8 && f < NUM_FORMATS_X8; }
// bytes per 8 rows and 256 weights (a super-block, or 8 blocks of Q4_1)
constexpr int64_t x8_bytes(int64_t f) {
  return f == Q4_K_X8 ? 1152 : f == Q6_K_X8 ? 1680 : f == Q5_K_X8 ? 1408 : 1280;
}
constexpr int x8_row_format(int f) { return f == Q4_K_X8 ? Q4_K : f == Q6_K_X8 ? Q6_K : f == Q5_K_X8 ? Q5_K : Q4_1; }
constexpr bool is_super(int64_t f) { return f >= Q4_K; }  // super-blocks of 256 weights
// bytes per block of 32 weights (per super-block of 256 for the K-quants)
constexpr int64_t block_bytes(int64_t f) {
  return f == Q8_0 ? 34 : f == Q4_1 ? 20 : f == Q5_0 ? 22 : f == Q4_K ? 144 : f == Q5_K ? 176 : 210;
}
constexpr int64_t row_bytes_of(int64_t f, int64_t nb) { return is_super(f) ? nb / 8 * block_bytes(f) : nb * block_bytes(f); }
template <int F> constexpr bool kMin = F == Q4_1 || F == Q4_K || F == Q5_K;  // w = d q + m: a min term
template <int F> constexpr bool kSplit = F == Q6_K;  // a scale per 16 weights: a block's halves scale apart

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


inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

inline int64_t round8(int64_t n) { return (n + 7) / 8 * 8; }
