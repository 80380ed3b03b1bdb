// Matrix products on x86 CPUs: y = prepare(x) @ W.T for any number of activation rows, from one decode
// token to a prompt chunk of many sequences' tokens.
//
// Decoding one token reads every weight once and does two flops per weight, so the speed limit is
// how fast the weights stream from memory. This kernel reads each weight row from memory exactly once
// per call, a step of 16 or 32 weights at a time, with several independent accumulators and software
// prefetches far enough ahead that memory, not the instruction window, sets the pace (the hardware prefetchers
// alone keep too few lines in flight). Many activation rows make it a GEMM: each thread goes over
// tiles of its weight rows small enough to stay in L2 and, per tile, over all activation rows a few at
// a time, so a weight row comes from memory once and from cache for every further chunk of rows.
// fp32 weights are fused-multiply-added, bf16 weights too once widened to fp32 (a shift or a mask) on AVX2, while the
// AVX-512 builds take the activations in bf16 to AVX-512 BF16's dots (the amx build's on AMX tiles: amx.h);
// int8 and int4 weights meet int16 activation codes in exact integer multiply-adds (one instruction per
// 2 * kLanes weights; the amx build's int8 ones on AMX tiles from kInt8TilesMinRows rows on, to the same floats),
// int4 with a float scale and min per group as GGUF's Q4_1 defines them, its weight rows in vector lanes
// (Int4Format). Every (weight row, activation row) product is summed in the same
// order whatever else is in the call, so a row's result does not depend on how many rows came with it
// (a 1-row decode and a K+1-row speculative verification agree to the bit). Rows are split across
// torch's intra-op threads. Written once over the SIMD layer (simd.h) and compiled per instruction set.
// Used by the `gemv` op (gemv.cpp) and the whole decode step (decode_step.cpp).
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>

#include <cstdlib>
#include <numeric>
#include <optional>

#include "amx.h"
#include "ggml_blocks.h"
#include "parallel.h"
#include "simd.h"

namespace inferlab {
inline namespace INFERLAB_ISA {

constexpr int64_t kDecodeRows = 8;    // up to this many activation rows a call is memory-bound (a decode batch)
constexpr int64_t kStep = 16;         // K must be a multiple of it; a format's step reads this many weights or twice as many
constexpr int64_t kMaxK = 32768;      // Llama-3.1-8B's down projection takes 14336
constexpr float kInt16Max = 16383;    // activation codes for integer weights: 2 * 127 * 16383 * (K / 16) fits int32
constexpr int64_t kInt8ExactK = 8192;  // ... up to this K; int8 weights' codes over more columns are kept smaller
constexpr float kInt8Max = 127;       // int4 weights' int8 activation codes per block (Int4Format's int8_x)
// The amx build's int8 weights go on AMX tiles from this many activation rows on (amx.h: Int8Tiles; the same floats
// as Int8Step's): a tile instruction costs the same whatever its rows, so below this the vector dots, whose work
// grows with the rows, are cheaper, and above it the tiles
constexpr int64_t kInt8TilesMinRows = 6;
// On the amx build, an int4 layer's products of a plan's dense_from_rows rows or more are taken in bf16 (the numbers
// of its bf16 copy): its tiles dequantized in cache (amx.h: Int4DequantTiles) up to this many rows, its copy streamed
// from memory from here on, where the copy's single pass outruns dequantizing (amx.h: Int4DequantTiles)
constexpr int64_t kInt4CopyFromRows = 56;

constexpr int64_t kL1PrefetchBytes = 4 * 1024;  // int4 tiles: the lines requested into L1 this far ahead too

// Activations as the integer formats read them: x / max|x| * `largest` (int16_codes: kInt16Max), rounded (to nearest
// even, as lrintf); returns the scale that undoes it
inline float int16_codes_up_to(float largest, const float* x, int64_t K, int16_t* out) {
  Wide::V amax = Wide::zero();
  int64_t k = 0;
  for (; k + kLanes <= K; k += kLanes) amax = Wide::max(amax, Wide::abs(Wide::load(x + k)));
  float m = Wide::max(amax);
  for (; k < K; ++k) m = std::max(m, std::abs(x[k]));
  const float scale = m > 0 ? m / largest : 1.0f;
  const Wide::V scale_v = Wide::set1(scale);
  for (k = 0; k + kLanes <= K; k += kLanes) Wide::store_int16(out + k, Wide::div(Wide::load(x + k), scale_v));
  for (; k < K; ++k) out[k] = static_cast<int16_t>(std::lrintf(x[k] / scale));
  return scale;
}
inline float int16_codes(const float* x, int64_t K, int16_t* out) { return int16_codes_up_to(kInt16Max, x, K, out); }

// int16_codes for int8 weights, whose products a lane sums in int32 over the whole row (Int8Step, amx.h's Int8Tiles):
// beyond kInt8ExactK columns, codes scaled down so that the sum still fits (13 bits at Llama-3.1-8B's 14336)
inline float int8_weight_codes(const float* x, int64_t K, int16_t* out) {
  return int16_codes_up_to(K <= kInt8ExactK ? kInt16Max : std::floor(kInt16Max * kInt8ExactK / K), x, K, out);
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
//   dot<R, M>(n, acc, m0, from_memory): acc[r * M + m] = (weight row n + r) . (activation row m0 + m) / x_scale[m0 + m]
// with each product's sum in one order for every R and M (batch invariance). from_memory: this is the call's first
// pass over these weight rows, whose stream is prefetched; later passes (more activation rows) find them in cache,
// where a prefetch per line is only one more load instruction per few multiply-adds, so they go without.
// kTileRows weight rows go into one dot call with a single activation row, kRows with up to kChunk of many
// activation rows.
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
    for_each_row(M, [&](int64_t m) { x_scale[m] = Step::prepare(xf + m * K, K, x.data() + m * stride); });
  }

  template <int R, int M>
  void dot(int64_t n, float* acc, int64_t m0, bool from_memory) const {
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
      if constexpr (kWidth > kStep) {
        if (whole < K) part[1] = Step::tail(rows + whole, xs + whole / kWidth * X_STEP, part[1]);
      }
      acc[0] = Step::total(Step::add(Step::add(part[0], part[1]), Step::add(part[2], part[3])));
      return;
    }
    for (int64_t k = 0; k < whole; k += kWidth) {
      for (int r = 0; r < R; ++r) {
        if (from_memory) prefetch_l2(rows + r * K + k);
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
  // one activation row: one weight row at a time, as one stream (fp32 and bf16 alike: several rows in flight per
  // thread are several streams, which the prefetchers follow worse than one)
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

#ifdef INFERLAB_AVX512
// bf16 weights times the activations rounded to bf16 (to nearest even), each 32-bit lane a pair of columns of both,
// summed in fp32 by AVX-512 BF16's dot instruction (VDPBF16PS: 32 exact products a step). A prompt's many rows are
// bound by the multiply-adds, and the dot does twice the columns of Bf16Step's widened fused multiply-adds per
// instruction with no widening, so a prompt chunk runs about twice as fast; one row streams its weights as fast
// either way. Rounding the activations to bf16 is what a bf16 model does between its layers anyway and what the amx
// build's tiles do (amx.h: Bf16Tiles); every row takes it, whatever the call's rows (batch invariance), so a decode
// and a prompt chunk get the same sums.
struct Bf16DotStep {
  static constexpr int kTileRows = 1, kRows = 4, kChunk = 4;
  static constexpr bool kExact = false;
  static constexpr int64_t kWidth = 2 * kLanes, kXPerWeight = 1;
  using W = at::BFloat16;
  using X = at::BFloat16;
  using Acc = __m512;
  static Acc zero() { return _mm512_setzero_ps(); }
  static Acc dots(__m512i pairs, const X* x, Acc acc) {
    return _mm512_dpbf16_ps(acc, reinterpret_cast<__m512bh>(_mm512_loadu_si512(x)), reinterpret_cast<__m512bh>(pairs));
  }
  static Acc step(const W* w, const X* x, Acc acc) { return dots(Wide::load_pairs(w), x, acc); }
  static Acc tail(const W* w, const X* x, Acc acc) { return dots(Wide::load_pairs_half(w), x, acc); }
  static float total(Acc acc) { return Wide::sum(acc); }
  static float prepare(const float* x, int64_t K, X* out) {  // out: zeros, round_up(K, kWidth) of them
    for (int64_t k = 0; k < K; k += kStep) {
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + k),
                          reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(_mm512_loadu_ps(x + k))));
    }
    return 1.0f;
  }
};
using Bf16Weights = DenseFormat<Bf16DotStep>;

// bf16 weights laid out at load in blocks of 16 rows (kernels/gemv.py: pack_bf16), per pair of columns one 64-byte
// vector: (N / 16, K / 2, 16) pairs, row n's columns (2p, 2p + 1) at [n / 16, p, n % 16]. One VDPBF16PS then takes
// one such vector times one activation pair broadcast from memory and updates 16 outputs' fp32 sums, a lane each:
// no horizontal sum per output (Bf16DotStep's ~10 instructions an output, a quarter of the work at K = 960), and
// each broadcast feeds kBlocks blocks. Each output is one chain of dots over the pairs in column order, whatever the
// call's rows (batch invariance: a 1-row decode and a prompt chunk get the same sums); only its place in memory
// between passes changes. A decode row keeps kDecodeBlocks blocks in flight as independent chains (a dot waits ~5
// cycles on the one before it in its chain), each a stream of lines prefetched into L2; many rows go over kBlocks
// blocks kPairs pairs at a time (their 64 KiB stay in L2 while every chunk of kChunk activation rows meets them),
// their sums kept between passes in a buffer of the thread's.
// The amx build keeps row-major weights: its A tiles read 16 rows of 32 columns (amx.h: Bf16Tiles).
struct Bf16Blocks {
  static constexpr int64_t kRows = 16;  // weight rows per block: an fp32 lane each
  static constexpr int kBlocks = 4;     // blocks per pass (4 weight vectors + kChunk x 4 sums of 32 registers)
  static constexpr int kDecodeBlocks = 8;  // ... of one activation row
  static constexpr int kChunk = 6;      // activation rows per pass
  static constexpr int64_t kPairs = 256;  // pairs per pass: kBlocks blocks' 64 KiB
  const uint32_t* w;  // (N / kRows, K / 2, kRows) pairs of bf16
  int64_t N, K, pairs;
  std::vector<uint32_t> x;  // (M, K / 2): each activation row's pairs rounded to bf16 (to nearest even), as Bf16DotStep's

  Bf16Blocks(const at::BFloat16* weights, int64_t N_, int64_t K_, const float* xf, int64_t M)
      : w(reinterpret_cast<const uint32_t*>(weights)), N(N_), K(K_), pairs(K_ / 2), x(M * (K_ / 2)) {
    for_each_row(M, [&](int64_t m) { Bf16DotStep::prepare(xf + m * K, K, reinterpret_cast<at::BFloat16*>(x.data() + m * pairs)); });
  }

  // sums[b * MR + m] (+)= block b0 + b's rows . activation row m0 + m over pairs [p0, p1): `start` begins the sums
  template <int B, int MR>
  void pass(int64_t b0, int64_t m0, int64_t p0, int64_t p1, __m512* sums, bool start, bool from_memory) const {
    __m512 acc[B * MR];  // in registers through the pass (through the pointer, each update would go to memory)
    for (int i = 0; i < B * MR; ++i) acc[i] = start ? _mm512_setzero_ps() : sums[i];
    const uint32_t* blocks = w + (b0 * pairs + p0) * kRows;
    const uint32_t* xs = x.data() + m0 * pairs + p0;
    for (int64_t p = 0; p < p1 - p0; ++p) {
      __m512i wv[B];
      for (int b = 0; b < B; ++b) {
        const uint32_t* line = blocks + (b * pairs + p) * kRows;
        if (from_memory) prefetch_l2(line);
        wv[b] = _mm512_loadu_si512(line);
      }
      for (int m = 0; m < MR; ++m) {
        const __m512bh pair = reinterpret_cast<__m512bh>(_mm512_set1_epi32(static_cast<int>(xs[m * pairs + p])));
        for (int b = 0; b < B; ++b) acc[b * MR + m] = _mm512_dpbf16_ps(acc[b * MR + m], reinterpret_cast<__m512bh>(wv[b]), pair);
      }
    }
    for (int i = 0; i < B * MR; ++i) sums[i] = acc[i];
  }

  // pass<B, MR> for b <= B blocks and mr <= MR rows, chosen at run time
  template <int B, int MR>
  void pass_of(int b, int mr, int64_t b0, int64_t m0, int64_t p0, int64_t p1, __m512* sums, bool start,
               bool from_memory) const {
    if constexpr (MR > 1) {
      if (mr < MR) return pass_of<B, MR - 1>(b, mr, b0, m0, p0, p1, sums, start, from_memory);
    }
    if constexpr (B > 1) {
      if (b < B) return pass_of<B - 1, MR>(b, mr, b0, m0, p0, p1, sums, start, from_memory);
    }
    pass<B, MR>(b0, m0, p0, p1, sums, start, from_memory);
  }

  // y (M, N) = x @ W.T * scales + bias, blocks split across torch's threads
  template <typename Y>
  void operator()(int64_t M, const float* scales, const float* bias, Y* y) const {
    // activation rows in chunks of near-equal size, as rows() makes them (which chunk a row is in does not change
    // its sums)
    const int64_t chunks = (M + kChunk - 1) / kChunk, group = M == 1 ? kDecodeBlocks : kBlocks;
    at::parallel_for(0, N / kRows, std::max<int64_t>(1, kGrain / kRows), [&](int64_t begin, int64_t end) {
      std::vector<__m512> sums(M * group);  // per chunk of rows: its b * rows sums at [m0 * group]
      for (int64_t b0 = begin; b0 < end; b0 += group) {
        const int b = static_cast<int>(std::min(group, end - b0));
        for (int64_t p0 = 0; p0 < pairs; p0 += kPairs) {
          const int64_t p1 = std::min(pairs, p0 + kPairs);
          for (int64_t c = 0, m0 = 0; c < chunks; ++c) {
            const int mr = static_cast<int>(M / chunks + (c < M % chunks));
            if (M == 1) {
              pass_of<kDecodeBlocks, 1>(b, mr, b0, m0, p0, p1, sums.data(), p0 == 0, true);
            } else {
              pass_of<kBlocks, kChunk>(b, mr, b0, m0, p0, p1, sums.data() + m0 * group, p0 == 0, c == 0);
            }
            m0 += mr;
          }
        }
        for (int64_t c = 0, m0 = 0; c < chunks; ++c) {
          const int mr = static_cast<int>(M / chunks + (c < M % chunks));
          for (int i = 0; i < b; ++i) {
            for (int m = 0; m < mr; ++m) {
              alignas(64) float lanes[kRows];
              _mm512_store_ps(lanes, sums[m0 * group + i * mr + m]);
              const int64_t n = (b0 + i) * kRows;
              for (int64_t r = 0; r < kRows; ++r) {
                y[(m0 + m) * N + n + r] =
                    static_cast<Y>(lanes[r] * (scales ? scales[n + r] : 1.0f) + (bias ? bias[n + r] : 0.0f));
              }
            }
          }
          m0 += mr;
        }
      }
    });
  }
};
#endif
// Rows per block of bf16 weights laid out for this build (Bf16Blocks; kernels/gemv.py: pack_bf16), 0: kept as rows
#if defined(INFERLAB_AVX512) && !defined(INFERLAB_AMX)
constexpr int64_t kBf16BlockRows = Bf16Blocks::kRows;
#else
constexpr int64_t kBf16BlockRows = 0;
#endif
#ifndef INFERLAB_AVX512
// bf16 weights widened to fp32 and fused-multiply-added with the fp32 activations, 2 * kLanes weights a
// step (the avx2 build, which has no bf16 dots; the AVX-512 builds take Bf16DotStep): bf16 is the high half of an
// fp32, so a 32-bit lane holding weights 2i and 2i+1 gives weight 2i shifted up and weight 2i+1 masked, and each
// step's activations are stored evens first, then odds. Every product is exact and each sum rounds once, in fp32.
struct Bf16Step {
  static constexpr int kTileRows = 1, kRows = 2, kChunk = 4;  // kTileRows: as fp32's
  static constexpr bool kExact = false;
  static constexpr int64_t kWidth = 2 * kLanes, kXPerWeight = 1;
  using W = at::BFloat16;
  using X = float;
  using Acc = Wide::V;
  static Acc zero() { return Wide::zero(); }
  static Acc dots(Wide::I pairs, const X* x, Acc acc) {
    const Wide::V even = Wide::even_bf16(pairs), odd = Wide::odd_bf16(pairs);
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
using Bf16Weights = DenseFormat<Bf16Step>;
#endif

// int8 weights times int16 activation codes, summed exactly in int32 (madd, or VNNI's dpwssd), one
// instruction per 2 * L::N weights, on lanes L: 256-bit steps for one activation row (512-bit ones, 32 bytes
// widened a step, are slower where 512-bit widening shuffles are double-pumped, and one row is bound by the stream,
// not the multiply-adds; the AVX-512 build still gains VNNI's fused multiply-add of the dots), the widest for more
// (many rows are bound by the multiply-adds, twice as many per 512-bit instruction). Each product sums in its 256-bit lane on
// both (a 512-bit vector's halves are added before the total), so both give a row the same float, to the bit.
template <typename L>
struct Int8Step {
  // one row at a time, as one stream: int8 rows are short (a row of a few hundred weights is a few cache
  // lines), and several of them in flight per thread are several streams, which the prefetchers follow worse
  static constexpr int kTileRows = 1, kRows = kLanes == 16 ? 4 : 2, kChunk = 4;
  static constexpr bool kExact = true;
  static constexpr int64_t kWidth = 2 * L::N, kXPerWeight = 1;
  using W = int8_t;
  using X = int16_t;
  using Acc = typename L::I;
  static Acc zero() { return L::zero_int(); }
  static Acc step(const W* w, const X* x, Acc acc) { return L::dot_int16(acc, L::widen(w), L::load_int(x)); }
  static Acc tail(const W* w, const X* x, Acc acc) { return L::dot_int16(acc, L::widen_half(w), L::load_int(x)); }
  static Acc add(Acc a, Acc b) { return L::add(a, b); }
  static float total(Acc acc) {  // the exact integer sum, rounded to float once (as amx.h's Int8Tiles rounds its own)
    const __m256i lanes = L::halves_added(acc);
    const __m256i wide = _mm256_add_epi64(_mm256_cvtepi32_epi64(_mm256_castsi256_si128(lanes)),
                                          _mm256_cvtepi32_epi64(_mm256_extracti128_si256(lanes, 1)));
    alignas(32) int64_t parts[4];
    _mm256_store_si256(reinterpret_cast<__m256i*>(parts), wide);
    return static_cast<float>(parts[0] + parts[1] + parts[2] + parts[3]);
  }
  static float prepare(const float* x, int64_t K, X* out) { return int8_weight_codes(x, K, out); }
};

// y[m0 + m, n] = dot(n, m0 + m) * x_scale[m0 + m] * scales[n] + bias[n] for n in [begin, end), m < MR;
// R weight rows per dot call
template <typename F, typename Y, int MR, int R>
void chunk_rows(const F& f, int64_t m0, const float* scales, const float* bias, Y* y, int64_t N, int64_t begin,
                int64_t end, bool from_memory) {
  float acc[R * MR];
  auto store = [&](int64_t row, int r) {
    const float s = scales ? scales[row] : 1.0f, b = bias ? bias[row] : 0.0f;
    for (int m = 0; m < MR; ++m) {
      y[(m0 + m) * N + row] = static_cast<Y>(acc[r * MR + m] * f.x_scale[m0 + m] * s + b);
    }
  };
  int64_t n = begin;
  for (; n + R <= end; n += R) {
    f.template dot<R, MR>(n, acc, m0, from_memory);
    for (int r = 0; r < R; ++r) store(n + r, r);
  }
  if constexpr (R > 1) {  // the rows after the last whole group of R
    for (; n < end; ++n) {
      f.template dot<1, MR>(n, acc, m0, from_memory);
      store(n, 0);
    }
  }
}

// chunk_rows for a chunk of mr <= MR activation rows: with one, F::kTileRows weight rows per dot call; with
// more, F::kRows, each activation load shared by their products: a decode batch of 2-8 rows (a speculative
// verification) is bound by the multiply-adds, not the weights' stream, and loads of the activations are a large
// part of them
template <typename F, typename Y, int MR = F::kChunk>
void chunk_rows_of(int64_t mr, const F& f, int64_t m0, const float* scales, const float* bias, Y* y, int64_t N,
                   int64_t begin, int64_t end, bool from_memory) {
  if constexpr (MR > 1) {
    if (mr < MR) return chunk_rows_of<F, Y, MR - 1>(mr, f, m0, scales, bias, y, N, begin, end, from_memory);
  }
  constexpr int R = MR == 1 ? F::kTileRows : F::kRows;
  chunk_rows<F, Y, MR, R>(f, m0, scales, bias, y, N, begin, end, from_memory);
}

// Weight rows [begin, end) times every activation row, F::kChunk activation rows at a time: a decode batch
// (up to kDecodeRows) F::kRows weight rows at a time, read from memory by the first chunk and from L1 by the
// others; more rows per tile of weight rows, read from memory by the first chunk and from L2 by the others.
template <typename F, typename Y>
void rows(const F& f, int64_t M, const float* scales, const float* bias, Y* y, int64_t N, int64_t begin,
          int64_t end, int64_t row_bytes) {
  const bool many = M > kDecodeRows;
  const int64_t tile = many ? std::max<int64_t>(F::kRows, kTileBytes / row_bytes / F::kRows * F::kRows)
                            : M <= F::kChunk ? end - begin : F::kRows;
  // activation rows in chunks of near-equal size (5 rows: 3 + 2, not 4 + 1): a chunk of one row beside others
  // sums into one chain of fused multiply-adds that waits on itself, the weights already in cache (a step of 5 rows
  // in 4 + 1 would take longer than one of 4; in 3 + 2, about as long). Which chunk a row falls in does not change
  // its sums
  const int64_t chunks = (M + F::kChunk - 1) / F::kChunk;
  for (int64_t t = begin; t < end; t += tile) {
    const int64_t t_end = std::min(end, t + tile);
    for (int64_t c = 0, m0 = 0; c < chunks; ++c) {
      const int64_t rows_in_chunk = M / chunks + (c < M % chunks);
      chunk_rows_of<F, Y>(rows_in_chunk, f, m0, scales, bias, y, N, t, t_end, c == 0);
      m0 += rows_in_chunk;
    }
  }
}

// Split the weight rows across torch's threads.
template <typename F, typename Y>
void run_rows(const F& f, int64_t M, const float* scales, const float* bias, Y* y, int64_t N, int64_t row_bytes) {
  at::parallel_for(0, N, kGrain, [&](int64_t begin, int64_t end) { rows(f, M, scales, bias, y, N, begin, end, row_bytes); });
}

// 4-bit codes q in [0, 15], two per byte (even column in the low nibble), w = q * scale + min per group
// of `group` columns (GGUF Q4_1's arithmetic), multiplied across rows: the L::N lanes of a vector are L::N
// consecutive weight rows (a block), so each row's sum is a lane, updated once per 32 columns in one order.
// The activations are the int16 codes the int8 format takes (int16_codes: x / max|x| * 16383 per row, the
// scale applied once at the end), the weights' nibbles widened in place to int16 pairs: a row's 4 bytes of 8
// columns (chunk) hold column j in bits 4j..4j+3, so masks of bytes and bytes >> 8 give the pairs of columns
// s and s + 4 (s < 4; s odd: 16 times them), each multiplied by the activation pair (x[s], x[s + 4]) in one
// int16 multiply-add of pairs (VNNI's vpdpwssd, AVX2's madd): 8 instructions per chunk and row of
// activations on AVX2, 4 on AVX-512, 5 per chunk to unpack it. The products sum exactly in int32 (the
// 16-fold ones apart, shifted back per block: <= 16 * 15 * 16383 * 32 a block), so the integers are the
// int16-code kernel's, in any order. Per row and block of 32 columns, in this order on every path:
// sum += float(q . codes) * scale; at a group's first block, sum += min * (the group's sum of codes);
// y = sum * x_scale + bias. Two ways to get it:
//  - tiled: a block's codes transposed into a buffer (chunks of 8 columns, L::N rows: 4 bytes a row), each
//    activation pair broadcast to every row; a tile of blocks (kTileBytes) read by every chunk of kChunk
//    activation rows. A layer's weights laid out as these tiles once (Projection's int4 tiles, quant/int4.py) are
//    read as one stream at any M, their scales and mins as fp16 (GGUF's Q4_1 stores them so, and quant/int4.py
//    rounds its own to fp16): a block of 32 columns is 20 bytes a row, not 24.
//  - streamed (untiled weights, up to kStreamRows activation rows: the gemv op's decode): each weight row
//    read whole, one after the other, L::N chunks a vector (their lanes summed per block at the end), the
//    L::N rows' dots then transposed into lanes. Transposing L::N rows as they are read makes L::N streams,
//    which the hardware prefetchers follow too late.
// With int8_x (a speculative draft's projections, whose errors cost only acceptance), the activations are int8
// codes per block of 32 columns instead (x / max|x| of the block * 127, rounded; llama.cpp's Q8 blocks): the low
// nibbles of a chunk's 4 bytes are its columns 0, 2, 4, 6 and (bytes >> 4)'s its columns 1, 3, 5, 7, each four
// uint8 times four int8 codes in one multiply-add of quads (VNNI's vpdpbusd; AVX2's maddubs + an int16 add, the
// block's sums widened to int32 once): 2 instructions per chunk and row of activations on AVX-512, 4 on AVX2 (6
// when each chunk widened its own), 3 to unpack it, and a block's float update
// sum += float(q . codes) * scale * the block's code scale. int4 at int8 codes has about ten times the logit
// error of its int16 codes against fp32, so the served int4 model keeps int16 unless asked (precision.activations).
// GGUF's Q4_K is this arithmetic at group 32 (w = d * sc * q - dmin * m per sub-block of 32), so a Q4_K file's
// weights are laid out as these tiles at load (quant/gguf_tiles.py), with their own scale lines (kind kQ4K): per
// super-block of 256 columns one line of the rows' fp16 d, then their fp16 -dmin, then the 6-bit sc and m of its 8
// sub-blocks as int8 lines (8 x L::N each): 148 bytes a row per 256 columns where the file's blocks take 144 (sc and m
// a byte each, not 6 bits), and exact, where an fp16 scale d * sc would round: each block's scale and min are their
// products in fp32 (11 by 6 bits: exact), made once per block for every activation row.
// GGUF's Q6_K is w = d * sc * (q - 32) per sub-block of 16 columns, q 6 bits: the same sums at group 16 (a float update
// per sub-block) with q's low 4 bits as these chunks and its high 2 bits in one more line per sub-block (kind kQ6K,
// quant/gguf_tiles.py): per super-block of 256 columns, per sub-block of 16 its two chunks and a line of their 32 high
// bit pairs, then a line of the rows' d (fp32, exact from fp16) and 4 lines of the 16 sub-blocks' int8 sc, so a tile
// is one stream. The pairs are put above the nibbles in the int16 lanes nibble_pairs makes (six_bit_pairs:
// 2 instructions a pair of lanes on AVX-512, made once for every activation row), so the dots take whole 6-bit codes
// at int4's 4 multiply-adds per chunk and row; the offset -32 is a min, -32 * d * sc per sub-block (exact), met with
// the sub-block's sum of activation codes as Q4_K's mins are. 212 bytes a row per 256 columns where the blocks take 210.
// At int8 codes (int8_x) a chunk's 6-bit codes are whole bytes (six_bit_bytes: the pairs brought above the nibbles,
// uint8 up to 63 in vpdpbusd's quads), the codes' scale one per super-block (llama.cpp's Q8_K), so that each
// sub-block's integer dot, less 32 times its sum of codes, meets its int8 sc as an integer and only the super-block's
// sum is a float update (d times the code scale): a sixteenth of the int16 path's float work.
// GGUF's 32-weight blocks Q5_0 (w = d * (q - 16), q 5 bits) and Q8_0 (w = d * q, q int8), where a K-quant file's rows
// are not a multiple of 256, are tiles the same way, in super-blocks of 2 blocks (64 columns) whose last line holds
// both blocks' fp16 d (kinds kQ5_0, kQ8_0; quant/gguf_tiles.py): as many bytes as the file's blocks. Q5_0: per block
// its 4 chunks of low nibbles and a line of its 32 fifth bits, put above the nibbles as Q6_K's pairs are
// (fifth_bit_pairs), the offset -16 a min -16 * d. Q8_0: per chunk 2 lines of int8 codes, each lane's 4 bytes columns
// (s, s + 1, s + 4, s + 5) for s = 0 and 2, whose int16 pairs (s, s + 4) and (s + 1, s + 5) are their low and high
// bytes sign-extended (int8_pairs, 3 instructions a line), met with the same activation pairs; no min.
struct Int4Format {
  using L = Wide;
  static constexpr int kChunk = kDecodeRows;  // activation rows per pass over a tiled block
  static constexpr int kStreamRows = 2;       // up to this many activation rows untiled weights are streamed
  static constexpr int64_t kBlock = 32;       // columns per float update; the group size is a multiple of it
  static constexpr int64_t kVectorBlocks = L::N / 4;  // blocks of one row a vector holds (16 bytes each)
  static constexpr int64_t kSlack = L::N * L::N;
  static constexpr int64_t kQ6KSuperCols = 256;  // Q6_K's super-block: 16 sub-blocks of 16 columns
  // What a tile made before holds besides its codes: per group fp16 scales and mins (quant/int4.py), or a K-quant's
  // own lines (Q4_K: group 32; Q6_K: group 16, high bit pairs among the codes; Q5_0: fifth bits among them; Q8_0)
  enum class Kind { kGroups, kQ4K, kQ6K, kQ5_0, kQ8_0 };
  // int8 activation codes (int8_x) take unsigned codes of at most 6 bits (uint8 times int8 quads): nibbles and
  // Q6_K's, not Q5_0's (their offset is not a sub-block's) or Q8_0's (signed)
  static constexpr bool takes_int8_codes(Kind kind) {
    return kind == Kind::kGroups || kind == Kind::kQ4K || kind == Kind::kQ6K;
  }
  const uint8_t* w;                           // (N, K / 2)
  // chunks of 8 columns, blocks of block_cols (kBlock, or a smaller group: Q6_K's 16), vectors of L::N chunks;
  // stride: int32 per activation row
  int64_t N, K, group, G, chunks, block_cols, blocks, vectors, stride;
  const float* scales;                        // (N, G)
  const float* mins;                          // (N, G)
  Kind kind;
  bool int8_x;                                // int8 activation codes per block (x8), else int16 per row (x)
  std::vector<int32_t> x;                     // (M, vectors, 4, L::N): per vector of chunks, for s < 4, the
                                              // activation pairs (x[8c + s], x[8c + s + 4]) of its chunks c
  std::vector<int32_t> x8;                    // int8_x: (M, chunks, 2): per chunk, its columns 0, 2, 4, 6 as 4
                                              // int8 codes, then its columns 1, 3, 5, 7
  std::vector<float> block_scale;             // int8_x: (M, blocks): the value of a code step in each block
  std::vector<int32_t> code_offsets;          // int8_x, kQ6K: (M, blocks): -32 times each block's sum of codes
  std::vector<float> x_scale;                 // (M,): 1 with int8_x
  std::vector<float> group_sums;              // (M, G): the sums of the codes (int8_x: of x itself)
  std::vector<int64_t> block_group;           // (blocks,): the group of each block (no division in the loops)
  std::vector<uint8_t> group_start;           // (blocks,): whether the block is its group's first

  Int4Format(const uint8_t* packed, int64_t N_, int64_t K_, int64_t group_, const float* scales_, const float* mins_,
             const float* xf, int64_t M, bool int8_activations, Kind kind_ = Kind::kGroups)
      : w(packed), N(N_), K(K_), group(group_), G(K_ / group_), chunks(K_ / 8), block_cols(std::min(group_, kBlock)),
        blocks(K_ / block_cols), vectors((chunks + L::N - 1) / L::N), stride(vectors * 4 * L::N), scales(scales_),
        mins(mins_), kind(kind_), int8_x(int8_activations), x(int8_x ? 0 : M * stride), x8(int8_x ? M * chunks * 2 : 0),
        block_scale(int8_x ? M * blocks : 0), code_offsets(int8_x && kind_ == Kind::kQ6K ? M * blocks : 0), x_scale(M),
        group_sums(M * G), block_group(blocks), group_start(blocks) {
    TORCH_CHECK(!int8_x || int8_code_cols() % block_cols == 0, "gemv: int8 activation codes need whole blocks");
    for (int64_t kb = 0; kb < blocks; ++kb) {
      block_group[kb] = kb * block_cols / group;
      group_start[kb] = kb * block_cols % group == 0;
    }
    for_each_row(M, [&](int64_t m) {
      if (int8_x) return int8_block_codes(xf + m * K, m);
      std::vector<int16_t> codes(K);
      x_scale[m] = int16_codes(xf + m * K, K, codes.data());
      for (int64_t g = 0; g < G; ++g) {
        group_sums[m * G + g] = std::accumulate(codes.data() + g * group, codes.data() + (g + 1) * group, 0.0f);
      }
      for (int64_t c = 0; c < chunks; ++c) {
        for (int s = 0; s < 4; ++s) {
          const uint32_t low = static_cast<uint16_t>(codes[8 * c + s]), high = static_cast<uint16_t>(codes[8 * c + s + 4]);
          pairs(m, c)[s * L::N] = static_cast<int32_t>(low | high << 16);
        }
      }
    });
  }
  // Columns per int8 code scale: kQ6K's super-block (llama.cpp's Q8_K: its sub-blocks' sums then meet their int8
  // scales as integers, one float update a super-block), else a block of 32
  int64_t int8_code_cols() const { return kind == Kind::kQ6K ? kQ6KSuperCols : kBlock; }
  // Activation row m (`row`, K values) as int8 codes per int8_code_cols columns, in the order the dots take them (x8);
  // block_scale per block of block_cols (each block: its code block's scale), kQ6K's code_offsets
  void int8_block_codes(const float* row, int64_t m) {
    x_scale[m] = 1.0f;
    for (int64_t g = 0; g < G; ++g) group_sums[m * G + g] = std::accumulate(row + g * group, row + (g + 1) * group, 0.0f);
    int8_t* codes = reinterpret_cast<int8_t*>(x8.data() + m * chunks * 2);
    const int64_t cols = int8_code_cols(), per_block = cols / block_cols;
    float rounded[kQ6KSuperCols];  // to nearest even
    for (int64_t cb = 0; cb < K / cols; ++cb) {
      const float* block = row + cb * cols;
      Wide::V amax = Wide::zero();
      for (int64_t j = 0; j < cols; j += kLanes) amax = Wide::max(amax, Wide::abs(Wide::load(block + j)));
      const float top = Wide::max(amax), inverse = top > 0 ? kInt8Max / top : 0.0f;
      std::fill_n(block_scale.data() + m * blocks + cb * per_block, per_block, top / kInt8Max);
      for (int64_t j = 0; j < cols; j += kLanes) {
        Wide::store(rounded + j, Wide::round(Wide::mul(Wide::load(block + j), Wide::set1(inverse))));
      }
      for (int64_t i = 0; i < cols; ++i) {  // position i: chunk i / 8, its columns of parity i % 8 / 4
        codes[cb * cols + i] = static_cast<int8_t>(rounded[8 * (i / 8) + 2 * (i % 4) + i % 8 / 4]);
      }
    }
    if (kind != Kind::kQ6K) return;
    for (int64_t kb = 0; kb < blocks; ++kb) {  // q - 32 met as q, less 32 times the block's codes
      code_offsets[m * blocks + kb] = -32 * std::accumulate(codes + kb * block_cols, codes + (kb + 1) * block_cols, 0);
    }
  }
  int32_t* pairs(int64_t m, int64_t c) {  // chunk c's pair for s = 0; s's L::N * s on
    return x.data() + m * stride + c / L::N * 4 * L::N + c % L::N;
  }
  const int32_t* pairs(int64_t m, int64_t c) const { return const_cast<Int4Format*>(this)->pairs(m, c); }

  // A block of L::N weight rows as the dots read it, from a buffer of codes (chunks, L::N) (tiled only), then
  // scales and mins: codes(c) the 4 bytes of chunk c per row, scale(g) and min(g) per row. Made before (in
  // memory): per group one line of L::N fp16 scales, then L::N fp16 mins (G, 2, L::N), or a K-quant's lines
  // (kQ4K: kSuperInts a super-block; lined kinds: Lined::super_ints); made here, in a buffer (in cache): fp32 scales (G, L::N),
  // then fp32 mins
  static constexpr int64_t kSubBlocks = 8;                         // Q4_K: sub-blocks (groups of 32) a super-block
  static constexpr int64_t kSuperInts = (1 + kSubBlocks / 2) * L::N;  // its lines: d and -dmin, then sc and m bytes
  // The kinds whose tiles are one stream of super-blocks (kQ6K, kQ5_0, kQ8_0): `blocks` blocks (groups) of `cols`
  // columns, `code_lines` lines each, then `lines` lines of factors. Q6_K: per sub-block 2 of nibbles, 1 of pairs, then
  // d and 4 of sc bytes; Q5_0: 4 of nibbles, 1 of fifth bits; Q8_0: 8 of int8 codes; both then the 2 blocks' fp16 d
  struct Lined {
    int64_t blocks, cols, code_lines, lines;
    constexpr int64_t code_ints() const { return blocks * code_lines * L::N; }
    constexpr int64_t super_ints() const { return code_ints() + lines * L::N; }
  };
  static constexpr bool is_lined(Kind kind) { return kind == Kind::kQ6K || kind == Kind::kQ5_0 || kind == Kind::kQ8_0; }
  static constexpr Lined lined(Kind kind) {
    return kind == Kind::kQ6K ? Lined{16, 16, 3, 5} : kind == Kind::kQ5_0 ? Lined{2, kBlock, 5, 1} : Lined{2, kBlock, 8, 1};
  }
  struct Tile {
    const int32_t* code_lanes;
    const float *scale_lanes, *min_lanes;  // made here
    const at::Half* half_lanes;            // made before (read from memory, prefetched); else null
    Kind kind;
    bool in_memory() const { return half_lanes != nullptr; }
    L::I codes(int64_t c) const { return L::load_int(code_lanes + c * L::N); }
    // lined kinds: block kb's code lines (kQ6K: its 2 chunks' low nibbles, then their high bit pairs)
    template <Kind kLined>
    const int32_t* lined_codes(int64_t kb) const {
      constexpr Lined l = lined(kLined);
      return code_lanes + kb / l.blocks * l.super_ints() + kb % l.blocks * l.code_lines * L::N;
    }
    // lined kinds: block kb's super-block lines of factors (kQ6K: fp32 d and then the int8 sc; kQ5_0, kQ8_0: fp16 d),
    // and a line of them for kb to prefetch (the super-block's spread over its blocks)
    template <Kind kLined>
    const int32_t* lined_factors(int64_t kb) const {
      constexpr Lined l = lined(kLined);
      return code_lanes + kb / l.blocks * l.super_ints() + l.code_ints();
    }
    template <Kind kLined>
    const int32_t* lined_factor_line(int64_t kb) const {
      constexpr Lined l = lined(kLined);
      return lined_factors<kLined>(kb) + kb % l.blocks * l.lines / l.blocks * L::N;
    }
    // kQ4K: group g's super-block line of fp16 factors (d, then -dmin) and its int8 line of sc (then m)
    const at::Half* factors(int64_t g) const { return half_lanes + g / kSubBlocks * 2 * kSuperInts; }
    const int8_t* sub_scales(int64_t g) const {
      return reinterpret_cast<const int8_t*>(factors(g) + 2 * L::N) + g % kSubBlocks * L::N;
    }
    L::V scale(int64_t g) const {  // lined kinds: Int4Format::lined_scales
      if (kind == Kind::kQ4K) return L::mul(L::load(factors(g)), L::load(sub_scales(g)));
      return in_memory() ? L::load(half_lanes + 2 * g * L::N) : L::load(scale_lanes + g * L::N);
    }
    L::V min(int64_t g) const {
      if (kind == Kind::kQ4K) return L::mul(L::load(factors(g) + L::N), L::load(sub_scales(g) + kSubBlocks * L::N));
      return in_memory() ? L::load(half_lanes + (2 * g + 1) * L::N) : L::load(min_lanes + g * L::N);
    }
    // in memory: the group's scales and mins (Q4_K's: a line of its super-block's, 8 groups over its 5 lines)
    const void* group_line(int64_t g) const {
      if (kind == Kind::kQ4K) return reinterpret_cast<const int32_t*>(factors(g)) + g % kSubBlocks * kSuperInts / kSubBlocks;
      return half_lanes + 2 * g * L::N;
    }
  };
  int64_t tile_ints() const { return (chunks + 2 * G) * L::N; }    // one block's buffer, in 4-byte values
  // a stored tile's codes (lined kinds: the whole tile, its lines among them)
  int64_t code_ints() const { return is_lined(kind) ? G / lined(kind).blocks * lined(kind).super_ints() : chunks * L::N; }
  int64_t stored_ints() const {  // one block's tile made before
    switch (kind) {
      case Kind::kQ4K:
        return code_ints() + G / kSubBlocks * kSuperInts;
      case Kind::kGroups:
        return code_ints() + G * L::N;
      default:  // lined
        return code_ints();
    }
  }
  int64_t row_blocks() const { return (N + L::N - 1) / L::N; }

  // Rows n.. of `values` (N, count) 4-byte values into out (count, L::N): L::N values of each row at a time,
  // transposed (rows past N repeat row N - 1); writes whole L::N x L::N squares, up to kSlack values past the end
  void transposed(const void* values_, int64_t count, int64_t n, int32_t* out) const {
    const int32_t* values = static_cast<const int32_t*>(values_);
    for (int64_t j0 = 0; j0 < count; j0 += L::N) {
      const int left = static_cast<int>(std::min<int64_t>(L::N, count - j0));
      L::I r[L::N];
      for (int i = 0; i < L::N; ++i) {
        const int32_t* at = values + std::min(n + i, N - 1) * count + j0;
        // the same values of the block after next requested now, one line a load: the L::N rows of a block are
        // a stream the hardware prefetchers follow too late (without: half the speed of reading row by row)
        _mm_prefetch(reinterpret_cast<const char*>(at + 2 * L::N * count), _MM_HINT_T0);
        r[i] = L::load_int(at, left);
      }
      L::transpose(r);
      for (int j = 0; j < L::N; ++j) L::store_int(out + (j0 + j) * L::N, r[j]);  // past `left`: overwritten next
    }
  }
  Tile lanes(int64_t n, int32_t* buffer) const {  // the scales and mins of the block of rows n.., into buffer
    const float* floats = reinterpret_cast<const float*>(buffer);
    transposed(scales, G, n, buffer);
    transposed(mins, G, n, buffer + G * L::N);
    return Tile{nullptr, floats, floats + G * L::N, nullptr, Kind::kGroups};
  }
  Tile tile(int64_t n, int32_t* buffer) const {  // the whole block of rows n.., written to buffer (tile_ints())
    transposed(w, chunks, n, buffer);
    Tile t = lanes(n, buffer + chunks * L::N);
    t.code_lanes = buffer;
    return t;
  }
  Tile tile_at(const int32_t* buffer) const {  // a block's tile made before (lined kinds: half_lanes only says so)
    return Tile{buffer, nullptr, nullptr, reinterpret_cast<const at::Half*>(buffer + code_ints()), kind};
  }

  // Block kb's scales and (at its group's first block) mins, a lane per row of the block: read once for every
  // activation row (converted from fp16 once, not once per row: in each row's update the conversions would be a
  // large share of a prompt's work)
  struct BlockScales {
    L::V scale, min;
    int64_t g;
    bool group_start;
  };
  BlockScales block_scales(const Tile& rows, int64_t kb) const {
    const int64_t g = block_group[kb];
    return {rows.scale(g), group_start[kb] ? rows.min(g) : L::zero(), g, group_start[kb] != 0};
  }
  // The lined kinds': a group a block (known at compile time where dot<.., kLined> inlines it: no test of the kind, of
  // a group's start or of block_group per block, which took a third of a Q6_K row's time). kQ6K: d * sc, and q - 32
  // its min; kQ5_0: d, and q - 16 its min; kQ8_0: d, no min
  template <Kind kLined>
  static BlockScales lined_scales(const Tile& rows, int64_t kb) {
    const int32_t* lines = rows.lined_factors<kLined>(kb);
    if constexpr (kLined == Kind::kQ6K) {
      const L::V scale = L::mul(L::load(reinterpret_cast<const float*>(lines)),
                                L::load(reinterpret_cast<const int8_t*>(lines + L::N) + kb % lined(kLined).blocks * L::N));
      return {scale, L::mul(scale, L::set1(-32.0f)), kb, true};
    }
    const L::V d = L::load(reinterpret_cast<const at::Half*>(lines) + kb % lined(kLined).blocks * L::N);
    if constexpr (kLined == Kind::kQ5_0) return {d, L::mul(d, L::set1(-16.0f)), kb, true};
    return {d, L::zero(), kb, false};
  }
  // sum (a lane per row of the block) after block kb of activation row m: the one update every path makes;
  // kInt8X: int8_x (chosen at compile time, so the served int16 path carries no test of it per block)
  template <bool kInt8X = false>
  L::V scaled(L::V sum, L::I q, const BlockScales& b, int64_t m, int64_t kb) const {
    const L::V scale = kInt8X ? L::mul(b.scale, L::set1(block_scale[m * blocks + kb])) : b.scale;
    sum = L::fmadd(L::to_float(q), scale, sum);
    return b.group_start ? L::fmadd(b.min, L::set1(group_sums[m * G + b.g]), sum) : sum;
  }

  // w[s]: the pair of columns s and s + 4 of each lane's chunk of 8 nibbles as two int16, 16 times them for odd s
  static void nibble_pairs(L::I bytes, L::I* w) {
    const L::I low = L::set1_int(0x000F000F), high = L::set1_int(0x00F000F0), shifted = L::shift_right(bytes, 8);
    w[0] = L::and_int(bytes, low);
    w[1] = L::and_int(bytes, high);
    w[2] = L::and_int(shifted, low);
    w[3] = L::and_int(shifted, high);
  }
  // the exact dots from their even-s and (16-fold) odd-s parts
  static L::I joined(L::I even, L::I odd) { return L::add(even, L::shift_right_signed(odd, 4)); }

  // nibble_pairs' w[s] with high bits above the nibbles: `first` holds those of columns s and s + 4 for s = 0, 1 and
  // `second` for s = 2, 3 at bits 4 and 20 (even s; `even` masks them) and 8 and 24 (odd s, which nibble_pairs leaves
  // 16-fold; `odd`)
  static void high_bit_pairs(L::I first, L::I second, L::I even, L::I odd, L::I* w) {
    w[0] = L::masked_or(first, even, w[0]);
    w[1] = L::masked_or(first, odd, w[1]);
    w[2] = L::masked_or(second, even, w[2]);
    w[3] = L::masked_or(second, odd, w[3]);
  }
  // kQ6K: nibble_pairs' w[s] of chunk j (0, 1) of a sub-block made whole 6-bit codes q = nibble + 16 * pair, from the
  // sub-block's line of high bit pairs. Its pair of column i of chunk j lies at bit 8j + 16 (i / 4) + {0, 4, 2, 6}[i % 4]
  // (quant/gguf_tiles.py), so one shift brings those of columns s and s + 4 above their nibbles for s = 0, 1 and
  // another for s = 2, 3
  static void six_bit_pairs(L::I high, int j, L::I* w) {
    const L::I first = j == 0 ? L::shift_left(high, 4) : L::shift_right(high, 4);
    const L::I second = j == 0 ? L::shift_left(high, 2) : L::shift_right(high, 6);
    high_bit_pairs(first, second, L::set1_int(0x00300030), L::set1_int(0x03000300), w);
  }
  // kQ6K at int8 codes: a chunk's even columns (bytes & 0x0F: columns 0, 2, 4, 6, a byte each) and odd ones
  // ((bytes >> 4) & 0x0F) made whole 6-bit codes, each column's high bit pair (at six_bit_pairs' bits) brought to bits
  // 4 and 5 of its byte: a shift for bytes 0 and 2 and another for bytes 1 and 3, per chunk j and parity
  static void six_bit_bytes(L::I bytes, L::I high, int j, L::I& even, L::I& odd) {
    const L::I nibbles = L::set1_int(0x0F0F0F0F), outer = L::set1_int(0x00300030), inner = L::set1_int(0x30003000);
    even = L::and_int(bytes, nibbles);
    odd = L::and_int(L::shift_right(bytes, 4), nibbles);
    if (j == 0) {
      even = L::masked_or(L::shift_left(high, 4), outer, L::masked_or(L::shift_left(high, 10), inner, even));
      odd = L::masked_or(high, outer, L::masked_or(L::shift_left(high, 6), inner, odd));
    } else {
      even = L::masked_or(L::shift_right(high, 4), outer, L::masked_or(L::shift_left(high, 2), inner, even));
      odd = L::masked_or(L::shift_right(high, 8), outer, L::masked_or(L::shift_right(high, 2), inner, odd));
    }
  }
  // kQ5_0: nibble_pairs' w[s] of chunk j (< 4) of a block made whole 5-bit codes q = nibble + 16 * fifth bit, from the
  // block's line of fifth bits: that of column i of chunk j at bit j + 4i (quant/gguf_tiles.py), so a shift left by
  // 4 - j brings columns 0, 1 (and 4, 5) to bits 4, 8 (20, 24) and one right by 4 + j columns 2, 3 (6, 7)
  static void fifth_bit_pairs(L::I fifth, int j, L::I* w) {
    high_bit_pairs(L::shift_left(fifth, 4 - j), L::shift_right(fifth, 4 + j), L::set1_int(0x00100010),
                   L::set1_int(0x01000100), w);
  }
  // kQ8_0: a chunk's two lines of int8 codes, each lane's bytes its columns (s, s + 1, s + 4, s + 5) for s = 0, 2 ->
  // w[s] the int16 pairs (columns s, s + 4): the low bytes of a line's int16 sign-extended, then its high ones
  static void int8_pairs(L::I first, L::I second, L::I* w) {
    w[0] = L::shift_right_signed16(L::shift_left16(first, 8), 8);
    w[1] = L::shift_right_signed16(first, 8);
    w[2] = L::shift_right_signed16(L::shift_left16(second, 8), 8);
    w[3] = L::shift_right_signed16(second, 8);
  }

  // Independent integer sums per activation row in dot<M>: an even-s and an odd-s one per chunk of a group of
  // chunks. Each multiply-add waits for the one before it on its sum (5 cycles), so one or two activation rows with
  // two sums each would wait on that, not on the ports, at under half the multiply-adds a cycle its instructions
  // allow. More rows bring their own sums; past 4 they would not fit the registers.
  static constexpr int chains(int M) { return M == 1 ? 8 : M <= 4 ? 4 : 2; }

  // sum[m] = the tiled block's rows . activation row m0 + m; from_memory as DenseFormat::dot's; kInt8X: int8_x;
  // kTiles: a lined kind's tiles (kQ6K: blocks of 16 columns), kQ4K's (int16 codes: its scales made here, the
  // super-block's fp16 d and -dmin converted once for its 8 blocks, not per block), else kGroups
  template <int M, bool kInt8X, Kind kTiles = Kind::kGroups>
  void dot(const Tile& rows, int64_t m0, L::V* sum, bool from_memory) const {
    constexpr bool kLined = is_lined(kTiles), kHighLine = kTiles == Kind::kQ6K || kTiles == Kind::kQ5_0;
    constexpr int kBlockChunks = (kLined ? lined(kTiles).cols : kBlock) / 8;
    constexpr int kChunkLines = kTiles == Kind::kQ8_0 ? 2 : 1;
    // kQ6K at int8 codes: integer sums per super-block (int8_code_cols); where quad sums are int32, each row's block
    // starts at its code offset, and from 5 rows on (enough chains to wait on) even and odd columns share one sum
    constexpr bool kIntSums = kInt8X && kTiles == Kind::kQ6K, kOffsetFirst = kIntSums && L::kInt32QuadSums;
    constexpr int C = kOffsetFirst && M > 4 ? 1 : chains(M), kGroup = std::max(1, C / 2);  // sums per activation row;
                                                                                           // chunks whose sums are apart
    L::V acc[M];  // not sum itself: through the pointer, each update went to memory and back
    for (int m = 0; m < M; ++m) acc[m] = L::zero();
    L::V super_d = L::zero(), super_min = L::zero();  // kQ4K: its super-block's d and -dmin, converted once for 8 blocks
    L::I super_sum[kIntSums ? M : 1];
    for (L::I& s : super_sum) s = L::zero_int();
    const bool prefetch = from_memory && rows.in_memory();
    for (int64_t kb = 0; kb < blocks; ++kb) {
      L::I dots[M * C];  // per activation row, per chunk of a group: even s, odd s
      for (int i = 0; i < M * C; ++i) dots[i] = L::zero_int();
      if constexpr (kOffsetFirst) {
        for (int m = 0; m < M; ++m) dots[m * C] = L::set1_int(code_offsets[(m0 + m) * blocks + kb]);
      }
      // each line of the tile's stream requests the one kL2PrefetchBytes on, on the first pass over it
      if (prefetch) {
        if constexpr (kLined) {
          prefetch_l2(rows.lined_factor_line<kTiles>(kb));
        } else {
          prefetch_l2(rows.group_line(block_group[kb]));
        }
      }
      // the block's chunks lie in one vector of chunks (kBlockChunks divides L::N): their pairs at block_pairs + j,
      // per activation row a stride on (computed once a block, not per chunk: address arithmetic off the chunks' path)
      const int32_t* block_pairs =
          kInt8X ? x8.data() + (m0 * chunks + kb * kBlockChunks) * 2 : pairs(m0, kb * kBlockChunks);
      // kQ6K, kQ5_0: the block's line of high bits, after its chunks
      const L::I high = kHighLine ? L::load_int(rows.lined_codes<kTiles>(kb) + kBlockChunks * L::N) : L::zero_int();
#pragma GCC unroll 4  // whole: which sums a chunk updates is then known at compile time, and they stay in registers
      for (int j = 0; j < kBlockChunks; ++j) {  // the block's chunks
        const int64_t c = kb * kBlockChunks + j;
        const int32_t* line =
            kLined ? rows.lined_codes<kTiles>(kb) + j * kChunkLines * L::N : rows.code_lanes + c * L::N;
        if (prefetch) {  // into L2 far ahead, and from there into L1 a little ahead: each line takes several
                         // instructions, so fewer lines wait in the instruction window than in a dense row; the
                         // chunk's lines, and after the block's last chunk its line of high bits
          for (int i = 0; i < kChunkLines + (kHighLine && j + 1 == kBlockChunks); ++i) {
            prefetch_l2(line + i * L::N);
            _mm_prefetch(reinterpret_cast<const char*>(line + i * L::N) + kL1PrefetchBytes, _MM_HINT_T0);
          }
        }
        const int chunk_sums = j % kGroup * 2;
        if constexpr (kInt8X) {
          const L::I bytes = L::load_int(line), low = L::set1_int(0x0F0F0F0F);
          L::I even = L::and_int(bytes, low), odd = L::and_int(L::shift_right(bytes, 4), low);
          if constexpr (kTiles == Kind::kQ6K) six_bit_bytes(bytes, high, j, even, odd);
          for (int m = 0; m < M; ++m) {  // each quad of codes broadcast from memory into its instruction
            const int32_t* quads = block_pairs + m * chunks * 2 + j * 2;
            L::I* d = dots + m * C + chunk_sums;
            d[0] = L::dot_uint8(d[0], even, L::set1_int(quads[0]));
            d[C > 1] = L::dot_uint8(d[C > 1], odd, L::set1_int(quads[1]));
          }
          continue;
        }
        L::I w[4];
        if constexpr (kTiles == Kind::kQ8_0) {
          int8_pairs(L::load_int(line), L::load_int(line + L::N), w);
        } else {
          nibble_pairs(L::load_int(line), w);
          if constexpr (kTiles == Kind::kQ6K) six_bit_pairs(high, j, w);
          if constexpr (kTiles == Kind::kQ5_0) fifth_bit_pairs(high, j, w);
        }
        for (int m = 0; m < M; ++m) {  // each activation pair broadcast from memory into its instruction
          const int32_t* x_pairs = block_pairs + m * stride + j;
          for (int s = 0; s < 4; ++s) {
            L::I& d = dots[m * C + chunk_sums + s % 2];
            d = L::dot_int16(d, w[s], L::set1_int(x_pairs[s * L::N]));
          }
        }
      }
      if constexpr (kIntSums) {  // each row's dot less its offset, times the sub-block's int8 sc, into its super-block's
        // sum (at most 16 x 128 x 16 x 32 x 127: int32), which meets d and its code scale at the super-block's end
        constexpr Lined l = lined(kTiles);
        const int32_t* lines = rows.lined_factors<kTiles>(kb);
        const L::I sc = L::load_int8_32(reinterpret_cast<const int8_t*>(lines + L::N) + kb % l.blocks * L::N);
        for (int m = 0; m < M; ++m) {
          L::I dot = L::quad_sums_total(dots[m * C]);  // a sum (2 x 2 x 63 x 127, AVX2's int16) into int32 each
          for (int j = 1; j < C; ++j) dot = L::add(dot, L::quad_sums_total(dots[m * C + j]));
          if constexpr (!kOffsetFirst) dot = L::add(dot, L::set1_int(code_offsets[(m0 + m) * blocks + kb]));
          super_sum[m] = L::add(super_sum[m], L::mul32(dot, sc));
        }
        if (kb % l.blocks == l.blocks - 1) {
          const L::V d = L::load(reinterpret_cast<const float*>(lines));
          for (int m = 0; m < M; ++m) {
            acc[m] = L::fmadd(L::to_float(super_sum[m]), L::mul(d, L::set1(block_scale[(m0 + m) * blocks + kb])), acc[m]);
            super_sum[m] = L::zero_int();
          }
        }
        continue;
      }
      BlockScales scales_of_block;
      if constexpr (kLined) {
        scales_of_block = lined_scales<kTiles>(rows, kb);
      } else if constexpr (kTiles == Kind::kQ4K) {  // a group a block: Tile::scale's and Tile::min's products
        if (kb % kSubBlocks == 0) {
          super_d = L::load(rows.factors(kb));
          super_min = L::load(rows.factors(kb) + L::N);
        }
        const int8_t* sub = rows.sub_scales(kb);
        scales_of_block = {L::mul(super_d, L::load(sub)), L::mul(super_min, L::load(sub + kSubBlocks * L::N)), kb, true};
      } else {
        scales_of_block = block_scales(rows, kb);
      }
      for (int m = 0; m < M; ++m) {  // integers: any order of adding them gives the same sums
        if constexpr (kInt8X) {  // the block's quad sums (on AVX2 in int16: at most 8 x 3,810), then into int32
          L::I quads = dots[m * C];
          for (int j = 1; j < C; ++j) quads = L::add_quad_sums(quads, dots[m * C + j]);
          acc[m] = scaled<kInt8X>(acc[m], L::quad_sums_total(quads), scales_of_block, m0 + m, kb);
          continue;
        }
        L::I even = dots[m * C], odd = dots[m * C + 1];
        for (int j = 2; j < C; j += 2) {
          even = L::add(even, dots[m * C + j]);
          odd = L::add(odd, dots[m * C + j + 1]);
        }
        // kQ8_0's odd s are not 16-fold (no nibbles)
        const L::I exact = kTiles == Kind::kQ8_0 ? L::add(even, odd) : joined(even, odd);
        acc[m] = scaled<kInt8X>(acc[m], exact, scales_of_block, m0 + m, kb);
      }
    }
    for (int m = 0; m < M; ++m) sum[m] = acc[m];
  }

  // The same sums, the block's rows n.. read from w one after another. Per row and activation row, 4 vectors of
  // kVectorBlocks blocks at a time dotted into int32 lanes, 4 per block, their sums (L::sum_quads) stored as
  // q (M, L::N rows, squares of L::N blocks); per square the L::N rows' sums transposed into lanes and scaled.
  // q: M * L::N * round_up(blocks, L::N) values
  template <int M>
  void streamed(const Tile& rows, int64_t n, int64_t m0, int32_t* q, L::V* sum) const {
    const int64_t row_q = round_up(blocks, L::N);
    for (int i = 0; i < L::N; ++i) {
      const int32_t* row = reinterpret_cast<const int32_t*>(w + std::min(n + i, N - 1) * (K / 2));
      for (int64_t v0 = 0; v0 < vectors; v0 += 4) {
        L::I dots[M][4][2];  // even s, odd s
        for (int m = 0; m < M; ++m) {
          for (int j = 0; j < 4; ++j) dots[m][j][0] = dots[m][j][1] = L::zero_int();
        }
        for (int64_t v = v0; v < std::min(vectors, v0 + 4); ++v) {
          const int32_t* at = row + v * 4 * kVectorBlocks;
          prefetch_l2(at);
          const int64_t left = 4 * (blocks - v * kVectorBlocks);  // int32 values left in the row
          const L::I bytes = left >= L::N ? L::load_int(at) : L::load_int(at, static_cast<int>(left));
          L::I w[4];
          nibble_pairs(bytes, w);
          for (int m = 0; m < M; ++m) {
            const int32_t* xs = x.data() + (m0 + m) * stride + v * 4 * L::N;
            L::I* d = dots[m][v - v0];
            for (int s = 0; s < 4; ++s) d[s % 2] = L::dot_int16(d[s % 2], w[s], L::load_int(xs + s * L::N));
          }
        }
        // lane 4 p + j: block (v0 + j) * kVectorBlocks + p
        for (int m = 0; m < M; ++m) {
          const L::I exact[4] = {joined(dots[m][0][0], dots[m][0][1]), joined(dots[m][1][0], dots[m][1][1]),
                                 joined(dots[m][2][0], dots[m][2][1]), joined(dots[m][3][0], dots[m][3][1])};
          L::store_int(q + (m * L::N + i) * row_q + v0 * kVectorBlocks, L::sum_quads(exact));
        }
      }
    }
    for (int m = 0; m < M; ++m) {
      sum[m] = L::zero();
      for (int64_t b0 = 0; b0 < blocks; b0 += L::N) {
        L::I square[L::N];  // square[lane] lane i: row i's sum at that lane (above)
        for (int i = 0; i < L::N; ++i) square[i] = L::load_int(q + (m * L::N + i) * row_q + b0);
        L::transpose(square);
        for (int64_t kb = b0; kb < std::min(blocks, b0 + L::N); ++kb) {
          const int64_t b = kb - b0;
          sum[m] = scaled(sum[m], square[4 * (b % kVectorBlocks) + b / kVectorBlocks], block_scales(rows, kb), m0 + m, kb);
        }
      }
    }
  }

  // dot<M, kInt8X> of the tile's kind, known at compile time (int8 codes: only the kinds that take them)
  template <int M, bool kInt8X>
  void dot_of_kind(const Tile& rows, int64_t m0, L::V* sum, bool from_memory) const {
    switch (rows.kind) {
      case Kind::kQ6K:
        return dot<M, kInt8X, Kind::kQ6K>(rows, m0, sum, from_memory);
      case Kind::kQ4K:
        return dot<M, kInt8X, Kind::kQ4K>(rows, m0, sum, from_memory);
      case Kind::kQ5_0:
        if constexpr (!kInt8X) return dot<M, false, Kind::kQ5_0>(rows, m0, sum, from_memory);
        break;
      case Kind::kQ8_0:
        if constexpr (!kInt8X) return dot<M, false, Kind::kQ8_0>(rows, m0, sum, from_memory);
        break;
      case Kind::kGroups:
        break;
    }
    dot<M, kInt8X>(rows, m0, sum, from_memory);
  }

  // y[m0 + m, n + i] = sum + bias[n + i] for the block's rows from n on, m < mr (<= MR)
  template <bool kStreamed, typename Y, int MR = kStreamed ? kStreamRows : kChunk>
  void rows_of(int64_t mr, const Tile& rows, int64_t n, int64_t m0, const float* bias, Y* y, int32_t* q,
               bool from_memory = true) const {
    if constexpr (MR > 1) {
      if (mr < MR) return rows_of<kStreamed, Y, MR - 1>(mr, rows, n, m0, bias, y, q, from_memory);
    }
    L::V sum[MR];
    if constexpr (kStreamed) {
      streamed<MR>(rows, n, m0, q, sum);
    } else if (int8_x) {
      dot_of_kind<MR, true>(rows, m0, sum, from_memory);
    } else {
      dot_of_kind<MR, false>(rows, m0, sum, from_memory);
    }
    for (int m = 0; m < MR; ++m) {
      float lanes[L::N];
      L::store(lanes, sum[m]);
      for (int64_t i = 0; i < std::min<int64_t>(L::N, N - n); ++i) {
        y[(m0 + m) * N + n + i] = static_cast<Y>(lanes[i] * x_scale[m0 + m] + (bias ? bias[n + i] : 0.0f));
      }
    }
  }

  // y (M, N) = x @ W.T + bias, blocks of rows split across torch's threads; `tiled`: every block's tile, made
  // before (else each thread makes them as it goes, or, with int16 codes, streams the rows, transposing only
  // scales and mins)
  template <typename Y>
  void operator()(int64_t M, const float* bias, Y* y, const int32_t* tiled = nullptr) const {
    const int64_t row_blocks = this->row_blocks();
    at::parallel_for(0, row_blocks, std::max<int64_t>(1, kGrain / L::N), [&](int64_t begin, int64_t end) {
      if (!tiled && M <= kStreamRows && !int8_x) {
        std::vector<int32_t> buffer(2 * G * L::N + kSlack), q(M * L::N * round_up(blocks, L::N));
        for (int64_t b = begin; b < end; ++b) rows_of<true>(M, lanes(b * L::N, buffer.data()), b * L::N, 0, bias, y, q.data());
        return;
      }
      const int64_t per_tile = M <= kDecodeRows ? 1 : std::max<int64_t>(1, kTileBytes / (code_ints() * 4));
      std::vector<int32_t> buffer(tiled ? 0 : per_tile * tile_ints() + kSlack);
      std::vector<Tile> tiles(per_tile);
      for (int64_t t = begin; t < end; t += per_tile) {
        const int64_t t_end = std::min(end, t + per_tile);
        for (int64_t b = t; b < t_end; ++b) {
          tiles[b - t] = tiled ? tile_at(tiled + b * stored_ints()) : tile(b * L::N, buffer.data() + (b - t) * tile_ints());
        }
        for (int64_t m0 = 0; m0 < M; m0 += kChunk) {
          for (int64_t b = t; b < t_end; ++b) {
            rows_of<false>(std::min<int64_t>(kChunk, M - m0), tiles[b - t], b * L::N, m0, bias, y, nullptr, m0 == 0);
          }
        }
      }
    });
  }
};

// Each row of x (M, K) -> that row of out (may be x) = x * rsqrt(mean(x^2) + eps) * norm_weight, in fp32: the RMSNorm
// before the product. The squares are summed in double, in 16 sums a column apart (lanes of vectors: one chain of
// scalar adds would pay one add's latency per column). Rows split across threads only beyond kNormValues values:
// below that the fork and the join cost more than the norm of a decode step's rows on one thread; SwiGLU's wider
// rows (for_each_row's own grain) gain from the split
constexpr int64_t kNormValues = 16384;
inline void rms_normalize(const float* x, float* out, int64_t M, int64_t K, const float* norm_weight, double eps) {
  constexpr int64_t kSums = 16;
  for_each_row(M, [&](int64_t m) {
    const float* row = x + m * K;
    double sums[kSums] = {};
    int64_t k = 0;
    for (; k + kSums <= K; k += kSums) {
      for (int64_t j = 0; j < kSums; ++j) sums[j] += static_cast<double>(row[k + j]) * row[k + j];
    }
    for (; k < K; ++k) sums[0] += static_cast<double>(row[k]) * row[k];
    double sum_sq = 0;
    for (const double s : sums) sum_sq += s;
    const float inv_rms = static_cast<float>(1.0 / std::sqrt(sum_sq / K + eps));
    float* normed = out + m * K;
    for (k = 0; k < K; ++k) normed[k] = row[k] * inv_rms * norm_weight[k];
  }, rows_holding(kNormValues, K));
}

// Each row [gate, up] of x (M, 2K) -> silu(gate) * up, row m of out (M, K): the SwiGLU before w2
inline void swiglu(const float* x, int64_t M, int64_t K, float* out) {
  for_each_row(M, [&](int64_t m) {
    const float* gate = x + m * 2 * K;
    const float* up = gate + K;
    float* row = out + m * K;
    int64_t k = 0;
    for (; k + kLanes <= K; k += kLanes) {
      const Wide::V g = Wide::load(gate + k);
      const Wide::V silu = Wide::div(g, Wide::add(Wide::set1(1.0f), exp<Wide>(Wide::sub(Wide::zero(), g))));
      Wide::store(row + k, Wide::mul(silu, Wide::load(up + k)));
    }
    for (; k < K; ++k) row[k] = gate[k] / (1.0f + std::exp(-gate[k])) * up[k];
  });
}

// One projection's weights as the kernel reads them: W in one of four formats,
//   fp32, bf16 or int8 (N, K), with `scales` (N,) for int8; or int4 codes with `scales` and `mins` per group
//   of inputs, as rows: uint8 (N, K / 2) with scales and mins (N, K / group); or as tiles: int32
//   (N / L::N, K / 8 + G, L::N), every block of L::N rows as Int4Format::tile_at reads it (codes, then per group
//   a line of L::N fp16 scales and L::N fp16 mins), with `scales` and `mins` the fp16 (N / L::N, G, L::N) views
//   of its scales and mins (quant/int4.py's tile_rows): the decode step reads them as one stream, without
//   transposing them on the way. Bias (N,). Scales, mins (of rows) and bias are read as fp32 (converted once,
//   here, when they are bf16). int8_from_rows: products of at least this many activation rows (0: none) meet int4
//   weights (Q4_K's and Q6_K's tiles too) with int8 activation codes per block of 32 columns (Q6_K's per 256;
//   Int4Format's int8_x: a speculative draft's, whose steps of many rows are bound by the multiply-adds, or
//   precision.activations=int8), not int16 ones per row; the other formats ignore it. `dense`: a
//   quantized layer's dequantized bf16 copy (N, K) (kernels/layer.py's DenseCopyLayer), which the amx build
//   multiplies on its bf16 tiles from `dense_from_rows` activation rows on (a prompt chunk: there the tiles over the
//   copy outrun the int4 kernel several times, and the Python model's oneDNN GEMM over it up to ~200 rows); int4
//   tiles from dense_from_rows (> 0) up to kInt4CopyFromRows rows are dequantized to the copy's numbers in cache
//   instead (amx.h: Int4DequantTiles). `dense_from_rows` 0 (the gemv op): the copy, where given, at any rows.
//   Or GGUF blocks as the file stores them: uint8 (N, K / weights per block, bytes per block), whose block size names
//   the format (ggml_blocks.h), without scales or mins; or a K-quant file's blocks as int4 tiles with the blocks'
//   own lines (Int4Format's kQ4K, kQ6K, kQ5_0, kQ8_0), without scales or mins (they are the tiles' own, in lines fp16
//   views could not name): Q4_K int32 (N / L::N, K / 8 + K / 256 * 5, L::N), Q6_K int32 (N / L::N, K / 256, 53, L::N),
//   Q5_0 int32 (N / L::N, K / 64, 11, L::N), Q8_0 int32 (N / L::N, K / 64, 17, L::N) (the lined kinds: their lines per
//   super-block name them); Q5_0's and Q8_0's tiles and the blocks meet int16 activation codes whatever
//   int8_from_rows says (Int4Format::takes_int8_codes). A projection may also be stacked from parts, each its own rows in its own format (a fused
//   q/k/v whose v a K-quant file keeps in more bits than q and k).
struct Projection {
  at::Tensor weight;
  Floats scales, mins, bias;
  int64_t N = 0, K = 0, group = 0;
  const int32_t* tiles = nullptr;  // int4 tiles: every block's Int4Format::tile
  Int4Format::Kind tile_kind = Int4Format::Kind::kGroups;
  int64_t int8_from_rows = 0;
  at::Tensor dense;  // undefined: none
  int64_t dense_from_rows = 0;
  int64_t block_bytes = 0;  // GGUF blocks: the bytes of one (ggml_blocks.h); 0: another format
  std::vector<Projection> stacked;  // parts, in the order of their rows (then no weight of its own)

  explicit Projection(std::vector<Projection> parts) : N(0), K(parts.empty() ? 0 : parts[0].K), stacked(std::move(parts)) {
    TORCH_CHECK(!stacked.empty(), "gemv: a stacked projection needs parts");
    for (const Projection& part : stacked) {
      TORCH_CHECK(part.K == K && part.stacked.empty(), "gemv: stacked parts must all take K = ", K, " inputs");
      N += part.N;
    }
  }

  Projection(const at::Tensor& w, const std::optional<at::Tensor>& scales_, const std::optional<at::Tensor>& mins_,
             const std::optional<at::Tensor>& bias_, int64_t int8_from_rows_ = 0,
             const std::optional<at::Tensor>& dense_ = std::nullopt, int64_t dense_from_rows_ = 0)
      : weight(w),
        scales(is_tiles(w) ? Floats() : optional_floats(scales_)),
        mins(is_tiles(w) ? Floats() : optional_floats(mins_)),
        bias(optional_floats(bias_)),
        int8_from_rows(int8_from_rows_),
        dense(dense_ ? *dense_ : at::Tensor()),
        dense_from_rows(dense_from_rows_) {
    const bool int4_rows = w.scalar_type() == at::kByte && w.dim() == 2;
    int64_t groups = 0;  // int4: per row
    const bool lined_tiles = is_tiles(w) && w.dim() == 4 && !scales_ && !mins_;
    TORCH_CHECK((lined_tiles || w.dim() == (is_tiles(w) || is_blocks(w) || is_bf16_blocks(w) ? 3 : 2)) && w.is_contiguous(),
                "gemv: weight must be a contiguous (N, K) matrix, int4 tiles (N / lanes, K / 8 + G, lanes), Q6_K, Q5_0 "
                "or Q8_0 tiles (N / lanes, K / columns a super-block, lines a super-block, lanes), GGUF blocks (N, "
                "blocks, bytes per block) or bf16 blocks (N / 16, K / 2, 32)");
    if (is_bf16_blocks(w)) {
      TORCH_CHECK(kBf16BlockRows > 0 && w.size(2) == 2 * kBf16BlockRows,
                  "gemv: this build takes bf16 weights as (N, K) rows, not blocks");
      N = w.size(0) * kBf16BlockRows;
      K = w.size(1) * 2;
    } else if (is_blocks(w)) {
      block_bytes = w.size(2);
      const int64_t per_block = block_weights(block_bytes);
      TORCH_CHECK(per_block > 0, "gemv: no GGUF block format is ", block_bytes, " bytes long");
      TORCH_CHECK(!scales_ && !mins_, "gemv: GGUF blocks hold their own scales");
      N = w.size(0);
      K = w.size(1) * per_block;
    } else if (lined_tiles) {
      using Kind = Int4Format::Kind;
      constexpr int64_t lanes = Int4Format::L::N;
      for (const Kind kind : {Kind::kQ6K, Kind::kQ5_0, Kind::kQ8_0}) {
        if (w.size(2) * lanes == Int4Format::lined(kind).super_ints()) tile_kind = kind;
      }
      TORCH_CHECK(tile_kind != Kind::kGroups && w.size(3) == lanes, "gemv: Q6_K, Q5_0 and Q8_0 tiles of this build are (N / ",
                  lanes, ", K / 256, 53, ", lanes, "), (N / ", lanes, ", K / 64, 11, ", lanes, ") and (N / ", lanes,
                  ", K / 64, 17, ", lanes, ")");
      const Int4Format::Lined lined = Int4Format::lined(tile_kind);
      N = w.size(0) * lanes;
      K = w.size(1) * lined.blocks * lined.cols;
      group = lined.cols;
      tiles = w.data_ptr<int32_t>();
    } else if (is_tiles(w) && !scales_ && !mins_) {  // Q4_K's
      constexpr int64_t lanes = Int4Format::L::N, per_super = 256 / 8 + Int4Format::kSuperInts / lanes;  // values
      TORCH_CHECK(w.size(2) == lanes && w.size(1) % per_super == 0,
                  "gemv: Q4_K tiles of this build are (N / ", lanes, ", K / 256 * ", per_super, ", ", lanes, ")");
      tile_kind = Int4Format::Kind::kQ4K;
      N = w.size(0) * lanes;
      K = w.size(1) / per_super * 256;
      group = Int4Format::kBlock;
      tiles = w.data_ptr<int32_t>();
    } else if (is_tiles(w)) {
      constexpr int64_t lanes = Int4Format::L::N;
      TORCH_CHECK(w.size(2) == lanes && scales_ && mins_ && scales_->dim() == 3 && scales_->sizes() == mins_->sizes() &&
                      scales_->size(0) == w.size(0) && scales_->size(2) == lanes &&
                      scales_->scalar_type() == at::kHalf && mins_->scalar_type() == at::kHalf,
                  "gemv: int4 tiles of this build are (N / ", lanes, ", K / 8 + G, ", lanes,
                  ") with fp16 scales and mins (N / ", lanes, ", G, ", lanes, ")");
      groups = scales_->size(1);
      const int64_t chunks = w.size(1) - groups;
      const int32_t* at = w.data_ptr<int32_t>();
      const std::vector<int64_t> half_strides = {2 * w.stride(0), 2 * lanes, 1};  // in fp16 values
      TORCH_CHECK(chunks > 0 && scales_->data_ptr() == at + chunks * lanes &&
                      mins_->data_ptr() == static_cast<const at::Half*>(scales_->data_ptr()) + lanes &&
                      scales_->strides() == half_strides && mins_->strides() == half_strides,
                  "gemv: int4 scales and mins must be the views of the tiles' own");
      N = w.size(0) * lanes;
      K = 8 * chunks;
      tiles = at;
    } else {
      N = w.size(0);
      K = int4_rows ? 2 * w.size(1) : w.size(1);
    }
    TORCH_CHECK(K % kStep == 0 && K <= kMaxK, "gemv: K must be a multiple of 16 and at most ", kMaxK, ", got ", K);
    TORCH_CHECK(!dense.defined() || (dense.scalar_type() == at::kBFloat16 && dense.is_contiguous() &&
                                     dense.dim() == 2 && dense.size(0) == N && dense.size(1) == K),
                "gemv: a dense copy must be a contiguous bf16 (N, K) matrix");
    TORCH_CHECK(!bias_ || bias_->numel() == N, "gemv: bias must have N = ", N, " values");
    if (int4_rows) {
      TORCH_CHECK(scales_ && mins_ && scales_->dim() == 2 && scales_->size(0) == N && scales_->sizes() == mins_->sizes(),
                  "gemv: int4 weights need scales and mins of shape (N, K / group_size)");
      groups = scales_->size(1);
    } else if (!tiles && !block_bytes) {
      TORCH_CHECK(w.scalar_type() == at::kFloat || w.scalar_type() == at::kBFloat16 || w.scalar_type() == at::kChar,
                  "gemv: weights must be float32, bfloat16, int8 or int4 (uint8 rows, int32 tiles), got ", w.scalar_type());
      TORCH_CHECK(!scales_ || scales_->numel() == N, "gemv: scales must have N = ", N, " values");
    }
    if (int4_rows || (tiles && tile_kind == Int4Format::Kind::kGroups)) {
      TORCH_CHECK(groups > 0, "gemv: int4 weights need a scale and a min per group");
      group = K / groups;
      TORCH_CHECK(group % Int4Format::kBlock == 0 && group * groups == K,
                  "gemv: the int4 group size must be a multiple of 32 dividing K");
    }
  }

  // y (M, N) = x (M, K, already normalized or gated) @ W.T * scales + bias
  template <typename Y>
  void operator()(const float* x, int64_t M, Y* y) const {
    TORCH_CHECK(M >= 1, "gemv: no activation rows");
    if (!stacked.empty()) return run_stacked(x, M, y);
    if (block_bytes) {
      with_block_format(block_bytes, [&](auto format) {
        using B = decltype(format);
        run_rows(BlockFormat<B>(weight.data_ptr<uint8_t>(), K, x, M, int16_codes), M, nullptr, bias.data(), y, N, weight.nbytes() / N);
      });
      return;
    }
#ifdef INFERLAB_AMX
    const bool bf16_products = dense_from_rows > 0 ? M >= dense_from_rows : dense.defined();
    if (bf16_products && tiles && tile_kind == Int4Format::Kind::kGroups && Int4DequantTiles::covers(N, K, group) &&
        (M < kInt4CopyFromRows || !dense.defined())) {  // the copy's numbers, made in cache
      Int4DequantTiles(tiles, N, K, group, x, M)(bias.data(), y);
      return;
    }
    if (bf16_products && dense.defined() && Bf16Tiles::covers(N, K)) {  // the copy: scales already applied
      Bf16Tiles(dense.data_ptr<at::BFloat16>(), N, K, x, M)(nullptr, bias.data(), y);
      return;
    }
#endif
    const int64_t row_bytes = weight.nbytes() / N;
    switch (weight.scalar_type()) {
      case at::kFloat:
        run_rows(DenseFormat<Fp32Step>(weight.data_ptr<float>(), K, x, M), M, scales.data(), bias.data(), y, N, row_bytes);
        break;
      case at::kBFloat16:
#ifdef INFERLAB_AVX512
        if (is_bf16_blocks(weight)) {
          Bf16Blocks(weight.data_ptr<at::BFloat16>(), N, K, x, M)(M, scales.data(), bias.data(), y);
          break;
        }
#endif
#ifdef INFERLAB_AMX
        if (Bf16Tiles::covers(N, K)) {
          Bf16Tiles(weight.data_ptr<at::BFloat16>(), N, K, x, M)(scales.data(), bias.data(), y);
          break;
        }
#endif
        run_rows(Bf16Weights(weight.data_ptr<at::BFloat16>(), K, x, M), M, scales.data(), bias.data(), y, N, row_bytes);
        break;
      case at::kChar:
#ifdef INFERLAB_AMX
        if (M >= kInt8TilesMinRows && Int8Tiles::covers(N, K)) {
          Int8Tiles(weight.data_ptr<int8_t>(), N, K, x, M, int8_weight_codes)(scales.data(), bias.data(), y);
          break;
        }
#endif
        if (M == 1) {
          run_int8(Narrow{}, x, M, y, row_bytes);
        } else {
          run_int8(Wide{}, x, M, y, row_bytes);
        }
        break;
      default:  // int4: rows (uint8) or tiles (int32)
        Int4Format(tiles ? nullptr : weight.data_ptr<uint8_t>(), N, K, group, scales.data(), mins.data(), x, M,
                   int8_from_rows > 0 && M >= int8_from_rows && Int4Format::takes_int8_codes(tile_kind), tile_kind)(
            M, bias.data(), y, tiles);
    }
  }

 private:
  template <typename L, typename Y>  // int8 weights on lanes L (Int8Step)
  void run_int8(L, const float* x, int64_t M, Y* y, int64_t row_bytes) const {
    run_rows(DenseFormat<Int8Step<L>>(weight.data_ptr<int8_t>(), K, x, M), M, scales.data(), bias.data(), y, N, row_bytes);
  }
  // each part into its own rows of y (M, N), through a buffer of its own columns
  template <typename Y>
  void run_stacked(const float* x, int64_t M, Y* y) const {
    int64_t first = 0;
    for (const Projection& part : stacked) {
      std::vector<Y> own(M * part.N);
      part(x, M, own.data());
      for (int64_t m = 0; m < M; ++m) std::copy_n(own.data() + m * part.N, part.N, y + m * N + first);
      first += part.N;
    }
  }
  static bool is_tiles(const at::Tensor& w) { return w.scalar_type() == at::kInt; }
  static bool is_blocks(const at::Tensor& w) { return w.scalar_type() == at::kByte && w.dim() == 3; }
  static bool is_bf16_blocks(const at::Tensor& w) { return w.scalar_type() == at::kBFloat16 && w.dim() == 3; }
  static Floats optional_floats(const std::optional<at::Tensor>& t) {
    return t && t->numel() ? Floats(t->contiguous(), false) : Floats();
  }
};

}  // namespace INFERLAB_ISA
}  // namespace inferlab
