// Products on AMX tiles (the amx build: INFERLAB_AMX): bf16 weights (Bf16Tiles), int8 weights (Int8Tiles), and int4
// tiles multiplied in bf16 (Int4DequantTiles).
//
// bf16: y = x @ W.T with the activations rounded to bf16, each product exact and summed in fp32 by the tiles' bf16
// dot instruction (TDPBF16PS).
//
// The vector bf16 dots of gemv.h's Bf16DotStep keep a step of 2-32 rows bound by the multiply-adds, which the
// tiles do many at once: the more rows, the more this gains. One row loses a little: the tiles stream the weights
// from memory more slowly than vector loads (from L2 they run far faster), and a row's sums must be the same
// whatever the call's rows, so one row cannot take the other kernel.
//
// A weight block of 16 rows x 32 columns is one A tile, loaded straight from the row-major weights; the
// activations are the B tiles, 16 rows of column pairs by up to 16 activation rows; a C tile holds the block's
// 16 x (up to 16) sums over the whole of K. The tile instruction's cost grows with the B tile's columns (padding
// one row to 16 would cost half as much again), so the tiles are configured to the rows the call has; beyond 16
// rows each B tile row starts a cache line (tile rows that straddle lines load far more slowly). Each
// (weight row, activation row) sum runs through the same instructions in the same order whatever else the call
// holds, so a row's result does not depend on the other rows (batch invariance, as gemv.h's). Rounding the
// activations to bf16 is what a bf16 model does between its layers anyway (the Python model's bf16 layers hand
// this kernel bf16 activations: their results are unchanged by it). Covers N a multiple of 16 and K of 32 (every
// projection of the supported models); other shapes take Bf16DotStep for all their rows.
#pragma once

#ifdef INFERLAB_AMX

#include <algorithm>
#include <cstdint>
#include <memory>
#include <vector>

#include "parallel.h"
#include "simd.h"

namespace inferlab {
inline namespace INFERLAB_ISA {

// A tile configuration (palette 1): tile t holds rows[t] rows of colsb[t] bytes; load() makes it this thread's
struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
  void shape(int tile, int64_t n_rows, int64_t bytes) {
    rows[tile] = static_cast<uint8_t>(n_rows);
    colsb[tile] = static_cast<uint16_t>(bytes);
  }
  void load() const { _tile_loadconfig(this); }
};

// The first 64-byte boundary at or after p (a buffer allocated 16 values longer): a tile row then starts a cache line
inline uint32_t* line_aligned(uint32_t* p) {
  return reinterpret_cast<uint32_t*>((reinterpret_cast<uintptr_t>(p) + 63) & ~uintptr_t(63));
}

struct Bf16Tiles {
  static constexpr int64_t kBlock = 16;       // weight rows per A tile; activation rows per B tile at most
  static constexpr int64_t kDepth = 32;       // columns per tile instruction (an A tile row: 32 bf16, 64 bytes)

  static bool covers(int64_t N, int64_t K) { return N % kBlock == 0 && K % kDepth == 0; }

  const at::BFloat16* w;  // (N, K)
  int64_t N, K, M;
  int64_t width;  // activation rows of a block of x: M up to 16, else 16 (a B tile's rows of 64 bytes)
  // (ceil(M / width), K / 2, width): activation row m's columns (2p, 2p + 1) at [m / width, p, m % width], as bf16.
  // Each B tile is 1 KiB in one piece: with one (K / 2, M) matrix, its rows 4 M bytes apart would fall into a
  // quarter of L1's sets or less beyond 16 rows, and evict each other; 64-byte aligned. Left uninitialized: the tiles read only the
  // columns of the rows the call has, each written below
  std::unique_ptr<uint32_t[]> storage;
  uint32_t* x;

  Bf16Tiles(const at::BFloat16* weights, int64_t N_, int64_t K_, const float* xf, int64_t M_)
      : w(weights), N(N_), K(K_), M(M_), width(std::min(M_, kBlock)),
        storage(new uint32_t[(M_ + width - 1) / width * width * (K_ / 2) + 16]),
        x(line_aligned(storage.get())) {
    if (M < kBlock) {  // a few rows (a decode step): each value rounded to bf16 (to nearest even) and put in place
      for_each_chunk(K / 16, 16, M, [&](int64_t chunk, int64_t m) {  // 16 values: 8 pairs
        alignas(32) uint32_t pairs[8];
        _mm256_store_si256(reinterpret_cast<__m256i*>(pairs),
                           reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(_mm512_loadu_ps(xf + m * K + 16 * chunk))));
        for (int p = 0; p < 8; ++p) x[(8 * chunk + p) * width + m] = pairs[p];
      });
      return;
    }
    // per 16 activation rows and 32 columns: each row's 16 column pairs rounded to bf16, the 16 x 16 pairs transposed
    // in registers into their B tile rows (a pair's value of every activation row); put in place a pair at a time
    // as above, this would be a visible share of a prompt's fused step
    const int64_t steps = K / kDepth, units = (M + kBlock - 1) / kBlock * steps;
    at::parallel_for(0, units, 8, [&](int64_t begin, int64_t end) {
      for (int64_t unit = begin; unit < end; ++unit) {
        const int64_t m0 = unit / steps * kBlock, k = unit % steps * kDepth, rows = std::min(kBlock, M - m0);
        __m512i pairs[kBlock];
        for (int64_t m = 0; m < kBlock; ++m) {
          const float* row = xf + (m0 + m) * K + k;
          pairs[m] = m < rows ? reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(_mm512_loadu_ps(row + 16), _mm512_loadu_ps(row)))
                              : _mm512_setzero_si512();
        }
        Wide::transpose(pairs);  // pairs[p] lane m: activation row m0 + m's columns (k + 2p, k + 2p + 1)
        uint32_t* block = x + m0 / width * (K / 2 * width) + k / 2 * width;
        for (int64_t p = 0; p < kBlock; ++p) {
          _mm512_mask_storeu_epi32(block + p * width, static_cast<__mmask16>((1u << rows) - 1), pairs[p]);
        }
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
  static void configure(int64_t cols0, int64_t cols1) {  // activation rows in B tiles 0 and 1 (0: unused)
    TileConfig c;
    const int64_t cols[2] = {cols0, cols1};
    for (int g = 0; g < 2; ++g) {
      const int64_t rows = cols[g] ? kBlock : 0;
      c.shape(g, rows, cols[g] * 4);      // B: 16 rows of column pairs
      c.shape(4 + g, rows, cols[g] * 4);  // C of block 0
      c.shape(6 + g, rows, cols[g] * 4);  // C of block 1
    }
    for (int a = 2; a < 4; ++a) c.shape(a, kBlock, kDepth * 2);
    c.load();
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
    const uint32_t* xs = x + m0 * (K / 2);  // rows m0.. (m0 a multiple of 16 and of width)
    const int64_t a_stride = K * 2, x_stride = width * 4, next_rows = kBlock * (K / 2);  // bytes, bytes, values
    _tile_zero(4);
    _tile_zero(6);
    if (cols1) {
      _tile_zero(5);
      _tile_zero(7);
    }
    // the next pair's weights requested into L2 in their memory order, a k step's share at a time (in the order of the
    // tile loads, or not at all, the hardware prefetcher sees 32 strided rows and falls behind). Beyond 32 rows this
    // repeats for every 32 rows of the same pair: requesting them on its first 32 only gains nothing in a whole step
    const char* next = reinterpret_cast<const char*>(a0 + 2 * kBlock * K);
    constexpr int64_t kAhead = 2 * kBlock * kDepth * sizeof(at::BFloat16);  // bytes: what a step reads of a pair
    for (int64_t k = 0; k < K; k += kDepth) {
      for (int64_t p = 0; p < kAhead; p += 64) _mm_prefetch(next + k / kDepth * kAhead + p, _MM_HINT_T1);
      const uint32_t* xk = xs + k / 2 * width;  // 16 rows of column pairs
      _tile_loadd(0, xk, x_stride);
      if (cols1) _tile_loadd(1, xk + next_rows, x_stride);
      _tile_loadd(2, a0 + k, a_stride);
      _tile_dpbf16ps(4, 2, 0);
      if (cols1) _tile_dpbf16ps(5, 2, 1);
      if (two) {
        _tile_loadd(3, a1 + k, a_stride);
        _tile_dpbf16ps(6, 3, 0);
        if (cols1) _tile_dpbf16ps(7, 3, 1);
      }
    }
    // [weight row][activation row]: y's rows are its columns, moved out by scalar moves (a 16 x 16 transpose in
    // registers with shuffles costs more than it saves)
    alignas(64) float c[kBlock * kBlock];
    auto store = [&](int64_t block, int64_t first, int64_t cols) {
      for (int64_t m = 0; m < cols; ++m) {  // a row of y at a time (16 values, a cache line): rows of y a multiple of
        Y* out = y + (first + m) * N + block * kBlock;  // 4 KiB apart (the LM head's) share L1's sets, 16 > its ways
        for (int64_t n = 0; n < kBlock; ++n) {
          const int64_t row = block * kBlock + n;
          out[n] = static_cast<Y>(c[n * kBlock + m] * (scales ? scales[row] : 1.0f) + (bias ? bias[row] : 0.0f));
        }
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

// int8 weights (one scale per row) times the int16 activation codes gemv.h's Int8Step takes, on the tiles' byte
// dots: a code is high * 256 + low (high signed, low unsigned), so a weight row . activation row is
// 256 * (w . high) + (w . low), two tile dots (TDPBSSD, TDPBSUD) over the whole of K, each exact in int32. Their
// total, exact in int64, is rounded to float once, as Int8Step::total rounds its own exact total: the same float,
// so a row gets the same result on this path and on Int8Step's (which the calls of one row keep: batch
// invariance). The layout is Bf16Tiles': A = 16 weight rows x 64 columns straight from the row-major weights, B =
// the activations as quads of columns (blocks of 16 rows: K / 4, 16), C = 16 x up to 16 sums; two weight blocks
// share each B load.
// Covers N a multiple of 16 and K of 64. A tile instruction costs the same whatever its rows, so one activation row
// is cheaper on Int8Step (gemv.h: kInt8TilesMinRows). Results go out a row of y at a time, as Bf16Tiles' do. (int4
// weights' integer products stay on gemv.h's kernel: their scale per 32 columns needs its own tile dots and a store
// of their sums per block of 32 columns, and the tile instructions a block of 16 x 32 weights then needs cost about
// what the vector kernel's multiply-adds do: the same floats, no faster.)
struct Int8Tiles {
  static constexpr int64_t kBlock = 16;  // weight rows per A tile; activation rows per B tile at most
  static constexpr int64_t kDepth = 64;  // columns per tile instruction (an A tile row: 64 int8)

  static bool covers(int64_t N, int64_t K) { return N % kBlock == 0 && K % kDepth == 0; }

  const int8_t* w;  // (N, K)
  int64_t N, K, M;
  // high, low: (ceil(M / 16), K / 4, 16): activation row m's codes 4p .. 4p + 3 at [m / 16, p, m % 16], by byte; a B
  // tile's rows 64 bytes (tile rows of 32 or 48 bytes straddle cache lines and load more slowly), the tile in one
  // piece (as Bf16Tiles' activations, so its rows do not crowd a few of L1's sets), 64-byte aligned
  std::vector<uint32_t> storage;
  uint32_t *high, *low;
  std::vector<float> x_scale;  // (M,)

  template <typename Codes>  // codes(row, K, out int16) -> the scale that undoes them (gemv.h's int16_codes)
  Int8Tiles(const int8_t* weights, int64_t N_, int64_t K_, const float* xf, int64_t M_, Codes codes)
      : w(weights), N(N_), K(K_), M(M_), storage(2 * padded() + 16), x_scale(M_) {
    high = line_aligned(storage.data());
    low = high + padded();
    std::vector<int16_t> rows(M * K);  // (M, K): each row's codes, then (below) split by bytes
    for_each_row(M, [&](int64_t m) { x_scale[m] = codes(xf + m * K, K, rows.data() + m * K); });
    for_each_chunk(K / 32, 32, M, [&](int64_t chunk, int64_t m) {  // 32 codes: their high and low bytes, 8 quads each
      const __m512i codes32 = _mm512_loadu_si512(rows.data() + m * K + 32 * chunk);
      alignas(32) uint32_t h[8], l[8];
      _mm256_store_si256(reinterpret_cast<__m256i*>(h), _mm512_cvtepi16_epi8(_mm512_srai_epi16(codes32, 8)));
      _mm256_store_si256(reinterpret_cast<__m256i*>(l), _mm512_cvtepi16_epi8(codes32));
      const int64_t at = m / kBlock * (K / 4 * kBlock) + m % kBlock;
      for (int p = 0; p < 8; ++p) high[at + (8 * chunk + p) * kBlock] = h[p], low[at + (8 * chunk + p) * kBlock] = l[p];
    });
  }

  int64_t padded() const { return (M + kBlock - 1) / kBlock * kBlock * (K / 4); }  // values of high (and of low)

  // y (M, N) = the products * x_scale * scales + bias (bias when given), weight blocks split across torch's threads
  template <typename Y>
  void operator()(const float* scales, const float* bias, Y* y) const {
    at::parallel_for(0, N / kBlock, kGrain / kBlock, [&](int64_t begin, int64_t end) { blocks(begin, end, scales, bias, y); });
  }

 private:
  // The tiles: B 0 (high bytes) and 1 (low), A 2 and 3 (two weight blocks), C 4 + 2 * block + byte
  static void configure(int64_t cols) {
    TileConfig c;
    for (int t : {0, 1}) c.shape(t, kDepth / 4, cols * 4);
    for (int t : {2, 3}) c.shape(t, kBlock, kDepth);
    for (int t : {4, 5, 6, 7}) c.shape(t, kBlock, cols * 4);
    c.load();
  }

  // Weight blocks [begin, end) times every activation row, 16 at a time; beyond 16, per tile of blocks in L2
  template <typename Y>
  void blocks(int64_t begin, int64_t end, const float* scales, const float* bias, Y* y) const {
    const int64_t tile = M <= kBlock ? end - begin : std::max<int64_t>(2, kTileBytes / (kBlock * K) / 2 * 2);
    int64_t configured = 0;
    for (int64_t t = begin; t < end; t += tile) {
      const int64_t t_end = std::min(end, t + tile);
      for (int64_t m0 = 0; m0 < M; m0 += kBlock) {
        const int64_t cols = std::min(kBlock, M - m0);
        if (cols != configured) configure(configured = cols);
        for (int64_t b = t; b < t_end; b += 2) pair(b, t_end - b > 1, m0, cols, scales, bias, y);
      }
    }
    _tile_release();
  }

  // Blocks b and (with `two`) b + 1 times activation rows m0 .. m0 + cols
  template <typename Y>
  void pair(int64_t b, bool two, int64_t m0, int64_t cols, const float* scales, const float* bias, Y* y) const {
    const int8_t* a0 = w + b * kBlock * K;
    const int8_t* a1 = a0 + kBlock * K;
    const int64_t x_stride = kBlock * 4;  // bytes
    _tile_zero(4);  // the tile instructions name their tiles as constants
    _tile_zero(5);
    _tile_zero(6);
    _tile_zero(7);
    const char* next = reinterpret_cast<const char*>(a0 + 2 * kBlock * K);  // as Bf16Tiles::pair's
    constexpr int64_t kAhead = 2 * kBlock * kDepth;
    for (int64_t k = 0; k < K; k += kDepth) {
      for (int64_t p = 0; p < kAhead; p += 64) _mm_prefetch(next + k / kDepth * kAhead + p, _MM_HINT_T1);
      _tile_loadd(0, high + m0 * (K / 4) + k / 4 * kBlock, x_stride);
      _tile_loadd(1, low + m0 * (K / 4) + k / 4 * kBlock, x_stride);
      _tile_loadd(2, a0 + k, K);
      _tile_dpbssd(4, 2, 0);
      _tile_dpbsud(5, 2, 1);
      if (two) {
        _tile_loadd(3, a1 + k, K);
        _tile_dpbssd(6, 3, 0);
        _tile_dpbsud(7, 3, 1);
      }
    }
    alignas(64) int32_t c_high[kBlock * kBlock], c_low[kBlock * kBlock];  // [weight row][activation row]
    alignas(64) float sums[kBlock * kBlock];
    const __m512 xs = _mm512_maskz_loadu_ps(static_cast<__mmask16>((1u << cols) - 1), x_scale.data() + m0);
    auto store = [&](int64_t block, int high_tile) {
      if (high_tile == 4) {
        _tile_stored(4, c_high, kBlock * 4);
        _tile_stored(5, c_low, kBlock * 4);
      } else {
        _tile_stored(6, c_high, kBlock * 4);
        _tile_stored(7, c_low, kBlock * 4);
      }
      for (int64_t n = 0; n < kBlock; ++n) {  // weight row n's sums: exact in double, rounded to float once
        const int64_t row = block * kBlock + n;
        __m256 half[2];
        for (int h = 0; h < 2; ++h) {
          const __m512d exact = _mm512_add_pd(
              _mm512_mul_pd(_mm512_cvtepi32_pd(_mm256_load_si256(reinterpret_cast<const __m256i*>(c_high + n * kBlock + 8 * h))),
                            _mm512_set1_pd(256.0)),
              _mm512_cvtepi32_pd(_mm256_load_si256(reinterpret_cast<const __m256i*>(c_low + n * kBlock + 8 * h))));
          half[h] = _mm512_cvtpd_ps(exact);
        }
        const __m512 total = _mm512_castpd_ps(_mm512_insertf64x4(_mm512_castps_pd(_mm512_castps256_ps512(half[0])),
                                                                 _mm256_castps_pd(half[1]), 1));
        const __m512 scaled = _mm512_mul_ps(_mm512_mul_ps(total, xs), _mm512_set1_ps(scales ? scales[row] : 1.0f));
        _mm512_store_ps(sums + n * kBlock, _mm512_add_ps(scaled, _mm512_set1_ps(bias ? bias[row] : 0.0f)));
      }
      for (int64_t m = 0; m < cols; ++m) {  // a row of y at a time: its 16 values fill one cache line
        Y* out = y + (m0 + m) * N + block * kBlock;
        for (int64_t n = 0; n < kBlock; ++n) out[n] = static_cast<Y>(sums[n * kBlock + m]);
      }
    };
    store(b, 4);
    if (two) store(b + 1, 6);
  }
};

// int4 weights as gemv.h's Int4Format tiles (blocks of 16 weight rows: per chunk of 8 columns a 4-byte value a row,
// then per group a line of the rows' 16 fp16 scales and one of their 16 fp16 mins), multiplied in bf16: each block's
// weights dequantized in cache, q * scale + min in fp32 rounded to bf16, which is what a layer's bf16 copy holds
// (quant/int4.py's dequantize_groups_int4 multiplies, then adds; here one fused multiply-add, the same floats: a 4-bit
// code times an fp16 scale is exact in fp32, so only the add rounds either way; one instruction fewer); the
// activations rounded to bf16. The block's weights become B tiles of column pairs with a lane per weight row, as the int4 tiles
// already hold them (a byte of a row's 4-byte chunk value is a pair of columns: no transpose), the activations A
// tiles of 16 rows, C = activation rows x the block's 16 weight rows, summed in fp32 over the whole of K by the tiles'
// bf16 dot (TDPBF16PS): the same floats as Bf16Tiles over the copy (the products of a pair and their order over K
// are the same with A and B swapped). Two blocks at a time, each pair of B tiles loaded once for up to 32 activation
// rows, and the next pair dequantized a k step at a time between this pair's tile dots (the vector units and the
// tile unit at work together rather than one after the other). The dequantizing costs ~10 instructions per 32
// weights whatever the rows (each code picked out of its 4-byte value by a byte shuffle of the value's masked low or
// high nibbles, fewer instructions than a shift and a mask); the int4 kernel's multiply-adds grow with the rows, so
// from a dozen or so rows this outruns it, and it reads a quarter of the bytes the bf16 copy streams. Where the rows
// are many enough that the tile dots dominate, streaming the copy costs less than dequantizing (gemv.h:
// kInt4CopyFromRows). Covers N a multiple of 16 and groups of a multiple of 32 columns. (Multiplying the codes
// exactly instead, each as the bf16 1 + q / 16, with each group's sums stored from its tile and scaled, is far more
// accurate than the copy's numbers but no faster: the store and scaling per group and block cost about what the
// dequantizing saves, and more with more rows.)
struct Int4DequantTiles {
  static constexpr int64_t kBlock = 16;  // weight rows per block (the tiles' lanes); activation rows per A tile
  static constexpr int64_t kDepth = 32;  // columns per tile instruction

  static bool covers(int64_t N, int64_t K, int64_t group) { return N % kBlock == 0 && K % kDepth == 0 && group % kDepth == 0; }

  const int32_t* tiles;  // (N / 16, K / 8 + G, 16) int32
  int64_t N, K, group, chunks, G, M;
  // (M, K) as bf16: the calling thread's buffer, kept from call to call (one allocated, zero-filled and first touched
  // per call is a visible share of a step); valid until this thread's next one
  uint16_t* x;

  Int4DequantTiles(const int32_t* tiles_, int64_t N_, int64_t K_, int64_t group_, const float* xf, int64_t M_)
      : tiles(tiles_), N(N_), K(K_), group(group_), chunks(K_ / 8), G(K_ / group_), M(M_) {
    thread_local std::vector<uint16_t> buffer;
    buffer.resize(std::max<size_t>(buffer.size(), M * K));
    x = buffer.data();
    // rows split across threads beyond 32 Ki values (serial, the other threads would wait; fewer values do not pay
    // for a fork)
    for_each_row(M, [&](int64_t m) {
      for (int64_t i = m * K; i < (m + 1) * K; i += 16) {
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(x + i),
                            reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(_mm512_loadu_ps(xf + i))));
      }
    }, rows_holding(32768, K));
  }

  // y (M, N) = the products + bias (when given), pairs of blocks split evenly across torch's threads. (Handing pairs
  // out a few at a time to whichever thread asks next, to absorb a thread slowed by other work, gains nothing: each
  // thread dequantizes the pair it takes next ahead of time, which a dynamic hand-out cannot know.)
  template <typename Y>
  void operator()(const float* bias, Y* y) const {
    at::parallel_for(0, N / kBlock, 2, [&](int64_t begin, int64_t end) {
      // four blocks' weights as B tiles: (K / 2 column pairs, 16 rows) each, written before they are read: the
      // thread's buffer kept from call to call (allocating and zeroing it per call costs a visible share)
      thread_local std::vector<uint32_t> b;
      b.resize(std::max<size_t>(b.size(), 2 * K * kBlock + 16));
      uint32_t* bt = line_aligned(b.data());
      uint32_t* bt1 = bt + K / 2 * kBlock;
      int64_t configured[2] = {-1, -1};
      uint32_t* next = bt1 + K / 2 * kBlock;  // the next pair's, made while this pair's tile dots run
      uint32_t* next1 = next + K / 2 * kBlock;
      for (int64_t s = 0; s < K / kDepth; ++s) {
        dequantize_step(begin, s, bt);
        if (begin + 1 < end) dequantize_step(begin + 1, s, bt1);
      }
      for (int64_t blk = begin; blk < end; blk += 2) {
        const bool two = blk + 1 < end;
        const int64_t after = blk + 2;  // the next pair's first block, if any
        for (int64_t m0 = 0; m0 < M; m0 += 2 * kBlock) {
          const int64_t rows0 = std::min(kBlock, M - m0), rows1 = std::clamp<int64_t>(M - m0 - kBlock, 0, kBlock);
          if (rows0 != configured[0] || rows1 != configured[1]) {
            TileConfig c;
            c.shape(0, rows0, 64);
            c.shape(4, rows0, 64);
            c.shape(5, rows0, 64);
            if (rows1) {
              c.shape(1, rows1, 64);
              c.shape(6, rows1, 64);
              c.shape(7, rows1, 64);
            }
            c.shape(2, kBlock, 64);
            c.shape(3, kBlock, 64);
            c.load();
            configured[0] = rows0, configured[1] = rows1;
          }
          _tile_zero(4);
          _tile_zero(5);
          if (rows1) {
            _tile_zero(6);
            _tile_zero(7);
          }
          const uint16_t* x0 = x + m0 * K;
          for (int64_t k = 0; k < K; k += kDepth) {
            if (m0 == 0 && after < end) {  // the vector units dequantize while the tile unit multiplies
              dequantize_step(after, k / kDepth, next);
              if (after + 1 < end) dequantize_step(after + 1, k / kDepth, next1);
            }
            _tile_loadd(0, x0 + k, K * 2);
            _tile_loadd(2, bt + k / 2 * kBlock, 64);
            _tile_dpbf16ps(4, 0, 2);
            if (two) {
              _tile_loadd(3, bt1 + k / 2 * kBlock, 64);
              _tile_dpbf16ps(5, 0, 3);
            }
            if (rows1) {
              _tile_loadd(1, x0 + kBlock * K + k, K * 2);
              _tile_dpbf16ps(6, 1, 2);
              if (two) _tile_dpbf16ps(7, 1, 3);
            }
          }
          alignas(64) float c[kBlock * kBlock];  // [activation row][weight row]
          auto store = [&](int64_t block, int64_t first, int64_t rows) {
            for (int64_t m = 0; m < rows; ++m) {
              Y* out = y + (first + m) * N + block * kBlock;
              for (int64_t n = 0; n < kBlock; ++n) out[n] = static_cast<Y>(c[m * kBlock + n] + (bias ? bias[block * kBlock + n] : 0.0f));
            }
          };
          _tile_stored(4, c, 64);
          store(blk, m0, rows0);
          if (two) {
            _tile_stored(5, c, 64);
            store(blk + 1, m0, rows0);
          }
          if (rows1) {
            _tile_stored(6, c, 64);
            store(blk, m0 + kBlock, rows1);
            if (two) {
              _tile_stored(7, c, 64);
              store(blk + 1, m0 + kBlock, rows1);
            }
          }
        }
        std::swap(bt, next);
        std::swap(bt1, next1);
      }
      _tile_release();
    });
  }

 private:
  // k step s (columns 32 s .. 32 s + 31) of block blk's weights into bt: rows 16 s .. of the (K / 2, 16) column pairs,
  // lane n = (w[n, 2p], w[n, 2p + 1]) as bf16. (Picking each code by VPERMT2B (AVX-512 VBMI) straight into the
  // tile row's order, sparing the final word permute, is slower: VPERMT2B costs more than the shuffle and permute.)
  void dequantize_step(int64_t blk, int64_t s, uint32_t* bt) const {
    const int32_t* t = tiles + blk * (chunks + G) * kBlock;
    const uint16_t* halves = reinterpret_cast<const uint16_t*>(t + chunks * kBlock);
    alignas(64) static const uint16_t order[32] = {0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23,
                                                    8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31};
    const __m512i interleave = _mm512_load_si512(order), nibbles = _mm512_set1_epi8(0xF);
    struct ByteControls {  // VPSHUFB's, picking byte p of each 4-byte value, zero-extended: in each 16-byte lane value
      alignas(64) uint32_t of[4][16];  // j's byte p is byte 4 j + p (0x80: a zero)
      constexpr ByteControls() : of{} {
        for (uint32_t p = 0; p < 4; ++p) {
          for (uint32_t j = 0; j < 16; ++j) of[p][j] = 0x80808000u | (4 * (j % 4) + p);
        }
      }
    };
    static constexpr ByteControls controls;
    const __m512i byte[4] = {_mm512_load_si512(controls.of[0]), _mm512_load_si512(controls.of[1]),
                             _mm512_load_si512(controls.of[2]), _mm512_load_si512(controls.of[3])};
    const int64_t g = s * kDepth / group;
    const __m512 scale = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(halves + 2 * g * kBlock)));
    const __m512 min = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(halves + (2 * g + 1) * kBlock)));
    for (int64_t c = s * 4; c < s * 4 + 4; ++c) {
      _mm_prefetch(reinterpret_cast<const char*>(t + c * kBlock) + 32 * 1024, _MM_HINT_T1);
      const __m512i bytes = _mm512_loadu_si512(t + c * kBlock);
      const __m512i lows = _mm512_and_si512(bytes, nibbles), highs = _mm512_and_si512(_mm512_srli_epi32(bytes, 4), nibbles);
      for (int p = 0; p < 4; ++p) {
        const __m512i lo = _mm512_shuffle_epi8(lows, byte[p]);
        const __m512i hi = _mm512_shuffle_epi8(highs, byte[p]);
        const __m512 lo_w = _mm512_fmadd_ps(_mm512_cvtepi32_ps(lo), scale, min);
        const __m512 hi_w = _mm512_fmadd_ps(_mm512_cvtepi32_ps(hi), scale, min);
        const __m512i both = reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(hi_w, lo_w));  // lo 0..15, hi 0..15
        _mm512_store_si512(bt + (4 * c + p) * kBlock, _mm512_permutexvar_epi16(interleave, both));
      }
    }
  }
};

}  // namespace INFERLAB_ISA
}  // namespace inferlab

#endif  // INFERLAB_AMX
