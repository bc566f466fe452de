// A decoder layer's two halves, and every layer of a step in one call.
// Included by cpu_kernels.cpp inside its namespace, after the files before it there.
#pragma once

// ---- every decoder layer of a step, in one call ---------------------------------------------------
// At a few tokens a step a decoder layer is about twenty small ops, and dispatching them from Python
// costs more than their arithmetic. This runs all layers of a float32-cache step (decodes, prefill
// chunks, or both) with the kernels above, called directly, in the order of the Python path
// (models/llama.py with fused ops on), so the two give the same bits.
// weights: 8 per layer: input norm, qkv (kernel layout), qkv bias (empty: none), o_proj, v (empty: v is in
// qkv), post-attention norm, gate_up, down_proj; fmts: 5 per layer (qkv, o_proj, v, gate_up, down_proj).
int64_t rows_of(const at::Tensor& w, int64_t K, int64_t fmt) {
  check_format(K, fmt, "forward_layers");
  return is_x8(fmt) ? w.numel() / matrix_bytes(fmt, 8, K / QK) * 8 : w.numel() / row_bytes_of(fmt, K / QK);
}

// One decoder layer's two halves, the only definition of the layer the kernels have: forward_layers runs
// them for every layer in one call, and a tensor-parallel rank calls them one at a time (attention_half,
// mlp_half) with the all-reduce of each half's row-parallel output between them.
//
// attention half: out (+)= o_proj(attention(rope(qkv(rms_norm(x))))), the new tokens' K and V into their
// cache slots. w: norm, qkv, qkv bias (empty: none), o_proj, v; f: the formats of qkv, o_proj and v. Where a
// file holds q/k and v in formats no one format holds exactly (llama.cpp's Q4_K_M: Q4_K q/k, Q6_K v), w[1] is
// q and k and w[4] v, each on its own blocks, side by side; else w[4] is empty.
// mlp half: out (+)= down(silu(gate) * up(rms_norm(x))). w: norm, gate_up, down; f: their formats.
// accumulate: out is the residual stream (x itself), added to in place; else out is written.
struct LayerArgs {
  const at::Tensor& cos;
  const at::Tensor& sin;
  const at::Tensor& slot_mapping;
  const at::Tensor& block_tables;
  const at::Tensor& seq_of;
  const at::Tensor& ctx_lens;
  int64_t H, HKV, D;
  double eps, scale;
};

void project_into(const at::Tensor& in, const at::Tensor& w, int64_t fmt, at::Tensor& out, bool accumulate,
                  ActivationBuffers& buf, const char* what) {
  check_blocks(w, out.size(1), in.size(1), fmt, what);
  qlinear_into(in, w, out.size(1), fmt, out, accumulate, buf);
}

at::Tensor project_new(const at::Tensor& in, const at::Tensor& w, int64_t fmt, ActivationBuffers& buf,
                       const char* what) {
  const int64_t n_out = rows_of(w, in.size(1), fmt);
  at::Tensor out = at::empty({in.size(0), n_out}, in.options());
  project_into(in, w, fmt, out, false, buf, what);
  return out;
}

void attention_half_into(const at::Tensor& x, const at::Tensor* w, const int64_t* f, const at::Tensor& kc,
                         const at::Tensor& vc, const LayerArgs& a, at::Tensor& out, bool accumulate,
                         ActivationBuffers& buf, const char* what) {
  const int64_t T = x.size(0), H = a.H, HKV = a.HKV, D = a.D;
  TORCH_CHECK(kc.scalar_type() == at::kFloat && vc.scalar_type() == at::kFloat && kc.is_contiguous() &&
                  vc.is_contiguous() && kc.dim() == 4 && kc.size(2) == HKV && kc.size(3) == D,
              "tokenmill::", what, ": caches must be contiguous float32 [blocks, block_size, Hkv, D]");
  TORCH_CHECK(a.slot_mapping.scalar_type() == at::kLong && a.slot_mapping.is_contiguous() &&
                  a.slot_mapping.numel() == T,
              "tokenmill::", what, ": slot_mapping must be contiguous int64 [T]");
  const int64_t num_slots = kc.size(0) * kc.size(1), row = HKV * D;
  const int64_t* slots = a.slot_mapping.data_ptr<int64_t>();
  at::Tensor h = rms_norm(x, w[0], a.eps);
  at::Tensor qkv = project_new(h, w[1], f[0], buf, what);
  if (w[4].numel() > 0) qkv = at::cat({qkv, project_new(h, w[4], f[2], buf, what)}, 1);
  if (w[2].numel() > 0) qkv = qkv + w[2];
  TORCH_CHECK(qkv.size(1) == (H + 2 * HKV) * D, "tokenmill::", what, ": qkv width does not match the heads");
  rope_(qkv, a.cos, a.sin, H + HKV, D);
  const float* qp = qkv.data_ptr<float>();
  float* kp = kc.data_ptr<float>();
  float* vp = vc.data_ptr<float>();
  const int64_t ld = qkv.stride(0);
  for (int64_t t = 0; t < T; ++t) {  // the new token's K and V into its cache slot
    TORCH_CHECK(slots[t] >= 0 && slots[t] < num_slots, "tokenmill::", what, ": slot ", slots[t],
                " outside the cache");
    std::memcpy(kp + slots[t] * row, qp + t * ld + H * D, row * sizeof(float));
    std::memcpy(vp + slots[t] * row, qp + t * ld + (H + HKV) * D, row * sizeof(float));
  }
  at::Tensor q = qkv.narrow(1, 0, H * D).view({T, H, D});
  at::Tensor o = paged_attention(q, kc, vc, a.block_tables, a.seq_of, a.ctx_lens, a.scale).view({T, H * D});
  project_into(o, w[3], f[1], out, accumulate, buf, what);
}

void mlp_half_into(const at::Tensor& x, const at::Tensor* w, const int64_t* f, double eps, at::Tensor& out,
                   bool accumulate, ActivationBuffers& buf, const char* what) {
  at::Tensor h = rms_norm(x, w[0], eps);
  at::Tensor act = silu_mul(project_new(h, w[1], f[0], buf, what));
  project_into(act, w[2], f[1], out, accumulate, buf, what);
}

at::Tensor forward_layers(const at::Tensor& x_in, at::TensorList weights, at::IntArrayRef fmts,
                          at::TensorList k_caches, at::TensorList v_caches, const at::Tensor& cos, const at::Tensor& sin,
                          const at::Tensor& slot_mapping, const at::Tensor& block_tables, const at::Tensor& seq_of,
                          const at::Tensor& ctx_lens, int64_t n_heads, int64_t n_kv_heads, int64_t head_dim, double eps,
                          double scale) {
  check_f32_rows(x_in, "forward_layers");
  const int64_t L = static_cast<int64_t>(k_caches.size());
  TORCH_CHECK(static_cast<int64_t>(weights.size()) == 8 * L && static_cast<int64_t>(fmts.size()) == 5 * L &&
                  static_cast<int64_t>(v_caches.size()) == L,
              "tokenmill::forward_layers: need 8 weights, 5 formats and a K and V cache per layer");
  const LayerArgs args{cos, sin, slot_mapping, block_tables, seq_of, ctx_lens, n_heads, n_kv_heads, head_dim, eps, scale};
  at::Tensor x = x_in.clone();  // the residual stream, updated in place by the o_proj and down_proj GEMMs
  ActivationBuffers buf;
  for (int64_t l = 0; l < L; ++l) {
    const at::Tensor* w = weights.data() + 8 * l;
    const int64_t* f = fmts.data() + 5 * l;
    attention_half_into(x, w, f, k_caches[l], v_caches[l], args, x, true, buf, "forward_layers");
    mlp_half_into(x, w + 5, f + 3, eps, x, true, buf, "forward_layers");
  }
  return x;
}

// One layer's attention half alone: its o_proj output [T, hidden] (a tensor-parallel rank's partial sum),
// not added to x. weights: norm, qkv, qkv bias (empty: none), o_proj, v (empty: in qkv); fmts: qkv's, o_proj's, v's.
at::Tensor attention_half(const at::Tensor& x, at::TensorList weights, at::IntArrayRef fmts, const at::Tensor& k_cache,
                          const at::Tensor& v_cache, const at::Tensor& cos, const at::Tensor& sin,
                          const at::Tensor& slot_mapping, const at::Tensor& block_tables, const at::Tensor& seq_of,
                          const at::Tensor& ctx_lens, int64_t n_heads, int64_t n_kv_heads, int64_t head_dim, double eps,
                          double scale) {
  check_f32_rows(x, "attention_half");
  TORCH_CHECK(weights.size() == 5 && fmts.size() == 3, "tokenmill::attention_half: need 5 weights and 3 formats");
  const LayerArgs args{cos, sin, slot_mapping, block_tables, seq_of, ctx_lens, n_heads, n_kv_heads, head_dim, eps, scale};
  thread_local ActivationBuffers buf;  // (reused across layers, as forward_layers does)
  at::Tensor out = at::empty({x.size(0), x.size(1)}, x.options());
  attention_half_into(x, weights.data(), fmts.data(), k_cache, v_cache, args, out, false, buf, "attention_half");
  return out;
}

// One layer's MLP half alone: its down_proj output [T, hidden], not added to x. weights: norm, gate_up, down.
at::Tensor mlp_half(const at::Tensor& x, at::TensorList weights, at::IntArrayRef fmts, double eps) {
  check_f32_rows(x, "mlp_half");
  TORCH_CHECK(weights.size() == 3 && fmts.size() == 2, "tokenmill::mlp_half: need 3 weights and 2 formats");
  thread_local ActivationBuffers buf;
  at::Tensor out = at::empty({x.size(0), x.size(1)}, x.options());
  mlp_half_into(x, weights.data(), fmts.data(), eps, out, false, buf, "mlp_half");
  return out;
}
