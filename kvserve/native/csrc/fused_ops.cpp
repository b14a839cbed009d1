// Fused small ops of a Llama decoder step (kvserve/native/fused.py is the Python side).
//
// Each op computes exactly what its torch reference in fused.py computes, rounding to the model
// dtype at the same points (every intermediate a torch op would store in bf16/fp16 is rounded
// here too); only float sums (the RMS) may add in another order. One call replaces 4-9 torch
// ops (and their allocations and dispatch) per use. Rows run in parallel through at::parallel_for
// with a grain that keeps a decode step's few rows on the calling thread.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <cmath>

namespace {

template <typename T> inline float f(T v) { return static_cast<float>(v); }
// Round a float to T's precision and back (identity for float).
template <typename T> inline float rnd(float v) { return static_cast<float>(static_cast<T>(v)); }

constexpr int64_t kRowGrain = 16;

template <typename T>
void rms_rows(const T* x, const T* w, T* out, T* sum_out, const T* res, int64_t rows, int64_t n,
              int64_t x_stride, float eps) {
  at::parallel_for(0, rows, kRowGrain, [&](int64_t r0, int64_t r1) {
    std::vector<float> h(n);
    for (int64_t r = r0; r < r1; ++r) {
      const T* xr = x + r * x_stride;
      float ss = 0.f;
      if (res != nullptr) {
        const T* rr = res + r * n;
        T* sr = sum_out + r * n;
        for (int64_t i = 0; i < n; ++i) {
          T s = static_cast<T>(f(xr[i]) + f(rr[i]));
          sr[i] = s;
          h[i] = f(s);
        }
      } else {
        for (int64_t i = 0; i < n; ++i) h[i] = f(xr[i]);
      }
      for (int64_t i = 0; i < n; ++i) ss += h[i] * h[i];
      const float inv = 1.0f / std::sqrt(ss / static_cast<float>(n) + eps);
      T* orow = out + r * n;
      for (int64_t i = 0; i < n; ++i) orow[i] = static_cast<T>(f(w[i]) * rnd<T>(h[i] * inv));
    }
  });
}

void check_rows(const at::Tensor& x, const at::Tensor& w) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "expected [rows, n] with a contiguous last dim");
  TORCH_CHECK(w.dim() == 1 && w.is_contiguous() && w.size(0) == x.size(1) && w.scalar_type() == x.scalar_type(),
              "weight must be [n] contiguous in x's dtype");
}

// weight * rms_norm(x.float()).to(dtype), x [rows, n].
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w, double eps) {
  check_rows(x, w);
  auto out = at::empty({x.size(0), x.size(1)}, x.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rms_norm", [&] {
    rms_rows<scalar_t>(x.data_ptr<scalar_t>(), w.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(), nullptr, nullptr,
                       x.size(0), x.size(1), x.stride(0), static_cast<float>(eps));
  });
  return out;
}

// (weight * rms_norm((x + residual).float()).to(dtype), x + residual), both [rows, n].
std::vector<at::Tensor> add_rms_norm(const at::Tensor& x, const at::Tensor& residual, const at::Tensor& w, double eps) {
  check_rows(x, w);
  TORCH_CHECK(residual.is_contiguous() && residual.sizes() == x.sizes() && residual.scalar_type() == x.scalar_type(),
              "residual must be contiguous, x's shape and dtype");
  auto out = at::empty({x.size(0), x.size(1)}, x.options());
  auto sum = at::empty({x.size(0), x.size(1)}, x.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "add_rms_norm", [&] {
    rms_rows<scalar_t>(x.data_ptr<scalar_t>(), w.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(),
                       sum.data_ptr<scalar_t>(), residual.data_ptr<scalar_t>(), x.size(0), x.size(1), x.stride(0),
                       static_cast<float>(eps));
  });
  return {out, sum};
}

// x * cos + rotate_half(x) * sin, x [T, heads, d] (last dim contiguous), cos/sin [T, d].
at::Tensor rotary(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1, "x must be [T, heads, d] with a contiguous last dim");
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.dim() == 2 && cos.size(0) == x.size(0) &&
              cos.size(1) == x.size(2) && sin.sizes() == cos.sizes() && cos.scalar_type() == x.scalar_type() &&
              sin.scalar_type() == x.scalar_type(), "cos/sin must be [T, d] contiguous in x's dtype");
  const int64_t t = x.size(0), heads = x.size(1), d = x.size(2), half = d / 2;
  TORCH_CHECK(d % 2 == 0, "head_dim must be even");
  auto out = at::empty({t, heads, d}, x.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rotary", [&] {
    using T = scalar_t;
    const T* xp = x.data_ptr<T>();
    const T* cp = cos.data_ptr<T>();
    const T* sp = sin.data_ptr<T>();
    T* op = out.data_ptr<T>();
    const int64_t s0 = x.stride(0), s1 = x.stride(1);
    at::parallel_for(0, t * heads, kRowGrain * 4, [&](int64_t b, int64_t e) {
      for (int64_t k = b; k < e; ++k) {
        const int64_t i = k / heads, h = k % heads;
        const T* xr = xp + i * s0 + h * s1;
        const T* c = cp + i * d;
        const T* s = sp + i * d;
        T* o = op + k * d;
        for (int64_t j = 0; j < d; ++j) {
          const float rot = j < half ? -f(xr[j + half]) : f(xr[j - half]);
          o[j] = static_cast<T>(rnd<T>(f(xr[j]) * f(c[j])) + rnd<T>(rot * f(s[j])));
        }
      }
    });
  });
  return out;
}

template <typename In, typename R, typename Out>
void silu_mul_rows(const In* gu, Out* out, int64_t rows, int64_t width, int64_t stride) {
  at::parallel_for(0, rows, kRowGrain, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const In* g = gu + r * stride;
      const In* u = g + width;
      Out* o = out + r * width;
      for (int64_t j = 0; j < width; ++j) {
        const float gv = rnd<R>(f(g[j]));
        const float sv = rnd<R>(gv / (1.0f + std::exp(-gv)));
        o[j] = static_cast<Out>(rnd<R>(sv * rnd<R>(f(u[j]))));
      }
    }
  });
}

// silu(gate) * up over gu = [rows, 2*width] (gate columns first), every intermediate rounded to
// round_dtype (0: float, 1: bfloat16, 2: float16); the output in gu's dtype.
at::Tensor silu_mul(const at::Tensor& gu, int64_t width, int64_t round_code) {
  const at::ScalarType round_dtype = round_code == 1 ? at::kBFloat16 : round_code == 2 ? at::kHalf : at::kFloat;
  TORCH_CHECK(gu.dim() == 2 && gu.stride(1) == 1 && gu.size(1) == 2 * width, "gu must be [rows, 2*width], "
              "contiguous last dim");
  auto out = at::empty({gu.size(0), width}, gu.options());
  const auto in = gu.scalar_type();
  const int64_t rows = gu.size(0), stride = gu.stride(0);
  if (in == at::kFloat && round_dtype == at::kBFloat16) {
    silu_mul_rows<float, c10::BFloat16, float>(gu.data_ptr<float>(), out.data_ptr<float>(), rows, width, stride);
  } else if (in == at::kFloat && round_dtype == at::kHalf) {
    silu_mul_rows<float, c10::Half, float>(gu.data_ptr<float>(), out.data_ptr<float>(), rows, width, stride);
  } else if (in == round_dtype) {
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, in, "silu_mul", [&] {
      silu_mul_rows<scalar_t, scalar_t, scalar_t>(gu.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(), rows, width,
                                                  stride);
    });
  } else {
    TORCH_CHECK(false, "silu_mul: unsupported dtypes");
  }
  return out;
}

}  // namespace

// int8 KV encode + scatter (kvserve.kv.quant.Int8Codec.encode_tokens, then put_tokens): per token
// and KV head, scale = max(amax / 127, 1e-12) and q = clamp(round_half_even(x / scale), -127, 127),
// written to (blocks[t], offsets[t]) of the codec's field views. Built without fast-math so every
// division and rounding is the IEEE one torch's ops do: the codes are torch's, bit for bit.
#pragma GCC push_options
#pragma GCC optimize("no-fast-math")
template <typename T>
__attribute__((optimize("no-fast-math"))) void int8_rows(
    const T* x, float* scale, int8_t* q, const int64_t* blocks, const int64_t* offsets, int64_t tokens,
    int64_t heads, int64_t dim, int64_t sb, int64_t so, int64_t qb, int64_t qo) {
  for (int64_t t = 0; t < tokens; ++t) {
    for (int64_t h = 0; h < heads; ++h) {
      const T* src = x + (t * heads + h) * dim;
      float amax = 0.f;
      for (int64_t d = 0; d < dim; ++d) amax = std::max(amax, std::fabs(f(src[d])));
      float s = amax / 127.0f;
      if (!(s >= 1e-12f)) s = s != s ? s : 1e-12f;  // clamp_min, NaN kept as torch keeps it
      scale[blocks[t] * sb + offsets[t] * so + h] = s;
      int8_t* dst = q + blocks[t] * qb + offsets[t] * qo + h * dim;
      for (int64_t d = 0; d < dim; ++d) {
        float r = std::nearbyint(f(src[d]) / s);
        dst[d] = static_cast<int8_t>(std::min(127.f, std::max(-127.f, r)));
      }
    }
  }
}
#pragma GCC pop_options

void int8_write(const at::Tensor& x, at::Tensor& scale, at::Tensor& q, const at::Tensor& blocks,
                const at::Tensor& offsets) {
  TORCH_CHECK(x.dim() == 3 && x.is_contiguous(), "x must be [tokens, kv_heads, head_dim] contiguous");
  const int64_t T = x.size(0), H = x.size(1), D = x.size(2);
  TORCH_CHECK(scale.dim() == 3 && scale.scalar_type() == at::kFloat && scale.size(2) == H && scale.stride(2) == 1 &&
              scale.stride(1) == H, "scale must be a float [blocks, block_size, kv_heads] view");
  TORCH_CHECK(q.dim() == 4 && q.scalar_type() == at::kChar && q.size(2) == H && q.size(3) == D && q.stride(3) == 1 &&
              q.stride(2) == D && q.stride(1) == H * D, "q must be an int8 [blocks, block_size, kv_heads, head_dim] view");
  TORCH_CHECK(blocks.scalar_type() == at::kLong && offsets.scalar_type() == at::kLong && blocks.is_contiguous() &&
              offsets.is_contiguous() && blocks.numel() == T && offsets.numel() == T, "blocks/offsets: int64 [tokens]");
  const int64_t* b = blocks.data_ptr<int64_t>();
  const int64_t* o = offsets.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t)
    TORCH_CHECK(b[t] >= 0 && b[t] < q.size(0) && o[t] >= 0 && o[t] < q.size(1), "slot out of range");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "int8_write", [&] {
    int8_rows<scalar_t>(x.data_ptr<scalar_t>(), scale.data_ptr<float>(), q.data_ptr<int8_t>(), b, o, T, H, D,
                        scale.stride(0), scale.stride(1), q.stride(0), q.stride(1));
  });
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("rms_norm", &rms_norm, "weight * rms_norm(x)");
  m.def("add_rms_norm", &add_rms_norm, "(weight * rms_norm(x + residual), x + residual)");
  m.def("rotary", &rotary, "x * cos + rotate_half(x) * sin");
  m.def("silu_mul", &silu_mul, "silu(gate) * up, rounded as the torch ops round");
  m.def("int8_write", &int8_write, "int8 KV encode (Int8Codec) and scatter into its field views");
}
