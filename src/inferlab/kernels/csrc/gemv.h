// Matrix products on x86 CPUs: y = prepare(x) @ W.T for any number of activation rows, from one decode
// token to a prompt chunk of many sequences' tokens.
//
// Decoding one token reads every weight once and does two flops per weight, so the speed limit is
// how fast the weights stream from memory. This kernel reads each weight row from memory exactly once
// per call, a step of 16 or 32 weights at a time, with several independent accumulators and software
// prefetches far enough ahead that memory, not the instruction window, sets the pace (measured here:
// int8 rows stream ~2x faster with them). Many activation rows make it a GEMM: each thread goes over
// tiles of its weight rows small enough to stay in L2 and, per tile, over all activation rows a few at
// a time, so a weight row comes from memory once and from cache for every further chunk of rows.
// fp32 weights are fused-multiply-added, bf16 weights too once widened to fp32 (a shift or a mask);
// int8 and int4 weights meet int16 activation codes in exact integer multiply-adds (one instruction per
// 2 * kLanes weights), int4 with a float scale and min per group as GGUF's Q4_1 defines them. Every (weight row, activation row) product is summed in the same
// order whatever else is in the call, so a row's result does not depend on how many rows came with it
// (a 1-row decode and a K+1-row speculative verification agree to the bit). Rows are split across
// torch's intra-op threads. Written once over the SIMD layer (simd.h) and compiled per instruction set.
// Used by the `gemv` op (gemv.cpp) and the whole decode step (decode_step.cpp).
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <optional>

#include "simd.h"

namespace inferlab {
inline namespace INFERLAB_ISA {

constexpr int64_t kDecodeRows = 8;    // up to this many activation rows a call is memory-bound (a decode batch)
constexpr int64_t kTileBytes = 64 * 1024;  // weight rows a thread multiplies into every activation row before the next ones
constexpr int64_t kGrain = 64;        // weight rows per thread at least
constexpr int64_t kPrefetchBytes = 4096;  // how far ahead each row is requested: one core alone keeps too few loads in flight
constexpr int64_t kStep = 16;         // K must be a multiple of it; a format's step reads this many weights or twice as many
constexpr int64_t kMaxK = 8192;
constexpr float kInt16Max = 16383;    // activation codes for integer weights: 2 * 127 * 16383 * (K / 16) fits int32

inline void prefetch(const void* p) { _mm_prefetch(static_cast<const char*>(p) + kPrefetchBytes, _MM_HINT_T0); }

inline void prefetch_lines(const void* p, int64_t bytes) {  // every 64-byte line of [p, p + bytes)
  for (int64_t b = 0; b < bytes; b += 64) prefetch(static_cast<const char*>(p) + b);
}

// Activations as the integer formats read them: x / max|x| * kInt16Max, rounded (to nearest even, as
// lrintf); returns the scale that undoes it
inline float int16_codes(const float* x, int64_t K, int16_t* out) {
  Wide::V amax = Wide::zero();
  int64_t k = 0;
  for (; k + kLanes <= K; k += kLanes) amax = Wide::max(amax, Wide::abs(Wide::load(x + k)));
  float m = Wide::max(amax);
  for (; k < K; ++k) m = std::max(m, std::abs(x[k]));
  const float scale = m > 0 ? m / kInt16Max : 1.0f;
  const Wide::V scale_v = Wide::set1(scale);
  for (k = 0; k + kLanes <= K; k += kLanes) Wide::store_int16(out + k, Wide::div(Wide::load(x + k), scale_v));
  for (; k < K; ++k) out[k] = static_cast<int16_t>(std::lrintf(x[k] / scale));
  return scale;
}

// Reorder each block of `block` values to its even-indexed ones, then its odd-indexed ones
template <typename T>
void deinterleave(T* x, int64_t K, int64_t block) {
  std::vector<T> tmp(block);
  for (int64_t k = 0; k < K; k += block) {
    for (int64_t i = 0; i < block / 2; ++i) {
      tmp[i] = x[k + 2 * i];
      tmp[block / 2 + i] = x[k + 2 * i + 1];
    }
    std::copy(tmp.begin(), tmp.end(), x + k);
  }
}

inline int64_t round_up(int64_t n, int64_t multiple) { return (n + multiple - 1) / multiple * multiple; }

// A weight format holds its weights and the prepared activations, and computes
//   dot<R, M>(n, acc, m0): acc[r * M + m] = (weight row n + r) . (activation row m0 + m) / x_scale[m0 + m]
// with each product's sum in one order for every R and M (batch invariance). kTileRows weight rows go
// into one dot call with a single activation row, kRows with up to kChunk of many activation rows.
// The dense formats share one loop over steps of Step::kWidth weights (DenseFormat); a K that is not a
// multiple of kWidth (only ever by kStep) ends with Step::tail, which reads the first kStep weights of a
// step (the activations are zero-padded to whole steps). int4 has groups.
template <typename Step>
struct DenseFormat {
  static constexpr int kTileRows = Step::kTileRows, kRows = Step::kRows, kChunk = Step::kChunk;
  static constexpr int64_t kWidth = Step::kWidth;
  using W = typename Step::W;
  using X = typename Step::X;
  const W* w;
  int64_t K, stride;  // stride: prepared values per activation row
  std::vector<X> x;
  std::vector<float> x_scale;  // (M,)

  DenseFormat(const W* weights, int64_t K_, const float* xf, int64_t M)
      : w(weights), K(K_), stride(round_up(K_, kWidth) * Step::kXPerWeight), x(M * stride), x_scale(M) {
    for (int64_t m = 0; m < M; ++m) x_scale[m] = Step::prepare(xf + m * K, K, x.data() + m * stride);
  }

  template <int R, int M>
  void dot(int64_t n, float* acc, int64_t m0) const {
    constexpr int64_t X_STEP = kWidth * Step::kXPerWeight;
    typename Step::Acc sum[R * M];
    const X* xs = x.data() + m0 * stride;
    for (int i = 0; i < R * M; ++i) sum[i] = Step::zero();
    const W* rows = w + n * K;
    const int64_t whole = K / kWidth * kWidth;  // weights in whole steps
    if constexpr (R == 1 && M == 1 && Step::kExact) {
      // one row, read as one stream into four independent partial sums; exact integer sums, so adding
      // the partials gives what one sum gives
      typename Step::Acc part[4] = {Step::zero(), Step::zero(), Step::zero(), Step::zero()};
      int64_t k = 0;
      for (; k + 4 * kWidth <= whole; k += 4 * kWidth) {
        prefetch_lines(rows + k, 4 * kWidth * sizeof(W));
        for (int j = 0; j < 4; ++j) {
          part[j] = Step::step(rows + k + j * kWidth, xs + (k / kWidth + j) * X_STEP, part[j]);
        }
      }
      for (; k < whole; k += kWidth) part[0] = Step::step(rows + k, xs + k / kWidth * X_STEP, part[0]);
      acc[0] = Step::total(Step::add(Step::add(part[0], part[1]), Step::add(part[2], part[3])));
      return;
    }
    for (int64_t k = 0; k < whole; k += kWidth) {
      for (int r = 0; r < R; ++r) {
        prefetch(rows + r * K + k);
        for (int m = 0; m < M; ++m) {
          sum[r * M + m] = Step::step(rows + r * K + k, xs + m * stride + k / kWidth * X_STEP, sum[r * M + m]);
        }
      }
    }
    if constexpr (kWidth > kStep) {
      if (whole < K) {
        for (int r = 0; r < R; ++r) {
          for (int m = 0; m < M; ++m) {
            sum[r * M + m] = Step::tail(rows + r * K + whole, xs + m * stride + whole / kWidth * X_STEP, sum[r * M + m]);
          }
        }
      }
    }
    for (int i = 0; i < R * M; ++i) acc[i] = Step::total(sum[i]);
  }
};

// fp32 weights: kStep of them fused-multiply-added per step, kLanes at a time
struct Fp32Step {
  // one activation row: one weight row at a time, as one stream (fp32 and bf16 alike: 4 rows in flight
  // per thread streamed SmolLM2's matrices 1.3-1.8x slower here, on one thread and on two)
  static constexpr int kTileRows = 1, kRows = kLanes == 16 ? 4 : 2, kChunk = 4;
  static constexpr bool kExact = false;
  static constexpr int64_t kWidth = kStep, kXPerWeight = 1;
  using W = float;
  using X = float;
  using Acc = Wide::V;
  static Acc zero() { return Wide::zero(); }
  static Acc step(const W* w, const X* x, Acc acc) {
    for (int j = 0; j < kStep / kLanes; ++j) acc = Wide::fmadd(Wide::load(w + j * kLanes), Wide::load(x + j * kLanes), acc);
    return acc;
  }
  static float total(Acc acc) { return Wide::sum(acc); }
  static float prepare(const float* x, int64_t K, X* out) {
    std::copy(x, x + K, out);
    return 1.0f;
  }
};

// bf16 weights widened to fp32 and fused-multiply-added with the fp32 activations, 2 * kLanes weights a
// step: bf16 is the high half of an fp32, so a 32-bit lane holding weights 2i and 2i+1 gives weight 2i
// shifted up and weight 2i+1 masked, and each step's activations are stored evens first, then odds. Every
// product is exact and each sum rounds once, in fp32 (the bf16 dot instruction of AVX-512 would need the
// activations split into two bf16 halves to stay that close, and measured here its dots of one weight row
// streamed ~1.3x slower than these FMAs).
struct Bf16Step {
  static constexpr int kTileRows = 1, kRows = kLanes == 16 ? 4 : 2, kChunk = 4;  // kTileRows: as fp32's
  static constexpr bool kExact = false;
  static constexpr int64_t kWidth = 2 * kLanes, kXPerWeight = 1;
  using W = at::BFloat16;
  using X = float;
  using Acc = Wide::V;
  static Acc zero() { return Wide::zero(); }
  // The AVX-512 build adds each pair's odd product first, as the bf16 dot instruction it once ran does, so
  // activations that are bf16 themselves (the Python model's bf16 layers call this kernel) sum as they did
  static constexpr bool kOddFirst = kLanes == 16;
  static Acc dots(Wide::I pairs, const X* x, Acc acc) {
    const Wide::V even = Wide::even_bf16(pairs), odd = Wide::odd_bf16(pairs);
    if constexpr (kOddFirst) {
      return Wide::fmadd(even, Wide::load(x), Wide::fmadd(odd, Wide::load(x + kLanes), acc));
    }
    return Wide::fmadd(odd, Wide::load(x + kLanes), Wide::fmadd(even, Wide::load(x), acc));
  }
  static Acc step(const W* w, const X* x, Acc acc) { return dots(Wide::load_pairs(w), x, acc); }
  static Acc tail(const W* w, const X* x, Acc acc) { return dots(Wide::load_pairs_half(w), x, acc); }
  static float total(Acc acc) { return Wide::sum(acc); }
  static float prepare(const float* x, int64_t K, X* out) {  // out: zeros, round_up(K, kWidth) of them
    std::copy(x, x + K, out);
    deinterleave(out, round_up(K, kWidth), kWidth);
    return 1.0f;
  }
};

// int8 weights times int16 activation codes, summed exactly in int32 (madd, or VNNI's dpwssd), one
// instruction per 16 weights. 256-bit steps on every build: 512-bit ones (32 bytes widened a step) decoded
// SmolLM2 int8 15% slower on Zen 4, whose 512-bit widening shuffles are double-pumped; the AVX-512 build
// still gains VNNI's fused multiply-add of the dots.
struct Int8Step {
  // one row at a time, as one stream: int8 rows are short (one 576-byte row of the model is 9 cache
  // lines), and 4 of them in flight per thread streamed ~20% slower here than one
  static constexpr int kTileRows = 1, kRows = kLanes == 16 ? 4 : 2, kChunk = 4;
  static constexpr bool kExact = true;
  static constexpr int64_t kWidth = kStep, kXPerWeight = 1;
  using L = Narrow;
  using W = int8_t;
  using X = int16_t;
  using Acc = L::I;
  static Acc zero() { return L::zero_int(); }
  static Acc step(const W* w, const X* x, Acc acc) { return L::dot_int16(acc, L::widen(w), L::load_int(x)); }
  static Acc add(Acc a, Acc b) { return L::add(a, b); }
  static float total(Acc acc) { return L::sum(acc); }
  static float prepare(const float* x, int64_t K, X* out) { return int16_codes(x, K, out); }
};

// 4-bit codes q in [0, 15], two per byte (even column in the low nibble), w = q * scale + min per group
// of `group` columns (GGUF Q4_1's arithmetic). Per group: the integer dot of the codes with the int16
// activation codes times the group's scale, plus its min times the group's sum of activation codes.
// One flat loop over steps of kBlocks blocks of 32 columns (16 bytes each; kBlocks = L::N / 8: the
// int32 lanes of block j are L's 8-lane block j), the integer dots scaled into fp32 sums whenever
// a step ends a group (a nested loop per group ran ~1.3x slower: its accumulators did not stay in
// registers), the min terms as one dot per row.
struct Int4Format {
  static constexpr int kTileRows = 4;    // one activation row: 4 weight rows streamed together
  static constexpr int kRows = kLanes == 16 ? 2 : 1, kChunk = 4;  // 2 accumulators per product
  static constexpr int64_t kBlock = 32;  // columns per block: 16 bytes
  using L = Wide;
  static constexpr int kBlocks = L::N / 8;
  static constexpr int64_t kStepColumns = kBlocks * kBlock;
  const uint8_t* w;                      // (N, K / 2)
  int64_t K, group, G, stride, steps_per_scale;
  const float* scales;                   // (N, G)
  const float* mins;                     // (N, G)
  std::vector<int16_t> x;                // (M, stride), each step's columns as their evens, then their odds
  std::vector<float> group_sums;         // (M, G)
  std::vector<int64_t> block_group;      // the group of each block of 32 columns, padded to whole steps
  std::vector<float> x_scale;            // (M,)

  Int4Format(const uint8_t* packed, int64_t K_, int64_t group_, const float* scales_, const float* mins_,
             const float* xf, int64_t M)
      : w(packed), K(K_), group(group_), G(K_ / group_), stride(round_up(K_, kStepColumns)),
        // a step inside one group: its dots add up over the group's steps; else scaled at every step
        steps_per_scale(group_ % kStepColumns == 0 ? group_ / kStepColumns : 1), scales(scales_), mins(mins_),
        x(M * stride), group_sums(M * G), block_group(stride / kBlock), x_scale(M) {
    for (int64_t b = 0; b < stride / kBlock; ++b) block_group[b] = std::min(b * kBlock / group, G - 1);
    for (int64_t m = 0; m < M; ++m) {
      int16_t* codes = x.data() + m * stride;  // the padding stays 0
      x_scale[m] = int16_codes(xf + m * K, K, codes);
      for (int64_t g = 0; g < G; ++g) {
        group_sums[m * G + g] = std::accumulate(codes + g * group, codes + (g + 1) * group, 0.0f);
      }
      deinterleave(codes, stride, kStepColumns);
    }
  }

  template <int R, int M>
  void dot(int64_t n, float* acc, int64_t m0) const {
    L::V sum[R * M];
    L::I dots[R * M];
    for (int i = 0; i < R * M; ++i) {
      sum[i] = L::zero();
      dots[i] = L::zero_int();
    }
    const int64_t steps = stride / kStepColumns;
    for (int64_t s = 0, left = steps_per_scale; s < steps; ++s) {
      const bool partial = (s + 1) * kStepColumns > K;  // the last step, half past the row's end
      for (int r = 0; r < R; ++r) {
        const uint8_t* bytes = w + (n + r) * (K / 2) + s * (kStepColumns / 2);
        prefetch(bytes);
        L::I codes;
        if constexpr (kBlocks > 1) {
          codes = partial ? L::widen_half(bytes) : L::widen(bytes);
        } else {
          codes = L::widen(bytes);
        }
        const L::I even = L::low_nibbles(codes);  // the codes of the step's even columns
        const L::I odd = L::high_nibbles(codes);
        for (int m = 0; m < M; ++m) {
          const int16_t* xs = x.data() + (m0 + m) * stride + s * kStepColumns;
          dots[r * M + m] = L::dot_int16(L::dot_int16(dots[r * M + m], even, L::load_int(xs)), odd,
                                         L::load_int(xs + kStepColumns / 2));
        }
      }
      if (--left == 0) {
        for (int r = 0; r < R; ++r) {
          float block_scales[kBlocks];
          for (int j = 0; j < kBlocks; ++j) block_scales[j] = scales[(n + r) * G + block_group[s * kBlocks + j]];
          const L::V scale = L::per_block(block_scales);
          for (int m = 0; m < M; ++m) {
            sum[r * M + m] = L::fmadd(L::to_float(dots[r * M + m]), scale, sum[r * M + m]);
            dots[r * M + m] = L::zero_int();
          }
        }
        left = steps_per_scale;
      }
    }
    for (int r = 0; r < R; ++r) {  // + the sum over groups of min * the group's activation codes, vectorized
      const float* row_mins = mins + (n + r) * G;
      for (int m = 0; m < M; ++m) {
        const float* sums = group_sums.data() + (m0 + m) * G;
        L::V min_terms = L::zero();
        int64_t g = 0;
        for (; g + L::N <= G; g += L::N) min_terms = L::fmadd(L::load(row_mins + g), L::load(sums + g), min_terms);
        float total = L::sum(sum[r * M + m]) + L::sum(min_terms);
        for (; g < G; ++g) total += row_mins[g] * sums[g];
        acc[r * M + m] = total;
      }
    }
  }
};

// y[m0 + m, n] = dot(n, m0 + m) * x_scale[m0 + m] * scales[n] + bias[n] for n in [begin, end), m < MR;
// R weight rows per dot call
template <typename F, typename Y, int MR, int R>
void chunk_rows(const F& f, int64_t m0, const float* scales, const float* bias, Y* y, int64_t N, int64_t begin,
                int64_t end) {
  float acc[R * MR];
  auto store = [&](int64_t row, int r) {
    const float s = scales ? scales[row] : 1.0f, b = bias ? bias[row] : 0.0f;
    for (int m = 0; m < MR; ++m) {
      y[(m0 + m) * N + row] = static_cast<Y>(acc[r * MR + m] * f.x_scale[m0 + m] * s + b);
    }
  };
  int64_t n = begin;
  for (; n + R <= end; n += R) {
    f.template dot<R, MR>(n, acc, m0);
    for (int r = 0; r < R; ++r) store(n + r, r);
  }
  if constexpr (R > 1) {  // the rows after the last whole group of R
    for (; n < end; ++n) {
      f.template dot<1, MR>(n, acc, m0);
      store(n, 0);
    }
  }
}

// chunk_rows for a chunk of mr <= MR activation rows: with one, F::kTileRows weight rows per dot call; with
// more, one (a decode batch: weight rows streamed one at a time) or, for `many` rows, F::kRows
template <typename F, typename Y, bool many, int MR = F::kChunk>
void chunk_rows_of(int64_t mr, const F& f, int64_t m0, const float* scales, const float* bias, Y* y, int64_t N,
                   int64_t begin, int64_t end) {
  if constexpr (MR > 1) {
    if (mr < MR) return chunk_rows_of<F, Y, many, MR - 1>(mr, f, m0, scales, bias, y, N, begin, end);
  }
  constexpr int R = MR == 1 ? F::kTileRows : many ? F::kRows : 1;
  chunk_rows<F, Y, MR, R>(f, m0, scales, bias, y, N, begin, end);
}

// Weight rows [begin, end) times every activation row, F::kChunk activation rows at a time: a decode batch
// (up to kDecodeRows) row by row, each weight row read from memory by the first chunk and from L1 by the
// others; more rows per tile of weight rows, read from memory by the first chunk and from L2 by the others.
template <typename F, typename Y>
void rows(const F& f, int64_t M, const float* scales, const float* bias, Y* y, int64_t N, int64_t begin,
          int64_t end, int64_t row_bytes) {
  const bool many = M > kDecodeRows;
  const int64_t tile = many ? std::max<int64_t>(F::kRows, kTileBytes / row_bytes / F::kRows * F::kRows)
                            : M <= F::kChunk ? end - begin : 1;
  for (int64_t t = begin; t < end; t += tile) {
    const int64_t t_end = std::min(end, t + tile);
    for (int64_t m0 = 0; m0 < M; m0 += F::kChunk) {
      const int64_t mr = std::min<int64_t>(F::kChunk, M - m0);
      if (many) {
        chunk_rows_of<F, Y, true>(mr, f, m0, scales, bias, y, N, t, t_end);
      } else {
        chunk_rows_of<F, Y, false>(mr, f, m0, scales, bias, y, N, t, t_end);
      }
    }
  }
}

// Split the weight rows across torch's threads.
template <typename F, typename Y>
void run_rows(const F& f, int64_t M, const float* scales, const float* bias, Y* y, int64_t N, int64_t row_bytes) {
  at::parallel_for(0, N, kGrain, [&](int64_t begin, int64_t end) { rows(f, M, scales, bias, y, N, begin, end, row_bytes); });
}

// Each row of x (M, K) -> x * rsqrt(mean(x^2) + eps) * norm_weight, in fp32: the RMSNorm before the product
inline void rms_normalize(float* x, int64_t M, int64_t K, const float* norm_weight, double eps) {
  for (int64_t m = 0; m < M; ++m) {
    float* row = x + m * K;
    double sum_sq = 0;
    for (int64_t k = 0; k < K; ++k) sum_sq += static_cast<double>(row[k]) * row[k];
    const float inv_rms = static_cast<float>(1.0 / std::sqrt(sum_sq / K + eps));
    for (int64_t k = 0; k < K; ++k) row[k] = row[k] * inv_rms * norm_weight[k];
  }
}

// Each row [gate, up] of x (M, 2K) -> silu(gate) * up (M, K), packed to the front: the SwiGLU before w2
inline void swiglu(float* x, int64_t M, int64_t K) {
  for (int64_t m = 0; m < M; ++m) {
    const float* gate = x + m * 2 * K;
    const float* up = gate + K;
    float* out = x + m * K;  // never ahead of the values it reads
    int64_t k = 0;
    for (; k + kLanes <= K; k += kLanes) {
      const Wide::V g = Wide::load(gate + k);
      const Wide::V silu = Wide::div(g, Wide::add(Wide::set1(1.0f), exp<Wide>(Wide::sub(Wide::zero(), g))));
      Wide::store(out + k, Wide::mul(silu, Wide::load(up + k)));
    }
    for (; k < K; ++k) out[k] = gate[k] / (1.0f + std::exp(-gate[k])) * up[k];
  }
}

// One projection's weights as the kernel reads them: W in one of four formats,
//   fp32, bf16 or int8 (N, K), with `scales` (N,) for int8; or uint8 (N, K / 2) int4 codes with
//   `scales` and `mins` (N, K / group); bias (N,). Scales, mins and bias are read as fp32 (converted
//   once, here, when they are bf16).
struct Projection {
  at::Tensor weight;
  Floats scales, mins, bias;
  int64_t N = 0, K = 0, group = 0;

  Projection(const at::Tensor& w, const std::optional<at::Tensor>& scales_, const std::optional<at::Tensor>& mins_,
             const std::optional<at::Tensor>& bias_)
      : weight(w), scales(optional_floats(scales_)), mins(optional_floats(mins_)), bias(optional_floats(bias_)) {
    TORCH_CHECK(w.dim() == 2 && w.is_contiguous(), "gemv: weight must be a contiguous (N, K) matrix");
    const bool int4 = w.scalar_type() == at::kByte;
    N = w.size(0);
    K = int4 ? 2 * w.size(1) : w.size(1);
    TORCH_CHECK(K % kStep == 0 && K <= kMaxK, "gemv: K must be a multiple of 16 and at most 8192, got ", K);
    TORCH_CHECK(!bias_ || bias_->numel() == N, "gemv: bias must have N = ", N, " values");
    if (int4) {
      TORCH_CHECK(scales_ && mins_ && scales_->dim() == 2 && scales_->size(0) == N && scales_->sizes() == mins_->sizes(),
                  "gemv: int4 weights need scales and mins of shape (N, K / group_size)");
      group = K / scales_->size(1);
      TORCH_CHECK(group % Int4Format::kBlock == 0 && group * scales_->size(1) == K,
                  "gemv: the int4 group size must be a multiple of 32 dividing K");
    } else {
      TORCH_CHECK(w.scalar_type() == at::kFloat || w.scalar_type() == at::kBFloat16 || w.scalar_type() == at::kChar,
                  "gemv: weights must be float32, bfloat16, int8 or uint8 int4 codes, got ", w.scalar_type());
      TORCH_CHECK(!scales_ || scales_->numel() == N, "gemv: scales must have N = ", N, " values");
    }
  }

  // y (M, N) = x (M, K, already normalized or gated) @ W.T * scales + bias
  template <typename Y>
  void operator()(const float* x, int64_t M, Y* y) const {
    TORCH_CHECK(M >= 1, "gemv: no activation rows");
    const int64_t row_bytes = weight.nbytes() / N;
    switch (weight.scalar_type()) {
      case at::kFloat:
        run_rows(DenseFormat<Fp32Step>(weight.data_ptr<float>(), K, x, M), M, scales.data(), bias.data(), y, N, row_bytes);
        break;
      case at::kBFloat16:
        run_rows(DenseFormat<Bf16Step>(weight.data_ptr<at::BFloat16>(), K, x, M), M, scales.data(), bias.data(), y, N,
                 row_bytes);
        break;
      case at::kChar:
        run_rows(DenseFormat<Int8Step>(weight.data_ptr<int8_t>(), K, x, M), M, scales.data(), bias.data(), y, N, row_bytes);
        break;
      default:
        run_rows(Int4Format(weight.data_ptr<uint8_t>(), K, group, scales.data(), mins.data(), x, M), M, nullptr,
                 bias.data(), y, N, row_bytes);
    }
  }

 private:
  static Floats optional_floats(const std::optional<at::Tensor>& t) {
    return t && t->numel() ? Floats(t->contiguous(), false) : Floats();
  }
};

}  // namespace INFERLAB_ISA
}  // namespace inferlab
