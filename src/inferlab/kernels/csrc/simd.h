// AVX2 helpers the CPU decode kernels share.
#pragma once

#include <ATen/ATen.h>

#include <immintrin.h>

#include <vector>

namespace inferlab {

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

inline float hmax(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ss(m, _mm_movehdup_ps(m));
  return _mm_cvtss_f32(m);
}

// e^x for 8 floats (relative error ~1e-7): x = n ln2 + r with |r| <= ln2 / 2, e^r by a degree-6 polynomial,
// 2^n into the exponent bits; x clamped to where e^x is a normal float
inline __m256 exp8(__m256 x) {
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.3f)), _mm256_set1_ps(88.3f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);  // ln2 in two parts: r stays exact
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

// 8 consecutive values widened to fp32 (bf16 is the high half of an fp32)
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }

inline __m256 load8(const at::BFloat16* p) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

// A fp32 or bf16 tensor's values as fp32, without a tensor op (each costs microseconds): the tensor's
// own memory (kept alive here) when it already is contiguous fp32 and no copy is asked for, else a
// converted copy. Default-constructed: no values, data() is nullptr.
class Floats {
 public:
  Floats() = default;
  Floats(const at::Tensor& t, bool copy) : tensor_(t.contiguous()) {
    const int64_t n = tensor_.numel();
    if (tensor_.scalar_type() == at::kFloat) {
      data_ = tensor_.data_ptr<float>();
      if (!copy) return;
      owned_.assign(data_, data_ + n);
    } else {
      TORCH_CHECK(tensor_.scalar_type() == at::kBFloat16, "expected float32 or bfloat16, got ", tensor_.scalar_type());
      const at::BFloat16* p = tensor_.data_ptr<at::BFloat16>();
      owned_.resize(n);
      for (int64_t i = 0; i < n; ++i) owned_[i] = static_cast<float>(p[i]);
    }
    data_ = owned_.data();
  }
  Floats(const Floats&) = delete;
  Floats(Floats&&) = default;  // moves the buffer itself, so data_ stays valid
  const float* data() const { return data_; }
  float* mutable_data() { return owned_.data(); }  // only when constructed with copy

 private:
  at::Tensor tensor_;
  std::vector<float> owned_;
  const float* data_ = nullptr;
};

}  // namespace inferlab
