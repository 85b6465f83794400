// y = x W^T on the CPU with W in GGUF (ggml) blocks, read packed: kernels/cpu_gemm.py loads it,
// kernels/gguf_reference.py is its reference (and documents the block layouts).
//
//   gguf_linear(x float32 [T, K], w uint8 [N, K / 32 * block_bytes], qtype, bias float32 [N] or None,
//               path="") -> float32 [T, N];  qtype 0 = Q4_0, 1 = Q4_1, 2 = Q8_0
//
// Activations stay float32. The vector paths take each 32-weight block's quants as floats
// (Q4_0's q - 8, Q4_1's and Q8_0's q: exact), sums q x over the block in float32 and adds
// d * that sum, plus Q4_1's m * (the block's sum of x, once per call): the reference's products
// d * q + m regrouped per block, so it differs from the reference only in float32 rounding, as
// a reordered sum does. The portable path dequantizes each block into exactly the floats the
// reference's dequantize gives (-ffp-contract=off: no multiply-add fused) and sums products.
//
// Work: output rows are split over threads (at::parallel_for); x's rows are taken in tiles of
// up to kTile (8) rows, and every weight block is decoded once per tile and used for all its rows
// (decode steps are one tile; a prefill of T rows decodes each block ceil(T / 8) times, from L1).
// The loop is written once over a vector type: 16 floats (AVX-512) and 8 (AVX2 with FMA, what
// laptops without AVX-512 have), each compiled where the compiler targets it (-march=native), and
// a portable loop the compiler vectorises as it can. The widest compiled serves; paths() lists
// them and gguf_linear(..., path=NAME) runs a narrower one (the tests check each). A Q4 block's 16
// bytes are widened to 32-bit lanes a vector of bytes at a time and both nibbles taken there,
// where widening each nibble vector apart took twice the byte shuffles (1.25x the decode GEMMs'
// time on an AVX2 machine).
// ATen and pybind11 with torch's tensor conversions; not torch/extension.h (all of libtorch's C++
// API besides), whose headers alone took twice as long to compile.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/csrc/utils/pybind.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <iterator>
#include <string>
#include <tuple>
#include <type_traits>
#include <vector>

#if defined(__AVX512F__) || defined(__AVX2__) || defined(__F16C__)
#include <immintrin.h>
#endif

namespace {

constexpr int kBlock = 32;
constexpr int kTile = 8;
#ifndef GGUF_PREFETCH_GROUPS
#define GGUF_PREFETCH_GROUPS 2
#endif
constexpr int kPrefetchGroups = GGUF_PREFETCH_GROUPS;  // 0: none

inline int block_bytes(int64_t qtype) { return qtype == 0 ? 18 : qtype == 1 ? 20 : 34; }

inline float fp16_at(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, 2);
#ifdef __F16C__
  return _cvtsh_ss(bits);  // the same value, in one instruction
#else
  return c10::detail::fp16_ieee_to_fp32_value(bits);
#endif
}

#ifdef __AVX512F__
#define GGUF_HAS_VEC16 1
struct Vec16 {  // 16 floats
  using T = __m512;
  static constexpr int kLanes = 16;
  static constexpr const char* kName = "avx512";
  static T zero() { return _mm512_setzero_ps(); }
  static T load(const float* p) { return _mm512_loadu_ps(p); }
  static T set1(float v) { return _mm512_set1_ps(v); }
  static T mul(T a, T b) { return _mm512_mul_ps(a, b); }
  static T fma(T a, T b, T c) { return _mm512_fmadd_ps(a, b, c); }
  static T add(T a, T b) { return _mm512_add_ps(a, b); }
  static float sum(T a) { return _mm512_reduce_add_ps(a); }
  using I = __m512i;  // 16 int32 lanes
  static I widen_u8(const uint8_t* p) { return _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
  static I widen_i8(const uint8_t* p) { return _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
  static I and15(I v) { return _mm512_and_si512(v, _mm512_set1_epi32(0x0F)); }
  static I shr4(I v) { return _mm512_srli_epi32(v, 4); }
  static I sub8(I v) { return _mm512_sub_epi32(v, _mm512_set1_epi32(8)); }
  static T to_float(I v) { return _mm512_cvtepi32_ps(v); }
};
#endif

#if defined(__AVX2__) && defined(__FMA__)
#define GGUF_HAS_VEC8 1
struct Vec8 {  // 8 floats (AVX2 and FMA: most laptops' x86 cores)
  using T = __m256;
  static constexpr int kLanes = 8;
  static constexpr const char* kName = "avx2";
  static T zero() { return _mm256_setzero_ps(); }
  static T load(const float* p) { return _mm256_loadu_ps(p); }
  static T set1(float v) { return _mm256_set1_ps(v); }
  static T mul(T a, T b) { return _mm256_mul_ps(a, b); }
  static T fma(T a, T b, T c) { return _mm256_fmadd_ps(a, b, c); }
  static T add(T a, T b) { return _mm256_add_ps(a, b); }
  static float sum(T a) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
  }
  using I = __m256i;  // 8 int32 lanes
  static I widen_u8(const uint8_t* p) { return _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))); }
  static I widen_i8(const uint8_t* p) { return _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))); }
  static I and15(I v) { return _mm256_and_si256(v, _mm256_set1_epi32(0x0F)); }
  static I shr4(I v) { return _mm256_srli_epi32(v, 4); }
  static I sub8(I v) { return _mm256_sub_epi32(v, _mm256_set1_epi32(8)); }
  static T to_float(I v) { return _mm256_cvtepi32_ps(v); }
};
#endif

struct Portable {  // no vector type: the loop the compiler vectorises as it can
  static constexpr int kLanes = 0;
  static constexpr const char* kName = "portable";
};

#if defined(GGUF_HAS_VEC16) || defined(GGUF_HAS_VEC8)

// One block's quants as floats, weights 0..31 in order: Q4_0's q - 8 (exact in int32 before the
// conversion), Q4_1's q, Q8_0's q; each vector's bytes widened straight from memory.
template <typename V, int QT>
inline void quants(const uint8_t* b, typename V::T* q) {
  constexpr int half = kBlock / V::kLanes / 2;
  if constexpr (QT == 2) {
    for (int v = 0; v < 2 * half; ++v) q[v] = V::to_float(V::widen_i8(b + 2 + v * V::kLanes));
  } else {
    // Byte i holds weights i (low nibble) and i + 16 (high): each byte widened to a 32-bit lane
    // once, then its two nibbles taken there (one widening a vector of bytes, not one a nibble).
    const uint8_t* qs = b + (QT == 1 ? 4 : 2);
    constexpr int kGroups = 16 / V::kLanes;  // byte groups of one vector each
    for (int g = 0; g < kGroups; ++g) {
      const typename V::I v = V::widen_u8(qs + g * V::kLanes);
      typename V::I lo = V::and15(v), hi = V::shr4(v);
      if constexpr (QT == 0) lo = V::sub8(lo), hi = V::sub8(hi);
      q[g] = V::to_float(lo);
      q[half + g] = V::to_float(hi);
    }
  }
}

// x's block sum (Q4_1's min term)
template <typename V>
inline float block_sum(const float* x) {
  typename V::T s = V::load(x);
  for (int v = 1; v < kBlock / V::kLanes; ++v) s = V::add(s, V::load(x + v * V::kLanes));
  return V::sum(s);
}

// rows [n, n + RN) of y for x rows [t0, t0 + TT): RN output rows at once give the decode steps
// (TT = 1) independent chains to overlap. Per block, d * (sum of q x) + m * (sum of x): xs holds
// x's block sums (Q4_1's min term; unused otherwise).
template <typename V, int QT, int TT, int RN>
inline void rows(const float* x, const float* xs, int64_t K, const uint8_t* w, int64_t rb, float* y, int64_t N,
                 int64_t t0, int64_t n, const float* bias) {
  constexpr int kVecs = kBlock / V::kLanes;
  const int bb = block_bytes(QT);
  const int64_t nb = K / kBlock;
  typename V::T acc[RN][TT];
  float macc[RN][TT];
  for (int r = 0; r < RN; ++r)
    for (int t = 0; t < TT; ++t) acc[r][t] = V::zero(), macc[r][t] = 0.0f;
  // The rows PF groups ahead, a group's share of them each block: the hardware's prefetcher
  // follows one stream, and this loop walks RN rows side by side.
  const uint8_t* ahead = n + (kPrefetchGroups + 1) * RN <= N ? w + (n + kPrefetchGroups * RN) * rb : nullptr;
  for (int64_t j = 0; j < nb; ++j) {
    const float* xp = x + t0 * K + j * kBlock;
    if (ahead != nullptr)
      for (int o = 0; o < RN * bb; o += 64) _mm_prefetch(reinterpret_cast<const char*>(ahead + j * RN * bb + o), _MM_HINT_T0);
    for (int r = 0; r < RN; ++r) {
      const uint8_t* b = w + (n + r) * rb + j * bb;
      typename V::T q[kVecs];
      quants<V, QT>(b, q);
      const typename V::T d = V::set1(fp16_at(b));
      for (int t = 0; t < TT; ++t) {
        typename V::T s = V::mul(q[0], V::load(xp + t * K));
        for (int v = 1; v < kVecs; ++v) s = V::fma(q[v], V::load(xp + t * K + v * V::kLanes), s);
        acc[r][t] = V::fma(d, s, acc[r][t]);
      }
      if constexpr (QT == 1) {
        const float m = fp16_at(b + 2);
        for (int t = 0; t < TT; ++t) macc[r][t] += m * xs[(t0 + t) * nb + j];
      }
    }
  }
  for (int r = 0; r < RN; ++r)
    for (int t = 0; t < TT; ++t) {
      float s = V::sum(acc[r][t]) + macc[r][t];
      y[(t0 + t) * N + n + r] = bias ? s + bias[n + r] : s;
    }
}

#endif

template <int QT>
inline void decode(const uint8_t* b, float* out) {
  const float d = fp16_at(b);
  if constexpr (QT == 2) {
    const int8_t* q = reinterpret_cast<const int8_t*>(b + 2);
    for (int i = 0; i < kBlock; ++i) out[i] = d * static_cast<float>(q[i]);
  } else {
    const uint8_t* qs = b + (QT == 1 ? 4 : 2);
    const float m = QT == 1 ? fp16_at(b + 2) : 0.0f;
    for (int i = 0; i < kBlock / 2; ++i) {
      const float ql = static_cast<float>(qs[i] & 0x0F), qh = static_cast<float>(qs[i] >> 4);
      if constexpr (QT == 0) {
        out[i] = d * (ql - 8.0f);
        out[i + 16] = d * (qh - 8.0f);
      } else {
        out[i] = d * ql + m;
        out[i + 16] = d * qh + m;
      }
    }
  }
}

// rows [n0, n1) of y for x rows [t0, t0 + TT)
template <typename V, int QT, int TT>
void tile(const float* x, const float* xs, int64_t K, const uint8_t* w, int64_t rb, float* y, int64_t N,
          int64_t t0, int64_t n0, int64_t n1, const float* bias) {
  if constexpr (V::kLanes > 0) {
#if defined(GGUF_HAS_VEC16) || defined(GGUF_HAS_VEC8)
    constexpr int RN = TT == 1 ? 4 : TT <= 3 ? 2 : 1;
    int64_t n = n0;
    for (; n + RN <= n1; n += RN) rows<V, QT, TT, RN>(x, xs, K, w, rb, y, N, t0, n, bias);
    for (; n < n1; ++n) rows<V, QT, TT, 1>(x, xs, K, w, rb, y, N, t0, n, bias);
#endif
  } else {  // each block dequantized to exactly the reference's floats, then multiplied
    const int bb = block_bytes(QT);
    const int64_t nb = K / kBlock;
    for (int64_t n = n0; n < n1; ++n) {
      const uint8_t* row = w + n * rb;
      float acc[TT][kBlock] = {};
      for (int64_t j = 0; j < nb; ++j) {
        float wv[kBlock];
        decode<QT>(row + j * bb, wv);
        const float* xp = x + t0 * K + j * kBlock;
        for (int t = 0; t < TT; ++t)
          for (int i = 0; i < kBlock; ++i) acc[t][i] += wv[i] * xp[t * K + i];
      }
      for (int t = 0; t < TT; ++t) {
        float s = 0.0f;
        for (int i = 0; i < kBlock; ++i) s += acc[t][i];
        y[(t0 + t) * N + n] = bias ? s + bias[n] : s;
      }
    }
  }
}

// Every task of a GEMM of T rows of x by N rows of w: N split over the threads, and within a task T
// in tiles of kTile rows, then one tile of the rest; f(tile rows as std::integral_constant, t0, n0, n1).
template <typename F>
void for_tiles(int64_t T, int64_t N, F&& f) {
  static_assert(kTile == 8, "the rest's cases below are 1..7");
  // Enough rows per task to amortise the scheduling, few enough to give every thread work.
  const int64_t grain = std::max<int64_t>(4, std::min<int64_t>(64, N / (4 * at::get_num_threads() + 1)));
  at::parallel_for(0, N, grain, [&](int64_t n0, int64_t n1) {
    int64_t t0 = 0;
    for (; t0 + kTile <= T; t0 += kTile) f(std::integral_constant<int, kTile>{}, t0, n0, n1);
    switch (T - t0) {
      case 1: f(std::integral_constant<int, 1>{}, t0, n0, n1); break;
      case 2: f(std::integral_constant<int, 2>{}, t0, n0, n1); break;
      case 3: f(std::integral_constant<int, 3>{}, t0, n0, n1); break;
      case 4: f(std::integral_constant<int, 4>{}, t0, n0, n1); break;
      case 5: f(std::integral_constant<int, 5>{}, t0, n0, n1); break;
      case 6: f(std::integral_constant<int, 6>{}, t0, n0, n1); break;
      case 7: f(std::integral_constant<int, 7>{}, t0, n0, n1); break;
      default: break;
    }
  });
}

template <typename V, int QT>
void run(const float* x, int64_t T, int64_t K, const uint8_t* w, int64_t rb, float* y, int64_t N,
         const float* bias) {
  const int64_t nb = K / kBlock;
  std::vector<float> sums;  // x's block sums, [T, nb]: Q4_1's min term (the vector paths)
#if defined(GGUF_HAS_VEC16) || defined(GGUF_HAS_VEC8)
  if constexpr (QT == 1 && V::kLanes > 0) {
    sums.resize(T * nb);
    for (int64_t i = 0; i < T * nb; ++i) sums[i] = block_sum<V>(x + i * kBlock);
  }
#endif
  const float* xs = sums.data();
  for_tiles(T, N, [&](auto tt, int64_t t0, int64_t n0, int64_t n1) {
    tile<V, QT, decltype(tt)::value>(x, xs, K, w, rb, y, N, t0, n0, n1, bias);
  });
}

template <typename V>
void run_path(int64_t qtype, const float* x, int64_t T, int64_t K, const uint8_t* w, int64_t rb, float* y,
              int64_t N, const float* bias) {
  if (qtype == 0) run<V, 0>(x, T, K, w, rb, y, N, bias);
  else if (qtype == 1) run<V, 1>(x, T, K, w, rb, y, N, bias);
  else run<V, 2>(x, T, K, w, rb, y, N, bias);
}

// ---- int8 activations (gguf_linear_q8, opt-in) ------------------------------------------------------
// x's rows are quantized in blocks of 32 as Q8 (what llama.cpp does to its activations): d = amax / 127
// (float32, kept in float32), q = x * (1 / d) rounded to nearest even, int8; s = the block's sum of q.
// A block's products are then integers, summed exactly in int32: sum (q_w - 8) q_x for Q4_0, q_w q_x
// for Q8_0 (both as |w| times x with w's sign, AVX2's u8 x s8 multiply-add), sum q_w q_x for Q4_1 plus
// its min term m * d_x * s. y = sum over blocks of d_w * d_x * that (float32). This changes the result
// (x is rounded to 8 bits a block): kernels/gguf_reference.linear_q8 is its reference, equal up to the
// float32 summation order.

struct QuantizedRows {
  std::vector<int8_t> q;   // [T, K]
  std::vector<float> d;    // [T, K / 32]
  std::vector<int32_t> s;  // [T, K / 32]
};

void quantize_rows(const float* x, int64_t T, int64_t K, QuantizedRows& out) {
  const int64_t nb = K / kBlock;
  out.q.resize(T * K), out.d.resize(T * nb), out.s.resize(T * nb);
  for (int64_t i = 0; i < T * nb; ++i) {
    const float* xb = x + i * kBlock;
    float amax = 0.0f;
    for (int j = 0; j < kBlock; ++j) amax = std::max(amax, std::fabs(xb[j]));
    const float d = amax / 127.0f;
    const float id = d != 0.0f ? 1.0f / d : 0.0f;
    int32_t sum = 0;
    for (int j = 0; j < kBlock; ++j) {
      const int v = static_cast<int>(std::nearbyint(xb[j] * id));  // the default rounding: to nearest even
      out.q[i * kBlock + j] = static_cast<int8_t>(v);
      sum += v;
    }
    out.d[i] = d, out.s[i] = sum;
  }
}

#ifdef GGUF_HAS_VEC8  // AVX2 and FMA
#define GGUF_HAS_Q8_AVX2 1
// One weight block's 32 quants as bytes in order (Q4_0: q - 8 signed; Q4_1: q unsigned; Q8_0: signed)
template <int QT>
inline __m256i block_bytes_avx2(const uint8_t* b) {
  if constexpr (QT == 2) return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 2));
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + (QT == 1 ? 4 : 2)));
  __m256i q = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(raw, 4), raw), _mm256_set1_epi8(0x0F));
  if constexpr (QT == 0) q = _mm256_sub_epi8(q, _mm256_set1_epi8(8));
  return q;
}

// The block's products in 8 int32 lanes (their sum: the block's integer dot product)
template <int QT>
inline __m256i block_dot_avx2(__m256i w, __m256i x) {
  __m256i p16;
  if constexpr (QT == 1) p16 = _mm256_maddubs_epi16(w, x);  // w in 0..15: unsigned as it is
  else p16 = _mm256_maddubs_epi16(_mm256_sign_epi8(w, w), _mm256_sign_epi8(x, w));  // |w| x (x w's sign)
  return _mm256_madd_epi16(p16, _mm256_set1_epi16(1));
}

template <int QT, int TT, int RN>
inline void rows_q8(const QuantizedRows& xq, int64_t K, const uint8_t* w, int64_t rb, float* y, int64_t N,
                    int64_t t0, int64_t n, const float* bias) {
  const int bb = block_bytes(QT);
  const int64_t nb = K / kBlock;
  __m256 acc[RN][TT];
  float macc[RN][TT];
  for (int r = 0; r < RN; ++r)
    for (int t = 0; t < TT; ++t) acc[r][t] = _mm256_setzero_ps(), macc[r][t] = 0.0f;
  const uint8_t* ahead = n + (kPrefetchGroups + 1) * RN <= N ? w + (n + kPrefetchGroups * RN) * rb : nullptr;
  for (int64_t j = 0; j < nb; ++j) {
    if (ahead != nullptr)
      for (int o = 0; o < RN * bb; o += 64) _mm_prefetch(reinterpret_cast<const char*>(ahead + j * RN * bb + o), _MM_HINT_T0);
    const int8_t* xb = xq.q.data() + t0 * K + j * kBlock;  // x's rows' block j, K apart
    const float* dx = xq.d.data() + t0 * nb + j;            // their scales, nb apart
    for (int r = 0; r < RN; ++r) {
      const uint8_t* b = w + (n + r) * rb + j * bb;
      const __m256i wv = block_bytes_avx2<QT>(b);
      const float dw = fp16_at(b);
      for (int t = 0; t < TT; ++t) {  // x read from L1 each time: TT vectors held would spill at TT = 8
        const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xb + t * K));
        const __m256 p = _mm256_cvtepi32_ps(block_dot_avx2<QT>(wv, xv));
        acc[r][t] = _mm256_fmadd_ps(_mm256_set1_ps(dw * dx[t * nb]), p, acc[r][t]);
      }
      if constexpr (QT == 1) {
        const float m = fp16_at(b + 2);
        for (int t = 0; t < TT; ++t)
          macc[r][t] += m * dx[t * nb] * static_cast<float>(xq.s[(t0 + t) * nb + j]);
      }
    }
  }
  for (int r = 0; r < RN; ++r)
    for (int t = 0; t < TT; ++t) {
      const float s = Vec8::sum(acc[r][t]) + macc[r][t];
      y[(t0 + t) * N + n + r] = bias ? s + bias[n + r] : s;
    }
}
#endif

// One weight block's 32 quants as integers (Q4_0: q - 8), for the portable path
template <int QT>
inline void block_ints(const uint8_t* b, int32_t* q) {
  if constexpr (QT == 2) {
    for (int i = 0; i < kBlock; ++i) q[i] = reinterpret_cast<const int8_t*>(b + 2)[i];
  } else {
    const uint8_t* qs = b + (QT == 1 ? 4 : 2);
    for (int i = 0; i < kBlock / 2; ++i) {
      q[i] = (qs[i] & 0x0F) - (QT == 0 ? 8 : 0);
      q[i + 16] = (qs[i] >> 4) - (QT == 0 ? 8 : 0);
    }
  }
}

template <int QT, int TT>
void tile_q8(bool vector, const QuantizedRows& xq, int64_t K, const uint8_t* w, int64_t rb, float* y, int64_t N,
             int64_t t0, int64_t n0, int64_t n1, const float* bias) {
#ifdef GGUF_HAS_Q8_AVX2
  if (vector) {
    constexpr int RN = TT == 1 ? 4 : TT <= 3 ? 2 : 1;
    int64_t n = n0;
    for (; n + RN <= n1; n += RN) rows_q8<QT, TT, RN>(xq, K, w, rb, y, N, t0, n, bias);
    for (; n < n1; ++n) rows_q8<QT, TT, 1>(xq, K, w, rb, y, N, t0, n, bias);
    return;
  }
#endif
  const int bb = block_bytes(QT);
  const int64_t nb = K / kBlock;
  for (int64_t n = n0; n < n1; ++n) {
    float acc[TT] = {};
    for (int64_t j = 0; j < nb; ++j) {
      const uint8_t* b = w + n * rb + j * bb;
      int32_t q[kBlock];
      block_ints<QT>(b, q);
      const float dw = fp16_at(b);
      for (int t = 0; t < TT; ++t) {
        const int8_t* xb = xq.q.data() + (t0 + t) * K + j * kBlock;
        int32_t dot = 0;
        for (int i = 0; i < kBlock; ++i) dot += q[i] * xb[i];
        const float dx = xq.d[(t0 + t) * nb + j];
        acc[t] += dw * dx * static_cast<float>(dot);
        if constexpr (QT == 1) acc[t] += fp16_at(b + 2) * dx * static_cast<float>(xq.s[(t0 + t) * nb + j]);
      }
    }
    for (int t = 0; t < TT; ++t) y[(t0 + t) * N + n] = bias ? acc[t] + bias[n] : acc[t];
  }
}

template <int QT>
void run_q8(bool vector, const QuantizedRows& xq, int64_t T, int64_t K, const uint8_t* w, int64_t rb, float* y,
            int64_t N, const float* bias) {
  for_tiles(T, N, [&](auto tt, int64_t t0, int64_t n0, int64_t n1) {
    tile_q8<QT, decltype(tt)::value>(vector, xq, K, w, rb, y, N, t0, n0, n1, bias);
  });
}

constexpr const char* kQ8Paths[] = {
#ifdef GGUF_HAS_Q8_AVX2
    "avx2",
#endif
    Portable::kName};

// The paths compiled, widest first: the first serves; the others can be asked for by name.
constexpr const char* kPaths[] = {
#ifdef GGUF_HAS_VEC16
    Vec16::kName,
#endif
#ifdef GGUF_HAS_VEC8
    Vec8::kName,
#endif
    Portable::kName};

std::vector<std::string> paths() { return {std::begin(kPaths), std::end(kPaths)}; }

// One call's arguments checked: its sizes, the bias's data (or null) and the output y [T, N]
struct Call {
  const float* bias;
  int64_t T, K, N, rb;
  at::Tensor y;
};

// The bias's data (or null), checked against w's N rows
const float* check_bias(const char* where, const at::Tensor& w, const c10::optional<at::Tensor>& bias) {
  if (!bias.has_value() || !bias->defined()) return nullptr;
  TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == w.size(0),
              where, ": bias must be a contiguous float32 [N]");
  return bias->data_ptr<float>();
}

// x [T, K] float32 and w [N, row bytes] checked against each other
Call check_args(const char* where, const at::Tensor& x, const at::Tensor& w, int64_t qtype,
                const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(qtype >= 0 && qtype <= 2, where, ": qtype must be 0 (Q4_0), 1 (Q4_1) or 2 (Q8_0)");
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.dim() == 2 && x.is_contiguous(),
              where, ": x must be a contiguous float32 CPU tensor [T, K]");
  TORCH_CHECK(w.device().is_cpu() && w.scalar_type() == at::kByte && w.dim() == 2 && w.is_contiguous(),
              where, ": w must be a contiguous uint8 CPU tensor [N, row bytes]");
  const int64_t K = x.size(1), rb = w.size(1);
  TORCH_CHECK(K % kBlock == 0 && rb == K / kBlock * block_bytes(qtype), where, ": w's rows are ", rb,
              " bytes, not the ", K / kBlock * block_bytes(qtype), " of ", K, " weights");
  return {check_bias(where, w, bias), x.size(0), K, w.size(0), rb, at::empty({x.size(0), w.size(0)}, x.options())};
}


at::Tensor gguf_linear(at::Tensor x, at::Tensor w, int64_t qtype, c10::optional<at::Tensor> bias,
                       const std::string& path) {
  const auto [b, T, K, N, rb, y] = check_args("gguf_linear", x, w, qtype, bias);
  if (T == 0 || N == 0) return y;
  const float* xp = x.data_ptr<float>();
  const uint8_t* wp = w.data_ptr<uint8_t>();
  float* yp = y.data_ptr<float>();
  const char* chosen = path.empty() ? kPaths[0] : path.c_str();
#ifdef GGUF_HAS_VEC16
  if (std::strcmp(chosen, Vec16::kName) == 0) return run_path<Vec16>(qtype, xp, T, K, wp, rb, yp, N, b), y;
#endif
#ifdef GGUF_HAS_VEC8
  if (std::strcmp(chosen, Vec8::kName) == 0) return run_path<Vec8>(qtype, xp, T, K, wp, rb, yp, N, b), y;
#endif
  TORCH_CHECK(std::strcmp(chosen, Portable::kName) == 0, "gguf_linear: no path ", chosen, " here (compiled: ",
              kPaths[0], ")");
  run_path<Portable>(qtype, xp, T, K, wp, rb, yp, N, b);
  return y;
}

at::Tensor gguf_linear_q8(at::Tensor x, at::Tensor w, int64_t qtype, c10::optional<at::Tensor> bias,
                          const std::string& path) {
  const auto [b, T, K, N, rb, y] = check_args("gguf_linear_q8", x, w, qtype, bias);
  if (T == 0 || N == 0) return y;
  const char* chosen = path.empty() ? kQ8Paths[0] : path.c_str();
  const bool vector = std::strcmp(chosen, Portable::kName) != 0;
  TORCH_CHECK(!vector || std::strcmp(chosen, kQ8Paths[0]) == 0, "gguf_linear_q8: no path ", chosen,
              " here (compiled: ", kQ8Paths[0], ")");
  QuantizedRows xq;
  quantize_rows(x.data_ptr<float>(), T, K, xq);
  const uint8_t* wp = w.data_ptr<uint8_t>();
  float* yp = y.data_ptr<float>();
  if (qtype == 0) run_q8<0>(vector, xq, T, K, wp, rb, yp, N, b);
  else if (qtype == 1) run_q8<1>(vector, xq, T, K, wp, rb, yp, N, b);
  else run_q8<2>(vector, xq, T, K, wp, rb, yp, N, b);
  return y;
}

// x's Q8 blocks, as gguf_linear_q8 takes them: (q int8 [T, K], d float32 [T, K / 32])
std::tuple<at::Tensor, at::Tensor> quantize_q8(at::Tensor x) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.dim() == 2 && x.is_contiguous() &&
              x.size(1) % kBlock == 0, "quantize_q8: x must be a contiguous float32 CPU tensor [T, K], K % 32 == 0");
  QuantizedRows xq;
  quantize_rows(x.data_ptr<float>(), x.size(0), x.size(1), xq);
  auto q = at::empty({x.size(0), x.size(1)}, x.options().dtype(at::kChar));
  auto d = at::empty({x.size(0), x.size(1) / kBlock}, x.options());
  std::memcpy(q.data_ptr<int8_t>(), xq.q.data(), xq.q.size());
  std::memcpy(d.data_ptr<float>(), xq.d.data(), xq.d.size() * sizeof(float));
  return {q, d};
}

std::vector<std::string> q8_paths() { return {std::begin(kQ8Paths), std::end(kQ8Paths)}; }

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("gguf_linear", &gguf_linear, "y = x W^T, W in GGUF Q4_0 / Q4_1 / Q8_0 blocks (float32 activations)",
        pybind11::arg("x"), pybind11::arg("w"), pybind11::arg("qtype"), pybind11::arg("bias") = pybind11::none(),
        pybind11::arg("path") = "");
  m.def("gguf_linear_q8", &gguf_linear_q8, "y = x W^T with x quantized to Q8 blocks (int8 products, int32 sums)",
        pybind11::arg("x"), pybind11::arg("w"), pybind11::arg("qtype"), pybind11::arg("bias") = pybind11::none(),
        pybind11::arg("path") = "");
  m.def("quantize_q8", &quantize_q8, "x's Q8 blocks as gguf_linear_q8 takes them: (q int8 [T, K], d [T, K / 32])");
  m.def("q8_paths", &q8_paths, "gguf_linear_q8's paths compiled (avx2, portable): path= picks one");
  m.def("paths", &paths, "the paths compiled, widest first (avx512, avx2 with FMA, portable): path= picks one");
}
