// The row layout's GEMM: which form runs (AVX2 tiles or VNNI panels), threads and prefetch.
// Included by cpu_kernels.cpp inside its namespace, after the files before it there.
#pragma once

// Which GEMM runs many-token calls: "avx512vnni" where the CPU has it (unless TOKENMILL_CPU_ISA=avx2 or
// kernel_isa("avx2") says otherwise), else "avx2". Results are the same bits either way; only speed differs.
bool cpu_has_vnni() {
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni");
}
// Atomics: a test or the load-time timing may switch them while another thread runs a GEMM (relaxed: the
// bits are the same either way, only which form runs changes).
std::atomic<bool> g_use_vnni{[] {
  const char* e = std::getenv("TOKENMILL_CPU_ISA");
  return cpu_has_vnni() && !(e && std::string(e) == "avx2");
}()};
// Below this many tokens the AVX2 tiles win: widening a panel costs about as much as a few tokens' work.
// Measured (benchmarks/linear_kernels.py, the model's shapes, 2 threads): on a Sapphire Rapids-class Xeon
// VNNI ran 0.7x at M=2, 1.2-1.5x at M=8, 3-4x at M=512; on a Zen 5 EPYC 0.9x at M=8 (0.5x on the output
// head), 1.4x at M=16, 2.7x at M=64, 3.4x at M=512. The crossing differs by machine: kernels.py times it
// when it loads the kernels and sets it with vnni_min_tokens().
std::atomic<int64_t> g_vnni_min_tokens{16};

template <int F, int RN>
inline void rows_all_tokens(const uint8_t* W, int64_t row_bytes, int64_t nb, const int16_t* xq, const float* xd,
                            const float* xs, int64_t ld, int64_t m0, int64_t m1, int64_t K, float* y, int64_t N,
                            bool accumulate, const uint8_t* pf, int64_t pf_lines) {
  constexpr int RM = RN == 4 ? 1 : 4;
  int64_t m = m0;
  for (; m + RM <= m1; m += RM, pf = nullptr)  // the first tile over these rows prefetches
    tile<F, RN, RM>(W, row_bytes, nb, xq + m * K, K, xd + m * ld, xs + m * ld, ld, y + m * N, N, accumulate, pf,
                     pf_lines);
  for (; m < m1; ++m, pf = nullptr)
    tile<F, RN, 1>(W, row_bytes, nb, xq + m * K, K, xd + m * ld, xs + m * ld, ld, y + m * N, N, accumulate, pf,
                    pf_lines);
}

// Software prefetch distance for GEMVs (a few tokens): the weights stream from DRAM once per step
// and, without it, one Zen 1 core waits on memory instead of overlapping it with the multiply-adds
// (single-thread Q8_0 head 5.9 -> 4.4 ms, a streaming Q4_1 matrix 6.3 -> 4.9 ms; 4-16 KiB all alike).
constexpr int64_t PF_DIST = 8192;
template <int F>
void gemm(const uint8_t* W, int64_t N, int64_t K, const int16_t* xq, const float* xd, const float* xs, int64_t ld,
          int64_t M, float* y, bool accumulate) {
  if (g_use_vnni.load(std::memory_order_relaxed) && M >= g_vnni_min_tokens.load(std::memory_order_relaxed))
    return gemm_vnni<F>(W, N, K, xq, xd, xs, ld, M, y, accumulate);
  const int64_t nb = K / QK;
  const int64_t row_bytes = row_bytes_of(F, nb);
  // Tokens in chunks whose quantized activations stay in L2 while every row of this thread passes over them.
  const int64_t chunk = std::max<int64_t>(4, (256 * 1024) / std::max<int64_t>(K * sizeof(int16_t), 1));
  const int RN = M == 1 ? 4 : 2;  // one token: 4 rows per tile; several: 2 rows x 4 tokens
  const int64_t tiles = (N + RN - 1) / RN;
  const bool prefetch = M < 8;
  const int64_t groups = (nb + 7) / 8;
  const int64_t pf_lines = (RN * row_bytes + 64 * groups - 1) / (64 * groups);  // a tile's lines, per group
  const auto span = [&](int64_t t0, int64_t t1) {
    if (prefetch)  // the first PF_DIST bytes of these rows, which the loop below does not prefetch
      for (int64_t o = 0; o < std::min<int64_t>(PF_DIST, (t1 - t0) * RN * row_bytes); o += 64)
        _mm_prefetch(reinterpret_cast<const char*>(W + t0 * RN * row_bytes + o), _MM_HINT_T0);
    for (int64_t mc = 0; mc < M; mc += chunk) {
      const int64_t mc1 = std::min(M, mc + chunk);
      for (int64_t t = t0; t < t1; ++t) {
        const int64_t n = t * RN;
        const int64_t rows = std::min<int64_t>(RN, N - n);
        const uint8_t* Wn = W + n * row_bytes;
        const uint8_t* pf = prefetch && mc == 0 ? Wn + PF_DIST : nullptr;
        float* yn = y + n;
        if (rows == 4) {
          rows_all_tokens<F, 4>(Wn, row_bytes, nb, xq, xd, xs, ld, mc, mc1, K, yn, N, accumulate, pf, pf_lines);
        } else if (rows == 2) {
          rows_all_tokens<F, 2>(Wn, row_bytes, nb, xq, xd, xs, ld, mc, mc1, K, yn, N, accumulate, pf, pf_lines);
        } else {
          for (int64_t r = 0; r < rows; ++r)
            for (int64_t m = mc; m < mc1; ++m)
              tile<F, 1, 1>(Wn + r * row_bytes, row_bytes, nb, xq + m * K, K, xd + m * ld, xs + m * ld, ld,
                             yn + r + m * N, N, accumulate);
        }
      }
    }
  };
  at::parallel_for(0, tiles, 1, span);
}
