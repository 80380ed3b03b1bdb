// Attention for decoding on AVX2 CPUs: one new query per sequence over all its cached keys, this
// step's key and value written into the cache first.
//
// With a single query there is nothing to tile: each head is one pass over its keys (scores), a
// softmax, and one pass over its values. The library's flash-attention kernel spends most of its
// time on set-up at this size (measured here: ~50 us per layer in fp32, ~170 us in bf16, for a
// 9-head, 256-token cache), which this loop does not have. Query heads share key/value heads in
// groups (GQA); exp is a vectorized polynomial with relative error below 2e-7.
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <limits>

#include "simd.h"

namespace {

using inferlab::hsum;
using inferlab::load8;

constexpr int64_t kMaxHeadDim = 256;
constexpr int64_t kKeysPerThread = 2048;  // below this many keys in all, one thread does every head

// e^x for x <= 0 (scores minus their max): x = n ln2 + r, e^r by a degree-7 polynomial, times 2^n
inline __m256 exp8(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);  // ln2 in two parts, for exactness
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  const __m256i two_n = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(two_n));
}

// out = softmax(q . k_l * scale over l) @ v for one head: q (D,), k and v rows l at k + l * k_stride
template <typename T>
void attend_head(const T* q, const T* k, const T* v, int64_t L, int64_t D, int64_t k_stride, int64_t v_stride,
                 float scale, T* out) {
  const int64_t V = D / 8;
  __m256 qv[kMaxHeadDim / 8];
  for (int64_t j = 0; j < V; ++j) qv[j] = _mm256_mul_ps(load8(q + 8 * j), _mm256_set1_ps(scale));
  std::vector<float> p(L);
  float max_score = -std::numeric_limits<float>::infinity();
  for (int64_t l = 0; l < L; ++l) {
    const T* key = k + l * k_stride;
    __m256 acc = _mm256_mul_ps(qv[0], load8(key));
    for (int64_t j = 1; j < V; ++j) acc = _mm256_fmadd_ps(qv[j], load8(key + 8 * j), acc);
    p[l] = hsum(acc);
    max_score = std::max(max_score, p[l]);
  }
  const __m256 max8 = _mm256_set1_ps(max_score);
  __m256 sum8 = _mm256_setzero_ps();
  int64_t l = 0;
  for (; l + 8 <= L; l += 8) {
    const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(p.data() + l), max8));
    _mm256_storeu_ps(p.data() + l, e);
    sum8 = _mm256_add_ps(sum8, e);
  }
  float sum = hsum(sum8);
  for (; l < L; ++l) sum += (p[l] = std::exp(p[l] - max_score));
  __m256 acc[kMaxHeadDim / 8];
  for (int64_t j = 0; j < V; ++j) acc[j] = _mm256_setzero_ps();
  for (l = 0; l < L; ++l) {
    const __m256 weight = _mm256_set1_ps(p[l]);
    const T* value = v + l * v_stride;
    for (int64_t j = 0; j < V; ++j) acc[j] = _mm256_fmadd_ps(weight, load8(value + 8 * j), acc[j]);
  }
  alignas(32) float result[kMaxHeadDim];
  const __m256 inv_sum = _mm256_set1_ps(1.0f / sum);
  for (int64_t j = 0; j < V; ++j) _mm256_store_ps(result + 8 * j, _mm256_mul_ps(acc[j], inv_sum));
  for (int64_t d = 0; d < D; ++d) out[d] = static_cast<T>(result[d]);
}

// Write this step's k, v (B, H_kv, 1, D) at position `pos` of the caches (B, H_kv, S, D) (views with unit
// stride along D), then attend q (B, H, 1, D) over positions 0..pos; H a multiple of H_kv -> (B, H, 1, D)
at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& k_cache,
                            const at::Tensor& v_cache, int64_t pos, double scale) {
  TORCH_CHECK(q.dim() == 4 && q.size(2) == 1, "decode_attention: q must be (B, H, 1, D)");
  TORCH_CHECK(k.dim() == 4 && k.size(2) == 1 && k.sizes() == v.sizes(), "decode_attention: k and v must be (B, H_kv, 1, D)");
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.sizes() == v_cache.sizes(), "decode_attention: the caches must be (B, H_kv, S, D)");
  const int64_t B = q.size(0), H = q.size(1), D = q.size(3), H_kv = k.size(1), L = pos + 1;
  TORCH_CHECK(k.size(0) == B && k.size(3) == D && k_cache.size(0) == B && k_cache.size(1) == H_kv &&
              k_cache.size(3) == D && H % H_kv == 0, "decode_attention: q, k/v and cache shapes disagree");
  TORCH_CHECK(pos >= 0 && pos < k_cache.size(2), "decode_attention: position ", pos, " is outside the cache");
  TORCH_CHECK(D % 8 == 0 && D <= kMaxHeadDim, "decode_attention: head_dim must be a multiple of 8 up to 256");
  TORCH_CHECK(k_cache.stride(3) == 1 && v_cache.stride(3) == 1, "decode_attention: caches must be contiguous along D");
  TORCH_CHECK(q.scalar_type() == k.scalar_type() && k.scalar_type() == v.scalar_type() &&
              v.scalar_type() == k_cache.scalar_type() && k_cache.scalar_type() == v_cache.scalar_type(),
              "decode_attention: q, k, v and the caches must share a dtype");
  TORCH_CHECK(k.stride(3) == 1 && v.stride(3) == 1, "decode_attention: k and v must be contiguous along D");
  const at::Tensor qc = q.contiguous();
  at::Tensor out = at::empty({B, H, 1, D}, q.options());
  const int64_t group = H / H_kv;
  auto run = [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    const T* qp = qc.data_ptr<T>();
    const T* kp = k_cache.data_ptr<T>();
    const T* vp = v_cache.data_ptr<T>();
    T* op = out.data_ptr<T>();
    for (int64_t b = 0; b < B; ++b) {
      for (int64_t h = 0; h < H_kv; ++h) {
        const T* k_new = k.data_ptr<T>() + b * k.stride(0) + h * k.stride(1);
        const T* v_new = v.data_ptr<T>() + b * v.stride(0) + h * v.stride(1);
        std::copy(k_new, k_new + D, k_cache.data_ptr<T>() + b * k_cache.stride(0) + h * k_cache.stride(1) + pos * k_cache.stride(2));
        std::copy(v_new, v_new + D, v_cache.data_ptr<T>() + b * v_cache.stride(0) + h * v_cache.stride(1) + pos * v_cache.stride(2));
      }
    }
    const int64_t grain = B * H * L < kKeysPerThread ? B * H : 1;
    at::parallel_for(0, B * H, grain, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) {
        const int64_t b = i / H, h = i % H, h_kv = h / group;
        attend_head(qp + i * D, kp + b * k_cache.stride(0) + h_kv * k_cache.stride(1),
                    vp + b * v_cache.stride(0) + h_kv * v_cache.stride(1), L, D, k_cache.stride(2), v_cache.stride(2),
                    static_cast<float>(scale), op + i * D);
      }
    });
  };
  switch (q.scalar_type()) {
    case at::kFloat: run(static_cast<float*>(nullptr)); break;
    case at::kBFloat16: run(static_cast<at::BFloat16*>(nullptr)); break;
    default: TORCH_CHECK(false, "decode_attention: float32 or bfloat16 only, got ", q.scalar_type());
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(inferlab, m) {
  m.def("decode_attention(Tensor q, Tensor k, Tensor v, Tensor(a!) k_cache, Tensor(b!) v_cache, int pos, float scale) "
        "-> Tensor");
}

TORCH_LIBRARY_IMPL(inferlab, CPU, m) {
  m.impl("decode_attention", &decode_attention);
}
