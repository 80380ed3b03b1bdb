// How the matrix kernels (gemv.h, amx.h) split a call across torch's intra-op threads and keep weights in cache.
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>

#include "simd.h"

namespace inferlab {
inline namespace INFERLAB_ISA {

constexpr int64_t kTileBytes = 64 * 1024;  // weight rows a thread multiplies into every activation row before the next ones
constexpr int64_t kGrain = 64;             // weight rows per thread at least

// Every weight stream is requested into L2 only, this far ahead: one core alone keeps too few loads in flight, and
// requests into L1 (at any distance) crowd out the lines the multiply-adds read. With the stream in L2 ahead of
// them, a step of a few activation rows pays the multiply-adds under the stream rather than on top of it
constexpr int64_t kL2PrefetchBytes = 32 * 1024;
inline void prefetch_l2(const void* p) { _mm_prefetch(static_cast<const char*>(p) + kL2PrefetchBytes, _MM_HINT_T1); }

inline void prefetch_lines(const void* p, int64_t bytes) {  // every 64-byte line of [p, p + bytes)
  for (int64_t b = 0; b < bytes; b += 64) prefetch_l2(static_cast<const char*>(p) + b);
}

// f(m) for each activation row m < M, rows split across torch's threads beyond `grain` rows: the work around the
// products (norms, SwiGLU, activation codes) is per row, and a prompt chunk's rows are many (serial, that work is a
// sizeable share of a product split across threads)
constexpr int64_t kRowGrain = 4;
template <typename F>
void for_each_row(int64_t M, const F& f, int64_t grain = kRowGrain) {
  at::parallel_for(0, M, grain, [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m) f(m);
  });
}

// for_each_row's grain for rows of K values whose work is too light to split below `values` values in all
inline int64_t rows_holding(int64_t values, int64_t K) { return std::max(kRowGrain, values / K); }

// f(chunk, m) for every chunk of columns < chunks and activation row m < M, split across torch's threads by chunks,
// `values` columns to a chunk: for a layout that interleaves the activation rows. The AMX tiles' activations (amx.h)
// hold one value of every activation row in each 64-byte row of a B tile, so threads that split the activation rows
// between them would write into the same cache lines, and a product of many rows on two threads would take longer
// than one of a single row; split by columns, each thread writes lines of its own (the same floats). Few values
// stay on the calling thread.
template <typename F>
void for_each_chunk(int64_t chunks, int64_t values, int64_t M, const F& f) {
  constexpr int64_t kMinValues = 4096;  // per thread's share at least
  at::parallel_for(0, chunks, std::max<int64_t>(1, kMinValues / (values * M)), [&](int64_t begin, int64_t end) {
    for (int64_t chunk = begin; chunk < end; ++chunk) {
      for (int64_t m = 0; m < M; ++m) f(chunk, m);
    }
  });
}

}  // namespace INFERLAB_ISA
}  // namespace inferlab
