// Attention for a prompt chunk on AMX tiles (the amx build): R consecutive rows of one sequence, at positions
// p0 .. p0 + R - 1, each over the sequence's bf16 keys and values up to its own position (causal).
//
// attention.h's loop attends a row at a time: every row of a 128-row chunk reads and widens the same keys again, and
// its products run on the vector units. Here a chunk's keys and values are laid out once per key/value head as B
// tiles (the keys' column pairs by key, the values' key pairs by column), and each tile of 16 rows takes its scores
// S = Q K^T and its output P V as tile dots (TDPBF16PS), with the softmax between them on the vector units: the
// queries (scaled) and the unnormalized weights P are rounded to bf16, as a bf16 model's own attention rounds them
// (the per-row loop keeps both in fp32); every product is exact and summed in fp32, the weights' sums in fp32 from
// their unrounded values. A row's result depends only on its own query and keys: rows of a tile are independent.
#pragma once

#ifdef INFERLAB_AMX

#include <cstdint>
#include <limits>
#include <vector>

#include "amx.h"
#include "simd.h"

namespace inferlab {
inline namespace INFERLAB_ISA {

constexpr int64_t kChunkMinRows = 16;  // a run of this many rows of one sequence or more takes the tiles

// One key/value head's keys 0..L-1 and their values as B tiles, made once per chunk and head
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
  TileConfig config;  // A: Q 0, P 1; B: keys 2, values 3; C: 4..7
  config.shape(0, n, 64);
  config.shape(1, n, 64);
  config.shape(2, 16, 64);
  config.shape(3, 16, 64);
  for (int t = 4; t < 8; ++t) config.shape(t, n, 64);
  config.load();
  for (int64_t head = head0; head < head0 + heads; ++head) {
    for (int64_t i = 0; i < n; ++i) {
      for (int64_t d = 0; d < D; d += 16) {
        const __m512 x = _mm512_mul_ps(_mm512_loadu_ps(q + (first + i) * H * D + head * D + d), _mm512_set1_ps(scale));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(qb.data() + i * D + d),
                            reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(x)));
      }
    }
    for (int64_t kb = 0; kb < key_blocks; ++kb) {
      _tile_zero(4);
      for (int64_t c = 0; c < D / 32; ++c) {
        _tile_loadd(0, qb.data() + c * 32, D * 2);
        _tile_loadd(2, kv.keys.data() + (kb * (D / 32) + c) * 256, 64);
        _tile_dpbf16ps(4, 0, 2);
      }
      _tile_stored(4, s.data() + kb * 16, width * 4);
    }
    for (int64_t i = 0; i < n; ++i) {  // softmax over keys 0..pos (pos = p0 + first + i), zeros beyond
      const float* row = s.data() + i * width;
      const int64_t keys = p0 + first + i + 1;
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
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(pb.data() + i * width + l),
                            reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(e)));
      }
      inv[i] = 1.0f / _mm512_reduce_add_ps(sum);
    }
    for (int64_t d0 = 0; d0 < D; d0 += 64) {  // four column blocks of 16 at a time: C 4..7
      _tile_zero(4);
      _tile_zero(5);
      _tile_zero(6);
      _tile_zero(7);
      for (int64_t kb = 0; kb < width / 32; ++kb) {
        const uint32_t* v = kv.values.data() + (kb * (D / 16) + d0 / 16) * 256;
        _tile_loadd(1, pb.data() + kb * 32, width * 2);
        _tile_loadd(3, v, 64);
        _tile_dpbf16ps(4, 1, 3);
        _tile_loadd(3, v + 256, 64);
        _tile_dpbf16ps(5, 1, 3);
        _tile_loadd(3, v + 512, 64);
        _tile_dpbf16ps(6, 1, 3);
        _tile_loadd(3, v + 768, 64);
        _tile_dpbf16ps(7, 1, 3);
      }
      _tile_stored(4, o.data() + d0, D * 4);
      _tile_stored(5, o.data() + d0 + 16, D * 4);
      _tile_stored(6, o.data() + d0 + 32, D * 4);
      _tile_stored(7, o.data() + d0 + 48, D * 4);
    }
    for (int64_t i = 0; i < n; ++i) {
      for (int64_t d = 0; d < D; d += 16) {
        _mm512_storeu_ps(out + (first + i) * H * D + head * D + d,
                         _mm512_mul_ps(_mm512_loadu_ps(o.data() + i * D + d), _mm512_set1_ps(inv[i])));
      }
    }
  }
  _tile_release();
}

}  // namespace INFERLAB_ISA
}  // namespace inferlab

#endif  // INFERLAB_AMX
