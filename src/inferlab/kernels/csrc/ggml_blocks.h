// GGUF's block formats as the file stores them, multiplied without a copy in another layout: the K-quants (Q4_K, Q5_K,
// Q6_K: super-blocks of 256 weights with a scale, and for Q4_K/Q5_K a min, per sub-block, each a small integer times
// the super-block's fp16 factor) and the 32-weight blocks (Q4_0, Q5_0, Q5_1, Q8_0) that a K-quant file falls back to
// where a row is not a multiple of 256.
//
// Every format here is w = factor * scale[j] * q + offset_factor * min[j] per sub-block j, with q, scale and min small
// integers (Q4_K/Q5_K: 6-bit scales and mins under the super-block's fp16 d and dmin; Q6_K: int8 scales under d; the
// 32-weight formats one fp16 d, Q5_1 also an fp16 m). The activations are the int16 codes the int8 and int4 formats
// take (gemv.h's int16_codes: x / max|x| * 16383 per row, the scale applied once at the end); the codes are widened to
// int16 lanes in registers and multiplied by their sub-block's scale there (|scale * q| <= 4096), so a super-block's
// products sum exactly in int32 lanes (VNNI's vpdpwssd, AVX2's madd: 32 or 16 products an instruction; at most
// 32 * 4096 * 16383 < 2^31 a lane), and each super-block adds factor * that sum to a float sum once; the mins meet the
// activation codes' sum per sub-block (integers too): offset_factor * sum_j min[j] * sum(codes_j). The result is the
// dequantized weights' product (gguf's dequantize) up to float rounding and the activation codes' rounding (half a
// code step per activation). Each (weight row, activation row) product is summed in one order whatever rows come with
// it (batch invariance, as gemv.h's other formats). Used by gemv.h's Projection for uint8 weights (N, blocks, bytes per
// block): the block's size in bytes names its format. (Q4_K layers whose rows are whole blocks of int4 tile rows are
// laid out as gemv.h's Int4Format tiles at load instead, quant/gguf_tiles.py: read as one stream, they run faster.)
#pragma once

#include <cstring>
#include <numeric>
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

inline uint32_t word_at(const uint8_t* p) {
  uint32_t w;
  std::memcpy(&w, p, sizeof w);
  return w;
}

// A block's factors and its sub-blocks' integer scales and mins
struct Header {
  float factor = 0, offset_factor = 0;
  int8_t scales[16], mins[8];
};

// A format: kWeights per block of kBytes, sub-blocks of kSub weights; header() its factors (with kSubScales, its
// sub-blocks' scales; with kOffsets, their mins); codes<L>(block, first) the integer codes of weights first..
// first + 2 L::N - 1 of the block, as int16 lanes

// Q4_K and Q5_K: fp16 d, fp16 dmin, then 12 bytes of 6-bit scales and mins of 8 sub-blocks: sub-blocks 0-3 in the low 6
// bits of bytes 0-3 (scales) and 4-7 (mins), 4-7 in the nibbles of bytes 8-11 with their top 2 bits in the top bits of
// bytes 0-7. w = d * scale * q - dmin * min. Unpacked four at a time in 32-bit words
inline void k_header(const uint8_t* b, Header& h) {
  h.factor = half_at(b);
  h.offset_factor = -half_at(b + 2);
  const uint32_t low = word_at(b + 4), high = word_at(b + 8), top = word_at(b + 12);
  const uint32_t six = 0x3F3F3F3F, four = 0x0F0F0F0F, two = 0x03030303;
  const uint32_t scales[2] = {low & six, (top & four) | ((low >> 6) & two) << 4};
  const uint32_t mins[2] = {high & six, ((top >> 4) & four) | ((high >> 6) & two) << 4};
  std::memcpy(h.scales, scales, sizeof scales);
  std::memcpy(h.mins, mins, sizeof mins);
}

// Q4_K (144 bytes): the header, then 128 bytes of nibbles: sub-blocks 2c and 2c + 1 the low and high nibbles of bytes
// 32c.. 32c + 31
struct Q4K {
  static constexpr int64_t kWeights = 256, kBytes = 144, kSub = 32;
  static constexpr bool kSubScales = true, kOffsets = true;
  static void header(const uint8_t* b, Header& h) { k_header(b, h); }
  template <typename L>
  static typename L::I codes(const uint8_t* b, int first) {
    const int j = first / 32;
    return L::and_int(L::shift_right16(L::widen_uint8_16(b + 16 + 32 * (j / 2) + first % 32), 4 * (j % 2)), L::set1_16(0xF));
  }
};

// Q5_K (176 bytes): as Q4_K, with 32 bytes of fifth bits after the header (bit j of byte i: weight i of sub-block j)
struct Q5K {
  static constexpr int64_t kWeights = 256, kBytes = 176, kSub = 32;
  static constexpr bool kSubScales = true, kOffsets = true;
  static void header(const uint8_t* b, Header& h) { k_header(b, h); }
  template <typename L>
  static typename L::I codes(const uint8_t* b, int first) {
    const int j = first / 32, l = first % 32;
    const typename L::I low = L::and_int(L::shift_right16(L::widen_uint8_16(b + 48 + 32 * (j / 2) + l), 4 * (j % 2)), L::set1_16(0xF));
    const typename L::I high = L::and_int(L::shift_right16(L::widen_uint8_16(b + 16 + l), j), L::set1_16(1));
    return L::or_int(low, L::shift_left16(high, 4));
  }
};

// Q6_K (210 bytes): 128 bytes of low nibbles, 64 of 2-bit pairs, 16 int8 scales, fp16 d; sub-blocks of 16.
// Weight 128h + 32k + l (h < 2, k < 4, l < 32): nibble k / 2 of low byte 64h + 32 (k % 2) + l, pair k of high byte
// 32h + l; w = d * scale * (q - 32)
struct Q6K {
  static constexpr int64_t kWeights = 256, kBytes = 210, kSub = 16;
  static constexpr bool kSubScales = true, kOffsets = false;
  static void header(const uint8_t* b, Header& h) {
    h.factor = half_at(b + 208);
    for (int j = 0; j < 16; ++j) h.scales[j] = static_cast<int8_t>(b[192 + j]);
  }
  template <typename L>
  static typename L::I codes(const uint8_t* b, int first) {
    const int h = first / 128, k = first % 128 / 32, l = first % 32;
    const typename L::I low =
        L::and_int(L::shift_right16(L::widen_uint8_16(b + 64 * h + 32 * (k % 2) + l), 4 * (k / 2)), L::set1_16(0xF));
    const typename L::I high = L::and_int(L::shift_right16(L::widen_uint8_16(b + 128 + 32 * h + l), 2 * k), L::set1_16(3));
    return L::sub16(L::or_int(low, L::shift_left16(high, 4)), L::set1_16(32));
  }
};

// The 32-weight blocks: weight i < 16 in the low nibble of byte i, weight i + 16 in its high nibble (Q4_0, Q5_0, Q5_1),
// their fifth bits (Q5_0, Q5_1) bit i of a 32-bit word; Q8_0 32 int8
struct Q4_0 {  // fp16 d, 16 bytes; w = d * (q - 8)
  static constexpr int64_t kWeights = 32, kBytes = 18, kSub = 32;
  static constexpr bool kSubScales = false, kOffsets = false;
  static void header(const uint8_t* b, Header& h) { h.factor = half_at(b); }
  template <typename L>
  static typename L::I codes(const uint8_t* b, int first) {
    return L::sub16(L::nibbles16(b + 2, first), L::set1_16(8));
  }
};

struct Q5_0 {  // fp16 d, 4 bytes of fifth bits, 16 bytes; w = d * (q - 16)
  static constexpr int64_t kWeights = 32, kBytes = 22, kSub = 32;
  static constexpr bool kSubScales = false, kOffsets = false;
  static void header(const uint8_t* b, Header& h) { h.factor = half_at(b); }
  template <typename L>
  static typename L::I codes(const uint8_t* b, int first) {
    return L::sub16(L::or_int(L::nibbles16(b + 6, first), L::sixteens(word_at(b + 2) >> first)), L::set1_16(16));
  }
};

struct Q5_1 {  // fp16 d, fp16 m, 4 bytes of fifth bits, 16 bytes; w = d * q + m
  static constexpr int64_t kWeights = 32, kBytes = 24, kSub = 32;
  static constexpr bool kSubScales = false, kOffsets = true;
  static void header(const uint8_t* b, Header& h) {
    h.factor = half_at(b);
    h.offset_factor = half_at(b + 2);
  }
  template <typename L>
  static typename L::I codes(const uint8_t* b, int first) {
    return L::or_int(L::nibbles16(b + 8, first), L::sixteens(word_at(b + 4) >> first));
  }
};

struct Q8_0 {  // fp16 d, 32 int8; w = d * q
  static constexpr int64_t kWeights = 32, kBytes = 34, kSub = 32;
  static constexpr bool kSubScales = false, kOffsets = false;
  static void header(const uint8_t* b, Header& h) { h.factor = half_at(b); }
  template <typename L>
  static typename L::I codes(const uint8_t* b, int first) {
    return L::widen_int8_16(reinterpret_cast<const int8_t*>(b + 2 + first));
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
// as int16 codes per row (`codes`: gemv.h's int16_codes)
template <typename B>
struct BlockFormat {
  using L = Wide;
  // a decode batch: one or two weight rows per dot call, their sums per activation row in registers
  static constexpr int kTileRows = 1, kRows = kLanes == 16 ? 2 : 1, kChunk = 4;
  static constexpr int kVector = 2 * L::N;  // weights per vector of int16 codes
  static constexpr int kSubs = B::kWeights / B::kSub;
  const uint8_t* w;
  int64_t K, blocks, row_bytes, subs;  // subs: sub-blocks per row
  std::vector<int16_t> x;              // (M, K) activation codes
  std::vector<float> x_sums;           // kOffsets: (M, subs), each sub-block's sum of codes (exact in fp32)
  std::vector<float> x_scale;          // (M,): the value of a code step

  template <typename Codes>
  BlockFormat(const uint8_t* weights, int64_t K_, const float* xf, int64_t M, Codes codes)
      : w(weights), K(K_), blocks(K_ / B::kWeights), row_bytes(blocks * B::kBytes), subs(K_ / B::kSub), x(M * K_),
        x_sums(B::kOffsets ? M * subs : 0), x_scale(M) {
    for_each_row(M, [&](int64_t m) {
      int16_t* row = x.data() + m * K;
      x_scale[m] = codes(xf + m * K, K, row);
      if constexpr (B::kOffsets) {
        for (int64_t s = 0; s < subs; ++s) {
          x_sums[m * subs + s] = static_cast<float>(std::accumulate(row + s * B::kSub, row + (s + 1) * B::kSub, 0));
        }
      }
    });
  }

  // the sub-block scales of weights first.. first + kVector - 1, a lane each
  static typename L::I sub_scales(const Header& h, int first) {
    if constexpr (B::kSub >= kVector) {
      return L::set1_16(h.scales[first / B::kSub]);
    } else {
      static_assert(2 * B::kSub == kVector, "a vector spans at most two sub-blocks");
      return L::halves16(h.scales[first / B::kSub], h.scales[first / B::kSub + 1]);
    }
  }

  template <int R, int M>
  void dot(int64_t n, float* acc, int64_t m0, bool from_memory) const {
    static_assert(!B::kOffsets || kSubs == 8 || kSubs == 1, "mins per 8 sub-blocks (a vector) or per block");
    // two running sums per product (even and odd blocks): one would wait on each block's multiply-add; the mins' sums
    // in 8 lanes (a K-quant's sub-blocks) or one
    typename L::V total[R * M][2];
    Narrow::V offsets[R * M];
    float offset[R * M];
    for (int i = 0; i < R * M; ++i) {
      total[i][0] = total[i][1] = L::zero();
      offsets[i] = Narrow::zero();
      offset[i] = 0.0f;
    }
    for (int64_t b = 0; b < blocks; ++b) {
      for (int r = 0; r < R; ++r) {
        const uint8_t* block = w + (n + r) * row_bytes + b * B::kBytes;
        // the stream kL2PrefetchBytes ahead, a request per line: once per block, or per line a small block starts
        if (from_memory && (B::kBytes >= 64 || (b * B::kBytes) % 64 < B::kBytes)) prefetch_lines(block, B::kBytes);
        Header h;
        B::header(block, h);
        typename L::I sums[M];
        for (int m = 0; m < M; ++m) sums[m] = L::zero_int();
        const int16_t* xs = x.data() + m0 * K + b * B::kWeights;
        for (int first = 0; first < B::kWeights; first += kVector) {
          typename L::I q = B::template codes<L>(block, first);
          if constexpr (B::kSubScales) q = L::mul16(q, sub_scales(h, first));
          for (int m = 0; m < M; ++m) sums[m] = L::dot_int16(sums[m], q, L::load_int(xs + m * K + first));
        }
        Narrow::V mins = Narrow::zero();  // offset_factor * min per sub-block (exact: fp16 times 6 bits)
        if constexpr (B::kOffsets && kSubs == 8) mins = Narrow::mul(Narrow::load(h.mins), Narrow::set1(h.offset_factor));
        for (int m = 0; m < M; ++m) {
          typename L::V& t = total[r * M + m][b % 2];
          t = L::fmadd(L::to_float(sums[m]), L::set1(h.factor), t);
          if constexpr (B::kOffsets) {
            const float* s = x_sums.data() + (m0 + m) * subs + b * kSubs;
            if constexpr (kSubs == 8) {
              offsets[r * M + m] = Narrow::fmadd(mins, Narrow::load(s), offsets[r * M + m]);
            } else {
              offset[r * M + m] += h.offset_factor * s[0];
            }
          }
        }
      }
    }
    for (int i = 0; i < R * M; ++i) acc[i] = L::sum(L::add(total[i][0], total[i][1])) + (Narrow::sum(offsets[i]) + offset[i]);
  }
};

}  // namespace INFERLAB_ISA
}  // namespace inferlab
