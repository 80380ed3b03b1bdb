// GGUF's block formats as the file stores them, multiplied without a copy in another layout: the K-quants (Q4_K, Q5_K,
// Q6_K: super-blocks of 256 weights with a scale, and for Q4_K/Q5_K a min, per sub-block, each a small integer times
// the super-block's fp16 factor) and the 32-weight blocks (Q4_0, Q5_0, Q5_1, Q8_0) that a K-quant file falls back to
// where a row is not a multiple of 256.
//
// Every format here is w = scale[j] * q + offset[j] per sub-block j, with q a small integer. A weight row's product
// with an activation row is therefore sum_j scale[j] * (q_j . x_j) + sum_j offset[j] * sum(x_j): the codes are widened
// to fp32 in registers and fused-multiply-added with the fp32 activations (every product exact), each sub-block's
// dot scaled once, and the offsets meet the activations' sums per sub-block, computed once per call. The arithmetic is
// the dequantized weights' (gguf's dequantize) up to float rounding, with no quantization of the activations.
// Each (weight row, activation row) product is summed in one order whatever rows come with it (batch invariance, as
// gemv.h's other formats). Used by gemv.h's Projection for uint8 weights (N, blocks, bytes per block): the block's
// size in bytes names its format.
#pragma once

#include <cstring>
#include <vector>

#include "parallel.h"
#include "simd.h"

namespace inferlab {
inline namespace INFERLAB_ISA {

inline float half_at(const uint8_t* p) {  // an fp16 stored at any alignment, as fp32
  uint16_t h;
  std::memcpy(&h, p, sizeof h);
  return _cvtsh_ss(h);
}

// Q4_K's and Q5_K's 12 bytes of 6-bit scales and mins of 8 sub-blocks: sub-blocks 0-3 in the low 6 bits of bytes 0-3
// (scales) and 4-7 (mins); 4-7 in the nibbles of bytes 8-11, their top 2 bits in the top bits of bytes 0-7
inline void k_scales(const uint8_t* b, float* scale, float* offset) {
  const float d = half_at(b), dmin = half_at(b + 2);
  const uint8_t* s = b + 4;
  for (int j = 0; j < 8; ++j) {
    const int sc = j < 4 ? s[j] & 63 : (s[j + 4] & 0xF) | ((s[j - 4] >> 6) << 4);
    const int m = j < 4 ? s[j + 4] & 63 : (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
    scale[j] = d * static_cast<float>(sc);
    offset[j] = -(dmin * static_cast<float>(m));
  }
}

// A format: kWeights per block of kBytes, sub-blocks of kSub weights; scales() gives each sub-block's scale and (with
// kOffsets) offset; codes<L>(block, j, i) the integer codes of weights i.. i + L::N - 1 of sub-block j

// Q4_K (144 bytes): fp16 d, fp16 dmin, 12 bytes of scales and mins, 128 bytes of nibbles: sub-blocks 2c and 2c + 1 are
// the low and high nibbles of bytes 32c.. 32c + 31. w = d * sc * q - dmin * m
struct Q4K {
  static constexpr int64_t kWeights = 256, kBytes = 144, kSub = 32;
  static constexpr bool kOffsets = true;
  static void scales(const uint8_t* b, float* scale, float* offset) { k_scales(b, scale, offset); }
  template <typename L>
  static typename L::I codes(const uint8_t* b, int j, int i) {
    return L::and_int(L::shift_right_by(L::widen_uint8(b + 16 + 32 * (j / 2) + i), 4 * (j % 2)), L::set1_int(0xF));
  }
};

// Q5_K (176 bytes): as Q4_K, with 32 bytes of fifth bits after the scales (bit j of byte i: weight i of sub-block j)
struct Q5K {
  static constexpr int64_t kWeights = 256, kBytes = 176, kSub = 32;
  static constexpr bool kOffsets = true;
  static void scales(const uint8_t* b, float* scale, float* offset) { k_scales(b, scale, offset); }
  template <typename L>
  static typename L::I codes(const uint8_t* b, int j, int i) {
    const typename L::I low =
        L::and_int(L::shift_right_by(L::widen_uint8(b + 48 + 32 * (j / 2) + i), 4 * (j % 2)), L::set1_int(0xF));
    const typename L::I high = L::and_int(L::shift_right_by(L::widen_uint8(b + 16 + i), j), L::set1_int(1));
    return L::or_int(low, L::shift_left_by(high, 4));
  }
};

// Q6_K (210 bytes): 128 bytes of low nibbles, 64 of 2-bit pairs, 16 int8 scales, fp16 d; sub-blocks of 16.
// Weight 128h + 32k + l (h < 2, k < 4, l < 32): nibble k / 2 of low byte 64h + 32 (k % 2) + l, pair k of high byte
// 32h + l; w = d * scale * (q - 32)
struct Q6K {
  static constexpr int64_t kWeights = 256, kBytes = 210, kSub = 16;
  static constexpr bool kOffsets = false;
  static void scales(const uint8_t* b, float* scale, float*) {
    const float d = half_at(b + 208);
    for (int j = 0; j < 16; ++j) scale[j] = d * static_cast<float>(static_cast<int8_t>(b[192 + j]));
  }
  template <typename L>
  static typename L::I codes(const uint8_t* b, int j, int i) {
    const int h = j / 8, k = j % 8 / 2, l = 16 * (j % 2) + i;
    const typename L::I low =
        L::and_int(L::shift_right_by(L::widen_uint8(b + 64 * h + 32 * (k % 2) + l), 4 * (k / 2)), L::set1_int(0xF));
    const typename L::I high = L::and_int(L::shift_right_by(L::widen_uint8(b + 128 + 32 * h + l), 2 * k), L::set1_int(3));
    return L::sub_int(L::or_int(low, L::shift_left_by(high, 4)), L::set1_int(32));
  }
};

// The 32-weight blocks: weight i < 16 in the low nibble of byte i, weight i + 16 in its high nibble (Q4_0, Q5_0, Q5_1),
// their fifth bits (Q5_0, Q5_1) bit i of a 32-bit word; Q8_0 32 int8
template <typename L>
typename L::I nibbles(const uint8_t* qs, int i) {
  return L::and_int(L::shift_right_by(L::widen_uint8(qs + i % 16), 4 * (i / 16)), L::set1_int(0xF));
}
template <typename L>
typename L::I fifth_bits(const uint8_t* qh, int i) {
  uint32_t bits;
  std::memcpy(&bits, qh, sizeof bits);
  const typename L::I at = L::add(L::iota(), L::set1_int(i));
  return L::shift_left_by(L::and_int(L::shift_right_lanes(L::set1_int(static_cast<int32_t>(bits)), at), L::set1_int(1)), 4);
}

struct Q4_0 {  // fp16 d, 16 bytes; w = d * (q - 8)
  static constexpr int64_t kWeights = 32, kBytes = 18, kSub = 32;
  static constexpr bool kOffsets = false;
  static void scales(const uint8_t* b, float* scale, float*) { scale[0] = half_at(b); }
  template <typename L>
  static typename L::I codes(const uint8_t* b, int, int i) {
    return L::sub_int(nibbles<L>(b + 2, i), L::set1_int(8));
  }
};

struct Q5_0 {  // fp16 d, 4 bytes of fifth bits, 16 bytes; w = d * (q - 16)
  static constexpr int64_t kWeights = 32, kBytes = 22, kSub = 32;
  static constexpr bool kOffsets = false;
  static void scales(const uint8_t* b, float* scale, float*) { scale[0] = half_at(b); }
  template <typename L>
  static typename L::I codes(const uint8_t* b, int, int i) {
    return L::sub_int(L::or_int(nibbles<L>(b + 6, i), fifth_bits<L>(b + 2, i)), L::set1_int(16));
  }
};

struct Q5_1 {  // fp16 d, fp16 m, 4 bytes of fifth bits, 16 bytes; w = d * q + m
  static constexpr int64_t kWeights = 32, kBytes = 24, kSub = 32;
  static constexpr bool kOffsets = true;
  static void scales(const uint8_t* b, float* scale, float* offset) {
    scale[0] = half_at(b);
    offset[0] = half_at(b + 2);
  }
  template <typename L>
  static typename L::I codes(const uint8_t* b, int, int i) {
    return L::or_int(nibbles<L>(b + 8, i), fifth_bits<L>(b + 4, i));
  }
};

struct Q8_0 {  // fp16 d, 32 int8; w = d * q
  static constexpr int64_t kWeights = 32, kBytes = 34, kSub = 32;
  static constexpr bool kOffsets = false;
  static void scales(const uint8_t* b, float* scale, float*) { scale[0] = half_at(b); }
  template <typename L>
  static typename L::I codes(const uint8_t* b, int, int i) {
    return L::widen_int8(reinterpret_cast<const int8_t*>(b + 2 + i));
  }
};

// Calls f(Format{}) for the format whose blocks are `bytes` long; false when none is
template <typename F>
bool with_block_format(int64_t bytes, F&& f) {
  switch (bytes) {
    case Q4K::kBytes: f(Q4K{}); return true;
    case Q5K::kBytes: f(Q5K{}); return true;
    case Q6K::kBytes: f(Q6K{}); return true;
    case Q4_0::kBytes: f(Q4_0{}); return true;
    case Q5_0::kBytes: f(Q5_0{}); return true;
    case Q5_1::kBytes: f(Q5_1{}); return true;
    case Q8_0::kBytes: f(Q8_0{}); return true;
    default: return false;
  }
}

// Weights per block of a format `bytes` long (0: no format here)
inline int64_t block_weights(int64_t bytes) {
  int64_t weights = 0;
  with_block_format(bytes, [&](auto format) { weights = decltype(format)::kWeights; });
  return weights;
}

// The weight-format interface of gemv.h's rows(): dot<R, M>(n, acc, m0, from_memory) over blocks of B, the activations
// the caller's fp32 rows (M, K) themselves
template <typename B>
struct BlockFormat {
  using L = Wide;
  // a decode batch: one or two weight rows per dot call, their two partial sums per activation row in registers
  static constexpr int kTileRows = 1, kRows = kLanes == 16 ? 2 : 1, kChunk = 4;
  static constexpr int kSubs = B::kWeights / B::kSub;
  const uint8_t* w;
  int64_t K, blocks, row_bytes, subs;  // subs: sub-blocks per row
  const float* x;                      // (M, K)
  std::vector<float> x_sums;           // kOffsets: (M, subs), each sub-block's sum of activations
  std::vector<float> x_scale;          // (M,): 1 (rows() scales by it)

  BlockFormat(const uint8_t* weights, int64_t K_, const float* xf, int64_t M)
      : w(weights), K(K_), blocks(K_ / B::kWeights), row_bytes(blocks * B::kBytes), subs(K_ / B::kSub), x(xf),
        x_sums(B::kOffsets ? M * subs : 0), x_scale(M, 1.0f) {
    if constexpr (B::kOffsets) {
      for_each_row(M, [&](int64_t m) {
        for (int64_t s = 0; s < subs; ++s) {
          const float* part = x + m * K + s * B::kSub;
          float t = 0.0f;
          for (int64_t k = 0; k < B::kSub; ++k) t += part[k];
          x_sums[m * subs + s] = t;
        }
      });
    }
  }

  template <int R, int M>
  void dot(int64_t n, float* acc, int64_t m0, bool from_memory) const {
    // two running sums per product (even and odd sub-blocks): one would wait on each sub-block's multiply-add
    typename L::V total[R * M][2];
    float offset[R * M];
    for (int i = 0; i < R * M; ++i) {
      total[i][0] = total[i][1] = L::zero();
      offset[i] = 0.0f;
    }
    for (int64_t b = 0; b < blocks; ++b) {
      for (int r = 0; r < R; ++r) {
        const uint8_t* block = w + (n + r) * row_bytes + b * B::kBytes;
        // the stream kL2PrefetchBytes ahead, a request per line: once per block, or per line a small block starts
        if (from_memory && (B::kBytes >= 64 || (b * B::kBytes) % 64 < B::kBytes)) prefetch_lines(block, B::kBytes);
        float scale[kSubs], off[kSubs];
        B::scales(block, scale, off);
        const float* xs = x + b * B::kWeights;
        for (int j = 0; j < kSubs; ++j) {
          typename L::V part[M];
          for (int m = 0; m < M; ++m) part[m] = L::zero();
          for (int i = 0; i < B::kSub; i += L::N) {
            const typename L::V q = L::to_float(B::template codes<L>(block, j, i));
            for (int m = 0; m < M; ++m) part[m] = L::fmadd(q, L::load(xs + (m0 + m) * K + j * B::kSub + i), part[m]);
          }
          for (int m = 0; m < M; ++m) {
            total[r * M + m][j % 2] = L::fmadd(L::set1(scale[j]), part[m], total[r * M + m][j % 2]);
            if constexpr (B::kOffsets) offset[r * M + m] += off[j] * x_sums[(m0 + m) * subs + b * kSubs + j];
          }
        }
      }
    }
    for (int i = 0; i < R * M; ++i) acc[i] = L::sum(L::add(total[i][0], total[i][1])) + offset[i];
  }
};

}  // namespace INFERLAB_ISA
}  // namespace inferlab
