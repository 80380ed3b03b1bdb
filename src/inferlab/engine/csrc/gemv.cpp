// Matrix-vector products for decoding on AVX2 CPUs: y = rmsnorm(x) @ W.T for a few activation rows.
//
// Decoding one token reads every weight once and does two flops per weight, so the speed limit is
// how fast the weights stream from memory. This kernel reads each weight row exactly once, 16
// weights a step, and multiplies them into every activation row (at most kMaxRows), with several
// independent accumulators and software prefetches far enough ahead that memory, not the instruction
// window, sets the pace (measured here: int8 rows stream ~2x faster with them). fp32 and bf16
// weights are widened to fp32 and fused-multiply-added; int8 weights meet int16 activation codes in
// an exact integer multiply-add (one instruction per 16 weights). The RMSNorm that precedes every
// projection is applied to the activations first, so it costs no separate pass. Rows are split
// across torch's intra-op threads.
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>

#include "simd.h"

namespace {

using inferlab::Floats;
using inferlab::hsum;

constexpr int64_t kMaxRows = 4;       // activation rows per call (decode batch); more go to a GEMM
constexpr int64_t kRowsPerTile = 4;   // weight rows streamed together when there is one activation row
constexpr int64_t kGrain = 64;        // weight rows per thread at least
constexpr int64_t kPrefetchBytes = 4096;  // how far ahead each row is requested: one core alone keeps too few loads in flight
constexpr int64_t kStep = 16;         // weights per row read per step; K must be a multiple of it
constexpr float kInt16Max = 16383;    // activation codes for int8 weights: 2 * 127 * 16383 * (K / 16) fits int32 up to K = 8192


// A weight format: the activations as its steps read them (`prepare`, which returns the factor that
// undoes their scaling), and one step = the dot of kStep weights with kStep prepared activations.
struct Fp32Weights {
  using W = float;
  using X = float;
  using Acc = __m256;
  static Acc zero() { return _mm256_setzero_ps(); }
  static Acc step(const W* w, const X* x, Acc acc) {
    acc = _mm256_fmadd_ps(_mm256_loadu_ps(w), _mm256_loadu_ps(x), acc);
    return _mm256_fmadd_ps(_mm256_loadu_ps(w + 8), _mm256_loadu_ps(x + 8), acc);
  }
  static float total(Acc acc) { return hsum(acc); }
  static float prepare(const float* x, int64_t K, X* out) {
    std::copy(x, x + K, out);
    return 1.0f;
  }
};

// bf16 is the high half of an fp32: a 32-bit lane holding weights 2i and 2i+1 gives weight 2i shifted
// up and weight 2i+1 masked, so the activations of each step are stored evens first, then odds.
struct Bf16Weights {
  using W = at::BFloat16;
  using X = float;
  using Acc = __m256;
  static Acc zero() { return _mm256_setzero_ps(); }
  static Acc step(const W* w, const X* x, Acc acc) {
    const __m256i pairs = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w));
    const __m256 even = _mm256_castsi256_ps(_mm256_slli_epi32(pairs, 16));
    const __m256 odd = _mm256_castsi256_ps(_mm256_and_si256(pairs, _mm256_set1_epi32(0xFFFF0000)));
    acc = _mm256_fmadd_ps(even, _mm256_loadu_ps(x), acc);
    return _mm256_fmadd_ps(odd, _mm256_loadu_ps(x + 8), acc);
  }
  static float total(Acc acc) { return hsum(acc); }
  static float prepare(const float* x, int64_t K, X* out) {
    for (int64_t k = 0; k < K; k += kStep) {
      for (int64_t i = 0; i < kStep / 2; ++i) {
        out[k + i] = x[k + 2 * i];
        out[k + kStep / 2 + i] = x[k + 2 * i + 1];
      }
    }
    return 1.0f;
  }
};

// int8 weights times int16 activation codes (x / max|x| * 16383), summed exactly in int32 by madd.
struct Int8Weights {
  using W = int8_t;
  using X = int16_t;
  using Acc = __m256i;
  static Acc zero() { return _mm256_setzero_si256(); }
  static Acc step(const W* w, const X* x, Acc acc) {
    const __m256i w16 = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w)));
    return _mm256_add_epi32(acc, _mm256_madd_epi16(w16, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x))));
  }
  static float total(Acc acc) { return hsum(_mm256_cvtepi32_ps(acc)); }
  static float prepare(const float* x, int64_t K, X* out) {
    float amax = 0;
    for (int64_t k = 0; k < K; ++k) amax = std::max(amax, std::abs(x[k]));
    const float scale = amax > 0 ? amax / kInt16Max : 1.0f;
    for (int64_t k = 0; k < K; ++k) out[k] = static_cast<int16_t>(std::lrintf(x[k] / scale));
    return scale;
  }
};

// acc[r * M + m] = row r of w . prepared activation row m, for R weight rows and M activation rows
template <typename F, int R, int M>
inline void dot_tile(const typename F::W* w, int64_t K, const typename F::X* x, float* acc) {
  typename F::Acc sum[R * M];
  for (int i = 0; i < R * M; ++i) sum[i] = F::zero();
  for (int64_t k = 0; k < K; k += kStep) {
    for (int r = 0; r < R; ++r) {
      _mm_prefetch(reinterpret_cast<const char*>(w + r * K + k) + kPrefetchBytes, _MM_HINT_T0);
      for (int m = 0; m < M; ++m) sum[r * M + m] = F::step(w + r * K + k, x + m * K + k, sum[r * M + m]);
    }
  }
  for (int i = 0; i < R * M; ++i) acc[i] = F::total(sum[i]);
}

// y[m, n] = (w[n] . x[m]) * x_scales[m] * scales[n] + bias[n] for n in [begin, end)
template <typename F, typename Y, int M>
void rows(const typename F::W* w, int64_t K, const typename F::X* x, const float* x_scales, const float* scales,
          const float* bias, Y* y, int64_t N, int64_t begin, int64_t end) {
  constexpr int R = M == 1 ? kRowsPerTile : 1;
  float acc[R * M];
  auto store = [&](int64_t row, int r) {
    const float s = scales ? scales[row] : 1.0f, b = bias ? bias[row] : 0.0f;
    for (int m = 0; m < M; ++m) y[m * N + row] = static_cast<Y>(acc[r * M + m] * x_scales[m] * s + b);
  };
  int64_t n = begin;
  for (; n + R <= end; n += R) {
    dot_tile<F, R, M>(w + n * K, K, x, acc);
    for (int r = 0; r < R; ++r) store(n + r, r);
  }
  for (; n < end; ++n) {
    dot_tile<F, 1, M>(w + n * K, K, x, acc);
    store(n, 0);
  }
}

// Prepare the M activation rows for format F, then split the weight rows across threads.
template <typename F, typename Y>
void run_format(const float* xf, int64_t M, int64_t K, const typename F::W* w, const float* scales,
                const float* bias, Y* y, int64_t N) {
  std::vector<typename F::X> x(M * K);
  float x_scales[kMaxRows];
  for (int64_t m = 0; m < M; ++m) x_scales[m] = F::prepare(xf + m * K, K, x.data() + m * K);
  at::parallel_for(0, N, kGrain, [&](int64_t begin, int64_t end) {
    switch (M) {
      case 1: rows<F, Y, 1>(w, K, x.data(), x_scales, scales, bias, y, N, begin, end); break;
      case 2: rows<F, Y, 2>(w, K, x.data(), x_scales, scales, bias, y, N, begin, end); break;
      case 3: rows<F, Y, 3>(w, K, x.data(), x_scales, scales, bias, y, N, begin, end); break;
      default: rows<F, Y, 4>(w, K, x.data(), x_scales, scales, bias, y, N, begin, end); break;
    }
  });
}

// Each row of x (M, K) -> x * rsqrt(mean(x^2) + eps) * norm_weight, in fp32: the RMSNorm before the product
void rms_normalize(float* x, int64_t M, int64_t K, const float* norm_weight, double eps) {
  for (int64_t m = 0; m < M; ++m) {
    float* row = x + m * K;
    double sum_sq = 0;
    for (int64_t k = 0; k < K; ++k) sum_sq += static_cast<double>(row[k]) * row[k];
    const float inv_rms = static_cast<float>(1.0 / std::sqrt(sum_sq / K + eps));
    for (int64_t k = 0; k < K; ++k) row[k] = row[k] * inv_rms * norm_weight[k];
  }
}

// y = rmsnorm(x) @ weight.T * scales + bias, each step only when given.
// x (..., K) fp32 or bf16; weight (N, K) fp32, bf16 or int8, K % 16 == 0; scales, bias (N,); norm_weight (K,)
at::Tensor gemv(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& scales,
                const std::optional<at::Tensor>& bias, const std::optional<at::Tensor>& norm_weight, double eps) {
  TORCH_CHECK(weight.dim() == 2 && weight.is_contiguous(), "gemv: weight must be a contiguous (N, K) matrix");
  const int64_t N = weight.size(0), K = weight.size(1);
  TORCH_CHECK(K % kStep == 0 && K <= 8192, "gemv: K must be a multiple of 16 and at most 8192, got ", K);
  TORCH_CHECK(x.size(-1) == K, "gemv: x has ", x.size(-1), " features, weight has ", K);
  const int64_t M = x.numel() / K;
  TORCH_CHECK(M >= 1 && M <= kMaxRows, "gemv: at most ", kMaxRows, " activation rows, got ", M);
  Floats xf(x.contiguous(), /*copy=*/norm_weight.has_value());  // normalized in place: never the caller's x
  if (norm_weight) rms_normalize(xf.mutable_data(), M, K, Floats(*norm_weight, false).data(), eps);
  const std::optional<Floats> sf = scales ? std::optional<Floats>(Floats(*scales, false)) : std::nullopt;
  const std::optional<Floats> bf = bias ? std::optional<Floats>(Floats(*bias, false)) : std::nullopt;
  const float* s = sf ? sf->data() : nullptr;
  const float* b = bf ? bf->data() : nullptr;
  auto out_shape = x.sizes().vec();
  out_shape.back() = N;
  at::Tensor y = at::empty(out_shape, x.options());
  auto run = [&](auto format, const auto* w) {
    using F = decltype(format);
    if (x.scalar_type() == at::kBFloat16) {
      run_format<F>(xf.data(), M, K, w, s, b, y.data_ptr<at::BFloat16>(), N);
    } else {
      run_format<F>(xf.data(), M, K, w, s, b, y.data_ptr<float>(), N);
    }
  };
  switch (weight.scalar_type()) {
    case at::kFloat: run(Fp32Weights{}, weight.data_ptr<float>()); break;
    case at::kBFloat16: run(Bf16Weights{}, weight.data_ptr<at::BFloat16>()); break;
    case at::kChar: run(Int8Weights{}, weight.data_ptr<int8_t>()); break;
    default: TORCH_CHECK(false, "gemv: weights must be float32, bfloat16 or int8, got ", weight.scalar_type());
  }
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(inferlab, m) {
  m.def("gemv(Tensor x, Tensor weight, Tensor? scales, Tensor? bias, Tensor? norm_weight, float eps) -> Tensor");
}

TORCH_LIBRARY_IMPL(inferlab, CPU, m) {
  m.impl("gemv", &gemv);
}
