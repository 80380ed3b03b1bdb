// Attention for decoding on x86 CPUs: one new query per sequence over all its cached keys, this
// step's key and value written into the cache first.
//
// With a single query there is nothing to tile: each head is one pass over its keys (scores), a
// softmax, and one pass over its values. The library's flash-attention kernel spends most of its
// time on set-up at this size (a few heads, a few hundred cached tokens), which this loop does not have. Keys live in blocks of a pool found
// through each sequence's block table (the contiguous cache is the case of one block per slot).
// Query heads sharing a key/value head (GQA) are attended in one pass over its keys; exp is a
// vectorized polynomial with relative error below 2e-7. Used by the `decode_attention` op and the whole decode step (decode_step.cpp).
// On the AVX-512 builds a step's runs of kChunkMinRows or more rows of one sequence (a prompt chunk, bf16 keys) attend
// a tile of 16 rows at a time instead, in bf16 pair dots (chunk_attention.h: on AMX tiles or the vectors; a chunk's
// rows share every key they read, laid out once, where this loop reads the keys again for each row).
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <optional>
#include <type_traits>

#include "chunk_attention.h"
#include "simd.h"

namespace inferlab {
inline namespace INFERLAB_ISA {

constexpr int64_t kMaxHeadDim = 256;
constexpr int64_t kKeysPerThread = 256;  // below this many keys in all, one thread does every head (fewer keys
// do not pay for the fork and the join of splitting a layer's heads across threads)

// One layer's keys or values: (num_blocks, H_kv, block_size, D), unit stride along D. An int8 pool holds
// codes, with one fp32 scale per row in `scales` (num_blocks, H_kv, block_size): a row is written as
// round(x / scale) with scale = max|x| / 127 (engine/kv_int8.py does the same) and read as scale * code.
template <typename T>
struct KvPool {
  static constexpr bool kInt8 = std::is_same_v<T, int8_t>;
  T* data;
  int64_t block_stride, head_stride, row_stride, block_size;
  float* scales = nullptr;
  int64_t scale_block_stride = 0, scale_head_stride = 0, scale_row_stride = 0;

  KvPool(const at::Tensor& pool, const std::optional<at::Tensor>& scales_)
      : data(pool.data_ptr<T>()), block_stride(pool.stride(0)), head_stride(pool.stride(1)),
        row_stride(pool.stride(2)), block_size(pool.size(2)) {
    if constexpr (kInt8) set_scales(*scales_, 0, 0);
  }

  // layer `layer` of every layer's pools (n_layers, num_blocks, H_kv, block_size, D), scales (n_layers, ...)
  KvPool(const at::Tensor& layers, int64_t layer, const std::optional<at::Tensor>& scales_)
      : data(layers.data_ptr<T>() + layer * layers.stride(0)), block_stride(layers.stride(1)),
        head_stride(layers.stride(2)), row_stride(layers.stride(3)), block_size(layers.size(3)) {
    if constexpr (kInt8) set_scales(*scales_, 1, layer * scales_->stride(0));
  }

  // position l of head h of the sequence whose block table is `table`
  T* row(const int64_t* table, int64_t h, int64_t l) const {
    return data + table[l / block_size] * block_stride + h * head_stride + (l % block_size) * row_stride;
  }

  // Head h's first n rows of block `block` requested into L1 (with an int8 pool's scales of them), all at once: a
  // sequence's blocks lie wherever the allocator put them, so the hardware prefetchers, which follow strides within a
  // page, meet each block cold; many sequences' scattered blocks then wait on memory, one sequence's hardly. One
  // block ahead is enough.
  void prefetch(int64_t block, int64_t h, int64_t n) const {
    const char* first = base(block, h);
    const int64_t bytes = n * row_stride * static_cast<int64_t>(sizeof(T));
    for (int64_t offset = 0; offset < bytes; offset += 64) _mm_prefetch(first + offset, _MM_HINT_T0);
    prefetch_scales(block, h);
  }

  // Rows of head h in two blocks requested a row at a time, as f reads the rows of a third: `next`, this pool's block
  // after the one read (null at the last), and `beside`, the block read of `also` (null without), another pool read
  // next through the same table (the values of the keys read). Prefetching a whole block at once stalls on the core's
  // few line-fill buffers (the key pass then waits on its own prefetches); a row's lines as each row is
  // read spread the same requests over the block's work, which pays for long contexts of many sequences and costs
  // nothing at short ones. Prefetching into L2 (T1, T2) instead gains nothing over L1.
  struct Ahead {
    const char *next, *beside;
    int64_t row_bytes;
    void row(int64_t r) const {
      for (int64_t offset = r * row_bytes, end = offset + row_bytes; offset < end; offset += 64) {
        if (next) _mm_prefetch(next + offset, _MM_HINT_T0);
        if (beside) _mm_prefetch(beside + offset, _MM_HINT_T0);
      }
    }
  };

  // f(start, rows, n, row_scales, ahead) for the blocks of head h's positions 0..L-1 in order: positions
  // start..start+n-1 are the rows from `rows` on, row_stride apart; an int8 pool's scales of them from row_scales on,
  // scale_row_stride apart (else null); ahead.row(r), called by f as it reads row r, requests the next block's row r
  // and that of `also`'s block beside this one (Ahead). The first block is requested at once.
  template <typename F>
  void for_each_block(const int64_t* table, int64_t h, int64_t L, F&& f, const KvPool* also = nullptr) const {
    prefetch(table[0], h, std::min(block_size, L));
    for (int64_t start = 0, j = 0; start < L; start += block_size, ++j) {
      const int64_t n = std::min(block_size, L - start);
      const bool more = start + block_size < L;
      if (more) prefetch_scales(table[j + 1], h);
      if (also) also->prefetch_scales(table[j], h);
      const Ahead ahead{more ? base(table[j + 1], h) : nullptr, also ? also->base(table[j], h) : nullptr,
                        row_stride * static_cast<int64_t>(sizeof(T))};
      const float* row_scales = kInt8 ? scales + table[j] * scale_block_stride + h * scale_head_stride : nullptr;
      f(start, data + table[j] * block_stride + h * head_stride, n, row_scales, ahead);
    }
  }

  // f(l, row, scale) for positions l = 0..L-1 of head h in order (no division per row); scale is what the row's
  // stored values are multiplied by: its own for int8 codes, else 1
  template <typename F>
  void for_each_row(const int64_t* table, int64_t h, int64_t L, F&& f) const {
    for_each_block(table, h, L, [&](int64_t start, const T* row, int64_t n, const float* row_scales, const Ahead& ahead) {
      for (int64_t r = 0; r < n; ++r, row += row_stride) {
        ahead.row(r);
        f(start + r, row, kInt8 ? row_scales[r * scale_row_stride] : 1.0f);
      }
    });
  }

  // x (D,) fp32 stored at position l of head h: converted, or quantized with its scale
  void write(const int64_t* table, int64_t h, int64_t l, const float* x, int64_t D) const {
    T* out = row(table, h, l);
    if constexpr (kInt8) {
      float absmax = 0.0f;
      for (int64_t i = 0; i < D; ++i) absmax = std::max(absmax, std::abs(x[i]));
      const float s = absmax / 127.0f, divisor = s > 0.0f ? s : 1.0f;
      for (int64_t i = 0; i < D; ++i) out[i] = static_cast<int8_t>(std::nearbyint(x[i] / divisor));
      scales[table[l / block_size] * scale_block_stride + h * scale_head_stride + (l % block_size) * scale_row_stride] = s;
    } else {
      std::transform(x, x + D, out, [](float value) { return static_cast<T>(value); });
    }
  }

 private:
  const char* base(int64_t block, int64_t h) const {
    return reinterpret_cast<const char*>(data + block * block_stride + h * head_stride);
  }

  void prefetch_scales(int64_t block, int64_t h) const {
    if constexpr (kInt8) {
      _mm_prefetch(reinterpret_cast<const char*>(scales + block * scale_block_stride + h * scale_head_stride), _MM_HINT_T0);
    }
  }

  // the scales' (block, head, row) strides are those of dims first.. of `t`, starting `offset` floats in
  void set_scales(const at::Tensor& t, int64_t first, int64_t offset) {
    scales = t.data_ptr<float>() + offset;
    scale_block_stride = t.stride(first);
    scale_head_stride = t.stride(first + 1);
    scale_row_stride = t.stride(first + 2);
  }
};

// Checks that an int8 pool (blocks..., H_kv, block_size, D) comes with fp32 scales of its shape but D,
// and that no other pool does
inline void check_kv_scales(const at::Tensor& pool, const std::optional<at::Tensor>& scales, const char* who) {
  if (pool.scalar_type() != at::kChar) {
    TORCH_CHECK(!scales.has_value(), who, ": scales come only with an int8 pool");
    return;
  }
  TORCH_CHECK(scales.has_value() && scales->scalar_type() == at::kFloat &&
                  scales->sizes() == pool.sizes().slice(0, pool.dim() - 1),
              who, ": an int8 pool needs float32 scales of its shape without head_dim");
}

// Where each of B sequences keeps its keys: its row of `block_tables` (B, width) int64, and the position
// of its new token, `positions` (B,) int64; checked against a pool of num_blocks blocks of block_size
struct SequenceBlocks {
  at::Tensor tables, positions;  // contiguous
  const int64_t* table;          // (B, width)
  const int64_t* pos;            // (B,)
  int64_t width;

  SequenceBlocks(const at::Tensor& block_tables, const at::Tensor& positions_, int64_t B, int64_t num_blocks,
                 int64_t block_size, const char* who) {
    TORCH_CHECK(block_tables.scalar_type() == at::kLong && block_tables.dim() == 2 && block_tables.size(0) == B &&
                positions_.scalar_type() == at::kLong && positions_.numel() == B,
                who, ": block_tables (B, n) and positions (B,) must be int64");
    tables = block_tables.contiguous();
    positions = positions_.contiguous();
    table = tables.data_ptr<int64_t>();
    pos = positions.data_ptr<int64_t>();
    width = tables.size(1);
    for (int64_t b = 0; b < B; ++b) {
      TORCH_CHECK(pos[b] >= 0 && pos[b] < width * block_size, who, ": position ", pos[b],
                  " is outside the sequence's blocks");
      for (int64_t j = 0; j <= pos[b] / block_size; ++j) {
        TORCH_CHECK(table[b * width + j] >= 0 && table[b * width + j] < num_blocks, who, ": block id out of range");
      }
    }
  }
};

constexpr int64_t kMaxGroup = 8;  // query heads of one task (write_and_attend), attended a tile at a time
constexpr int64_t kMaxV = kMaxHeadDim / 8;  // vectors of a head's row at most (8 lanes)
constexpr int kTileSums = 16;     // vectors of sums a tile of query heads keeps in registers: heads x vectors of D

// f(std::integral_constant<int, n>) for 1 <= n <= N: a tile of n query heads, n known at compile time
template <int N, typename F>
void with_heads(int64_t n, const F& f) {
  if constexpr (N > 1) {
    if (n < N) return with_heads<N - 1>(n, f);
  }
  f(std::integral_constant<int, N>{});
}

// Pass 1 for a tile of GT query heads q (fp32, GT rows of D) over keys 0..L-1 of head h: p + g * L the scores,
// max_score[g] their maximum. V: D / S::N when known at compile time, else 0. With GT and V known, the query rows
// and maxima here and the value sums of weigh_values stay in registers; with G counted at run time they would live in
// memory, every update a store and a reload (the same floats, summed in the same order, either way). Each key's
// products with a query head are a vector of S::N partial sums; S::N keys' vectors are summed into one vector of
// their scores at once (S::sums), not each across its own lanes (a horizontal sum per key and head). The keys'
// products are not what bounds this loop, so neither bf16 dot products against a bf16-rounded query (far larger
// error) nor a decode row's keys on the AMX tiles would make it faster: at serving's lengths it waits on the keys'
// and values' bytes from memory, requested a block ahead a row at a time (KvPool::Ahead).
template <typename S, int V_, int GT, typename T>
void score_heads(const float* q, const KvPool<T>& keys, const KvPool<T>& values, const int64_t* table, int64_t h,
                 int64_t L, int64_t D, float scale, float* p, float* max_score) {
  const int64_t V = V_ ? V_ : D / S::N;
  typename S::V qv[GT][V_ ? V_ : kMaxV], top[GT];
  float tail_top[GT];  // over the keys of partial groups (fewer than S::N)
  for (int g = 0; g < GT; ++g) {
    for (int64_t j = 0; j < V; ++j) qv[g][j] = S::mul(S::load(q + g * D + S::N * j), S::set1(scale));
    top[g] = S::set1(-std::numeric_limits<float>::infinity());
    tail_top[g] = -std::numeric_limits<float>::infinity();
  }
  using Ahead = typename KvPool<T>::Ahead;
  keys.for_each_block(table, h, L, [&](int64_t start, const T* rows, int64_t n, const float* row_scales, const Ahead& ahead) {
    for (int64_t r0 = 0; r0 < n; r0 += S::N) {
      const int m = static_cast<int>(std::min<int64_t>(S::N, n - r0));
      typename S::V dots[GT][S::N];  // [g][i]: key r0 + i times query head g, lane by lane
      for (int i = 0; i < S::N; ++i) {
        if (i >= m) {
          for (int g = 0; g < GT; ++g) dots[g][i] = S::zero();
          continue;
        }
        ahead.row(r0 + i);
        const T* key = rows + (r0 + i) * keys.row_stride;
        typename S::V k[V_ ? V_ : kMaxV];
        for (int64_t j = 0; j < V; ++j) k[j] = S::load(key + S::N * j);
        for (int g = 0; g < GT; ++g) {
          typename S::V acc = S::mul(qv[g][0], k[0]);
          for (int64_t j = 1; j < V; ++j) acc = S::fmadd(qv[g][j], k[j], acc);
          dots[g][i] = acc;
        }
      }
      float key_scales[S::N];  // int8 codes: each key's own scale
      if constexpr (KvPool<T>::kInt8) {
        for (int i = 0; i < S::N; ++i) key_scales[i] = i < m ? row_scales[(r0 + i) * keys.scale_row_stride] : 0.0f;
      }
      for (int g = 0; g < GT; ++g) {
        typename S::V scores = S::sums(dots[g]);
        if constexpr (KvPool<T>::kInt8) scores = S::mul(scores, S::load(key_scales));
        float* out = p + g * L + start + r0;
        if (m == S::N) {
          S::store(out, scores);
          top[g] = S::max(top[g], scores);
          continue;
        }
        float lanes[S::N];
        S::store(lanes, scores);
        for (int i = 0; i < m; ++i) tail_top[g] = std::max(tail_top[g], out[i] = lanes[i]);
      }
    }
  }, &values);
  for (int g = 0; g < GT; ++g) max_score[g] = std::max(S::max(top[g]), tail_top[g]);
}

// Pass 3 for the same tile: out + g * D = (weights p + g * L) @ values * inv_sum[g]
template <typename S, int V_, int GT, typename T>
void weigh_values(const float* p, const float* inv_sum, const KvPool<T>& values, const int64_t* table, int64_t h,
                  int64_t L, int64_t D, float* out) {
  const int64_t V = V_ ? V_ : D / S::N;
  typename S::V acc[GT][V_ ? V_ : kMaxV];
  for (int g = 0; g < GT; ++g) {
    for (int64_t j = 0; j < V; ++j) acc[g][j] = S::zero();
  }
  values.for_each_row(table, h, L, [&](int64_t l, const T* value, float value_scale) {
    for (int64_t j = 0; j < V; ++j) {
      const typename S::V x = S::load(value + S::N * j);
      for (int g = 0; g < GT; ++g) acc[g][j] = S::fmadd(S::set1(p[g * L + l] * value_scale), x, acc[g][j]);
    }
  });
  for (int g = 0; g < GT; ++g) {
    const typename S::V inv = S::set1(inv_sum[g]);
    for (int64_t j = 0; j < V; ++j) S::store(out + g * D + S::N * j, S::mul(acc[g][j], inv));
  }
}

// out + g * D (D,) = softmax(q_g . k_l * scale over l < L) @ v for the G query heads q + g * D (fp32) that share
// head h of one sequence's keys and values: one pass over the keys and one over the values per tile of query heads
// (all G of a usual GQA group: each cached row read and converted once per key/value head, not per query head; int8
// rows: q . codes times the row's scale, and each value row's weight times its scale). S: vectors of S::N lanes,
// N dividing D; V: D / S::N when known at compile time (the usual head dims), else 0.
template <typename S, int V_, typename T>
void attend_heads_in(const float* q, const KvPool<T>& keys, const KvPool<T>& values, const int64_t* table, int64_t h,
                     int64_t G, int64_t L, int64_t D, float scale, float* out) {
  constexpr int kTile = V_ ? std::max(1, kTileSums / V_) : 1;  // query heads per tile
  std::vector<float> p(G * L);  // head g's scores, then weights, at p[g * L + l]
  float max_score[kMaxGroup], inv_sum[kMaxGroup];
  for (int64_t g0 = 0; g0 < G; g0 += kTile) {
    with_heads<kTile>(std::min<int64_t>(kTile, G - g0), [&](auto n) {
      score_heads<S, V_, decltype(n)::value>(q + g0 * D, keys, values, table, h, L, D, scale, p.data() + g0 * L,
                                               max_score + g0);
    });
  }
  for (int64_t g = 0; g < G; ++g) {
    float* pg = p.data() + g * L;
    const typename S::V max_v = S::set1(max_score[g]);
    typename S::V sum_v = S::zero();
    int64_t l = 0;
    for (; l + S::N <= L; l += S::N) {
      const typename S::V e = exp<S>(S::sub(S::load(pg + l), max_v));
      S::store(pg + l, e);
      sum_v = S::add(sum_v, e);
    }
    float sum = S::sum(sum_v);
    for (; l < L; ++l) sum += (pg[l] = std::exp(pg[l] - max_score[g]));
    inv_sum[g] = 1.0f / sum;
  }
  for (int64_t g0 = 0; g0 < G; g0 += kTile) {
    with_heads<kTile>(std::min<int64_t>(kTile, G - g0), [&](auto n) {
      weigh_values<S, V_, decltype(n)::value>(p.data() + g0 * L, inv_sum + g0, values, table, h, L, D, out + g0 * D);
    });
  }
}

// attend_heads_in on the widest vectors that divide head_dim, with the usual head dims (4 or 8 vectors) unrolled
template <typename T>
void attend_heads(const float* q, const KvPool<T>& keys, const KvPool<T>& values, const int64_t* table, int64_t h,
                  int64_t G, int64_t L, int64_t D, float scale, float* out) {
  auto on = [&](auto lanes) {
    using S = decltype(lanes);
    if (D == 4 * S::N) return attend_heads_in<S, 4>(q, keys, values, table, h, G, L, D, scale, out);
    if (D == 8 * S::N) return attend_heads_in<S, 8>(q, keys, values, table, h, G, L, D, scale, out);
    attend_heads_in<S, 0>(q, keys, values, table, h, G, L, D, scale, out);
  };
  if (D % Wide::N == 0) return on(Wide{});
  on(Narrow{});
}

#ifdef INFERLAB_AVX512
// The runs of kChunkMinRows or more rows of one sequence at consecutive positions (a prompt chunk: the same block
// table) attended a tile of rows at a time (chunk_attention.h); returns the other rows, for the loop a row at a time
inline std::vector<int64_t> attend_chunks(const float* q, const KvPool<at::BFloat16>& k_pool,
                                          const KvPool<at::BFloat16>& v_pool, const int64_t* tables,
                                          int64_t table_width, const int64_t* positions, int64_t B, int64_t H,
                                          int64_t H_kv, int64_t D, float scale, float* out) {
  struct Run {
    int64_t first, n;
  };
  std::vector<Run> runs;
  std::vector<int64_t> rows;
  for (int64_t b = 0; b < B;) {
    const int64_t* table = tables + b * table_width;
    int64_t e = b + 1;
    while (e < B && positions[e] == positions[e - 1] + 1 &&
           std::equal(table, table + table_width, tables + e * table_width)) {
      ++e;
    }
    if (e - b >= kChunkMinRows) {
      runs.push_back({b, e - b});
    } else {
      for (int64_t r = b; r < e; ++r) rows.push_back(r);
    }
    b = e;
  }
  if (runs.empty()) return rows;
  std::vector<ChunkKv> kvs(runs.size() * H_kv);  // per run and key/value head
  at::parallel_for(0, static_cast<int64_t>(kvs.size()), 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const Run& run = runs[i / H_kv];
      const int64_t* table = tables + run.first * table_width;
      const int64_t h = i % H_kv;
      auto key_row = [&](int64_t l) { return reinterpret_cast<const uint16_t*>(k_pool.row(table, h, l)); };
      auto value_row = [&](int64_t l) { return reinterpret_cast<const uint16_t*>(v_pool.row(table, h, l)); };
      kvs[i].make(key_row, value_row, positions[run.first + run.n - 1] + 1, D);
    }
  });
  struct Tile {
    int64_t run, kv, first, n;
  };
  std::vector<Tile> tiles;  // per run, key/value head and 16 rows: every query head of the group
  for (int64_t r = 0; r < static_cast<int64_t>(runs.size()); ++r) {
    for (int64_t h = 0; h < H_kv; ++h) {
      for (int64_t first = 0; first < runs[r].n; first += 16) {
        tiles.push_back({r, r * H_kv + h, first, std::min<int64_t>(16, runs[r].n - first)});
      }
    }
  }
  const int64_t group = H / H_kv;
  at::parallel_for(0, static_cast<int64_t>(tiles.size()), 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const Tile& t = tiles[i];
      const int64_t offset = runs[t.run].first * H * D, head0 = t.kv % H_kv * group;
      attend_chunk_tile(kvs[t.kv], q + offset, H, t.first, t.n, positions[runs[t.run].first], head0, group, scale,
                        out + offset);
    }
  });
  return rows;
}
#endif

// For each of B sequences: write k, v (H_kv, D) at its position into the pools, then attend its q (H, D)
// over positions 0..position. q, k, v, out fp32, rows of B; tables (B, table_width); H a multiple of H_kv.
template <typename T>
void write_and_attend(const float* q, const float* k, const float* v, const KvPool<T>& k_pool, const KvPool<T>& v_pool,
                      const int64_t* tables, int64_t table_width, const int64_t* positions, int64_t B, int64_t H,
                      int64_t H_kv, int64_t D, float scale, float* out) {
  int64_t keys = 0;
  for (int64_t b = 0; b < B; ++b) {
    const int64_t* table = tables + b * table_width;
    for (int64_t h = 0; h < H_kv; ++h) {
      const float* k_new = k + (b * H_kv + h) * D;
      const float* v_new = v + (b * H_kv + h) * D;
      k_pool.write(table, h, positions[b], k_new, D);
      v_pool.write(table, h, positions[b], v_new, D);
    }
    keys += H * (positions[b] + 1);
  }
  std::vector<int64_t> rows(B);  // the rows attended one at a time
  std::iota(rows.begin(), rows.end(), 0);
#ifdef INFERLAB_AVX512
  if constexpr (std::is_same_v<T, at::BFloat16>) {  // a prompt chunk's rows a tile at a time; the others stay
    if (D % 64 == 0 && B >= kChunkMinRows) {
      rows = attend_chunks(q, k_pool, v_pool, tables, table_width, positions, B, H, H_kv, D, scale, out);
    }
  }
#endif
  const int64_t R = static_cast<int64_t>(rows.size());
  // a task attends `per_task` query heads of one key/value head (all of its group, up to kMaxGroup), or one head
  // where that leaves too few tasks to share among the threads (a lone sequence)
  const int64_t group = H / H_kv;
  const int64_t per_task = R * H_kv >= 2 * at::get_num_threads() ? std::min(group, kMaxGroup) : 1;
  const int64_t tasks_per_head = (group + per_task - 1) / per_task, tasks = R * H_kv * tasks_per_head;
  const int64_t grain = keys < kKeysPerThread ? std::max<int64_t>(tasks, 1) : 1;
  at::parallel_for(0, tasks, grain, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t b = rows[i / (H_kv * tasks_per_head)], h_kv = i / tasks_per_head % H_kv;
      const int64_t first = h_kv * group + i % tasks_per_head * per_task;  // its first query head
      const int64_t n = std::min(per_task, (h_kv + 1) * group - first);
      const int64_t offset = (b * H + first) * D;
      attend_heads(q + offset, k_pool, v_pool, tables + b * table_width, h_kv, n, positions[b] + 1, D, scale,
                   out + offset);
    }
  });
}

}  // namespace INFERLAB_ISA
}  // namespace inferlab
