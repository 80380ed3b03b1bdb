// The `gemv` op: y = prepare(x) @ W.T * scales + bias for any number of activation rows (kernel: gemv.h).
// What precedes each projection (the RMSNorm, or the SwiGLU before w2) is applied to the activations
// first, so it costs no separate call.
#include <torch/library.h>

#include "gemv.h"

namespace {

using inferlab::Floats;
using inferlab::Projection;

// y = rmsnorm(x) @ W.T * scales + bias, each step only when given; W, scales, mins, bias as Projection
// reads them. x (..., K) fp32 or bf16 -> y (..., N) in x's dtype; norm_weight (K,). `gated`: x is
// (..., 2K), [gate, up], and the product is taken with silu(gate) * up (SwiGLU). int8_activations: int4 weights
// meet int8 activation codes at any rows (Projection's int8_from_rows of 1). bf16_from_rows (> 0): int4 tiles from
// this many rows on are multiplied in bf16 on the amx build (Projection's dense_from_rows without a copy).
at::Tensor gemv(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& scales,
                const std::optional<at::Tensor>& bias, const std::optional<at::Tensor>& norm_weight, double eps,
                const std::optional<at::Tensor>& mins, bool gated, bool int8_activations, int64_t bf16_from_rows) {
  const Projection projection(weight, scales, mins, bias, int8_activations ? 1 : 0, std::nullopt, bf16_from_rows);
  const int64_t K = projection.K, N = projection.N;
  const int64_t width = gated ? 2 * K : K;
  TORCH_CHECK(x.size(-1) == width, "gemv: x has ", x.size(-1), " features, expected ", width);
  const int64_t M = x.numel() / width;
  TORCH_CHECK(M >= 1, "gemv: x has no activation rows");
  Floats xf(x, /*copy=*/norm_weight.has_value() && !gated);  // normalized in place: never the caller's x
  std::vector<float> gated_x(gated ? M * K : 0);                // silu(gate) * up, rows of K
  if (gated) inferlab::swiglu(xf.data(), M, K, gated_x.data());
  float* writable = gated ? gated_x.data() : norm_weight ? xf.mutable_data() : nullptr;
  if (norm_weight) inferlab::rms_normalize(writable, writable, M, K, Floats(*norm_weight, false).data(), eps);
  const float* prepared = gated ? gated_x.data() : xf.data();
  auto out_shape = x.sizes().vec();
  out_shape.back() = N;  // (..., N)
  at::Tensor y = at::empty(out_shape, x.options());
  if (x.scalar_type() == at::kBFloat16) {
    projection(prepared, M, y.data_ptr<at::BFloat16>());
  } else {
    projection(prepared, M, y.data_ptr<float>());
  }
  return y;
}

// Rows per block of int4 tiles in this build (its widest vector's lanes): how quant/int4.py lays them out
int64_t int4_tile_rows() { return inferlab::Int4Format::L::N; }

// Rows per block of bf16 weights laid out for this build (gemv.h: Bf16Blocks), 0 where it takes them as rows
int64_t bf16_block_rows() { return inferlab::kBf16BlockRows; }

}  // namespace

TORCH_LIBRARY_FRAGMENT(INFERLAB_OPS, m) {
  m.def("gemv(Tensor x, Tensor weight, Tensor? scales, Tensor? bias, Tensor? norm_weight, float eps, Tensor? mins, "
        "bool gated, bool int8_activations=False, int bf16_from_rows=0) -> Tensor");
  m.def("int4_tile_rows() -> int", &int4_tile_rows);
  m.def("bf16_block_rows() -> int", &bf16_block_rows);
}

TORCH_LIBRARY_IMPL(INFERLAB_OPS, CPU, m) {
  m.impl("gemv", &gemv);
}
