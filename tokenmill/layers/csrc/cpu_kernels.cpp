// tokenmill CPU kernels (x86-64 AVX2 + FMA + F16C), registered as torch.ops.tokenmill.*.
//
// Quantized linear layers hold GGUF's block formats (weights along K in blocks of 32; the K-quants in
// super-blocks of 256 = 8 blocks of 32), with the format ids of quant.py's FORMAT_IDS:
//   0 Q8_0: fp16 d, int8 q[32]                             34 bytes, w = d * q
//   1 Q4_1: fp16 d, fp16 m, 16 bytes of nibbles            20 bytes, w = d * q + m, q in [0, 15];
//           weight j of the block is the low nibble of byte j, weight j + 16 its high nibble.
//   2 Q5_0: fp16 d, 4 bytes qh, 16 bytes of nibbles        22 bytes, w = d * (q - 16), q in [0, 31]: the
//           nibbles as Q4_1's, bit j of qh (little-endian uint32) the fifth bit of weight j.
//   3 Q4_K: per 256: fp16 d, fp16 dmin, 12 bytes of 6-bit scales sc[8] and mins m[8], 128 bytes of
//           nibbles                                       144 bytes, block j: w = d sc_j q - dmin m_j;
//           block j's weights are nibble j % 2 of bytes 32 (j / 2) .. 32 (j / 2) + 31.
//   4 Q5_K: Q4_K with 32 bytes qh after the scales        176 bytes, bit j of qh[l]: fifth bit of block j's weight l
//   5 Q6_K: per 256: ql[128], qh[64], int8 sc[16], fp16 d 210 bytes, w = d sc_i (q - 32) per 16 weights
//           (i = weight / 16), q: 4 bits from ql and 2 from qh (gguf's Q6_K layout, see unpack_block).
//   6-9: Q4_K, Q6_K, Q4_1 and Q5_K in panels of 8 rows (panels_x8.h; layers/panels.py), where rows are a
//           multiple of 8 and K of 256: the fastest GEMV and the same bits.
// The kernels take them in a kernel layout (quant.py's QuantizedTensor.kernel_layout(); the same
// bytes, reordered within each row) so that eight block scales load in one instruction:
//   Q8_0 row: fp16 d[nb] | int8 q[nb][32]
//   Q4_1 row: fp16 d[nb] | fp16 m[nb] | nibbles[nb][16]
//   Q5_0 row: fp16 d[nb] | (qh[4], nibbles[16])[nb]
//   K-quant rows: the super-blocks as they are (a super-block's header holds its eight blocks' scales).
// Activations are quantized per token and per block of 32 to int16 with one float scale (32767 steps:
// the weights' rounding is then all the error there is), so every dot product runs on integer
// multiply-adds (vpmaddwd on weights widened to int16) and is scaled once per block.
// TOKENMILL_ACTIVATIONS=int8 (activation_precision("int8")) takes 127 steps per block instead, held in the
// same int16 (256 q8): llama.cpp's precision, half the products in the panel formats; still batch invariant.
//
// Batch invariance: every op here computes a token's result from that token's inputs alone, in an
// order that does not depend on how many tokens share the call, how they are tiled or how threads
// split the work. A request's output is then the same bits alone or batched, prefilled in one chunk
// or many, or with its prefix from the cache.
//
// Built and loaded by tokenmill/layers/kernels.py; tokenmill/layers/quant.py holds the pure-torch
// reference of every op here (the tests compare the two).
//
// One translation unit, its parts included below in this order, a concern each:
//   common.h        the formats' ids and sizes, small helpers
//   activations.h   activations to int16 per token and block of 32
//   gemm_rows.h     the integer GEMM on the row layout, AVX2 (unpacking, scales, tiles)
//   gemm_vnni.h     the same on AVX512-VNNI for many tokens (panels of 16 rows widened once)
//   gemm.h          which of the two runs, threads and prefetch
//   panels_x8.h     Q4_K, Q6_K, Q4_1, Q5_K in panels of 8 rows (+ panels_x8_body.inc, compiled per ISA), to_panels
//   linear.h        qlinear: checks, activation scratch, the table of GEMMs by format
//   flinear.h       float32 linear layers in one summation order
//   elementwise.h   RMSNorm, RoPE, SwiGLU
//   attention.h     paged attention reading the KV blocks in place
//   layer.h         a decoder layer's halves, and every layer of a step in one call
// and here: the instruction-set switches and the op registrations.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <immintrin.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <optional>
#include <string>
#include <type_traits>
#include <vector>

namespace {

#include "common.h"
#include "activations.h"
#include "gemm_rows.h"
#include "gemm_vnni.h"
#include "gemm.h"
#include "panels_x8.h"
#include "linear.h"
#include "flinear.h"
#include "elementwise.h"
#include "attention.h"
#include "layer.h"

// The many-token GEMM's instruction set: "" reports it, "avx2" or "avx512vnni" selects it (for tests and
// benchmarks; the results are the same bits).
std::string kernel_isa(std::string name) {
  if (name == "avx2") g_use_vnni.store(false);
  else if (name == "avx512vnni") {
    TORCH_CHECK(cpu_has_vnni(), "tokenmill::kernel_isa: this CPU lacks AVX512-VNNI (avx512f/bw/vl/vnni)");
    g_use_vnni.store(true);
  } else TORCH_CHECK(name.empty(), "tokenmill::kernel_isa: name must be '', 'avx2' or 'avx512vnni', got '", name, "'");
  return g_use_vnni.load() ? "avx512vnni" : "avx2";
}

// The fewest tokens the many-token GEMM takes VNNI for: n > 0 sets it, 0 reports it.
int64_t vnni_min_tokens(int64_t n) {
  TORCH_CHECK(n >= 0, "tokenmill::vnni_min_tokens: n must be >= 0, got ", n);
  if (n > 0) g_vnni_min_tokens.store(n);
  return g_vnni_min_tokens.load();
}

// The activations' precision: "" reports it, "int16" (the default) or "int8" selects it for the GEMMs that
// follow (process-wide, like TOKENMILL_ACTIVATIONS; layers/kernels.py's set_activation_precision).
std::string activation_precision(std::string name) {
  if (name == "int8") g_int8_activations.store(true);
  else if (name == "int16") g_int8_activations.store(false);
  else TORCH_CHECK(name.empty(), "tokenmill::activation_precision: name must be '', 'int16' or 'int8', got '", name, "'");
  return g_int8_activations.load() ? "int8" : "int16";
}

}  // namespace

TORCH_LIBRARY(tokenmill, m) {
  m.def("kernel_isa(str name) -> str", &kernel_isa);
  m.def("activation_precision(str name) -> str", &activation_precision);
  m.def("vnni_min_tokens(int n) -> int", &vnni_min_tokens);
  m.def("qlinear(Tensor x, Tensor w, int n_out, int fmt) -> Tensor");
  m.def("flinear(Tensor x, Tensor w, int n_out, Tensor? bias=None) -> Tensor");
  m.def("quantize_activations(Tensor x) -> Tensor[]");
  m.def("rms_norm(Tensor x, Tensor w, float eps) -> Tensor");
  m.def("rope_(Tensor(a!) x, Tensor cos, Tensor sin, int n_heads, int head_dim) -> ()");
  m.def("silu_mul(Tensor gu) -> Tensor");
  m.def("paged_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, Tensor seq_of, "
        "Tensor ctx_lens, float scale, Tensor? k_scale=None, Tensor? v_scale=None, int window=0, "
        "float softcap=0.0) -> Tensor");
  m.def("forward_layers(Tensor x, Tensor[] weights, int[] fmts, Tensor[] k_caches, Tensor[] v_caches, Tensor cos, "
        "Tensor sin, Tensor slot_mapping, Tensor block_tables, Tensor seq_of, Tensor ctx_lens, int n_heads, "
        "int n_kv_heads, int head_dim, float eps, float scale) -> Tensor");
  m.def("attention_half(Tensor x, Tensor[] weights, int[] fmts, Tensor k_cache, Tensor v_cache, Tensor cos, "
        "Tensor sin, Tensor slot_mapping, Tensor block_tables, Tensor seq_of, Tensor ctx_lens, int n_heads, "
        "int n_kv_heads, int head_dim, float eps, float scale) -> Tensor");
  m.def("mlp_half(Tensor x, Tensor[] weights, int[] fmts, float eps) -> Tensor");
  m.def("to_panels(Tensor data, int fmt, int n, int k) -> Tensor");
  m.def("panel_rows(Tensor panels, int fmt, int k, Tensor ids) -> Tensor");
}

TORCH_LIBRARY_IMPL(tokenmill, CPU, m) {
  m.impl("qlinear", &qlinear);
  m.impl("flinear", &flinear);
  m.impl("quantize_activations", &quantize_activations);
  m.impl("rms_norm", &rms_norm);
  m.impl("rope_", &rope_);
  m.impl("silu_mul", &silu_mul);
  m.impl("paged_attention", &paged_attention);
  m.impl("forward_layers", &forward_layers);
  m.impl("attention_half", &attention_half);
  m.impl("mlp_half", &mlp_half);
  m.impl("to_panels", &to_panels);
  m.impl("panel_rows", &panel_rows);
}
