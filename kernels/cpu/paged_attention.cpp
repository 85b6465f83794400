// Paged attention and the KV-cache write on the CPU, reading the cache in place.
//
// The contract is kernels/reference.py's paged_attention and store_kv_cache
// (layouts in kernels/README.md); kernels/cpu_attention.py builds this file,
// checks the arguments and falls back to the reference where it cannot.
//
//   q        [T, Hq, D]                          float32 / float16 / bfloat16, stride 1 in D
//   k_cache  [num_blocks, block_size, Hkv, D]    q's dtype or float8_e4m3fn (times k_scale), stride 1 in D
//   v_cache  like k_cache
//   block_tables [B, max_blocks] int32; query_start_loc [B + 1] int32; seq_lens [B] int32
//   sinks    [Hq] float32 or None: attention sinks (gpt-oss), a logit per query head in the
//            softmax's denominator only, folded into each row once its keys are done
//   out      [T, Hq, D] in q's dtype; computed in float32
//
// One work item is (sequence, up to QT of its queries, its kv heads; one kv
// head where too few sequences would leave a thread idle). It walks the cache
// blocks holding the keys its queries see, in tiles of up to kLanes keys, with an
// online softmax (running max and sum per query row): nothing is copied out of
// a float32 cache, and 16-bit and FP8 caches are widened one tile at a time.
// A query row (query, head) gets a tile's scores as one vector (kLanes dot
// products, their lanes summed together) and adds the tile's weighted values
// with the row's output held in registers. Items run over the torch intra-op
// threads, longest first, each thread taking the next item.
// ATen and pybind11 with torch's tensor conversions; not torch/extension.h (all of libtorch's C++
// API besides), whose headers alone took twice as long to compile.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/csrc/utils/pybind.h>

#include <c10/util/BFloat16.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <optional>
#include <vector>

// Built for the machine that runs it (-march=native; kernels/cpu_attention.py names the build
// after the CPU's feature flags): the vectors are the machine's own width (kLanes floats: 16 under
// AVX-512, 8 under AVX or AVX2, 4 otherwise). A vector wider than the machine's has no register
// of its own, and GCC then keeps it in memory and works on it piece by piece: an AVX2 build of
// 16-float vectors spent most of a decode step's attention storing and reloading them.
#define PDSERVE_INLINE inline __attribute__((always_inline))

namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();
constexpr int kMaxHeadDim = 512;
constexpr int kTargetRows = 32;  // query rows per item: QT = max(1, 32 / G) queries
constexpr int64_t kMinParallelWork = 1 << 14;  // query rows x keys

PDSERVE_INLINE float to_float(float x) { return x; }
PDSERVE_INLINE float to_float(c10::Half x) { return static_cast<float>(x); }
PDSERVE_INLINE float to_float(c10::BFloat16 x) { return static_cast<float>(x); }
PDSERVE_INLINE float to_float(c10::Float8_e4m3fn x) { return static_cast<float>(x); }

// Every e4m3 byte's value, for widening an FP8 cache's tiles: a table read, where converting each
// element's bits took 1.58 ms a layer of decode attention at 1.8k keys (0.42 ms from float32).
struct E4M3Table {
  float v[256];
  E4M3Table() {
    for (int i = 0; i < 256; ++i) v[i] = to_float(c10::Float8_e4m3fn(static_cast<uint8_t>(i), c10::Float8_e4m3fn::from_bits()));
  }
};
const E4M3Table kE4M3;

// One register of floats: a tile of kLanes keys, a head dim in chunks of kLanes.
#if defined(__AVX512F__)
constexpr int kLanes = 16;
#elif defined(__AVX__)
constexpr int kLanes = 8;
#else
constexpr int kLanes = 4;
#endif
typedef float vf __attribute__((vector_size(4 * kLanes)));
typedef int32_t vi __attribute__((vector_size(4 * kLanes)));
typedef float vf8 __attribute__((vector_size(32)));
typedef float vf4 __attribute__((vector_size(16)));

PDSERVE_INLINE vf load(const float* p) {
  vf v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}
PDSERVE_INLINE void store(float* p, vf v) { std::memcpy(p, &v, sizeof(v)); }
PDSERVE_INLINE vf splat(float x) { return vf{} + x; }
PDSERVE_INLINE float hsum4(vf4 c) { return (c[0] + c[2]) + (c[1] + c[3]); }
PDSERVE_INLINE float hsum(vf a) {
#if defined(__AVX512F__)
  const vf8 b = __builtin_shufflevector(a, a, 0, 1, 2, 3, 4, 5, 6, 7) +
                __builtin_shufflevector(a, a, 8, 9, 10, 11, 12, 13, 14, 15);
  return hsum4(__builtin_shufflevector(b, b, 0, 1, 2, 3) + __builtin_shufflevector(b, b, 4, 5, 6, 7));
#elif defined(__AVX__)
  return hsum4(__builtin_shufflevector(a, a, 0, 1, 2, 3) + __builtin_shufflevector(a, a, 4, 5, 6, 7));
#else
  return hsum4(a);
#endif
}
PDSERVE_INLINE vf vmax(vf a, vf b) { return a > b ? a : b; }
PDSERVE_INLINE float hmax(vf a) {
#if defined(__AVX512F__)
  a = vmax(a, __builtin_shufflevector(a, a, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7));
  a = vmax(a, __builtin_shufflevector(a, a, 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11));
  a = vmax(a, __builtin_shufflevector(a, a, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13));
  a = vmax(a, __builtin_shufflevector(a, a, 1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14));
#elif defined(__AVX__)
  a = vmax(a, __builtin_shufflevector(a, a, 4, 5, 6, 7, 0, 1, 2, 3));
  a = vmax(a, __builtin_shufflevector(a, a, 2, 3, 0, 1, 6, 7, 4, 5));
  a = vmax(a, __builtin_shufflevector(a, a, 1, 0, 3, 2, 5, 4, 7, 6));
#else
  a = vmax(a, __builtin_shufflevector(a, a, 2, 3, 0, 1));
  a = vmax(a, __builtin_shufflevector(a, a, 1, 0, 3, 2));
#endif
  return a[0];
}

// exp(x) for x <= 0, lane by lane, in plain arithmetic: 2^(x log2 e) split into
// 2^n * 2^f, f in [-0.5, 0.5], 2^f by a degree-6 polynomial (relative error
// ~2e-7). Below -87 (and -inf) it is 0.
PDSERVE_INLINE vf exp_nonpositive(vf x) {
  const vf lowest = splat(-87.0f);
  const vf t = (x > lowest ? x : lowest) * 1.44269504088896341f;
  const vf n = (t + 12582912.0f) - 12582912.0f;  // rounded to an integer (1.5 * 2^23 trick)
  const vf f = t - n;
  vf p = splat(1.5353362e-4f);
  p = p * f + 1.3398874e-3f;
  p = p * f + 9.6181291e-3f;
  p = p * f + 5.5504109e-2f;
  p = p * f + 2.4022651e-1f;
  p = p * f + 6.9314718e-1f;
  p = p * f + 1.0f;
  const vi bits = (__builtin_convertvector(n, vi) + 127) << 23;
  vf scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return x < lowest ? vf{} : p * scale;
}
PDSERVE_INLINE float exp_nonpositive(float x) { return exp_nonpositive(splat(x))[0]; }

// out[j] = the sum of a[j]'s lanes, for kLanes vectors at once: rounds of pairing halves (lanes
// of two vectors interleaved, then added), then one permutation back to key order. Under AVX-512
// 46 vector ops where 16 horizontal sums take ~160.
#if defined(__AVX512F__)
PDSERVE_INLINE vf sum_lanes(const vf* a) {
  vf b[8], c[4], e[2];
  for (int k = 0; k < 8; ++k) {
    const vf x = a[2 * k], y = a[2 * k + 1];
    b[k] = __builtin_shufflevector(x, y, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
           __builtin_shufflevector(x, y, 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
  }  // b[k]: lanes 0-7 partial sums of a[2k], 8-15 of a[2k+1]
  for (int k = 0; k < 4; ++k) {
    const vf x = b[2 * k], y = b[2 * k + 1];
    c[k] = __builtin_shufflevector(x, y, 0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27) +
           __builtin_shufflevector(x, y, 4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31);
  }  // c[k]: 4 lanes each of a[4k], a[4k+2], a[4k+1], a[4k+3]
  for (int k = 0; k < 2; ++k) {
    const vf x = c[2 * k], y = c[2 * k + 1];
    e[k] = __builtin_shufflevector(x, y, 0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29) +
           __builtin_shufflevector(x, y, 2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31);
  }  // e[k]: lane pairs of a[8k + {0, 4, 2, 6, 1, 5, 3, 7}]
  const vf f = __builtin_shufflevector(e[0], e[1], 0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30) +
               __builtin_shufflevector(e[0], e[1], 1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31);
  // f: lane 2i holds a[perm[i]], lane 2i + 1 a[8 + perm[i]], perm = {0, 4, 2, 6, 1, 5, 3, 7}
  return __builtin_shufflevector(f, f, 0, 8, 4, 12, 2, 10, 6, 14, 1, 9, 5, 13, 3, 11, 7, 15);
}
#elif defined(__AVX__)
PDSERVE_INLINE vf sum_lanes(const vf* a) {
  vf b[4], c[2];
  for (int k = 0; k < 4; ++k) {
    const vf x = a[2 * k], y = a[2 * k + 1];
    b[k] = __builtin_shufflevector(x, y, 0, 1, 2, 3, 8, 9, 10, 11) + __builtin_shufflevector(x, y, 4, 5, 6, 7, 12, 13, 14, 15);
  }  // b[k]: lanes 0-3 partial sums of a[2k], 4-7 of a[2k+1]
  for (int k = 0; k < 2; ++k) {
    const vf x = b[2 * k], y = b[2 * k + 1];
    c[k] = __builtin_shufflevector(x, y, 0, 1, 8, 9, 4, 5, 12, 13) + __builtin_shufflevector(x, y, 2, 3, 10, 11, 6, 7, 14, 15);
  }  // c[k]: lane pairs of a[4k], a[4k+2], a[4k+1], a[4k+3]
  const vf e = __builtin_shufflevector(c[0], c[1], 0, 8, 2, 10, 4, 12, 6, 14) +
               __builtin_shufflevector(c[0], c[1], 1, 9, 3, 11, 5, 13, 7, 15);
  // e: lanes hold a[0], a[4], a[2], a[6], a[1], a[5], a[3], a[7]
  return __builtin_shufflevector(e, e, 0, 4, 2, 6, 1, 5, 3, 7);
}
#else
PDSERVE_INLINE vf sum_lanes(const vf* a) { return vf{hsum(a[0]), hsum(a[1]), hsum(a[2]), hsum(a[3])}; }
#endif

struct Item {
  int32_t seq;
  int32_t q_lo;  // the item's queries: rows q_lo..q_hi-1 of q, all of one sequence
  int32_t q_hi;
  int32_t h_lo;  // and its kv heads h_lo..h_hi-1
  int32_t h_hi;
};

struct Geometry {
  int64_t num_blocks, block_size, num_kv_heads, head_dim, group;
  int64_t kc_block, kc_slot, kc_head;  // k_cache strides (head dim stride 1)
  int64_t vc_block, vc_slot, vc_head;
  int64_t q_token, q_head, o_token, o_head;
  int64_t table_stride;
  int64_t window;  // <= 0: none
  float scale, k_scale, v_scale;
  const float* sinks;  // [Hq], or nullptr: none
};

// Per thread: K and V of one tile in float32 (16-bit and FP8 caches), the rows'
// queries, accumulators and softmax state, and a row of zeros (a short tile's padding).
struct Scratch {
  std::vector<float> k, v, q, acc, m, l, zeros;
  std::vector<int64_t> lo, hi;
  // rows: query rows per kv head; heads: kv heads per item
  void size_for(int64_t rows, int64_t heads, int64_t block_size, int64_t head_dim) {
    lo.resize(rows);
    hi.resize(rows);
    k.resize(kLanes * head_dim);
    v.resize(kLanes * head_dim);
    q.resize(heads * rows * head_dim);
    acc.resize(heads * rows * head_dim);
    m.resize(heads * rows);
    l.resize(heads * rows);
    zeros.assign(head_dim, 0.0f);
  }
};

// One query row over a tile of up to kLanes keys (the head dim DC * kLanes, or DC == 0:
// d, a multiple of kLanes, given at run time). k[j], v[j]: key j's vectors (past
// the tile's keys, k[j] points at zeros). The row sees keys [lo, hi) of the tile (lo < hi).
// Online softmax: m, l the row's running max and sum, acc its unnormalised output.
template <int DC>
PDSERVE_INLINE void row_over_tile(const float* __restrict q, float* __restrict acc, float* m, float* l,
                                  const float* const* k, const float* const* v, int64_t lo, int64_t hi,
                                  float scale, int64_t d_runtime) {
  const int64_t dc = DC > 0 ? DC : d_runtime / kLanes;
  vf a[kLanes] = {};
  for (int64_t c = 0; c < dc; ++c) {
    const vf qc = load(q + c * kLanes);
    for (int j = 0; j < kLanes; ++j) a[j] += qc * load(k[j] + c * kLanes);
  }
  vi lane;
  for (int j = 0; j < kLanes; ++j) lane[j] = j;
  const vi visible = (lane >= static_cast<int32_t>(lo)) & (lane < static_cast<int32_t>(hi));
  const vf s = visible ? sum_lanes(a) * scale : splat(kNegInf);
  const float m_new = std::max(*m, hmax(s));
  const float alpha = exp_nonpositive(*m - m_new);  // 0 on the row's first tile (m = -inf)
  const vf p = exp_nonpositive(s - m_new);
  *l = *l * alpha + hsum(p);
  *m = m_new;
  float w[kLanes];
  store(w, p);
  if constexpr (DC > 0) {  // the row's output in registers: DC independent FMA chains
    vf o[DC];
    for (int c = 0; c < DC; ++c) o[c] = load(acc + c * kLanes) * alpha;
    for (int64_t j = lo; j < hi; ++j) {
      const vf wj = splat(w[j]);
      for (int c = 0; c < DC; ++c) o[c] += wj * load(v[j] + c * kLanes);
    }
    for (int c = 0; c < DC; ++c) store(acc + c * kLanes, o[c]);
  } else {
    for (int64_t c = 0; c < dc; ++c) {
      vf o = load(acc + c * kLanes) * alpha;
      for (int64_t j = lo; j < hi; ++j) o += w[j] * load(v[j] + c * kLanes);
      store(acc + c * kLanes, o);
    }
  }
}

// The same for any head dim, scalar loops (head dims that are not a multiple of kLanes).
PDSERVE_INLINE void row_over_tile_any(const float* __restrict q, float* __restrict acc, float* m, float* l,
                                      const float* const* k, const float* const* v, int64_t lo, int64_t hi,
                                      float scale, int64_t d) {
  float s[kLanes];
  float mb = kNegInf;
  for (int64_t j = lo; j < hi; ++j) {
    float dot = 0.0f;
    for (int64_t x = 0; x < d; ++x) dot += q[x] * k[j][x];
    s[j] = dot * scale;
    mb = std::max(mb, s[j]);
  }
  const float m_new = std::max(*m, mb);
  const float alpha = exp_nonpositive(*m - m_new);
  float sum = 0.0f;
  for (int64_t j = lo; j < hi; ++j) {
    s[j] = exp_nonpositive(s[j] - m_new);
    sum += s[j];
  }
  *l = *l * alpha + sum;
  *m = m_new;
  for (int64_t x = 0; x < d; ++x) acc[x] *= alpha;
  for (int64_t j = lo; j < hi; ++j)
    for (int64_t x = 0; x < d; ++x) acc[x] += s[j] * v[j][x];
}

// Rows [0, rows) of one kv head over one tile; row r sees keys [lo[r], hi[r]).
template <int DC>
void rows_over_tile(int64_t rows, const float* q, float* acc, float* m, float* l,
                                   const float* const* k, const float* const* v, const int64_t* lo,
                                   const int64_t* hi, float scale, int64_t d) {
  for (int64_t r = 0; r < rows; ++r) {
    if (lo[r] >= hi[r]) continue;
    if (d % kLanes == 0)
      row_over_tile<DC>(q + r * d, acc + r * d, m + r, l + r, k, v, lo[r], hi[r], scale, d);
    else
      row_over_tile_any(q + r * d, acc + r * d, m + r, l + r, k, v, lo[r], hi[r], scale, d);
  }
}

// Keys j in [0, n) of a block as float32 rows: the cache itself for a float32
// cache, else converted (times the FP8 scale) into buf. Returns the rows' stride.
template <typename cache_t>
const float* block_as_float(const cache_t* src, int64_t stride, int64_t n, int64_t d, float mult,
                                           float* buf, int64_t* out_stride) {
  if constexpr (std::is_same<cache_t, float>::value) {
    *out_stride = stride;
    return src;
  } else {
    for (int64_t j = 0; j < n; ++j) {
      const cache_t* row = src + j * stride;
      float* dst = buf + j * d;
      if constexpr (std::is_same<cache_t, c10::Float8_e4m3fn>::value) {
        const uint8_t* bytes = reinterpret_cast<const uint8_t*>(row);
        for (int64_t x = 0; x < d; ++x) dst[x] = kE4M3.v[bytes[x]] * mult;
      } else {
        for (int64_t x = 0; x < d; ++x) dst[x] = to_float(row[x]);
      }
    }
    *out_stride = d;
    return buf;
  }
}

// Query i of the sequence sits at position seq_len - q_len + i and sees keys
// (p - W, p] (with a window W) or [0, p]. The item walks the blocks of keys
// [k_lo, k_hi), from its first query's window start to its last query, and in
// each block its kv heads one after another (a block's heads are adjacent in
// memory). Rows are (kv head, query, head of the group), in that order.
template <typename scalar_t, typename cache_t, int DC>
void attend(const Item& it, const Geometry& g, const scalar_t* __restrict q_ptr, const cache_t* __restrict k_ptr,
            const cache_t* __restrict v_ptr, const int32_t* __restrict table, int64_t seq_len, int64_t q_len,
            int64_t q_first, scalar_t* __restrict out_ptr, Scratch& sc) {
  const int64_t d = g.head_dim, bs = g.block_size, G = g.group;
  const int64_t nq = it.q_hi - it.q_lo, rows = nq * G;  // rows per kv head
  const int64_t nh = it.h_hi - it.h_lo;
  const int64_t pos0 = seq_len - q_len + (it.q_lo - q_first);
  const int64_t pos1 = pos0 + nq - 1;
  const int64_t k_lo = g.window > 0 ? std::max<int64_t>(0, pos0 - g.window + 1) : 0;
  const int64_t k_hi = pos1 + 1;
  float* qs = sc.q.data();
  float* acc = sc.acc.data();
  for (int64_t h = 0; h < nh; ++h) {
    for (int64_t i = 0; i < nq; ++i) {
      for (int64_t j = 0; j < G; ++j) {
        const scalar_t* src = q_ptr + (it.q_lo + i) * g.q_token + ((it.h_lo + h) * G + j) * g.q_head;
        float* dst = qs + ((h * nq + i) * G + j) * d;
        for (int64_t x = 0; x < d; ++x) dst[x] = to_float(src[x]);
      }
    }
  }
  std::fill(acc, acc + nh * rows * d, 0.0f);
  std::fill(sc.m.begin(), sc.m.begin() + nh * rows, kNegInf);
  std::fill(sc.l.begin(), sc.l.begin() + nh * rows, 0.0f);
  int64_t* lo = sc.lo.data();
  int64_t* hi = sc.hi.data();
  const float* kp[kLanes];
  const float* vp[kLanes];
  for (int64_t blk = k_lo / bs; blk * bs < k_hi; ++blk) {
    const int64_t id = table[blk];  // in [0, num_blocks): checked before the parallel region
    const int64_t first = std::max(k_lo, blk * bs), last = std::min(k_hi, (blk + 1) * bs);  // keys [first, last)
    for (int64_t t0 = first; t0 < last; t0 += kLanes) {  // tiles of up to kLanes keys
      const int64_t n = std::min<int64_t>(kLanes, last - t0), slot = t0 - blk * bs;
      // Row (i, j) sees the tile's keys [lo, hi), relative to t0, whatever its kv head.
      int64_t busy = 0;  // the first row that sees any of them: rows before it are skipped
      for (int64_t i = nq - 1; i >= 0; --i) {
        const int64_t p = pos0 + i;
        const int64_t a = g.window > 0 ? std::max(t0, p - g.window + 1) : t0;
        const int64_t b = std::min(t0 + n, p + 1);
        for (int64_t j = 0; j < G; ++j) {
          lo[i * G + j] = a - t0;
          hi[i * G + j] = b - t0;
        }
        if (a < b) busy = i * G;
      }
      for (int64_t h = 0; h < nh; ++h) {
        int64_t ks, vs;
        const int64_t head = it.h_lo + h;
        const float* kb = block_as_float(k_ptr + id * g.kc_block + slot * g.kc_slot + head * g.kc_head, g.kc_slot,
                                         n, d, g.k_scale, sc.k.data(), &ks);
        const float* vb = block_as_float(v_ptr + id * g.vc_block + slot * g.vc_slot + head * g.vc_head, g.vc_slot,
                                         n, d, g.v_scale, sc.v.data(), &vs);
        for (int64_t j = 0; j < kLanes; ++j) {
          kp[j] = j < n ? kb + j * ks : sc.zeros.data();
          vp[j] = j < n ? vb + j * vs : sc.zeros.data();
        }
        const int64_t r0 = h * rows + busy;
        rows_over_tile<DC>(rows - busy, qs + r0 * d, acc + r0 * d, sc.m.data() + r0, sc.l.data() + r0, kp, vp,
                           lo + busy, hi + busy, g.scale, d);
      }
    }
  }
  for (int64_t h = 0; h < nh; ++h) {
    for (int64_t i = 0; i < nq; ++i) {
      for (int64_t j = 0; j < G; ++j) {
        const int64_t r = (h * nq + i) * G + j;
        float inv = 1.0f / sc.l[r];
        if (g.sinks != nullptr) {  // the sink: one more key, of value zero, in the softmax
          const float sink = g.sinks[(it.h_lo + h) * G + j], m = sc.m[r];
          const float m_fin = std::max(m, sink), alpha = std::exp(m - m_fin);
          inv = alpha / (sc.l[r] * alpha + std::exp(sink - m_fin));
        }
        scalar_t* dst = out_ptr + (it.q_lo + i) * g.o_token + ((it.h_lo + h) * G + j) * g.o_head;
        for (int64_t x = 0; x < d; ++x) dst[x] = static_cast<scalar_t>(acc[r * d + x] * inv);
      }
    }
  }
}

// Query rows x keys x kv heads an item reads (the keys of its first query's window to its last query).
inline int64_t item_cost(const Item& it, const int32_t* lens, const int32_t* starts, int64_t window) {
  const int64_t q_len = starts[it.seq + 1] - starts[it.seq];
  const int64_t pos1 = lens[it.seq] - q_len + (it.q_hi - 1 - starts[it.seq]);
  const int64_t pos0 = pos1 - (it.q_hi - it.q_lo - 1);
  const int64_t k_lo = window > 0 ? std::max<int64_t>(0, pos0 - window + 1) : 0;
  return (it.q_hi - it.q_lo) * (pos1 + 1 - k_lo) * (it.h_hi - it.h_lo);
}

template <typename scalar_t, typename cache_t, int DC>
void run(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& block_tables,
         const int32_t* starts, const int32_t* lens, const std::vector<Item>& items, const Geometry& g,
         at::Tensor& out, int64_t work) {
  const scalar_t* q_ptr = q.data_ptr<scalar_t>();
  const cache_t* k_ptr = reinterpret_cast<const cache_t*>(k_cache.data_ptr());
  const cache_t* v_ptr = reinterpret_cast<const cache_t*>(v_cache.data_ptr());
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  scalar_t* out_ptr = out.data_ptr<scalar_t>();
  const int64_t max_rows = std::max<int64_t>(1, kTargetRows / g.group) * g.group;
  int64_t max_heads = 0;
  for (const Item& it : items) max_heads = std::max<int64_t>(max_heads, it.h_hi - it.h_lo);
  const int64_t num_items = static_cast<int64_t>(items.size());
  // Below kMinParallelWork a parallel region costs more than it saves. Threads take
  // items off a shared counter (items come longest first), which balances
  // sequences of different lengths better than a static split.
  const int64_t threads = work < kMinParallelWork ? 1 : std::min<int64_t>(at::get_num_threads(), num_items);
  std::atomic<int64_t> next{0};
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
    Scratch sc;
    sc.size_for(max_rows, max_heads, g.block_size, g.head_dim);
    for (int64_t i = next++; i < num_items; i = next++) {
      const Item& it = items[i];
      attend<scalar_t, cache_t, DC>(it, g, q_ptr, k_ptr, v_ptr, tables + it.seq * g.table_stride, lens[it.seq],
                                starts[it.seq + 1] - starts[it.seq], starts[it.seq], out_ptr, sc);
    }
  });
}

at::Tensor paged_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                           const at::Tensor& block_tables, const at::Tensor& query_start_loc,
                           const at::Tensor& seq_lens, double scale, int64_t window, double k_scale,
                           double v_scale, const std::optional<at::Tensor>& sinks) {
  // Shapes, dtypes and strides are checked in kernels/cpu_attention.py; these guard memory safety.
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4 && v_cache.dim() == 4, "paged_attention: bad ranks");
  TORCH_CHECK(q.stride(2) == 1 && k_cache.stride(3) == 1 && v_cache.stride(3) == 1,
              "paged_attention: the head dim must have stride 1");
  TORCH_CHECK(k_cache.sizes() == v_cache.sizes(), "paged_attention: k_cache and v_cache differ in shape");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && query_start_loc.scalar_type() == at::kInt &&
                  seq_lens.scalar_type() == at::kInt && block_tables.is_contiguous() &&
                  query_start_loc.is_contiguous() && seq_lens.is_contiguous(),
              "paged_attention: block_tables, query_start_loc and seq_lens must be contiguous int32");
  Geometry g;
  g.num_blocks = k_cache.size(0);
  g.block_size = k_cache.size(1);
  g.num_kv_heads = k_cache.size(2);
  g.head_dim = k_cache.size(3);
  TORCH_CHECK(q.size(2) == g.head_dim && g.head_dim <= kMaxHeadDim && q.size(1) % g.num_kv_heads == 0,
              "paged_attention: q's heads do not match the cache");
  g.group = q.size(1) / g.num_kv_heads;
  g.kc_block = k_cache.stride(0), g.kc_slot = k_cache.stride(1), g.kc_head = k_cache.stride(2);
  g.vc_block = v_cache.stride(0), g.vc_slot = v_cache.stride(1), g.vc_head = v_cache.stride(2);
  g.q_token = q.stride(0), g.q_head = q.stride(1);
  g.table_stride = block_tables.size(1);
  g.window = window;
  g.scale = static_cast<float>(scale);
  g.k_scale = static_cast<float>(k_scale);
  g.v_scale = static_cast<float>(v_scale);
  g.sinks = nullptr;
  if (sinks.has_value()) {
    TORCH_CHECK(sinks->scalar_type() == at::kFloat && sinks->dim() == 1 && sinks->size(0) == q.size(1) &&
                    sinks->is_contiguous() && sinks->device().is_cpu(),
                "paged_attention: sinks must be contiguous float32 [num_q_heads] on the CPU");
    g.sinks = sinks->data_ptr<float>();
  }
  at::Tensor out = at::empty(q.sizes(), q.options());
  g.o_token = out.stride(0), g.o_head = out.stride(1);

  const int64_t B = seq_lens.size(0);
  TORCH_CHECK(query_start_loc.size(0) == B + 1 && block_tables.size(0) == B, "paged_attention: batch sizes differ");
  const int32_t* starts = query_start_loc.data_ptr<int32_t>();
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  const int64_t qt = std::max<int64_t>(1, kTargetRows / g.group);
  std::vector<Item> items;
  int64_t work = 0;  // ~ query rows x keys, to decide whether threads pay
  for (int64_t b = 0; b < B; ++b) {
    const int64_t lo = starts[b], hi = starts[b + 1], n = lens[b];
    if (hi == lo) continue;
    TORCH_CHECK(lo >= 0 && hi > lo && hi <= q.size(0) && n >= hi - lo &&
                    (n + g.block_size - 1) / g.block_size <= g.table_stride,
                "paged_attention: sequence ", b, " has rows [", lo, ", ", hi, ") and ", n,
                " keys, which q, seq_lens or block_tables cannot hold");
    const int64_t keys = g.window > 0 ? std::min<int64_t>(n, g.window + hi - lo) : n;
    work += (hi - lo) * keys * q.size(1);
    // The blocks the sequence's queries read, checked once here, before the work is split
    // into items (per query tile and kv head) and handed to threads.
    const int32_t* table = block_tables.data_ptr<int32_t>() + b * g.table_stride;
    const int64_t first_key = g.window > 0 ? std::max<int64_t>(0, n - (hi - lo) - g.window + 1) : 0;
    for (int64_t blk = first_key / g.block_size; blk * g.block_size < n; ++blk) {
      TORCH_CHECK(table[blk] >= 0 && table[blk] < g.num_blocks, "paged_attention: block id ", table[blk],
                  " of sequence ", b, " is outside the cache's ", g.num_blocks, " blocks");
    }
    for (int64_t t = lo; t < hi; t += qt) {
      items.push_back({static_cast<int32_t>(b), static_cast<int32_t>(t), static_cast<int32_t>(std::min(hi, t + qt)),
                       0, static_cast<int32_t>(g.num_kv_heads)});
    }
  }
  // Too few items to keep the threads busy (one long sequence): one kv head an item.
  if (static_cast<int64_t>(items.size()) < 2 * at::get_num_threads() && g.num_kv_heads > 1) {
    std::vector<Item> per_head;
    for (const Item& it : items)
      for (int32_t h = 0; h < g.num_kv_heads; ++h) per_head.push_back({it.seq, it.q_lo, it.q_hi, h, h + 1});
    items.swap(per_head);
  }
  std::stable_sort(items.begin(), items.end(), [&](const Item& a, const Item& b) {
    return item_cost(a, lens, starts, g.window) > item_cost(b, lens, starts, g.window);
  });
  const auto qd = q.scalar_type(), cd = k_cache.scalar_type();
  TORCH_CHECK(v_cache.scalar_type() == cd && (cd == qd || cd == at::kFloat8_e4m3fn),
              "paged_attention: the cache holds q's dtype or float8_e4m3fn");
  // The head dims most models use get their own loops (the queries then stay in registers).
#define PDSERVE_RUN(S, C)                                                               \
  (g.head_dim == 64    ? run<S, C, 64 / kLanes>(q, k_cache, v_cache, block_tables, starts, lens, items, g, out, work) \
   : g.head_dim == 128 ? run<S, C, 128 / kLanes>(q, k_cache, v_cache, block_tables, starts, lens, items, g, out, work) \
                       : run<S, C, 0>(q, k_cache, v_cache, block_tables, starts, lens, items, g, out, work))
  const bool fp8 = cd == at::kFloat8_e4m3fn;
  switch (qd) {
    case at::kFloat:
      fp8 ? PDSERVE_RUN(float, c10::Float8_e4m3fn) : PDSERVE_RUN(float, float);
      break;
    case at::kHalf:
      fp8 ? PDSERVE_RUN(c10::Half, c10::Float8_e4m3fn) : PDSERVE_RUN(c10::Half, c10::Half);
      break;
    case at::kBFloat16:
      fp8 ? PDSERVE_RUN(c10::BFloat16, c10::Float8_e4m3fn) : PDSERVE_RUN(c10::BFloat16, c10::BFloat16);
      break;
    default:
      TORCH_CHECK(false, "paged_attention: q must be float32, float16 or bfloat16, got ", qd);
  }
#undef PDSERVE_RUN
  return out;
}

// What kernels.reference.store_kv_cache does: cache[slot] = token (FP8 caches:
// e4m3(clamp(x / scale, -448, 448)), the division in float32, rounded to nearest even).
template <typename scalar_t, typename cache_t>
void store_rows(const at::Tensor& x, at::Tensor& cache, const int64_t* slots, int64_t num_tokens, float scale) {
  const int64_t bs = cache.size(1), heads = cache.size(2), d = cache.size(3);
  const int64_t limit = cache.size(0) * bs;
  const scalar_t* src = x.data_ptr<scalar_t>();
  cache_t* dst = reinterpret_cast<cache_t*>(cache.data_ptr());
  const int64_t c0 = cache.stride(0), c1 = cache.stride(1), c2 = cache.stride(2);
  const int64_t x0 = x.stride(0), x1 = x.stride(1);
  for (int64_t t = 0; t < num_tokens; ++t) {
    const int64_t slot = slots[t];
    if (slot < 0) continue;
    TORCH_CHECK(slot < limit, "store_kv_cache: slot ", slot, " is outside the cache's ", limit, " slots");
    cache_t* row = dst + (slot / bs) * c0 + (slot % bs) * c1;
    for (int64_t h = 0; h < heads; ++h) {
      const scalar_t* in = src + t * x0 + h * x1;
      cache_t* o = row + h * c2;
      if constexpr (std::is_same<cache_t, c10::Float8_e4m3fn>::value) {
        for (int64_t e = 0; e < d; ++e) {
          const float v = std::min(std::max(to_float(in[e]) / scale, -448.0f), 448.0f);
          o[e] = c10::Float8_e4m3fn(v);
        }
      } else {
        std::memcpy(o, in, d * sizeof(cache_t));
      }
    }
  }
}

void store_kv_cache(const at::Tensor& key, const at::Tensor& value, at::Tensor& k_cache, at::Tensor& v_cache,
                    const at::Tensor& slot_mapping, double k_scale, double v_scale) {
  TORCH_CHECK(key.dim() == 3 && value.sizes() == key.sizes() && k_cache.dim() == 4 &&
                  v_cache.sizes() == k_cache.sizes() && key.size(1) == k_cache.size(2) &&
                  key.size(2) == k_cache.size(3),
              "store_kv_cache: shapes do not match");
  TORCH_CHECK(key.stride(2) == 1 && value.stride(2) == 1 && k_cache.stride(3) == 1 && v_cache.stride(3) == 1,
              "store_kv_cache: the head dim must have stride 1");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.is_contiguous() &&
                  slot_mapping.size(0) == key.size(0),
              "store_kv_cache: slot_mapping must be contiguous int64 [num_tokens]");
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  const int64_t n = key.size(0);
  const auto xd = key.scalar_type(), cd = k_cache.scalar_type();
  TORCH_CHECK(value.scalar_type() == xd && v_cache.scalar_type() == cd && (cd == xd || cd == at::kFloat8_e4m3fn),
              "store_kv_cache: the cache holds key's dtype or float8_e4m3fn");
  const float ks = static_cast<float>(k_scale), vs = static_cast<float>(v_scale);
#define PDSERVE_STORE(S)                                                     \
  if (cd == at::kFloat8_e4m3fn) {                                            \
    store_rows<S, c10::Float8_e4m3fn>(key, k_cache, slots, n, ks);           \
    store_rows<S, c10::Float8_e4m3fn>(value, v_cache, slots, n, vs);         \
  } else {                                                                   \
    store_rows<S, S>(key, k_cache, slots, n, ks);                            \
    store_rows<S, S>(value, v_cache, slots, n, vs);                          \
  }
  switch (xd) {
    case at::kFloat: PDSERVE_STORE(float) break;
    case at::kHalf: PDSERVE_STORE(c10::Half) break;
    case at::kBFloat16: PDSERVE_STORE(c10::BFloat16) break;
    default: TORCH_CHECK(false, "store_kv_cache: key must be float32, float16 or bfloat16, got ", xd);
  }
#undef PDSERVE_STORE
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_attention", &paged_attention, "paged attention over the KV cache in place (CPU)");
  m.def("store_kv_cache", &store_kv_cache, "write K/V into their cache slots (CPU)");
}
