// How the matrix kernels (gemv.h, amx.h) split a call across torch's intra-op threads and keep weights in cache.
#pragma once

#include <ATen/Parallel.h>

#include <cstdint>

#include "simd.h"

namespace inferlab {
inline namespace INFERLAB_ISA {

constexpr int64_t kTileBytes = 64 * 1024;  // weight rows a thread multiplies into every activation row before the next ones
constexpr int64_t kGrain = 64;             // weight rows per thread at least

// f(m) for each activation row m < M, rows split across torch's threads from 2 * kRowGrain rows on: the work
// around the products (norms, SwiGLU, activation codes) is per row, and a prompt chunk's rows are many (serial,
// preparing 16 rows of SmolLM2's w2 took ~50 us beside a 200 us product on two threads)
constexpr int64_t kRowGrain = 4;
template <typename F>
void for_each_row(int64_t M, const F& f) {
  at::parallel_for(0, M, kRowGrain, [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m) f(m);
  });
}

}  // namespace INFERLAB_ISA
}  // namespace inferlab
