// One step of the whole decoder in one call, for any number of token rows: the decode tokens of many
// sequences and the causal prompt chunks of others, mixed (each row has its own position and block table).
//
// Per token and layer the Python model makes ~35 tensor-op calls, each with its dispatch cost, around four
// matrix-vector products: on a small CPU the calls alone are a large share of a step. Here the same step is a loop in C++ over the layers: RMSNorm -> wqkv -> RoPE -> k/v
// written to the cache -> attention -> wo -> residual, then RMSNorm -> w13 -> SwiGLU -> w2 ->
// residual, and the final norm and LM head, with the projections on the gemv kernel (gemv.h) and the
// attention on the block-table kernel (attention.h). The residual stream stays fp32 between layers.
// The Python model (model/transformer.py) is the reference the tests hold this against. Each phase is
// a profiler range ("decode_step: ..."), so torch.profiler still shows where a step's time goes.
#include <ATen/record_function.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include <numeric>

#include "attention.h"
#include "gemv.h"

namespace {

using inferlab::Floats;
using inferlab::KvPool;
using inferlab::Projection;

// A projection as Python hands it over: [weight, scales, mins, bias, dense copy], absent parts as empty tensors (int4
// tiles: read where they are, the layer's own); the copy serves products of dense_from_rows rows and more. Several
// such lists one after the other: a projection stacked from parts, each its own rows in its own format
Projection projection_from(const std::vector<at::Tensor>& parts, int64_t int8_from_rows, int64_t dense_from_rows) {
  TORCH_CHECK(!parts.empty() && parts.size() % 5 == 0,
              "DecodePlan: a projection is [weight, scales, mins, bias, dense copy], once per part");
  auto given = [](const at::Tensor& t) { return t.numel() ? std::optional<at::Tensor>(t) : std::nullopt; };
  std::vector<Projection> stacked;
  for (size_t i = 0; i < parts.size(); i += 5) {
    stacked.emplace_back(parts[i], given(parts[i + 1]), given(parts[i + 2]), given(parts[i + 3]), int8_from_rows,
                         given(parts[i + 4]), dense_from_rows);
  }
  return stacked.size() == 1 ? std::move(stacked[0]) : Projection(std::move(stacked));
}

struct Layer {
  Floats attention_norm;
  Projection wqkv, wo;
  Floats ffn_norm;
  Projection w13, w2;
};

// x (D,) rotated by the position's cos/sin rows (sin negated on its first half: rotate-half layout)
inline void rope(const float* x, const float* cos, const float* sin, int64_t D, float* out) {
  const int64_t half = D / 2;  // each half pairs with the other: out = x * cos + roll(x, half) * sin
  for (int64_t i = 0; i < half; ++i) out[i] = x[i] * cos[i] + x[i + half] * sin[i];
  for (int64_t i = half; i < D; ++i) out[i] = x[i] * cos[i] + x[i - half] * sin[i];
}

const c10::ArrayRef<const c10::IValue> kNoInputs{};  // profiler ranges record no inputs

inline void add_to(float* h, const float* y, int64_t n) {
  for (int64_t i = 0; i < n; ++i) h[i] += y[i];
}

class DecodePlan : public torch::CustomClassHolder {
 public:
  // rope_cos, rope_sin: (max_seq_len, head_dim); norm: the final RMSNorm's weight; output: the LM head;
  // int8_from_rows: int4 projections of this many rows or more take int8 activation codes per block (Projection's;
  // 0: none);
  // dense_from_rows: projections holding a dense copy multiply it from this many rows on (Projection's)
  DecodePlan(int64_t n_heads, int64_t n_kv_heads, int64_t head_dim, double norm_eps, at::Tensor rope_cos,
             at::Tensor rope_sin, at::Tensor norm, std::vector<at::Tensor> output, int64_t int8_from_rows,
             int64_t dense_from_rows)
      : H_(n_heads), H_kv_(n_kv_heads), D_(head_dim), eps_(norm_eps), cos_(rope_cos, false), sin_(rope_sin, false),
        rope_rows_(rope_cos.size(0)), norm_(norm, false),
        output_(projection_from(output, int8_from_rows, dense_from_rows)), dim_(norm.numel()),
        int8_from_rows_(int8_from_rows), dense_from_rows_(dense_from_rows) {
    TORCH_CHECK(H_ % H_kv_ == 0 && D_ % 8 == 0 && D_ <= inferlab::kMaxHeadDim,
                "DecodePlan: heads must group evenly and head_dim be a multiple of 8 up to 256");
    TORCH_CHECK(rope_cos.sizes() == rope_sin.sizes() && rope_cos.dim() == 2 && rope_cos.size(1) == D_,
                "DecodePlan: rope tables must be (max_seq_len, head_dim)");
    TORCH_CHECK(output_.K == dim_, "DecodePlan: the LM head takes ", output_.K, " features, the model has ", dim_);
  }

  void add_layer(at::Tensor attention_norm, std::vector<at::Tensor> wqkv, std::vector<at::Tensor> wo,
                 at::Tensor ffn_norm, std::vector<at::Tensor> w13, std::vector<at::Tensor> w2) {
    auto projection = [&](const std::vector<at::Tensor>& parts) {
      return projection_from(parts, int8_from_rows_, dense_from_rows_);
    };
    Layer layer{Floats(attention_norm, false), projection(wqkv), projection(wo), Floats(ffn_norm, false),
                projection(w13), projection(w2)};
    const int64_t qkv = (H_ + 2 * H_kv_) * D_;
    TORCH_CHECK(attention_norm.numel() == dim_ && ffn_norm.numel() == dim_ && layer.wqkv.K == dim_ &&
                layer.wqkv.N == qkv && layer.wo.K == H_ * D_ && layer.wo.N == dim_ && layer.w13.K == dim_ &&
                layer.w13.N == 2 * layer.w2.K && layer.w2.N == dim_ && (layers_.empty() || layer.w2.K == layers_[0].w2.K),
                "DecodePlan: layer ", layers_.size(), "'s shapes do not fit the model's");
    layers_.push_back(std::move(layer));
  }

  // x (B, dim) the new tokens' embeddings; caches (n_layers, num_blocks, H_kv, block_size, D);
  // block_tables (B, n) int64; positions (B,) int64; int8 caches come with their scales (n_layers,
  // num_blocks, H_kv, block_size) fp32 (attention.h's KvPool); logit_rows (R,) int64, the rows whose logits
  // are wanted (absent: all B; empty: none, only the k/v written) -> logits (R, vocab) fp32. Every layer writes every row's
  // k/v at its position before any row attends, and row b attends over its block table's positions up to
  // its own: rows of one sequence at consecutive positions are its causal forward.
  at::Tensor step(at::Tensor x, at::Tensor k_cache, at::Tensor v_cache, at::Tensor block_tables, at::Tensor positions,
                  std::optional<at::Tensor> k_scales, std::optional<at::Tensor> v_scales,
                  std::optional<at::Tensor> logit_rows) {
    const int64_t B = x.size(0), L = static_cast<int64_t>(layers_.size());
    TORCH_CHECK(x.dim() == 2 && x.size(1) == dim_ && B >= 1, "DecodePlan.step: x must be (B, ", dim_, ") with B >= 1");
    TORCH_CHECK(k_cache.dim() == 5 && k_cache.sizes() == v_cache.sizes() && k_cache.size(0) == L &&
                k_cache.size(2) == H_kv_ && k_cache.size(4) == D_ && k_cache.stride(4) == 1 && v_cache.stride(4) == 1 &&
                k_cache.scalar_type() == v_cache.scalar_type(),
                "DecodePlan.step: caches must be (", L, ", blocks, ", H_kv_, ", block_size, ", D_, ")");
    const inferlab::SequenceBlocks seqs(block_tables, positions, B, k_cache.size(1), k_cache.size(3), "DecodePlan.step");
    for (int64_t b = 0; b < B; ++b) {
      TORCH_CHECK(seqs.pos[b] < rope_rows_, "DecodePlan.step: position ", seqs.pos[b], " is outside the rope tables");
    }
    const at::ScalarType kv = k_cache.scalar_type();
    TORCH_CHECK(kv == at::kFloat || kv == at::kBFloat16 || kv == at::kChar,
                "DecodePlan.step: float32, bfloat16 or int8 caches only, got ", kv);
    inferlab::check_kv_scales(k_cache, k_scales, "DecodePlan.step");
    inferlab::check_kv_scales(v_cache, v_scales, "DecodePlan.step");
    std::vector<int64_t> wanted;
    if (logit_rows) {
      TORCH_CHECK(logit_rows->scalar_type() == at::kLong && logit_rows->dim() == 1,
                  "DecodePlan.step: logit_rows must be (R,) int64");
      const at::Tensor rows = logit_rows->contiguous();
      wanted.assign(rows.data_ptr<int64_t>(), rows.data_ptr<int64_t>() + rows.numel());
      for (const int64_t b : wanted) TORCH_CHECK(b >= 0 && b < B, "DecodePlan.step: logit row ", b, " is not a row of x");
    } else {
      wanted.resize(B);
      std::iota(wanted.begin(), wanted.end(), 0);
    }
    auto run_on = [&](auto* tag) {
      using T = std::remove_pointer_t<decltype(tag)>;
      return run<T>(x, k_cache, v_cache, k_scales, v_scales, seqs.table, seqs.width, seqs.pos, wanted);
    };
    if (kv == at::kFloat) return run_on(static_cast<float*>(nullptr));
    if (kv == at::kBFloat16) return run_on(static_cast<at::BFloat16*>(nullptr));
    return run_on(static_cast<int8_t*>(nullptr));
  }

 private:
  template <typename T>
  at::Tensor run(const at::Tensor& x, const at::Tensor& k_cache, const at::Tensor& v_cache,
                 const std::optional<at::Tensor>& k_scales, const std::optional<at::Tensor>& v_scales,
                 const int64_t* table, int64_t width, const int64_t* pos, const std::vector<int64_t>& logit_rows) const {
    const int64_t B = x.size(0), qkv_width = (H_ + 2 * H_kv_) * D_, hidden = layers_.empty() ? 0 : layers_[0].w2.K;
    Floats residual(x, /*copy=*/true);
    float* h = residual.mutable_data();  // (B, dim), fp32 throughout
    std::vector<float> normed(B * dim_), qkv(B * qkv_width), q(B * H_ * D_), k(B * H_kv_ * D_), v(B * H_kv_ * D_),
        attended(B * H_ * D_), projected(B * dim_), gate_up(B * 2 * hidden), gated(B * hidden);
    const float scale = 1.0f / std::sqrt(static_cast<float>(D_));
    auto normalize = [&](const Floats& weight) { inferlab::rms_normalize(h, normed.data(), B, dim_, weight.data(), eps_); };
    for (int64_t i = 0; i < static_cast<int64_t>(layers_.size()); ++i) {
      const Layer& layer = layers_[i];
      {
        RECORD_FUNCTION("decode_step: norm+wqkv", kNoInputs);
        normalize(layer.attention_norm);
        layer.wqkv(normed.data(), B, qkv.data());
      }
      {
        RECORD_FUNCTION("decode_step: rope+kv_write+attention", kNoInputs);
        inferlab::for_each_row(B, [&](int64_t b) {  // each row: [q heads, k heads, v heads]; q and k rotated
          const float* row = qkv.data() + b * qkv_width;
          const float* cos = cos_.data() + pos[b] * D_;
          const float* sin = sin_.data() + pos[b] * D_;
          for (int64_t head = 0; head < H_; ++head) rope(row + head * D_, cos, sin, D_, q.data() + (b * H_ + head) * D_);
          for (int64_t head = 0; head < H_kv_; ++head) {
            rope(row + (H_ + head) * D_, cos, sin, D_, k.data() + (b * H_kv_ + head) * D_);
          }
          std::copy(row + (H_ + H_kv_) * D_, row + qkv_width, v.data() + b * H_kv_ * D_);
        });
        inferlab::write_and_attend(q.data(), k.data(), v.data(), KvPool<T>(k_cache, i, k_scales),
                                   KvPool<T>(v_cache, i, v_scales), table, width, pos, B, H_, H_kv_, D_, scale,
                                   attended.data());
      }
      {
        RECORD_FUNCTION("decode_step: wo+residual", kNoInputs);
        layer.wo(attended.data(), B, projected.data());
        add_to(h, projected.data(), B * dim_);
      }
      {
        RECORD_FUNCTION("decode_step: norm+w13", kNoInputs);
        normalize(layer.ffn_norm);
        layer.w13(normed.data(), B, gate_up.data());
      }
      {
        RECORD_FUNCTION("decode_step: swiglu+w2+residual", kNoInputs);
        inferlab::swiglu(gate_up.data(), B, hidden, gated.data());
        layer.w2(gated.data(), B, projected.data());
        add_to(h, projected.data(), B * dim_);
      }
    }
    RECORD_FUNCTION("decode_step: norm+lm_head", kNoInputs);  // only the rows whose logits are wanted
    const int64_t R = static_cast<int64_t>(logit_rows.size());
    normed.resize(std::max(B, R) * dim_);  // a row may be asked for twice
    for (int64_t r = 0; r < R; ++r) std::copy(h + logit_rows[r] * dim_, h + (logit_rows[r] + 1) * dim_, normed.begin() + r * dim_);
    inferlab::rms_normalize(normed.data(), normed.data(), R, dim_, norm_.data(), eps_);
    // fp32 whatever the activations' dtype: bf16's spacing near a logit of 25 is 0.125, which turns a near-tie
    // between the top two tokens into a tie, and greedy decoding then follows the wrong one
    at::Tensor logits = at::empty({R, output_.N}, x.options().dtype(at::kFloat));
    if (R > 0) output_(normed.data(), R, logits.data_ptr<float>());
    return logits;
  }

  int64_t H_, H_kv_, D_;
  double eps_;
  Floats cos_, sin_;
  int64_t rope_rows_;
  Floats norm_;
  Projection output_;
  int64_t dim_;
  int64_t int8_from_rows_;
  int64_t dense_from_rows_;
  std::vector<Layer> layers_;
};

}  // namespace

TORCH_LIBRARY_FRAGMENT(INFERLAB_OPS, m) {
  m.class_<DecodePlan>("DecodePlan")
      .def(torch::init<int64_t, int64_t, int64_t, double, at::Tensor, at::Tensor, at::Tensor, std::vector<at::Tensor>,
                      int64_t, int64_t>())
      .def("add_layer", &DecodePlan::add_layer)
      .def("step", &DecodePlan::step);
}
