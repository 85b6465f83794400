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
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <c10/util/Half.h>

#include <cstdint>
#include <cstring>
#include <iterator>
#include <string>
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
  // Enough rows per task to amortise the scheduling, few enough to give every thread work.
  const int64_t grain = std::max<int64_t>(4, std::min<int64_t>(64, N / (4 * at::get_num_threads() + 1)));
  at::parallel_for(0, N, grain, [&](int64_t n0, int64_t n1) {
    int64_t t0 = 0;
    for (; t0 + kTile <= T; t0 += kTile) tile<V, QT, kTile>(x, xs, K, w, rb, y, N, t0, n0, n1, bias);
    switch (T - t0) {
      case 1: tile<V, QT, 1>(x, xs, K, w, rb, y, N, t0, n0, n1, bias); break;
      case 2: tile<V, QT, 2>(x, xs, K, w, rb, y, N, t0, n0, n1, bias); break;
      case 3: tile<V, QT, 3>(x, xs, K, w, rb, y, N, t0, n0, n1, bias); break;
      case 4: tile<V, QT, 4>(x, xs, K, w, rb, y, N, t0, n0, n1, bias); break;
      case 5: tile<V, QT, 5>(x, xs, K, w, rb, y, N, t0, n0, n1, bias); break;
      case 6: tile<V, QT, 6>(x, xs, K, w, rb, y, N, t0, n0, n1, bias); break;
      case 7: tile<V, QT, 7>(x, xs, K, w, rb, y, N, t0, n0, n1, bias); break;
      default: break;
    }
  });
}

template <typename V>
void run_path(int64_t qtype, const float* x, int64_t T, int64_t K, const uint8_t* w, int64_t rb, float* y,
              int64_t N, const float* bias) {
  if (qtype == 0) run<V, 0>(x, T, K, w, rb, y, N, bias);
  else if (qtype == 1) run<V, 1>(x, T, K, w, rb, y, N, bias);
  else run<V, 2>(x, T, K, w, rb, y, N, bias);
}

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

torch::Tensor gguf_linear(torch::Tensor x, torch::Tensor w, int64_t qtype, c10::optional<torch::Tensor> bias,
                          const std::string& path) {
  TORCH_CHECK(qtype >= 0 && qtype <= 2, "gguf_linear: qtype must be 0 (Q4_0), 1 (Q4_1) or 2 (Q8_0)");
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.dim() == 2 && x.is_contiguous(),
              "gguf_linear: x must be a contiguous float32 CPU tensor [T, K]");
  TORCH_CHECK(w.device().is_cpu() && w.scalar_type() == at::kByte && w.dim() == 2 && w.is_contiguous(),
              "gguf_linear: w must be a contiguous uint8 CPU tensor [N, row bytes]");
  const int64_t T = x.size(0), K = x.size(1), N = w.size(0), rb = w.size(1);
  TORCH_CHECK(K % kBlock == 0 && rb == K / kBlock * block_bytes(qtype),
              "gguf_linear: w's rows are ", rb, " bytes, not the ", K / kBlock * block_bytes(qtype), " of ", K,
              " weights");
  const float* b = nullptr;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == N,
                "gguf_linear: bias must be a contiguous float32 [N]");
    b = bias->data_ptr<float>();
  }
  auto y = torch::empty({T, N}, x.options());
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

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("gguf_linear", &gguf_linear, "y = x W^T, W in GGUF Q4_0 / Q4_1 / Q8_0 blocks (float32 activations)",
        pybind11::arg("x"), pybind11::arg("w"), pybind11::arg("qtype"), pybind11::arg("bias") = pybind11::none(),
        pybind11::arg("path") = "");
  m.def("paths", &paths, "the paths compiled, widest first (avx512, avx2 with FMA, portable): path= picks one");
}
