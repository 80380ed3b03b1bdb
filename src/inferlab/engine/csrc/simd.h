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
