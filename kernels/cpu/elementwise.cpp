// The per-layer elementwise glue of a CPU step, one call each: RMSNorm (with the residual add), the
// neox-style rotary embedding and SiLU-and-mul. kernels/cpu_ops.py calls them; the references are
// kernels/reference.py's rms_norm, fused_add_rms_norm, rotary_embedding and silu_and_mul, and each function here
// rounds where its reference does (a float32 product or sum, a cast to the model dtype), so only
// the order of a row's sum of squares differs (the rotary embedding is bit-exact). Built into
// the compiled CPU attention's extension (kernels/cpu_attention.py) and registered as
// torch.ops.pdserve_cpu.*.
//
//   rms_norm(x [T, H], w [H], eps) -> [T, H]                          w * (x * rsqrt(mean(x^2) + eps))
//   fused_add_rms_norm(x, residual, w, eps) -> (rms_norm(x + residual), x + residual)
//   rotary_embedding(positions [T], q [T, Hq, D], k [T, Hk, D], cos_sin [P, D] float32) -> (q', k')
//   rotary_qkv(positions, qkv [T, (Hq + 2 Hk) D], cos_sin, Hq, Hk) -> (q', k', v: a view of qkv)
//   silu_and_mul(x [T, 2I]) -> silu(x[:, :I]) * x[:, I:]            ATen's kernels: bit-exact
//
// x, q, k: float32, float64, float16 or bfloat16, the last dim contiguous (any other strides); w in
// x's dtype; positions int32 or int64; outputs are new contiguous tensors. Anything else raises. Rows are split over threads (at::parallel_for).
// ATen and the op registry; not torch/extension.h (all of libtorch's C++ API and the Python
// bindings), whose headers alone took three times as long to compile.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>
#include <tuple>
#include <vector>

// The references round every product before a sum: no fused multiply-add here (GCC contracts
// across statements by default, clang within an expression).
#pragma GCC optimize("fp-contract=off")
#pragma STDC FP_CONTRACT OFF

namespace {

constexpr int64_t kGrainElems = 1 << 14;  // about this many elements a thread at least

int64_t grain(int64_t per_row) { return std::max<int64_t>(1, kGrainElems / std::max<int64_t>(1, per_row)); }

template <typename T>
inline T round_to(float v) { return static_cast<T>(v); }

// One row: out = w * T(x * r), r = 1 / sqrt(mean(x^2) + eps) in float32.
template <typename T>
inline void norm_row(const T* x, const T* w, T* out, int64_t h, float eps) {
  float sum = 0.f;
  for (int64_t i = 0; i < h; ++i) {
    const float v = static_cast<float>(x[i]);
    sum += v * v;
  }
  const float r = 1.f / std::sqrt(sum / static_cast<float>(h) + eps);
  for (int64_t i = 0; i < h; ++i) {
    const T n = round_to<T>(static_cast<float>(x[i]) * r);
    out[i] = round_to<T>(static_cast<float>(w[i]) * static_cast<float>(n));
  }
}

void check_rows(const at::Tensor& x, const char* name) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 && x.stride(1) == 1, name,
              " must be a CPU [T, H] tensor with its last dim contiguous");
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w, double eps) {
  check_rows(x, "x");
  TORCH_CHECK(w.dtype() == x.dtype() && w.dim() == 1 && w.size(0) == x.size(1) && w.is_contiguous(),
              "w must be a contiguous [H] tensor in x's dtype");
  auto out = at::empty(x.sizes(), x.options());
  const int64_t t = x.size(0), h = x.size(1);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "rms_norm", [&] {
    const scalar_t* xp = x.data_ptr<scalar_t>();
    const scalar_t* wp = w.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    const int64_t sx = x.stride(0);
    at::parallel_for(0, t, grain(h), [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) norm_row(xp + r * sx, wp, op + r * h, h, static_cast<float>(eps));
    });
  });
  return out;
}

std::tuple<at::Tensor, at::Tensor> fused_add_rms_norm(const at::Tensor& x, const at::Tensor& residual,
                                                      const at::Tensor& w, double eps) {
  check_rows(x, "x");
  check_rows(residual, "residual");
  TORCH_CHECK(residual.dtype() == x.dtype() && residual.sizes() == x.sizes(), "residual must match x");
  TORCH_CHECK(w.dtype() == x.dtype() && w.dim() == 1 && w.size(0) == x.size(1) && w.is_contiguous(),
              "w must be a contiguous [H] tensor in x's dtype");
  auto out = at::empty(x.sizes(), x.options());
  auto sum = at::empty(x.sizes(), x.options());
  const int64_t t = x.size(0), h = x.size(1);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "fused_add_rms_norm", [&] {
    const scalar_t* xp = x.data_ptr<scalar_t>();
    const scalar_t* rp = residual.data_ptr<scalar_t>();
    const scalar_t* wp = w.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    scalar_t* sp = sum.data_ptr<scalar_t>();
    const int64_t sx = x.stride(0), sr = residual.stride(0);
    at::parallel_for(0, t, grain(h), [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        scalar_t* s = sp + r * h;
        for (int64_t i = 0; i < h; ++i)
          s[i] = round_to<scalar_t>(static_cast<float>(xp[r * sx + i]) + static_cast<float>(rp[r * sr + i]));
        norm_row(s, wp, op + r * h, h, static_cast<float>(eps));
      }
    });
  });
  return {out, sum};
}

// One head: out[:half] = x1 c - x2 s, out[half:] = x2 c + x1 s, each product and sum rounded to T,
// with c and s the table's float32 cos and sin rounded to T.
template <typename T>
inline void rotate_head(const T* x, const T* c, const T* s, T* out, int64_t half) {
  for (int64_t i = 0; i < half; ++i) {
    const float x1 = static_cast<float>(x[i]), x2 = static_cast<float>(x[i + half]);
    const float ci = static_cast<float>(c[i]), si = static_cast<float>(s[i]);
    const float a = static_cast<float>(round_to<T>(x1 * ci)), b = static_cast<float>(round_to<T>(x2 * si));
    out[i] = round_to<T>(a - b);
    const float e = static_cast<float>(round_to<T>(x2 * ci)), f = static_cast<float>(round_to<T>(x1 * si));
    out[i + half] = round_to<T>(e + f);
  }
}

at::Tensor rotate(const at::Tensor& positions, const at::Tensor& x, const at::Tensor& cos_sin) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 3 && x.stride(2) == 1, "q and k must be CPU [T, H, D] tensors "
              "with their last dim contiguous");
  const int64_t t = x.size(0), heads = x.size(1), d = x.size(2), half = d / 2;
  TORCH_CHECK(cos_sin.size(1) == d && d % 2 == 0, "the cos/sin table's width must equal the head dim");
  auto out = at::empty(x.sizes(), x.options());
  const int64_t* pos = positions.data_ptr<int64_t>();
  const float* table = cos_sin.data_ptr<float>();
  const int64_t max_pos = cos_sin.size(0);
  for (int64_t r = 0; r < t; ++r)
    TORCH_CHECK(pos[r] >= 0 && pos[r] < max_pos, "position ", pos[r], " is outside the table's ", max_pos);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "rotary_embedding", [&] {
    const scalar_t* xp = x.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    const int64_t s0 = x.stride(0), s1 = x.stride(1);
    at::parallel_for(0, t, grain(heads * d), [&](int64_t begin, int64_t end) {
      std::vector<scalar_t> cs(d);
      for (int64_t r = begin; r < end; ++r) {
        const float* row = table + pos[r] * d;
        for (int64_t i = 0; i < d; ++i) cs[i] = round_to<scalar_t>(row[i]);
        for (int64_t h = 0; h < heads; ++h)
          rotate_head(xp + r * s0 + h * s1, cs.data(), cs.data() + half, op + (r * heads + h) * d, half);
      }
    });
  });
  return out;
}

std::tuple<at::Tensor, at::Tensor> rotary_embedding(const at::Tensor& positions, const at::Tensor& q,
                                                    const at::Tensor& k, const at::Tensor& cos_sin) {
  TORCH_CHECK(positions.device().is_cpu() && positions.dim() == 1 && positions.size(0) == q.size(0) &&
              k.size(0) == q.size(0), "positions must be a CPU [T] tensor, T = q's and k's rows");
  TORCH_CHECK(cos_sin.device().is_cpu() && cos_sin.dtype() == at::kFloat && cos_sin.dim() == 2,
              "the cos/sin table must be a CPU float32 [P, D]");
  const at::Tensor pos = positions.to(at::kLong).contiguous();
  const at::Tensor table = cos_sin.contiguous();
  return {rotate(pos, q, table), rotate(pos, k, table)};
}

// The qkv projection's output [T, (Hq + 2 Hk) D]: q and k rotated as rotary_embedding rotates them
// (new tensors), v its part of the row as a view [T, Hk, D]; one call where a split, three reshapes
// and rotary_embedding were five.
std::tuple<at::Tensor, at::Tensor, at::Tensor> rotary_qkv(const at::Tensor& positions, const at::Tensor& qkv,
                                                          const at::Tensor& cos_sin, int64_t q_heads,
                                                          int64_t kv_heads) {
  TORCH_CHECK(qkv.device().is_cpu() && qkv.dim() == 2 && qkv.stride(1) == 1, "qkv must be a CPU [T, (Hq + 2 Hk) D] "
              "tensor with its last dim contiguous");
  const int64_t t = qkv.size(0), heads = q_heads + 2 * kv_heads;
  TORCH_CHECK(q_heads > 0 && kv_heads > 0 && qkv.size(1) % heads == 0, "qkv's row of ", qkv.size(1),
              " is not (", q_heads, " + 2 x ", kv_heads, ") heads");
  const int64_t d = qkv.size(1) / heads, s0 = qkv.stride(0);
  const at::Tensor q = qkv.as_strided({t, q_heads, d}, {s0, d, 1});
  const at::Tensor k = qkv.as_strided({t, kv_heads, d}, {s0, d, 1}, qkv.storage_offset() + q_heads * d);
  const at::Tensor v = qkv.as_strided({t, kv_heads, d}, {s0, d, 1}, qkv.storage_offset() + (q_heads + kv_heads) * d);
  auto [q2, k2] = rotary_embedding(positions, q, k, cos_sin);
  return {q2, k2, v};
}

// silu(x[:, :I]) * x[:, I:] for x [T, 2I]: ATen's own silu and multiply, as the reference calls them
// (the same kernels, so the same bits), in one call where the reference's two slices and two ops
// were four crossings of the Python binding.
at::Tensor silu_and_mul(const at::Tensor& x) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() >= 1 && x.size(-1) % 2 == 0,
              "x must be a CPU [..., 2I] tensor");
  const int64_t inter = x.size(-1) / 2;
  at::Tensor out = at::silu(x.narrow(-1, 0, inter));
  out.mul_(x.narrow(-1, inter, inter));
  return out;
}

}  // namespace

TORCH_LIBRARY(pdserve_cpu, m) {
  m.def("rms_norm(Tensor x, Tensor w, float eps) -> Tensor", &rms_norm);
  m.def("fused_add_rms_norm(Tensor x, Tensor residual, Tensor w, float eps) -> (Tensor, Tensor)",
        &fused_add_rms_norm);
  m.def("rotary_embedding(Tensor positions, Tensor q, Tensor k, Tensor cos_sin) -> (Tensor, Tensor)",
        &rotary_embedding);
  m.def("rotary_qkv(Tensor positions, Tensor qkv, Tensor cos_sin, int q_heads, int kv_heads) -> "
        "(Tensor, Tensor, Tensor)", &rotary_qkv);
  m.def("silu_and_mul(Tensor x) -> Tensor", &silu_and_mul);
}
