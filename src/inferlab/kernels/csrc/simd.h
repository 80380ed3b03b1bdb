// The SIMD layer the CPU decode kernels share, for the instruction set this build targets.
//
// kernels/build.py compiles the same sources once per instruction set: AVX2 + FMA (8 fp32 lanes); with
// INFERLAB_AVX512 defined, AVX-512 F/BW/VL + VNNI + BF16 (16 lanes); with INFERLAB_AMX as well, that and AMX's
// bf16 tiles for bf16 weights (amx.h). Each build puts its symbols in an inline namespace of its own and its
// ops in a library of its own (INFERLAB_OPS, e.g. inferlab_avx512), so all of them load into one process. The kernels are written once against Lanes<N>: the fp32 vector of N
// lanes and the operations on it, where N is kLanes (the widest) or 8 (attention, where 8 divides head_dim
// and kLanes does not).
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>

#include <immintrin.h>

#include <vector>

#if defined(INFERLAB_AMX)
#define INFERLAB_ISA amx
#elif defined(INFERLAB_AVX512)
#define INFERLAB_ISA avx512
#else
#define INFERLAB_ISA avx2
#endif
#define INFERLAB_OPS_NAME(isa) INFERLAB_OPS_CONCAT(inferlab_, isa)
#define INFERLAB_OPS_CONCAT(a, b) a##b
#define INFERLAB_OPS INFERLAB_OPS_NAME(INFERLAB_ISA)  // the op library: torch.ops.inferlab_avx2, ...

namespace inferlab {
inline namespace INFERLAB_ISA {

template <int N>
struct Lanes;

template <>
struct Lanes<8> {
  static constexpr int N = 8;
  using V = __m256;
  using I = __m256i;  // 8 int32 lanes, or 16 int16
  static V zero() { return _mm256_setzero_ps(); }
  static V set1(float x) { return _mm256_set1_ps(x); }
  static V load(const float* p) { return _mm256_loadu_ps(p); }
  static V load(const at::BFloat16* p) {  // bf16 is the high half of an fp32
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  }
  static V load(const int8_t* p) {  // 8 int8 codes as fp32
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
  }
  static V load(const at::Half* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
  static void store(float* p, V v) { _mm256_storeu_ps(p, v); }
  static V add(V a, V b) { return _mm256_add_ps(a, b); }
  static V sub(V a, V b) { return _mm256_sub_ps(a, b); }
  static V mul(V a, V b) { return _mm256_mul_ps(a, b); }
  static V div(V a, V b) { return _mm256_div_ps(a, b); }
  static V max(V a, V b) { return _mm256_max_ps(a, b); }
  static V min(V a, V b) { return _mm256_min_ps(a, b); }
  static V abs(V a) { return _mm256_andnot_ps(_mm256_set1_ps(-0.0f), a); }
  static V fmadd(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
  static V fnmadd(V a, V b, V c) { return _mm256_fnmadd_ps(a, b, c); }
  static V round(V a) { return _mm256_round_ps(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
  static V pow2(V n) {  // 2^n for whole n in the normal range: n + 127 into the exponent bits
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23));
  }
  static float sum(V v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
  }
  // lane i: the sum of v[i]'s lanes (i < 8), each summed in the same order whatever the others hold: lanes 2
  // apart within each 128-bit half, then those pairs, then the halves
  static V sums(const V* v) {
    V s[4], u[2];
    for (int p = 0; p < 4; ++p) {
      s[p] = _mm256_add_ps(_mm256_unpacklo_ps(v[2 * p], v[2 * p + 1]), _mm256_unpackhi_ps(v[2 * p], v[2 * p + 1]));
    }
    for (int p = 0; p < 2; ++p) {
      u[p] = _mm256_add_ps(_mm256_shuffle_ps(s[2 * p], s[2 * p + 1], 0x44), _mm256_shuffle_ps(s[2 * p], s[2 * p + 1], 0xEE));
    }
    return _mm256_add_ps(_mm256_permute2f128_ps(u[0], u[1], 0x20), _mm256_permute2f128_ps(u[0], u[1], 0x31));
  }
  static float max(V v) {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    m = _mm_max_ss(m, _mm_movehdup_ps(m));
    return _mm_cvtss_f32(m);
  }
  static void store_int16(int16_t* p, V v) {  // v's values rounded (to nearest even) to int16; they fit
    const __m256i i = _mm256_cvtps_epi32(v);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm_packs_epi32(_mm256_castsi256_si128(i), _mm256_extracti128_si256(i, 1)));
  }
  static I zero_int() { return _mm256_setzero_si256(); }
  static I add(I a, I b) { return _mm256_add_epi32(a, b); }
  // Quads u.s (u uint8, s int8) summed into `quad sums`: with VNNI int32 lanes, one instruction; on AVX2 the pairs of
  // products and their sums stay in int16 lanes (maddubs saturates there: the caller keeps every lane's sum within
  // int16, as a block's int4 codes times int8 codes do, 8 x 2 x 15 x 127), and quad_sums_total adds their pairs into
  // int32 once per block of the caller's (2 instructions a call instead of 3, and 1 a block to widen)
#ifdef INFERLAB_AVX512
  static I dot_int16(I acc, I a, I b) { return _mm256_dpwssd_epi32(acc, a, b); }  // + pairs a.b (VNNI)
  static I dot_uint8(I acc, I u, I s) { return _mm256_dpbusd_epi32(acc, u, s); }  // + quads u.s (VNNI)
  static I add_quad_sums(I a, I b) { return _mm256_add_epi32(a, b); }
  static I quad_sums_total(I a) { return a; }
  static constexpr bool kInt32QuadSums = true;  // quad sums are int32 lanes: any int32 may start them
#else
  static I dot_int16(I acc, I a, I b) { return _mm256_add_epi32(acc, _mm256_madd_epi16(a, b)); }  // + pairs a.b
  static I dot_uint8(I acc, I u, I s) { return _mm256_add_epi16(acc, _mm256_maddubs_epi16(u, s)); }
  static I add_quad_sums(I a, I b) { return _mm256_add_epi16(a, b); }
  static I quad_sums_total(I a) { return _mm256_madd_epi16(a, _mm256_set1_epi16(1)); }
  static constexpr bool kInt32QuadSums = false;
#endif
  static V to_float(I a) { return _mm256_cvtepi32_ps(a); }
  static float sum(I a) { return sum(to_float(a)); }
  // 2N int8 weights as 2N int16 lanes
  static I widen(const int8_t* p) { return _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
  static I halves_added(I a) { return a; }  // as Lanes<16>'s: the 8 int32 lanes of a 256-bit vector
  static I load_int(const int16_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
  // 2N bf16 as N 32-bit lanes of pairs; their even-indexed and odd-indexed values as fp32 (bf16 is an fp32's high half)
  static I load_pairs(const at::BFloat16* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
  static I load_pairs_half(const at::BFloat16* p) {  // N bf16, the rest 0
    return _mm256_zextsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }
  static V even_bf16(I pairs) { return _mm256_castsi256_ps(_mm256_slli_epi32(pairs, 16)); }
  static V odd_bf16(I pairs) { return _mm256_castsi256_ps(_mm256_and_si256(pairs, _mm256_set1_epi32(0xFFFF0000))); }
  // int4 weights: N 4-byte values, or the first n of them (the rest 0, nothing read past them); an N x N transpose
  static I load_int(const int32_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
  static I load_int(const int32_t* p, int n) {
    const __m256i first = _mm256_cmpgt_epi32(_mm256_set1_epi32(n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
    return _mm256_maskload_epi32(reinterpret_cast<const int*>(p), first);
  }
  static void transpose(I* r) {  // r[i] lane j -> r[j] lane i
    I a[8], b[8];
    for (int i = 0; i < 4; ++i) {
      a[2 * i] = _mm256_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
      a[2 * i + 1] = _mm256_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 2; ++i) {
      for (int k = 0; k < 2; ++k) {
        b[4 * i + 2 * k] = _mm256_unpacklo_epi64(a[4 * i + k], a[4 * i + k + 2]);
        b[4 * i + 2 * k + 1] = _mm256_unpackhi_epi64(a[4 * i + k], a[4 * i + k + 2]);
      }
    }
    for (int k = 0; k < 4; ++k) {  // 128-bit half j of b[4 i + k]: rows 4 i.. of column 4 j + k
      r[k] = _mm256_permute2x128_si256(b[k], b[4 + k], 0x20);
      r[4 + k] = _mm256_permute2x128_si256(b[k], b[4 + k], 0x31);
    }
  }
  static void store_int(int32_t* p, I a) { _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), a); }
  static I set1_int(int32_t x) { return _mm256_set1_epi32(x); }
  static I and_int(I a, I b) { return _mm256_and_si256(a, b); }
  static I shift_right(I a, int bits) { return _mm256_srli_epi32(a, bits); }
  static I shift_right_signed(I a, int bits) { return _mm256_srai_epi32(a, bits); }
  static I shift_left(I a, int bits) { return _mm256_slli_epi32(a, bits); }
  static I masked_or(I a, I mask, I b) { return _mm256_or_si256(_mm256_and_si256(a, mask), b); }  // (a & mask) | b
  // GGUF blocks (ggml_blocks.h), as 2N int16 lanes: 2N bytes widened (unsigned, signed); 16 bytes' low nibbles
  // (first = 0) or high ones (first = 16); int16 shifts by a count known at run time, products, the same value in every
  // lane or in each half; lane i 16 where bit i of `bits` is set, else 0
  static I widen_uint8_16(const uint8_t* p) { return _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
  static I widen_int8_16(const int8_t* p) { return _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
  static I nibbles16(const uint8_t* p, int first) {
    return and_int(shift_right16(widen_uint8_16(p), first / 4), _mm256_set1_epi16(0xF));
  }
  static I shift_right16(I a, int bits) { return _mm256_srl_epi16(a, _mm_cvtsi32_si128(bits)); }
  static I shift_left16(I a, int bits) { return _mm256_sll_epi16(a, _mm_cvtsi32_si128(bits)); }
  static I shift_right_signed16(I a, int bits) { return _mm256_srai_epi16(a, bits); }
  static I sub16(I a, I b) { return _mm256_sub_epi16(a, b); }
  static I mul16(I a, I b) { return _mm256_mullo_epi16(a, b); }
  static I mul32(I a, I b) { return _mm256_mullo_epi32(a, b); }
  static I load_int8_32(const int8_t* p) {  // 8 int8 as int32 lanes
    return _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  }
  static I set1_16(int16_t x) { return _mm256_set1_epi16(x); }
  static I halves16(int16_t a, int16_t b) { return _mm256_setr_m128i(_mm_set1_epi16(a), _mm_set1_epi16(b)); }
  static I sixteens(uint32_t bits) {
    const I lane_bits = _mm256_setr_epi16(1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, -32768);
    const I set = _mm256_cmpeq_epi16(_mm256_and_si256(_mm256_set1_epi16(static_cast<int16_t>(bits)), lane_bits), lane_bits);
    return _mm256_and_si256(set, _mm256_set1_epi16(16));
  }
  static I or_int(I a, I b) { return _mm256_or_si256(a, b); }
  static I sum_quads(const I* a) {  // lane 4 p + j: the sum of a[j]'s 4 lanes in its 128-bit lane p (j < 4)
    const I t0 = _mm256_add_epi32(_mm256_unpacklo_epi32(a[0], a[1]), _mm256_unpackhi_epi32(a[0], a[1]));
    const I t1 = _mm256_add_epi32(_mm256_unpacklo_epi32(a[2], a[3]), _mm256_unpackhi_epi32(a[2], a[3]));
    return _mm256_add_epi32(_mm256_unpacklo_epi64(t0, t1), _mm256_unpackhi_epi64(t0, t1));
  }
};

#ifdef INFERLAB_AVX512
constexpr int kLanes = 16;

template <>
struct Lanes<16> {
  static constexpr int N = 16;
  using V = __m512;
  using I = __m512i;
  static V zero() { return _mm512_setzero_ps(); }
  static V set1(float x) { return _mm512_set1_ps(x); }
  static V load(const float* p) { return _mm512_loadu_ps(p); }
  static V load(const at::BFloat16* p) {
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  }
  static V load(const int8_t* p) {  // 16 int8 codes as fp32
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
  }
  static V load(const at::Half* p) { return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }
  static void store(float* p, V v) { _mm512_storeu_ps(p, v); }
  static V add(V a, V b) { return _mm512_add_ps(a, b); }
  static V sub(V a, V b) { return _mm512_sub_ps(a, b); }
  static V mul(V a, V b) { return _mm512_mul_ps(a, b); }
  static V div(V a, V b) { return _mm512_div_ps(a, b); }
  static V max(V a, V b) { return _mm512_max_ps(a, b); }
  static V min(V a, V b) { return _mm512_min_ps(a, b); }
  static V abs(V a) { return _mm512_abs_ps(a); }
  static V fmadd(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
  static V fnmadd(V a, V b, V c) { return _mm512_fnmadd_ps(a, b, c); }
  static V round(V a) { return _mm512_roundscale_ps(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
  static V pow2(V n) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23));
  }
  static float sum(V v) { return _mm512_reduce_add_ps(v); }
  static V sums(const V* v) {  // as Lanes<8>'s, then the 128-bit quarters in pairs and the pairs
    V s[8], u[4], w[2];
    for (int p = 0; p < 8; ++p) {
      s[p] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * p], v[2 * p + 1]), _mm512_unpackhi_ps(v[2 * p], v[2 * p + 1]));
    }
    for (int p = 0; p < 4; ++p) {
      u[p] = _mm512_add_ps(_mm512_shuffle_ps(s[2 * p], s[2 * p + 1], 0x44), _mm512_shuffle_ps(s[2 * p], s[2 * p + 1], 0xEE));
    }
    for (int p = 0; p < 2; ++p) {  // quarter c of u[p]: rows 4p.. over quarter c of theirs; 0x88: quarters 0, 2, 0xDD: 1, 3
      w[p] = _mm512_add_ps(_mm512_shuffle_f32x4(u[2 * p], u[2 * p + 1], 0x88), _mm512_shuffle_f32x4(u[2 * p], u[2 * p + 1], 0xDD));
    }
    return _mm512_add_ps(_mm512_shuffle_f32x4(w[0], w[1], 0x88), _mm512_shuffle_f32x4(w[0], w[1], 0xDD));
  }
  static float max(V v) { return _mm512_reduce_max_ps(v); }
  static void store_int16(int16_t* p, V v) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(_mm512_cvtps_epi32(v)));
  }
  static I zero_int() { return _mm512_setzero_si512(); }
  static I add(I a, I b) { return _mm512_add_epi32(a, b); }
  static V to_float(I a) { return _mm512_cvtepi32_ps(a); }
  static I load_int(const int32_t* p) { return _mm512_loadu_si512(p); }
  static I load_int(const int32_t* p, int n) { return _mm512_maskz_loadu_epi32(static_cast<__mmask16>((1u << n) - 1), p); }
  // 2N int8 weights as 2N int16 lanes; widen_half: the first N of them, the other lanes 0; load_int: 2N int16
  static I widen(const int8_t* p) { return _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }
  static I widen_half(const int8_t* p) {
    return _mm512_cvtepi8_epi16(_mm256_zextsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
  }
  static I load_int(const int16_t* p) { return _mm512_loadu_si512(p); }
  static __m256i halves_added(I a) {  // the 8 int32 lanes of Lanes<8> that hold the same products
    return _mm256_add_epi32(_mm512_castsi512_si256(a), _mm512_extracti64x4_epi64(a, 1));
  }
  static void transpose(I* r) {  // r[i] lane j -> r[j] lane i
    I a[16], b[16];
    for (int i = 0; i < 8; ++i) {
      a[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
      a[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 4; ++i) {
      for (int k = 0; k < 2; ++k) {
        b[4 * i + 2 * k] = _mm512_unpacklo_epi64(a[4 * i + k], a[4 * i + k + 2]);
        b[4 * i + 2 * k + 1] = _mm512_unpackhi_epi64(a[4 * i + k], a[4 * i + k + 2]);
      }
    }
    for (int k = 0; k < 4; ++k) {  // 128-bit quarter j of b[4 i + k]: rows 4 i.. of column 4 j + k
      const I s0 = _mm512_shuffle_i32x4(b[k], b[4 + k], 0x44), s1 = _mm512_shuffle_i32x4(b[k], b[4 + k], 0xEE);
      const I s2 = _mm512_shuffle_i32x4(b[8 + k], b[12 + k], 0x44), s3 = _mm512_shuffle_i32x4(b[8 + k], b[12 + k], 0xEE);
      r[k] = _mm512_shuffle_i32x4(s0, s2, 0x88);
      r[4 + k] = _mm512_shuffle_i32x4(s0, s2, 0xDD);
      r[8 + k] = _mm512_shuffle_i32x4(s1, s3, 0x88);
      r[12 + k] = _mm512_shuffle_i32x4(s1, s3, 0xDD);
    }
  }
  static I load_pairs(const at::BFloat16* p) { return _mm512_loadu_si512(p); }
  static I load_pairs_half(const at::BFloat16* p) { return _mm512_maskz_loadu_epi16(0xFFFF, p); }  // N bf16, the rest 0
  static void store_int(int32_t* p, I a) { _mm512_storeu_si512(p, a); }
  static I set1_int(int32_t x) { return _mm512_set1_epi32(x); }
  static I and_int(I a, I b) { return _mm512_and_si512(a, b); }
  static I shift_right(I a, int bits) { return _mm512_srli_epi32(a, bits); }
  static I shift_right_signed(I a, int bits) { return _mm512_srai_epi32(a, bits); }
  static I shift_left(I a, int bits) { return _mm512_slli_epi32(a, bits); }
  // (a & mask) | b in one ternary-logic instruction (truth table 0xEA)
  static I masked_or(I a, I mask, I b) { return _mm512_ternarylogic_epi32(a, mask, b, 0xEA); }
  static I widen_uint8_16(const uint8_t* p) { return _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }
  static I widen_int8_16(const int8_t* p) { return _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }
  static I nibbles16(const uint8_t* p, int) {  // both: 32 lanes, the low nibbles of 16 bytes, then their high ones
    const __m256i bytes = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    const __m256i low = _mm256_and_si256(bytes, _mm256_set1_epi16(0xF)), high = _mm256_srli_epi16(bytes, 4);
    return _mm512_inserti64x4(_mm512_castsi256_si512(low), high, 1);
  }
  static I shift_right16(I a, int bits) { return _mm512_srl_epi16(a, _mm_cvtsi32_si128(bits)); }
  static I shift_left16(I a, int bits) { return _mm512_sll_epi16(a, _mm_cvtsi32_si128(bits)); }
  static I shift_right_signed16(I a, int bits) { return _mm512_srai_epi16(a, bits); }
  static I sub16(I a, I b) { return _mm512_sub_epi16(a, b); }
  static I mul16(I a, I b) { return _mm512_mullo_epi16(a, b); }
  static I mul32(I a, I b) { return _mm512_mullo_epi32(a, b); }
  static I load_int8_32(const int8_t* p) {  // 16 int8 as int32 lanes
    return _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }
  static I set1_16(int16_t x) { return _mm512_set1_epi16(x); }
  static I halves16(int16_t a, int16_t b) {
    return _mm512_inserti64x4(_mm512_set1_epi16(a), _mm256_set1_epi16(b), 1);
  }
  static I sixteens(uint32_t bits) { return _mm512_maskz_mov_epi16(static_cast<__mmask32>(bits), _mm512_set1_epi16(16)); }
  static I or_int(I a, I b) { return _mm512_or_si512(a, b); }
  static I sum_quads(const I* a) {
    const I t0 = _mm512_add_epi32(_mm512_unpacklo_epi32(a[0], a[1]), _mm512_unpackhi_epi32(a[0], a[1]));
    const I t1 = _mm512_add_epi32(_mm512_unpacklo_epi32(a[2], a[3]), _mm512_unpackhi_epi32(a[2], a[3]));
    return _mm512_add_epi32(_mm512_unpacklo_epi64(t0, t1), _mm512_unpackhi_epi64(t0, t1));
  }
  static I dot_int16(I acc, I a, I b) { return _mm512_dpwssd_epi32(acc, a, b); }  // VNNI: + pairs a.b
  static I dot_uint8(I acc, I u, I s) { return _mm512_dpbusd_epi32(acc, u, s); }  // VNNI: + quads u.s (uint8, int8)
  static I add_quad_sums(I a, I b) { return _mm512_add_epi32(a, b); }  // quad sums are int32 lanes here
  static I quad_sums_total(I a) { return a; }
  static constexpr bool kInt32QuadSums = true;
};
#else
constexpr int kLanes = 8;
#endif

using Wide = Lanes<kLanes>;  // the widest vector this build has
using Narrow = Lanes<8>;

// e^x per lane (relative error ~1e-7): x = n ln2 + r with |r| <= ln2 / 2, e^r by a degree-6 polynomial,
// 2^n into the exponent bits; x clamped to where e^x is a normal float
template <typename L>
typename L::V exp(typename L::V x) {
  x = L::min(L::max(x, L::set1(-87.3f)), L::set1(88.3f));
  const typename L::V n = L::round(L::mul(x, L::set1(1.44269504088896341f)));
  typename L::V r = L::fnmadd(n, L::set1(0.693359375f), x);  // ln2 in two parts: r stays exact
  r = L::fnmadd(n, L::set1(-2.12194440e-4f), r);
  typename L::V p = L::set1(1.9875691500e-4f);
  p = L::fmadd(p, r, L::set1(1.3981999507e-3f));
  p = L::fmadd(p, r, L::set1(8.3334519073e-3f));
  p = L::fmadd(p, r, L::set1(4.1665795894e-2f));
  p = L::fmadd(p, r, L::set1(1.6666665459e-1f));
  p = L::fmadd(p, r, L::set1(5.0000001201e-1f));
  p = L::fmadd(p, L::mul(r, r), L::add(r, L::set1(1.0f)));
  return L::mul(p, L::pow2(n));
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

}  // namespace INFERLAB_ISA
}  // namespace inferlab
