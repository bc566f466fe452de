// qlinear over every format: argument checks, the activation scratch, the table of GEMMs.
// Included by cpu_kernels.cpp inside its namespace, after the files before it there.
#pragma once

constexpr int64_t matrix_bytes(int64_t f, int64_t n, int64_t nb) {
  return is_x8(f) ? n / 8 * (nb / 8) * x8_bytes(f) : n * row_bytes_of(f, nb);
}

void check_format(int64_t K, int64_t fmt, const char* op) {
  TORCH_CHECK(fmt >= 0 && fmt < NUM_FORMATS_X8, "tokenmill::", op,
              ": format must be 0 (Q8_0), 1 (Q4_1), 2 (Q5_0), 3 (Q4_K), 4 (Q5_K), 5 (Q6_K), 6 (Q4_K in panels of 8 rows), "
              "7 (Q6_K in panels), 8 (Q4_1 in panels) or 9 (Q5_K in panels), got ", fmt);
  const int64_t unit = is_super(fmt) ? 8 * QK : QK;  // the panel formats included: groups of 256
  TORCH_CHECK(K % unit == 0, "tokenmill::", op, ": in_features must be a multiple of ", unit, " for this format, got ", K);
}

void check_blocks(const at::Tensor& w, int64_t n_out, int64_t K, int64_t fmt, const char* op) {
  TORCH_CHECK(w.device().is_cpu() && w.scalar_type() == at::kByte && w.is_contiguous(), "tokenmill::", op,
              " takes contiguous uint8 blocks on the CPU (QuantizedTensor.kernel_layout())");
  check_format(K, fmt, op);
  TORCH_CHECK(!is_x8(fmt) || n_out % 8 == 0, "tokenmill::", op, ": a matrix in panels of 8 rows needs out_features a "
              "multiple of 8, got ", n_out);
  const int64_t bytes = matrix_bytes(fmt, n_out, K / QK);
  TORCH_CHECK(w.numel() == bytes, "tokenmill::", op, ": weight holds ", w.numel(), " bytes, expected ", bytes,
              " for [", n_out, ", ", K, "]");
}

// The quantized activations of one GEMM input: scratch that forward_layers reuses across its GEMMs.
struct ActivationBuffers {
  at::Tensor q, d, s, h, l, s16;  // h, l, s16: their split for the panel formats (panels_x8.h)
  bool int8 = false;              // q holds int8 steps (256 q8): l is all zeros
  void fit(int64_t M, int64_t K, int64_t ld, const at::TensorOptions& opt) {
    if (!q.defined() || q.numel() < M * K) {
      q = at::empty({M * K}, opt.dtype(at::kShort));
      h = at::empty({M * K}, opt.dtype(at::kChar));
      l = at::empty({M * K}, opt.dtype(at::kByte));
      s16 = at::empty({M * K / 16}, opt.dtype(at::kInt));
    }
    if (!d.defined() || d.numel() < M * ld) {
      d = at::empty({M * ld}, opt.dtype(at::kFloat));
      s = at::empty({M * ld}, opt.dtype(at::kFloat));
    }
  }
};

// The GEMM of each format, a table instead of a switch in every caller (as ggml's type_traits_cpu): y (+)= x . W^T
// on quantized activations (xq, xd, xs with row stride ld), the panel formats also on their byte split (buf).
using GemmFn = void (*)(const uint8_t* W, int64_t N, int64_t K, const int16_t* xq, const float* xd, const float* xs,
                        int64_t ld, int64_t M, float* y, bool accumulate, ActivationBuffers& buf);
template <int F>
void gemm_of(const uint8_t* W, int64_t N, int64_t K, const int16_t* xq, const float* xd, const float* xs, int64_t ld,
             int64_t M, float* y, bool accumulate, ActivationBuffers& buf) {
  if constexpr (is_x8(F))
    gemm_x8<F>(W, N, K, xq, xd, xs, ld, M, y, accumulate, buf.h.data_ptr<int8_t>(), buf.l.data_ptr<uint8_t>(),
               buf.s16.data_ptr<int32_t>(), buf.int8);
  else
    gemm<F>(W, N, K, xq, xd, xs, ld, M, y, accumulate);
}
constexpr GemmFn kGemm[NUM_FORMATS_X8] = {gemm_of<Q8_0>, gemm_of<Q4_1>,    gemm_of<Q5_0>,    gemm_of<Q4_K>,
                                          gemm_of<Q5_K>, gemm_of<Q6_K>,    gemm_of<Q4_K_X8>, gemm_of<Q6_K_X8>,
                                          gemm_of<Q4_1_X8>, gemm_of<Q5_K_X8>};
static_assert(Q5_K_X8 == NUM_FORMATS_X8 - 1, "kGemm lists every format in id order");

// y[M, n_out] (=, or += with accumulate) x[M, K] . W^T; x contiguous float32 rows
void qlinear_into(const at::Tensor& x, const at::Tensor& w, int64_t n_out, int64_t fmt, at::Tensor& y, bool accumulate,
                  ActivationBuffers& buf) {
  const int64_t M = x.size(0), K = x.size(1);
  if (M == 0) return;
  const int64_t nb = K / QK, ld = round8(nb);
  buf.fit(M, K, ld, x.options());
  int16_t* q = buf.q.data_ptr<int16_t>();
  float* d = buf.d.data_ptr<float>();
  float* s = buf.s.data_ptr<float>();
  buf.int8 = g_int8_activations.load(std::memory_order_relaxed);
  quantize_rows16(x.data_ptr<float>(), M, K, q, d, s, ld, buf.int8);
  const uint8_t* wp = w.data_ptr<uint8_t>();
  float* yp = y.data_ptr<float>();
  kGemm[fmt](wp, n_out, K, q, d, s, ld, M, yp, accumulate, buf);  // fmt checked by the callers (check_blocks)
}



// fmt: a FORMAT_IDS value (see the top); w in the kernel layout
at::Tensor qlinear(const at::Tensor& x, const at::Tensor& w, int64_t n_out, int64_t fmt) {
  TORCH_CHECK(x.device().is_cpu(), "tokenmill::qlinear runs on the CPU");
  TORCH_CHECK(x.scalar_type() == at::kFloat, "tokenmill::qlinear takes float32 activations");
  const int64_t K = x.size(-1);
  check_blocks(w, n_out, K, fmt, "qlinear");
  auto xc = x.reshape({-1, K}).contiguous();
  auto out_shape = x.sizes().vec();
  out_shape.back() = n_out;
  auto y = at::empty({xc.size(0), n_out}, x.options());
  ActivationBuffers buf;
  qlinear_into(xc, w, n_out, fmt, y, false, buf);
  return y.view(out_shape);
}

// Quantize activations only (for tests: the reference must round exactly like the kernel): (q int16, d, d * sum(q)).
std::vector<at::Tensor> quantize_activations(const at::Tensor& x) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 2 && x.size(1) % QK == 0,
              "tokenmill::quantize_activations takes float32 [M, K] with K a multiple of 32");
  auto xc = x.contiguous();
  const int64_t M = xc.size(0), K = xc.size(1), nb = K / QK;
  auto d = at::empty({M, nb}, x.options());
  auto s = at::empty({M, nb}, x.options());
  auto q = at::empty({M, K}, x.options().dtype(at::kShort));
  quantize_rows16(xc.data_ptr<float>(), M, K, q.data_ptr<int16_t>(), d.data_ptr<float>(), s.data_ptr<float>(), nb,
                  g_int8_activations.load(std::memory_order_relaxed));
  return {q, d, s};
}
