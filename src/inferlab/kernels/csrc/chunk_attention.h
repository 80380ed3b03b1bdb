// Attention for a prompt chunk (the AVX-512 builds): R consecutive rows of one sequence, at positions p0 .. p0 + R - 1,
// each over the sequence's bf16 keys and values up to its own position (causal).
//
// attention.h's loop attends a row at a time: every row of a 128-row chunk reads and widens the same keys again, and
// its products are fp32 multiply-adds of one row. Here a chunk's keys and values are laid out once per key/value head
// (ChunkKv: the keys' column pairs by key, the values' key pairs by column), and each tile of up to 16 rows takes its
// scores S = Q K^T and its output P V as bf16 pair dots summed in fp32, with the softmax between them: on AMX tiles
// (TDPBF16PS, the amx build), else on the vectors (VDPBF16PS: one instruction a column pair of 16 keys, or a key pair
// of 16 columns, per row). The queries (scaled) and the unnormalized weights P are rounded to bf16, as a bf16 model's
// own attention rounds them (the per-row loop keeps both in fp32); every product is exact and summed in fp32, the
// weights' sums in fp32 from their unrounded values. A row's result depends only on its own query and keys: rows of
// a tile are independent.
#pragma once

#ifdef INFERLAB_AVX512

#include <algorithm>
#include <cstdint>
#include <limits>
#include <type_traits>
#include <vector>

#ifdef INFERLAB_AMX
#include "amx.h"
#endif
#include "simd.h"

namespace inferlab {
inline namespace INFERLAB_ISA {

constexpr int64_t kChunkMinRows = 16;  // a run of this many rows of one sequence or more attends a tile at a time

// One key/value head's keys 0..L-1 and their values as AMX B tiles (each 64-byte line of them one vector of the
// vector path's dots), made once per chunk and head
struct ChunkKv {
  int64_t D = 0;                 // head dim; below, `padded`: the keys rounded up to 32 (the value tiles' depth)
  std::vector<uint32_t> keys;    // (padded / 16, D / 32, 16, 16): [key block][column chunk][pair p][key n] = k[n][2p, 2p+1]
  std::vector<uint32_t> values;  // (padded / 32, D / 16, 16, 16): [key block][column block][key pair j][column d]

  // keys 0..L-1: key_row(l), value_row(l) position l's D bf16 values (uint16)
  template <typename KeyRows, typename ValueRows>
  void make(const KeyRows& key_row, const ValueRows& value_row, int64_t L, int64_t D_) {
    D = D_;
    const int64_t padded = (L + 31) / 32 * 32;
    keys.assign(padded / 16 * (D / 32) * 256, 0);
    values.assign(padded / 32 * (D / 16) * 256, 0);
    for (int64_t l = 0; l < L; ++l) {
      const uint32_t* pairs = reinterpret_cast<const uint32_t*>(key_row(l));
      uint32_t* block = keys.data() + l / 16 * (D / 32) * 256 + l % 16;
      for (int64_t c = 0; c < D / 32; ++c) {
        for (int64_t p = 0; p < 16; ++p) block[(c * 16 + p) * 16] = pairs[c * 16 + p];
      }
      const uint16_t* v = value_row(l);
      uint16_t* out = reinterpret_cast<uint16_t*>(values.data() + l / 32 * (D / 16) * 256) + (l % 32 / 2) * 32 + l % 2;
      for (int64_t d = 0; d < D; ++d) out[d / 16 * 512 + d % 16 * 2] = v[d];
    }
  }
};

// The tile's n rows' query of one head (row stride `stride`) times `scale`, rounded to bf16 into qb (n, D)
inline void chunk_queries(const float* q, int64_t stride, int64_t n, int64_t D, float scale, uint16_t* qb) {
  for (int64_t i = 0; i < n; ++i) {
    for (int64_t d = 0; d < D; d += 16) {
      const __m512 x = _mm512_mul_ps(_mm512_loadu_ps(q + i * stride + d), _mm512_set1_ps(scale));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(qb + i * D + d), reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(x)));
    }
  }
}

// The tile's n rows' weights from their scores (row stride width; row i at position pos0 + i): softmax over keys
// 0..pos unnormalized, rounded to bf16 into pb (row stride width; zeros beyond pos), and 1 / their fp32 sum in inv
inline void chunk_weights(const float* s, int64_t width, int64_t n, int64_t pos0, uint16_t* pb, float* inv) {
  for (int64_t i = 0; i < n; ++i) {  // softmax over keys 0..pos (pos = pos0 + i), zeros beyond
    const float* row = s + i * width;
    const int64_t keys = pos0 + i + 1;
    auto mask = [&](int64_t l) {  // the lanes of keys l .. l + 15 up to pos
      return l + 16 <= keys ? __mmask16(0xFFFF) : l < keys ? static_cast<__mmask16>((1u << (keys - l)) - 1) : __mmask16(0);
    };
    __m512 top = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
    for (int64_t l = 0; l < keys; l += 16) top = _mm512_mask_max_ps(top, mask(l), top, _mm512_loadu_ps(row + l));
    const __m512 max = _mm512_set1_ps(_mm512_reduce_max_ps(top));
    __m512 sum = _mm512_setzero_ps();
    for (int64_t l = 0; l < keys; l += 16) {
      const __m512 e = _mm512_maskz_mov_ps(mask(l), exp<Wide>(_mm512_sub_ps(_mm512_loadu_ps(row + l), max)));
      sum = _mm512_add_ps(sum, e);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(pb + i * width + l),
                          reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(e)));
    }
    inv[i] = 1.0f / _mm512_reduce_add_ps(sum);
  }
}

#ifdef INFERLAB_AMX
// The amx build's scores and outputs (the tile configuration attend_chunk_tile loads: A: Q 0, P 1; B: keys 2,
// values 3; C: 4..7). Scores: the tile's rows' bf16 queries qb (n, D) times keys 0..16 key_blocks - 1, into s (row
// stride width)
inline void tile_scores(const ChunkKv& kv, const uint16_t* qb, int64_t, int64_t key_blocks, int64_t width, float* s) {
  const int64_t D = kv.D;
  for (int64_t kb = 0; kb < key_blocks; ++kb) {
    _tile_zero(4);
    for (int64_t c = 0; c < D / 32; ++c) {
      _tile_loadd(0, qb + c * 32, D * 2);
      _tile_loadd(2, kv.keys.data() + (kb * (D / 32) + c) * 256, 64);
      _tile_dpbf16ps(4, 0, 2);
    }
    _tile_stored(4, s + kb * 16, width * 4);
  }
}

// Outputs: the rows' bf16 weights pb (row stride width) times the values, into o (n, D) unnormalized
inline void tile_outputs(const ChunkKv& kv, const uint16_t* pb, int64_t, int64_t width, float* o) {
  const int64_t D = kv.D;
  for (int64_t d0 = 0; d0 < D; d0 += 64) {  // four column blocks of 16 at a time: C 4..7
    _tile_zero(4);
    _tile_zero(5);
    _tile_zero(6);
    _tile_zero(7);
    for (int64_t kb = 0; kb < width / 32; ++kb) {
      const uint32_t* v = kv.values.data() + (kb * (D / 16) + d0 / 16) * 256;
      _tile_loadd(1, pb + kb * 32, width * 2);
      _tile_loadd(3, v, 64);
      _tile_dpbf16ps(4, 1, 3);
      _tile_loadd(3, v + 256, 64);
      _tile_dpbf16ps(5, 1, 3);
      _tile_loadd(3, v + 512, 64);
      _tile_dpbf16ps(6, 1, 3);
      _tile_loadd(3, v + 768, 64);
      _tile_dpbf16ps(7, 1, 3);
    }
    _tile_stored(4, o + d0, D * 4);
    _tile_stored(5, o + d0 + 16, D * 4);
    _tile_stored(6, o + d0 + 32, D * 4);
    _tile_stored(7, o + d0 + 48, D * 4);
  }
}
#else
inline __m512bh bf16_pairs(const uint32_t* p) { return reinterpret_cast<__m512bh>(_mm512_loadu_si512(p)); }
inline __m512bh bf16_pair_of(uint32_t pair) { return reinterpret_cast<__m512bh>(_mm512_set1_epi32(static_cast<int>(pair))); }

// R rows' scores (row stride width) over key blocks 0..key_blocks - 1, two blocks of 16 keys at a time (2R sums, each
// a lane per key): per column pair, its 16 keys' pairs times each row's query pair (qp: R rows of `pairs`). A key block
// past key_blocks is the layout's padding (ChunkKv's keys come in blocks of 32), within the scores' width
template <int R>
void chunk_scores(const uint32_t* keys, const uint32_t* qp, int64_t pairs, int64_t key_blocks, int64_t width, float* s) {
  for (int64_t kb = 0; kb < key_blocks; kb += 2) {
    const uint32_t* block = keys + kb * pairs * 16;
    __m512 acc[2][R];
    for (int r = 0; r < R; ++r) acc[0][r] = acc[1][r] = _mm512_setzero_ps();
    for (int64_t p = 0; p < pairs; ++p) {
      const __m512bh a = bf16_pairs(block + p * 16), b = bf16_pairs(block + (pairs + p) * 16);
      for (int r = 0; r < R; ++r) {
        const __m512bh x = bf16_pair_of(qp[r * pairs + p]);
        acc[0][r] = _mm512_dpbf16_ps(acc[0][r], a, x);
        acc[1][r] = _mm512_dpbf16_ps(acc[1][r], b, x);
      }
    }
    for (int r = 0; r < R; ++r) {
      _mm512_storeu_ps(s + r * width + kb * 16, acc[0][r]);
      _mm512_storeu_ps(s + r * width + kb * 16 + 16, acc[1][r]);
    }
  }
}

// R rows' unnormalized outputs (row stride D) = their weights (pp: R rows of width / 2 pairs) times the values, 64
// columns at a time (4R sums, each a lane per column): per key pair, its pairs of 16 columns times each row's weight pair
template <int R>
void chunk_outputs(const uint32_t* values, const uint32_t* pp, int64_t D, int64_t width, float* o) {
  for (int64_t d0 = 0; d0 < D; d0 += 64) {
    __m512 acc[R][4];
    for (int r = 0; r < R; ++r) {
      for (int c = 0; c < 4; ++c) acc[r][c] = _mm512_setzero_ps();
    }
    for (int64_t kb = 0; kb < width / 32; ++kb) {
      const uint32_t* v = values + (kb * (D / 16) + d0 / 16) * 256;
      for (int j = 0; j < 16; ++j) {
        const __m512bh columns[4] = {bf16_pairs(v + j * 16), bf16_pairs(v + 256 + j * 16), bf16_pairs(v + 512 + j * 16),
                                     bf16_pairs(v + 768 + j * 16)};
        for (int r = 0; r < R; ++r) {
          const __m512bh x = bf16_pair_of(pp[r * width / 2 + kb * 16 + j]);
          for (int c = 0; c < 4; ++c) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], columns[c], x);
        }
      }
    }
    for (int r = 0; r < R; ++r) {
      for (int c = 0; c < 4; ++c) _mm512_storeu_ps(o + r * D + d0 + 16 * c, acc[r][c]);
    }
  }
}

// f(std::integral_constant<int, r>) for the r = min(4, n) rows of a group (r known at compile time)
template <typename F>
void with_row_group(int64_t n, const F& f) {
  switch (std::min<int64_t>(n, 4)) {
    case 1:
      return f(std::integral_constant<int, 1>{});
    case 2:
      return f(std::integral_constant<int, 2>{});
    case 3:
      return f(std::integral_constant<int, 3>{});
    default:
      return f(std::integral_constant<int, 4>{});
  }
}

// The same scores and outputs on the vectors (tile_scores' and tile_outputs' arguments), rows in groups of 4
inline void tile_scores(const ChunkKv& kv, const uint16_t* qb, int64_t n, int64_t key_blocks, int64_t width, float* s) {
  const int64_t pairs = kv.D / 2;
  const uint32_t* qp = reinterpret_cast<const uint32_t*>(qb);
  for (int64_t i = 0; i < n; i += 4) {
    with_row_group(n - i, [&](auto r) {
      chunk_scores<decltype(r)::value>(kv.keys.data(), qp + i * pairs, pairs, key_blocks, width, s + i * width);
    });
  }
}

inline void tile_outputs(const ChunkKv& kv, const uint16_t* pb, int64_t n, int64_t width, float* o) {
  const uint32_t* pp = reinterpret_cast<const uint32_t*>(pb);
  for (int64_t i = 0; i < n; i += 4) {
    with_row_group(n - i, [&](auto r) {
      chunk_outputs<decltype(r)::value>(kv.values.data(), pp + i * width / 2, kv.D, width, o + i * kv.D);
    });
  }
}
#endif  // INFERLAB_AMX

// Rows first .. first + n - 1 (n <= 16) of a chunk at positions p0 + first .., query heads head0 .. head0 + heads - 1
// of the rows' (H, D) q (fp32, row stride H * D), over `kv` (D a multiple of 64): out (row stride H * D) =
// softmax(q k^T * scale) v, head by head
inline void attend_chunk_tile(const ChunkKv& kv, const float* q, int64_t H, int64_t first, int64_t n, int64_t p0,
                              int64_t head0, int64_t heads, float scale, float* out) {
  const int64_t D = kv.D, last = p0 + first + n - 1;  // the tile's last position: keys 0..last
  const int64_t key_blocks = last / 16 + 1, width = (last + 32) / 32 * 32;  // scores' columns, a multiple of 32
  std::vector<uint16_t> qb(16 * D), pb(16 * width, 0);
  std::vector<float> s(16 * width), o(16 * D);
  alignas(64) float inv[16];
#ifdef INFERLAB_AMX
  TileConfig config;  // the shapes tile_scores and tile_outputs take
  config.shape(0, n, 64);
  config.shape(1, n, 64);
  config.shape(2, 16, 64);
  config.shape(3, 16, 64);
  for (int t = 4; t < 8; ++t) config.shape(t, n, 64);
  config.load();
#endif
  for (int64_t head = head0; head < head0 + heads; ++head) {
    chunk_queries(q + first * H * D + head * D, H * D, n, D, scale, qb.data());
    tile_scores(kv, qb.data(), n, key_blocks, width, s.data());
    chunk_weights(s.data(), width, n, p0 + first, pb.data(), inv);
    tile_outputs(kv, pb.data(), n, width, o.data());
    for (int64_t i = 0; i < n; ++i) {
      for (int64_t d = 0; d < D; d += 16) {
        _mm512_storeu_ps(out + (first + i) * H * D + head * D + d,
                         _mm512_mul_ps(_mm512_loadu_ps(o.data() + i * D + d), _mm512_set1_ps(inv[i])));
      }
    }
  }
#ifdef INFERLAB_AMX
  _tile_release();
#endif
}

}  // namespace INFERLAB_ISA
}  // namespace inferlab

#endif  // INFERLAB_AVX512
