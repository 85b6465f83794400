// y = x W^T on the CPU with W in GGUF (ggml) blocks, read packed: kernels/cpu_gemm.py loads it,
// kernels/gguf_reference.py is its reference (and documents the block layouts).
//
//   gguf_linear(x float32 [T, K], w uint8 [N, K / 32 * block_bytes], qtype, bias float32 [N] or None)
//     -> float32 [T, N];  qtype 0 = Q4_0, 1 = Q4_1, 2 = Q8_0
//
// Activations stay float32: each 32-weight block is dequantized in registers (w = d * (q - 8),
// d * q + m, d * q: a float32 product, then a float32 sum; built with -ffp-contract=off so that
// no multiply-add is fused) into exactly the floats the reference's dequantize gives, and
// multiplied with x in float32. Only the order of the sums differs from the reference's matmul.
//
// Work: output rows are split over threads (at::parallel_for); x's rows are taken in tiles of
// up to kTile (8) rows, and every weight block is decoded once per tile and used for all its rows
// (decode steps are one tile; a prefill of T rows decodes each block ceil(T / 8) times, from L1).
// AVX-512 where the compiler targets it (-march=native on an AVX-512 machine), else portable C++
// that the compiler vectorises as it can.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <c10/util/Half.h>

#include <cstdint>
#include <cstring>

#ifdef __AVX512F__
#include <immintrin.h>
#endif

namespace {

constexpr int kBlock = 32;
constexpr int kTile = 8;

inline int block_bytes(int64_t qtype) { return qtype == 0 ? 18 : qtype == 1 ? 20 : 34; }

inline float fp16_at(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, 2);
  return c10::detail::fp16_ieee_to_fp32_value(bits);
}

#ifdef __AVX512F__

// One block -> its 32 weights in two vectors (weights 0..15, 16..31).
template <int QT>
inline void decode(const uint8_t* b, __m512& lo, __m512& hi) {
  const __m512 d = _mm512_set1_ps(fp16_at(b));
  if constexpr (QT == 2) {
    const __m128i q0 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 2));
    const __m128i q1 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 18));
    lo = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q0)));
    hi = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q1)));
  } else {
    const __m128i qs = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + (QT == 1 ? 4 : 2)));
    const __m128i mask = _mm_set1_epi8(0x0F);
    const __m512 ql = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(qs, mask)));
    const __m512 qh = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(qs, 4), mask)));
    if constexpr (QT == 0) {
      const __m512 eight = _mm512_set1_ps(8.0f);
      lo = _mm512_mul_ps(d, _mm512_sub_ps(ql, eight));
      hi = _mm512_mul_ps(d, _mm512_sub_ps(qh, eight));
    } else {
      const __m512 m = _mm512_set1_ps(fp16_at(b + 2));
      lo = _mm512_add_ps(_mm512_mul_ps(d, ql), m);
      hi = _mm512_add_ps(_mm512_mul_ps(d, qh), m);
    }
  }
}

// rows [n, n + RN) of y for x rows [t0, t0 + TT): RN output rows at once give the decode steps
// (TT = 1) independent chains to overlap
template <int QT, int TT, int RN>
inline void rows(const float* x, int64_t K, const uint8_t* w, int64_t rb, float* y, int64_t N, int64_t t0,
                 int64_t n, const float* bias) {
  const int bb = block_bytes(QT);
  const int64_t nb = K / kBlock;
  __m512 acc0[RN][TT], acc1[RN][TT];
  for (int r = 0; r < RN; ++r)
    for (int t = 0; t < TT; ++t) acc0[r][t] = acc1[r][t] = _mm512_setzero_ps();
  for (int64_t j = 0; j < nb; ++j) {
    const float* xp = x + t0 * K + j * kBlock;
    for (int r = 0; r < RN; ++r) {
      __m512 lo, hi;
      decode<QT>(w + (n + r) * rb + j * bb, lo, hi);
      for (int t = 0; t < TT; ++t) {
        acc0[r][t] = _mm512_fmadd_ps(lo, _mm512_loadu_ps(xp + t * K), acc0[r][t]);
        acc1[r][t] = _mm512_fmadd_ps(hi, _mm512_loadu_ps(xp + t * K + 16), acc1[r][t]);
      }
    }
  }
  for (int r = 0; r < RN; ++r)
    for (int t = 0; t < TT; ++t) {
      float s = _mm512_reduce_add_ps(_mm512_add_ps(acc0[r][t], acc1[r][t]));
      y[(t0 + t) * N + n + r] = bias ? s + bias[n + r] : s;
    }
}

// rows [n0, n1) of y for x rows [t0, t0 + TT)
template <int QT, int TT>
void tile(const float* x, int64_t K, const uint8_t* w, int64_t rb, float* y, int64_t N, int64_t t0, int64_t n0,
          int64_t n1, const float* bias) {
  constexpr int RN = TT == 1 ? 4 : TT <= 3 ? 2 : 1;
  int64_t n = n0;
  for (; n + RN <= n1; n += RN) rows<QT, TT, RN>(x, K, w, rb, y, N, t0, n, bias);
  for (; n < n1; ++n) rows<QT, TT, 1>(x, K, w, rb, y, N, t0, n, bias);
}

#else  // portable

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

template <int QT, int TT>
void tile(const float* x, int64_t K, const uint8_t* w, int64_t rb, float* y, int64_t N, int64_t t0, int64_t n0,
          int64_t n1, const float* bias) {
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

#endif

template <int QT>
void run(const float* x, int64_t T, int64_t K, const uint8_t* w, int64_t rb, float* y, int64_t N,
         const float* bias) {
  // Enough rows per task to amortise the scheduling, few enough to give every thread work.
  const int64_t grain = std::max<int64_t>(4, std::min<int64_t>(64, N / (4 * at::get_num_threads() + 1)));
  at::parallel_for(0, N, grain, [&](int64_t n0, int64_t n1) {
    int64_t t0 = 0;
    for (; t0 + kTile <= T; t0 += kTile) tile<QT, kTile>(x, K, w, rb, y, N, t0, n0, n1, bias);
    switch (T - t0) {
      case 1: tile<QT, 1>(x, K, w, rb, y, N, t0, n0, n1, bias); break;
      case 2: tile<QT, 2>(x, K, w, rb, y, N, t0, n0, n1, bias); break;
      case 3: tile<QT, 3>(x, K, w, rb, y, N, t0, n0, n1, bias); break;
      case 4: tile<QT, 4>(x, K, w, rb, y, N, t0, n0, n1, bias); break;
      case 5: tile<QT, 5>(x, K, w, rb, y, N, t0, n0, n1, bias); break;
      case 6: tile<QT, 6>(x, K, w, rb, y, N, t0, n0, n1, bias); break;
      case 7: tile<QT, 7>(x, K, w, rb, y, N, t0, n0, n1, bias); break;
      default: break;
    }
  });
}

torch::Tensor gguf_linear(torch::Tensor x, torch::Tensor w, int64_t qtype, c10::optional<torch::Tensor> bias) {
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
  if (qtype == 0) run<0>(xp, T, K, wp, rb, yp, N, b);
  else if (qtype == 1) run<1>(xp, T, K, wp, rb, yp, N, b);
  else run<2>(xp, T, K, wp, rb, yp, N, b);
  return y;
}

bool avx512() {
#ifdef __AVX512F__
  return true;
#else
  return false;
#endif
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("gguf_linear", &gguf_linear, "y = x W^T, W in GGUF Q4_0 / Q4_1 / Q8_0 blocks (float32 activations)");
  m.def("avx512", &avx512, "whether the AVX-512 path was compiled");
}
