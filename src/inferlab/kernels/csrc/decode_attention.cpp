// The `decode_attention` op: one query per sequence, its k/v written into the pool first (attention.h).
#include <torch/library.h>

#include "attention.h"

namespace {

using inferlab::Floats;
using inferlab::KvPool;

// q (B, H, 1, D); k, v (B, H_kv, 1, D); pools (num_blocks, H_kv, block_size, D), unit stride along D,
// written in place; block_tables (B, n) int64 block ids; positions (B,) int64: where each sequence's
// new k/v go and the last position its query sees; int8 pools with their scales (num_blocks, H_kv,
// block_size) fp32, written too. H a multiple of H_kv -> (B, H, 1, D) in q's dtype.
at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& k_pool,
                            const at::Tensor& v_pool, const at::Tensor& block_tables, const at::Tensor& positions,
                            const std::optional<at::Tensor>& k_scales, const std::optional<at::Tensor>& v_scales,
                            double scale) {
  TORCH_CHECK(q.dim() == 4 && q.size(2) == 1, "decode_attention: q must be (B, H, 1, D)");
  TORCH_CHECK(k.dim() == 4 && k.size(2) == 1 && k.sizes() == v.sizes(), "decode_attention: k and v must be (B, H_kv, 1, D)");
  TORCH_CHECK(k_pool.dim() == 4 && k_pool.sizes() == v_pool.sizes(), "decode_attention: the pools must be (blocks, H_kv, block_size, D)");
  const int64_t B = q.size(0), H = q.size(1), D = q.size(3), H_kv = k.size(1);
  TORCH_CHECK(k.size(0) == B && k.size(3) == D && k_pool.size(1) == H_kv && k_pool.size(3) == D && H % H_kv == 0,
              "decode_attention: q, k/v and pool shapes disagree");
  TORCH_CHECK(D % 8 == 0 && D <= inferlab::kMaxHeadDim, "decode_attention: head_dim must be a multiple of 8 up to 256");
  TORCH_CHECK(k_pool.stride(3) == 1 && v_pool.stride(3) == 1, "decode_attention: pools must be contiguous along D");
  TORCH_CHECK(k_pool.scalar_type() == v_pool.scalar_type(), "decode_attention: the pools must share a dtype");
  inferlab::check_kv_scales(k_pool, k_scales, "decode_attention");
  inferlab::check_kv_scales(v_pool, v_scales, "decode_attention");
  const inferlab::SequenceBlocks seqs(block_tables, positions, B, k_pool.size(0), k_pool.size(2), "decode_attention");
  const Floats qf(q, false), kf(k, false), vf(v, false);
  at::Tensor out = at::empty({B, H, 1, D}, q.options().dtype(at::kFloat));
  auto run = [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    inferlab::write_and_attend(qf.data(), kf.data(), vf.data(), KvPool<T>(k_pool, k_scales), KvPool<T>(v_pool, v_scales), seqs.table,
                               seqs.width, seqs.pos, B, H, H_kv, D, static_cast<float>(scale), out.data_ptr<float>());
  };
  switch (k_pool.scalar_type()) {
    case at::kFloat: run(static_cast<float*>(nullptr)); break;
    case at::kBFloat16: run(static_cast<at::BFloat16*>(nullptr)); break;
    case at::kChar: run(static_cast<int8_t*>(nullptr)); break;
    default: TORCH_CHECK(false, "decode_attention: float32, bfloat16 or int8 pools only, got ", k_pool.scalar_type());
  }
  return out.to(q.scalar_type());
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(INFERLAB_OPS, m) {
  m.def("decode_attention(Tensor q, Tensor k, Tensor v, Tensor(a!) k_pool, Tensor(b!) v_pool, Tensor block_tables, "
        "Tensor positions, Tensor(c!)? k_scales, Tensor(d!)? v_scales, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(INFERLAB_OPS, CPU, m) {
  m.impl("decode_attention", &decode_attention);
}
