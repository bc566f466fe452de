// Attention over the paged KV cache, reading the blocks in place.
// Included by cpu_kernels.cpp inside its namespace, after the files before it there.
#pragma once

// ---- decode attention over the paged KV cache, reading the blocks in place ---------------------------
// per-thread scratch of attend (below): scores [G, L] and the L rows' offsets
struct AttendScratch {
  std::vector<float> scores;
  std::vector<int64_t> rows;
  std::vector<float> k, v;  // a quantized cache's rows of one part, dequantized
};

// out[0:8 NV] = sum_i p[i] * base[rows[i] + 0:8 NV] in NV registers (a running sum in memory was bound by
// its stores); prefetches the row pf rows ahead (pf = 0: none)
template <int NV>
inline void accumulate_rows(const float* base, const int64_t* rows, int64_t L, const float* p, float* out, int64_t pf) {
  __m256 a[NV];
  for (int v = 0; v < NV; ++v) a[v] = _mm256_setzero_ps();
  for (int64_t i = 0; i < L; ++i) {
    if (pf && i + pf < L)
      for (int o = 0; o < 8 * NV; o += 16) _mm_prefetch(reinterpret_cast<const char*>(base + rows[i + pf] + o), _MM_HINT_T0);
    const __m256 pi = _mm256_set1_ps(p[i]);
    const float* r = base + rows[i];
    for (int v = 0; v < NV; ++v) a[v] = _mm256_fmadd_ps(pi, _mm256_loadu_ps(r + 8 * v), a[v]);
  }
  for (int v = 0; v < NV; ++v) _mm256_storeu_ps(out + 8 * v, a[v]);
}

// the same for any n <= 64 columns: registers where n is a multiple of 8, else a scalar loop
inline void accumulate_rows(const float* base, const int64_t* rows, int64_t L, const float* p, int64_t n, float* out,
                            int64_t pf) {
  switch (n % 8 == 0 ? n / 8 : 0) {
    case 1: return accumulate_rows<1>(base, rows, L, p, out, pf);
    case 2: return accumulate_rows<2>(base, rows, L, p, out, pf);
    case 3: return accumulate_rows<3>(base, rows, L, p, out, pf);
    case 4: return accumulate_rows<4>(base, rows, L, p, out, pf);
    case 5: return accumulate_rows<5>(base, rows, L, p, out, pf);
    case 6: return accumulate_rows<6>(base, rows, L, p, out, pf);
    case 7: return accumulate_rows<7>(base, rows, L, p, out, pf);
    case 8: return accumulate_rows<8>(base, rows, L, p, out, pf);
    default:
      std::fill(out, out + n, 0.0f);
      for (int64_t i = 0; i < L; ++i)
        for (int64_t e = 0; e < n; ++e) out[e] += p[i] * base[rows[i] + e];
  }
}

// the dot products of q [D] (D a multiple of 8) with the 8 rows at base + rows[0..7], as 8 lanes: one
// reduction tree for all eight instead of a horizontal sum per row
inline __m256 dot8_rows(const float* q, const float* base, const int64_t* rows, int64_t D) {
  __m256 s[8];
  for (int r = 0; r < 8; ++r) s[r] = _mm256_setzero_ps();
  for (int64_t d = 0; d < D; d += 8) {
    const __m256 qv = _mm256_loadu_ps(q + d);
    for (int r = 0; r < 8; ++r) s[r] = _mm256_fmadd_ps(qv, _mm256_loadu_ps(base + rows[r] + d), s[r]);
  }
  // per 128 bits after two rounds: a = [r0 r1 r2 r3] (low half of D's lanes, then high), c = [r4 .. r7]
  const __m256 a = _mm256_hadd_ps(_mm256_hadd_ps(s[0], s[1]), _mm256_hadd_ps(s[2], s[3]));
  const __m256 c = _mm256_hadd_ps(_mm256_hadd_ps(s[4], s[5]), _mm256_hadd_ps(s[6], s[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(a, c, 0x20), _mm256_permute2f128_ps(a, c, 0x31));
}

// Attention for every token of a step, prefill or decode alike: query token t (q [T, H, D]) attends to
// the first ctx_lens[t] cached tokens of its sequence, found through block_tables[seq_of[t]]; its own
// K/V are in the cache already. No gathered copy of the context. Query heads sharing a KV head
// (grouped-query attention) are handled together so each key and value is read once per group.
//
// Batch invariance: a token's output is a function of its query and its context only. The context is
// cut into parts of PART tokens at fixed offsets (0, PART, 2 PART, ...), each part reduced the same way,
// and the parts merged in order by their maxima and sums (flash-decoding); how many tokens share the
// step, whether this token came in a prefill chunk or as a decode, and how the parts are spread over
// threads change nothing. One long sequence still spreads over the threads through its parts.
// A sliding window (Mistral, Gemma 2, Phi-3) starts token t's context at ctx_lens[t] - window: the parts
// keep their fixed offsets, the first one cut at that start. A soft cap (Gemma 2) turns each score s into
// cap * tanh(s / cap) before the softmax.
constexpr int64_t PART = 256;

// fp8 e4m3 (finite, NaN at 0x7f/0xff) to float, exactly as torch converts it: 256 entries, built once
const std::array<float, 256> kE4M3 = [] {
  std::array<float, 256> t{};
  for (int b = 0; b < 256; ++b) {
    const int e = (b >> 3) & 15, m = b & 7;
    float v = e == 0 ? std::ldexp(static_cast<float>(m), -9) : std::ldexp(1.0f + m / 8.0f, e - 7);
    if (e == 15 && m == 7) v = std::numeric_limits<float>::quiet_NaN();
    t[b] = (b & 128) ? -v : v;
  }
  return t;
}();

// A quantized cache (--kv-cache-dtype int8|fp8): 1-byte values [blocks, block_size, Hkv, D] and one float32
// scale per token and KV head [blocks, block_size, Hkv]. Rows are dequantized as value * scale, the one
// float multiply attention.py's dequantize_kv does, so the kernel sees the values the torch path would.
struct QuantizedCache {
  const uint8_t* values = nullptr;  // int8 or e4m3 bits
  const float* scales = nullptr;
  bool fp8 = false;
  inline void row(int64_t slot_row, int64_t scale_idx, int64_t D, float* out) const {
    const uint8_t* v = values + slot_row;
    const float s = scales[scale_idx];
    if (fp8)
      for (int64_t e = 0; e < D; ++e) out[e] = kE4M3[v[e]] * s;
    else
      for (int64_t e = 0; e < D; ++e) out[e] = static_cast<float>(static_cast<int8_t>(v[e])) * s;
  }
};

at::Tensor paged_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                           const at::Tensor& block_tables, const at::Tensor& seq_of, const at::Tensor& ctx_lens,
                           double scale, const std::optional<at::Tensor>& k_scale = std::nullopt,
                           const std::optional<at::Tensor>& v_scale = std::nullopt, int64_t window = 0,
                           double softcap = 0.0) {
  TORCH_CHECK(q.device().is_cpu() && q.scalar_type() == at::kFloat && q.dim() == 3 && q.stride(2) == 1 &&
                  q.stride(1) == q.size(2),
              "tokenmill::paged_attention: q must be float32 [T, H, D] with contiguous heads");
  const bool quantized = k_scale.has_value();
  TORCH_CHECK(quantized == v_scale.has_value(), "tokenmill::paged_attention: give both k_scale and v_scale, or neither");
  const auto store = k_cache.scalar_type();
  TORCH_CHECK(quantized ? (store == at::kChar || store == at::kByte) : store == at::kFloat,
              "tokenmill::paged_attention: caches must be float32, or int8/uint8 (fp8 e4m3 bits) with scales");
  TORCH_CHECK(v_cache.scalar_type() == store && k_cache.dim() == 4 && k_cache.is_contiguous() &&
                  v_cache.is_contiguous() && k_cache.sizes() == v_cache.sizes(),
              "tokenmill::paged_attention: caches must be contiguous [blocks, block_size, Hkv, D] of one dtype");
  QuantizedCache kq, vq;
  if (quantized) {
    for (const at::Tensor* sc : {&*k_scale, &*v_scale})
      TORCH_CHECK(sc->scalar_type() == at::kFloat && sc->is_contiguous() &&
                      sc->numel() * k_cache.size(3) == k_cache.numel(),
                  "tokenmill::paged_attention: scales must be contiguous float32 [blocks, block_size, Hkv]");
    kq = {static_cast<const uint8_t*>(k_cache.data_ptr()), k_scale->data_ptr<float>(), store == at::kByte};
    vq = {static_cast<const uint8_t*>(v_cache.data_ptr()), v_scale->data_ptr<float>(), store == at::kByte};
  }
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && block_tables.is_contiguous() && block_tables.dim() == 2 &&
                  seq_of.scalar_type() == at::kLong && seq_of.is_contiguous() &&
                  ctx_lens.scalar_type() == at::kLong && ctx_lens.is_contiguous() &&
                  seq_of.numel() == q.size(0) && ctx_lens.numel() == q.size(0),
              "tokenmill::paged_attention: block_tables [S, W], seq_of [T] and ctx_lens [T] must be contiguous int64");
  const int64_t T = q.size(0), H = q.size(1), D = q.size(2), ldq = q.stride(0);
  const int64_t NB = k_cache.size(0), BS = k_cache.size(1), HKV = k_cache.size(2);
  TORCH_CHECK(k_cache.size(3) == D && H % HKV == 0, "tokenmill::paged_attention: head layout mismatch");
  const int64_t G = H / HKV, S = block_tables.size(0), W = block_tables.size(1);
  const float* qp = q.data_ptr<float>();
  const float* kp_float = quantized ? nullptr : k_cache.data_ptr<float>();
  const float* vp_float = quantized ? nullptr : v_cache.data_ptr<float>();
  const int64_t* tp = block_tables.data_ptr<int64_t>();
  const int64_t* sp = seq_of.data_ptr<int64_t>();
  const int64_t* lp = ctx_lens.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t) {
    TORCH_CHECK(sp[t] >= 0 && sp[t] < S, "tokenmill::paged_attention: token ", t, " names block-table row ", sp[t],
                " of ", S);
    TORCH_CHECK(lp[t] >= 1 && lp[t] <= W * BS, "tokenmill::paged_attention: context length ", lp[t],
                " does not fit the block table of ", W, " blocks");
  }
  auto out = at::empty({T, H, D}, q.options());
  float* op = out.data_ptr<float>();
  if (T == 0) return out;
  TORCH_CHECK(window >= 0 && softcap >= 0, "tokenmill::paged_attention: window and softcap must be >= 0");
  const float sc = static_cast<float>(scale), cap = static_cast<float>(softcap);
  // The G query heads of KV head hk over context tokens [j0, j1) of token t: acc = sum_j e_j v_j (not yet
  // divided), mx = max score, sum = sum_j e_j, with e_j = exp(score_j - mx). s: the scratch of one thread.
  // The cached rows come from DRAM (a decode step streams ~100 MB of weights between two visits to a
  // layer's KV), strided by Hkv * D floats: each row is prefetched PF_ROWS tokens ahead, as the hardware
  // prefetcher does not follow the block table.
  constexpr int64_t PF_ROWS = 16;
  const int64_t row_floats = HKV * D;
  auto attend = [&](int64_t t, int64_t hk, int64_t j0, int64_t j1, AttendScratch& s, float* acc, float* mx,
                    float* sum) {
    const int64_t L = j1 - j0, b = sp[t];
    s.scores.assign(G * L, 0.0f);
    s.rows.resize(L);
    int64_t* rows = s.rows.data();  // float offset of context token j0 + i's row for this head, in either cache
    for (int64_t i = 0; i < L; ++i) {
      const int64_t j = j0 + i, blk = tp[b * W + j / BS];
      TORCH_CHECK(blk >= 0 && blk < NB, "tokenmill::paged_attention: block id ", blk, " out of range");
      rows[i] = (blk * BS + j % BS) * row_floats + hk * D;
    }
    const float* kp = kp_float;
    const float* vp = vp_float;
    if (quantized) {  // the part's rows dequantized into scratch; everything below then reads floats alike
      s.k.resize(L * D), s.v.resize(L * D);
      for (int64_t i = 0; i < L; ++i) {
        const int64_t scale_idx = rows[i] / D;  // (slot * Hkv + hk): one scale per token and KV head
        kq.row(rows[i], scale_idx, D, s.k.data() + i * D);
        vq.row(rows[i], scale_idx, D, s.v.data() + i * D);
        rows[i] = i * D;
      }
      kp = s.k.data(), vp = s.v.data();
    }
    auto prefetch_row = [&](const float* base, int64_t i) {
      if (i < L)
        for (int64_t o = 0; o < D; o += 16) _mm_prefetch(reinterpret_cast<const char*>(base + rows[i] + o), _MM_HINT_T0);
    };
    for (int64_t i = 0; i < std::min(L, PF_ROWS); ++i) prefetch_row(kp, i), prefetch_row(vp, i);
    const float* qh = qp + t * ldq + hk * G * D;  // the G query heads of this KV head are adjacent
    float* scores = s.scores.data();
    int64_t i = 0;
    if (D % 8 == 0)
      for (; i + 8 <= L; i += 8) {
        for (int64_t r = 0; r < 8; ++r) prefetch_row(kp, i + r + PF_ROWS);
        for (int64_t g = 0; g < G; ++g)
          _mm256_storeu_ps(scores + g * L + i, _mm256_mul_ps(dot8_rows(qh + g * D, kp, rows + i, D), _mm256_set1_ps(sc)));
      }
    for (; i < L; ++i) {
      prefetch_row(kp, i + PF_ROWS);
      const float* kj = kp + rows[i];
      for (int64_t g = 0; g < G; ++g) scores[g * L + i] = dot_f32(qh + g * D, kj, D) * sc;
    }
    if (cap > 0)
      for (int64_t e = 0; e < G * L; ++e) scores[e] = cap * std::tanh(scores[e] / cap);
    for (int64_t g = 0; g < G; ++g) {
      float* sg = scores + g * L;
      const float m = *std::max_element(sg, sg + L);
      __m256 vsum = _mm256_setzero_ps();
      int64_t j = 0;
      for (; j + 8 <= L; j += 8) {
        const __m256 e = exp256(_mm256_sub_ps(_mm256_loadu_ps(sg + j), _mm256_set1_ps(m)));
        _mm256_storeu_ps(sg + j, e);
        vsum = _mm256_add_ps(vsum, e);
      }
      float total = hsum(vsum);
      for (; j < L; ++j) {
        sg[j] = std::exp(sg[j] - m);
        total += sg[j];
      }
      mx[g] = m;
      sum[g] = total;
    }
    // acc_g = sum_i e_gi v_i, 64 columns at a time in registers (a running sum in memory was bound by
    // its stores); the first head's pass over the rows also prefetches the rows ahead
    for (int64_t g = 0; g < G; ++g)
      for (int64_t d0 = 0; d0 < D; d0 += 64)
        accumulate_rows(vp + d0, rows, L, scores + g * L, std::min<int64_t>(64, D - d0), acc + g * D + d0,
                        g == 0 ? PF_ROWS : 0);
  };
  // The parts' results, merged in order: o = sum_p w_p acc_p / sum_p w_p sum_p, w_p = exp(mx_p - max).
  // With one part w = 1 exactly, so this is acc / sum.
  auto merge = [&](int64_t t, int64_t hk, int64_t P, const float* acc, const float* mx, const float* sum) {
    for (int64_t g = 0; g < G; ++g) {
      float m = -std::numeric_limits<float>::infinity();
      for (int64_t p = 0; p < P; ++p) m = std::max(m, mx[p * G + g]);
      float total = 0.0f;
      float* o = op + (t * H + hk * G + g) * D;
      std::fill(o, o + D, 0.0f);
      for (int64_t p = 0; p < P; ++p) {
        const float w = std::exp(mx[p * G + g] - m);
        total += w * sum[p * G + g];
        const float* a = acc + (p * G + g) * D;
        for (int64_t e = 0; e < D; ++e) o[e] += w * a[e];
      }
      const float inv = 1.0f / total;
      for (int64_t e = 0; e < D; ++e) o[e] *= inv;
    }
  };
  // token t's context is [first_pos(t), lp[t]); its parts are the PART-aligned pieces of that range
  auto first_pos = [&](int64_t t) { return window > 0 ? std::max<int64_t>(0, lp[t] - window) : int64_t{0}; };
  auto parts_of = [&](int64_t t) { return (lp[t] + PART - 1) / PART - first_pos(t) / PART; };
  auto part_range = [&](int64_t t, int64_t part) {  // [j0, j1) of the part-th part of token t's context
    const int64_t p = first_pos(t) / PART + part;
    return std::make_pair(std::max(first_pos(t), p * PART), std::min(lp[t], (p + 1) * PART));
  };
  const int64_t items = T * HKV, threads = at::get_num_threads();
  if (items >= 2 * threads) {  // enough (token, KV head) pairs: each thread takes whole pairs
    at::parallel_for(0, items, 1, [&](int64_t i0, int64_t i1) {
      AttendScratch scratch;
      std::vector<float> acc, mx, sum;
      for (int64_t i = i0; i < i1; ++i) {
        const int64_t t = i / HKV, hk = i % HKV, P = parts_of(t);
        acc.resize(P * G * D), mx.resize(P * G), sum.resize(P * G);
        for (int64_t p = 0; p < P; ++p) {
          const auto [j0, j1] = part_range(t, p);
          attend(t, hk, j0, j1, scratch, acc.data() + p * G * D, mx.data() + p * G, sum.data() + p * G);
        }
        merge(t, hk, P, acc.data(), mx.data(), sum.data());
      }
    });
    return out;
  }
  // Few pairs (a decode step of one or two sequences): the parts themselves go to the threads.
  std::vector<int64_t> first(items + 1, 0);  // pair i's parts are [first[i], first[i + 1])
  for (int64_t i = 0; i < items; ++i) first[i + 1] = first[i] + parts_of(i / HKV);
  const int64_t total_parts = first[items];
  std::vector<float> acc(total_parts * G * D), mx(total_parts * G), sum(total_parts * G);
  at::parallel_for(0, total_parts, 1, [&](int64_t p0, int64_t p1) {
    AttendScratch scratch;
    for (int64_t p = p0; p < p1; ++p) {
      const int64_t i = std::upper_bound(first.begin(), first.end(), p) - first.begin() - 1;
      const int64_t t = i / HKV, hk = i % HKV, part = p - first[i];
      const auto [j0, j1] = part_range(t, part);
      attend(t, hk, j0, j1, scratch, acc.data() + p * G * D, mx.data() + p * G, sum.data() + p * G);
    }
  });
  for (int64_t i = 0; i < items; ++i)
    merge(i / HKV, i % HKV, first[i + 1] - first[i], acc.data() + first[i] * G * D, mx.data() + first[i] * G,
          sum.data() + first[i] * G);
  return out;
}
