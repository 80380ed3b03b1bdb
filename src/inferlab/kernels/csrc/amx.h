// bf16 weights on AMX tiles (the amx build: INFERLAB_AMX): y = x @ W.T with the activations rounded to bf16,
// each product exact and summed in fp32 by the tiles' bf16 dot instruction (TDPBF16PS).
//
// The widened-bf16 multiply-adds of gemv.h's Bf16Step keep a step of 2-32 rows bound by the multiply-adds. SmolLM2's
// whole bf16 decode step (fused, 150-token contexts, 2 threads, AMX Xeon), AVX-512 build vs this one, ms: 1 row 8.5
// vs 10.3, 5 rows 14.1 vs 12.6, 8 17.9 vs 14.6, 16 30.7 vs 23.4, 24 41.1 vs 25.5, 32 51.9 vs 33.7. One row loses:
// the tiles stream the weights from memory more slowly than vector loads (one pass over 270 MB on huge pages, 2
// threads: 34 GB/s against 41; no prefetch order tried closed it; from L2 the tiles run at 188 GB/s), and a row's
// sums must be the same whatever the call's rows, so one row cannot take the other kernel.
//
// A weight block of 16 rows x 32 columns is one A tile, loaded straight from the row-major weights; the
// activations are the B tiles, 16 rows of column pairs by up to 16 activation rows; a C tile holds the block's
// 16 x (up to 16) sums over the whole of K. The tile instruction's cost grows with the B tile's columns (padding
// one row to 16 took 1.5x as long), so the tiles are configured to the rows the call has; beyond 16 rows each B
// tile row starts a cache line (24 rows in 96-byte tile rows: 41 ms a step; padded to 128 bytes: 25.5). Each
// (weight row, activation row) sum runs through the same instructions in the same order whatever else the call
// holds, so a row's result does not depend on the other rows (batch invariance, as gemv.h's). Rounding the
// activations to bf16 is what a bf16 model does between its layers anyway (the Python model's bf16 layers hand
// this kernel bf16 activations: their results are unchanged by it). Covers N a multiple of 16 and K of 32 (every
// projection of the supported models); other shapes, on this build too, take Bf16Step for all their rows.
#pragma once

#ifdef INFERLAB_AMX

#include <algorithm>
#include <cstdint>
#include <vector>

#include "parallel.h"
#include "simd.h"

namespace inferlab {
inline namespace INFERLAB_ISA {

struct Bf16Tiles {
  static constexpr int64_t kBlock = 16;       // weight rows per A tile; activation rows per B tile at most
  static constexpr int64_t kDepth = 32;       // columns per tile instruction (an A tile row: 32 bf16, 64 bytes)

  static bool covers(int64_t N, int64_t K) { return N % kBlock == 0 && K % kDepth == 0; }

  const at::BFloat16* w;  // (N, K)
  int64_t N, K, M;
  int64_t stride;  // activation rows per row of x: M, or beyond 16 M rounded up to 16 (64-byte B tile rows)
  std::vector<uint32_t> x;  // (K / 2, stride): activation row m's columns (2p, 2p + 1) at [p, m], as bf16

  Bf16Tiles(const at::BFloat16* weights, int64_t N_, int64_t K_, const float* xf, int64_t M_)
      : w(weights), N(N_), K(K_), M(M_), stride(M_ <= kBlock ? M_ : (M_ + kBlock - 1) / kBlock * kBlock),
        x(K_ / 2 * stride) {
    for_each_row(M, [&](int64_t m) {
      for (int64_t k = 0; k < K; k += 16) {  // 16 values to bf16 (round to nearest even): 8 pairs
        alignas(32) uint32_t pairs[8];
        _mm256_store_si256(reinterpret_cast<__m256i*>(pairs),
                           reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(_mm512_loadu_ps(xf + m * K + k))));
        for (int p = 0; p < 8; ++p) x[(k / 2 + p) * stride + m] = pairs[p];
      }
    });
  }

  // y (M, N) = the products * scales + bias (each when given), weight blocks split across torch's threads
  template <typename Y>
  void operator()(const float* scales, const float* bias, Y* y) const {
    at::parallel_for(0, N / kBlock, kGrain / kBlock, [&](int64_t begin, int64_t end) { blocks(begin, end, scales, bias, y); });
  }

 private:
  // The tiles: B 0 and 1 (activation rows m0.. and m0 + 16..), A 2 and 3 (two weight blocks), C 4 + 2 * block + group
  struct alignas(64) Config {
    uint8_t palette = 1, start_row = 0, reserved[14] = {};
    uint16_t colsb[16] = {};
    uint8_t rows[16] = {};
  };

  static void configure(int64_t cols0, int64_t cols1) {  // activation rows in B tiles 0 and 1 (0: unused)
    Config c;
    const int64_t cols[2] = {cols0, cols1};
    for (int g = 0; g < 2; ++g) {
      const uint8_t rows = cols[g] ? kBlock : 0;
      c.rows[g] = rows, c.colsb[g] = cols[g] * 4;  // B: 16 rows of column pairs
      c.rows[4 + g] = rows, c.colsb[4 + g] = cols[g] * 4;  // C of block 0
      c.rows[6 + g] = rows, c.colsb[6 + g] = cols[g] * 4;  // C of block 1
    }
    for (int a = 2; a < 4; ++a) c.rows[a] = kBlock, c.colsb[a] = kDepth * 2;
    _tile_loadconfig(&c);
  }

  // Weight blocks [begin, end) times every activation row, 32 of them (two B tiles) at a time; beyond 32, per
  // tile of blocks that stays in L2
  template <typename Y>
  void blocks(int64_t begin, int64_t end, const float* scales, const float* bias, Y* y) const {
    const int64_t tile = M <= 2 * kBlock ? end - begin : std::max<int64_t>(2, kTileBytes / (kBlock * K * 2) / 2 * 2);
    int64_t configured[2] = {-1, -1};
    for (int64_t t = begin; t < end; t += tile) {
      const int64_t t_end = std::min(end, t + tile);
      for (int64_t m0 = 0; m0 < M; m0 += 2 * kBlock) {
        const int64_t cols0 = std::min(kBlock, M - m0), cols1 = std::clamp<int64_t>(M - m0 - kBlock, 0, kBlock);
        if (cols0 != configured[0] || cols1 != configured[1]) {
          configure(cols0, cols1);
          configured[0] = cols0, configured[1] = cols1;
        }
        for (int64_t b = t; b < t_end; b += 2) pair(b, t_end - b > 1, m0, cols0, cols1, scales, bias, y);
      }
    }
    _tile_release();
  }

  // Blocks b and (with `two`) b + 1 times activation rows m0 .. m0 + cols0 + cols1
  template <typename Y>
  void pair(int64_t b, bool two, int64_t m0, int64_t cols0, int64_t cols1, const float* scales, const float* bias,
            Y* y) const {
    const at::BFloat16* a0 = w + b * kBlock * K;
    const at::BFloat16* a1 = a0 + kBlock * K;
    const uint32_t* xs = x.data() + m0;
    const int64_t a_stride = K * 2, x_stride = stride * 4;  // bytes
    _tile_zero(4);
    _tile_zero(6);
    if (cols1) {
      _tile_zero(5);
      _tile_zero(7);
    }
    // the next pair's weights requested into L2 in their memory order, a k step's share at a time (ahead in the
    // order of the tile loads streamed slower, as did nothing: the hardware prefetcher then sees 32 strided rows)
    const char* next = reinterpret_cast<const char*>(a0 + 2 * kBlock * K);
    constexpr int64_t kAhead = 2 * kBlock * kDepth * sizeof(at::BFloat16);  // bytes: what a step reads of a pair
    for (int64_t k = 0; k < K; k += kDepth) {
      for (int64_t p = 0; p < kAhead; p += 64) _mm_prefetch(next + k / kDepth * kAhead + p, _MM_HINT_T1);
      const uint32_t* xk = xs + k / 2 * stride;  // 16 rows of column pairs
      _tile_loadd(0, xk, x_stride);
      if (cols1) _tile_loadd(1, xk + kBlock, x_stride);
      _tile_loadd(2, a0 + k, a_stride);
      _tile_dpbf16ps(4, 2, 0);
      if (cols1) _tile_dpbf16ps(5, 2, 1);
      if (two) {
        _tile_loadd(3, a1 + k, a_stride);
        _tile_dpbf16ps(6, 3, 0);
        if (cols1) _tile_dpbf16ps(7, 3, 1);
      }
    }
    alignas(64) float c[kBlock * kBlock];  // [weight row][activation row]
    auto store = [&](int64_t block, int64_t first, int64_t cols) {
      for (int64_t n = 0; n < kBlock; ++n) {
        const int64_t row = block * kBlock + n;
        const float s = scales ? scales[row] : 1.0f, add = bias ? bias[row] : 0.0f;
        for (int64_t m = 0; m < cols; ++m) y[(first + m) * N + row] = static_cast<Y>(c[n * kBlock + m] * s + add);
      }
    };
    _tile_stored(4, c, kBlock * 4);
    store(b, m0, cols0);
    if (cols1) {
      _tile_stored(5, c, kBlock * 4);
      store(b, m0 + kBlock, cols1);
    }
    if (two) {
      _tile_stored(6, c, kBlock * 4);
      store(b + 1, m0, cols0);
      if (cols1) {
        _tile_stored(7, c, kBlock * 4);
        store(b + 1, m0 + kBlock, cols1);
      }
    }
  }
};

}  // namespace INFERLAB_ISA
}  // namespace inferlab

#endif  // INFERLAB_AMX
