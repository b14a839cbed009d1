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
#include <cstring>
#include <type_traits>
#if (defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)) || defined(__AVX512F__)
#include <immintrin.h>
#endif

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
// One head's row rotated: o = x * c + rotate_half(x) * s, each product rounded to T, then the sum.
template <typename T>
inline void rotate_row(const T* xr, const T* c, const T* s, T* o, int64_t d) {
  const int64_t half = d / 2;
  for (int64_t j = 0; j < d; ++j) {
    const float rot = j < half ? -f(xr[j + half]) : f(xr[j - half]);
    o[j] = static_cast<T>(rnd<T>(f(xr[j]) * f(c[j])) + rnd<T>(rot * f(s[j])));
  }
}

at::Tensor rotary(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1, "x must be [T, heads, d] with a contiguous last dim");
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.dim() == 2 && cos.size(0) == x.size(0) &&
              cos.size(1) == x.size(2) && sin.sizes() == cos.sizes() && cos.scalar_type() == x.scalar_type() &&
              sin.scalar_type() == x.scalar_type(), "cos/sin must be [T, d] contiguous in x's dtype");
  const int64_t t = x.size(0), heads = x.size(1), d = x.size(2);
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
        rotate_row<T>(xr, cp + i * d, sp + i * d, op + k * d, d);
      }
    });
  });
  return out;
}

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define KVS_FUSED_AVX2 1
// 8 lanes of T widened to fp32.
template <typename T> inline __m256 load8(const T* p) {
  if constexpr (std::is_same_v<T, float>) return _mm256_loadu_ps(p);
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  if constexpr (std::is_same_v<T, c10::Half>) return _mm256_cvtph_ps(h);
  else return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
// bf16 bits of 8 floats, round to nearest even (finite inputs), in the low 16 bits of each lane.
inline __m256i bf16_bits(__m256 v) {
  const __m256i b = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(b, 16), _mm256_set1_epi32(1));
  return _mm256_srli_epi32(_mm256_add_epi32(b, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF))), 16);
}
// Round to R's precision and back (identity for float).
template <typename R> inline __m256 rnd8(__m256 v) {
  if constexpr (std::is_same_v<R, float>) return v;
  else if constexpr (std::is_same_v<R, c10::Half>) return _mm256_cvtph_ps(_mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT));
  else return _mm256_castsi256_ps(_mm256_slli_epi32(bf16_bits(v), 16));
}
template <typename T> inline void store8(T* p, __m256 v) {
  if constexpr (std::is_same_v<T, float>) {
    _mm256_storeu_ps(p, v);
  } else if constexpr (std::is_same_v<T, c10::Half>) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT));
  } else {
    const __m256i b = bf16_bits(v);
    const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(b, b), 0b1000);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_castsi256_si128(packed));
  }
}
// exp(x), Cephes' single-precision polynomial (within 2 units in the last place of fp32), 8 lanes;
// +inf above 88.3 (where fp32's exp overflows, as torch's does: silu(-100) is -0, not -1e-36).
inline __m256 exp8(__m256 x0) {
  const __m256 big = _mm256_cmp_ps(x0, _mm256_set1_ps(88.3f), _CMP_GT_OQ);
  __m256 x = _mm256_min_ps(_mm256_max_ps(x0, _mm256_set1_ps(-87.3f)), _mm256_set1_ps(88.3f));
  const __m256 fx = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(0.693359375f), x);
  x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(-2.12194440e-4f), x);
  __m256 y = _mm256_set1_ps(1.9875691500e-4f);
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507e-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073e-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894e-2f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459e-1f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201e-1f));
  y = _mm256_fmadd_ps(y, _mm256_mul_ps(x, x), _mm256_add_ps(x, _mm256_set1_ps(1.f)));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(fx), _mm256_set1_epi32(127)), 23);
  return _mm256_blendv_ps(_mm256_mul_ps(y, _mm256_castsi256_ps(e)), _mm256_set1_ps(INFINITY), big);
}
#endif

#if defined(KVS_FUSED_AVX2) && defined(__AVX512F__) && defined(__AVX512BF16__)
#define KVS_FUSED_SILU16 1
// exp8's polynomial and clamps on 16 lanes (the same operations in the same order: the same bits).
inline __m512 exp16(__m512 x0) {
  const __mmask16 big = _mm512_cmp_ps_mask(x0, _mm512_set1_ps(88.3f), _CMP_GT_OQ);
  __m512 x = _mm512_min_ps(_mm512_max_ps(x0, _mm512_set1_ps(-87.3f)), _mm512_set1_ps(88.3f));
  const __m512 fx = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                         _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  x = _mm512_fnmadd_ps(fx, _mm512_set1_ps(0.693359375f), x);
  x = _mm512_fnmadd_ps(fx, _mm512_set1_ps(-2.12194440e-4f), x);
  __m512 y = _mm512_set1_ps(1.9875691500e-4f);
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(1.3981999507e-3f));
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(8.3334519073e-3f));
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(4.1665795894e-2f));
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(1.6666665459e-1f));
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(5.0000001201e-1f));
  y = _mm512_fmadd_ps(y, _mm512_mul_ps(x, x), _mm512_add_ps(x, _mm512_set1_ps(1.f)));
  const __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(fx), _mm512_set1_epi32(127)), 23);
  return _mm512_mask_blend_ps(big, _mm512_mul_ps(y, _mm512_castsi512_ps(e)), _mm512_set1_ps(INFINITY));
}
inline __m512 load16_bf16(const c10::BFloat16* p) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
}
inline __m256i bf16_16(__m512 v) { return (__m256i)_mm512_cvtneps_pbh(v); }  // round to nearest even
inline __m512 rnd16_bf16(__m512 v) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bf16_16(v)), 16));
}
#endif

template <typename In, typename R, typename Out>
void silu_mul_rows(const In* gu, Out* out, int64_t rows, int64_t width, int64_t stride) {
  // A row is thousands of values: one row per task keeps both threads busy from two rows up.
  at::parallel_for(0, rows, rows * width >= (1 << 15) ? 1 : kRowGrain, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const In* g = gu + r * stride;
      const In* u = g + width;
      Out* o = out + r * width;
      int64_t j = 0;
#ifdef KVS_FUSED_SILU16
      // bf16 throughout (the models' case): 16 lanes a step, bit-equal to the 8-lane loop below
      // (on the AMX Xeon at 512 rows x 4,864: 0.67x torch's time, the 8-lane loop ~1.4x; benchmarks/cpu_ops.py).
      if constexpr (std::is_same_v<In, c10::BFloat16> && std::is_same_v<R, c10::BFloat16> &&
                    std::is_same_v<Out, c10::BFloat16>) {
        const __m512 one16 = _mm512_set1_ps(1.f), zero16 = _mm512_setzero_ps();
        for (; j + 16 <= width; j += 16) {
          const __m512 gv = load16_bf16(g + j);
          const __m512 sv = rnd16_bf16(_mm512_div_ps(gv, _mm512_add_ps(one16, exp16(_mm512_sub_ps(zero16, gv)))));
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(o + j), bf16_16(_mm512_mul_ps(sv, load16_bf16(u + j))));
        }
      }
#endif
#ifdef KVS_FUSED_AVX2
      const __m256 one = _mm256_set1_ps(1.f), zero = _mm256_setzero_ps();
      for (; j + 8 <= width; j += 8) {
        const __m256 gv = rnd8<R>(load8(g + j));
        const __m256 sv = rnd8<R>(_mm256_div_ps(gv, _mm256_add_ps(one, exp8(_mm256_sub_ps(zero, gv)))));
        store8(o + j, rnd8<R>(_mm256_mul_ps(sv, rnd8<R>(load8(u + j)))));
      }
#endif
      for (; j < width; ++j) {
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

#pragma GCC push_options
#pragma GCC optimize("no-fast-math")
// One head row's encode (dim values at src): its scale and codes, the scalar way.
template <typename T>
__attribute__((optimize("no-fast-math"))) float int8_head_scalar(const T* src, int64_t dim, int8_t* dst) {
  float amax = 0.f;
  for (int64_t d = 0; d < dim; ++d) amax = std::max(amax, std::fabs(f(src[d])));
  float s = amax / 127.0f;
  if (!(s >= 1e-12f)) s = s != s ? s : 1e-12f;  // clamp_min, NaN kept as torch keeps it
  for (int64_t d = 0; d < dim; ++d) {
    float r = std::nearbyint(f(src[d]) / s);
    dst[d] = static_cast<int8_t>(std::min(127.f, std::max(-127.f, r)));
  }
  return s;
}

#if defined(__AVX512F__)
template <typename T>
inline __m512 widen16(const T* p) {
  if constexpr (std::is_same_v<T, float>) {
    return _mm512_loadu_ps(p);
  } else if constexpr (std::is_same_v<T, c10::BFloat16>) {
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  } else {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  }
}

// The same, 16 lanes at a time (dim % 16 == 0): every operation is the scalar one per lane (the
// IEEE division, round-half-even, the clamps' NaN rules: max(NaN, a) and max(a, |NaN|) give a), so
// the codes and scale are the scalar path's, bit for bit.
template <typename T>
__attribute__((optimize("no-fast-math"))) float int8_head_avx512(const T* src, int64_t dim, int8_t* dst) {
  __m512 mx = _mm512_setzero_ps();
  for (int64_t d = 0; d < dim; d += 16) mx = _mm512_max_ps(_mm512_abs_ps(widen16(src + d)), mx);
  float s = _mm512_reduce_max_ps(mx) / 127.0f;
  if (!(s >= 1e-12f)) s = s != s ? s : 1e-12f;
  const __m512 sv = _mm512_set1_ps(s), lo = _mm512_set1_ps(-127.f), hi = _mm512_set1_ps(127.f);
  for (int64_t d = 0; d < dim; d += 16) {
    const __m512 r = _mm512_roundscale_ps(_mm512_div_ps(widen16(src + d), sv), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 c = _mm512_min_ps(_mm512_max_ps(r, lo), hi);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + d), _mm512_cvtepi32_epi8(_mm512_cvtps_epi32(c)));
  }
  return s;
}
#endif

template <typename T>
inline float int8_head(const T* src, int64_t dim, int8_t* dst) {
#if defined(__AVX512F__)
  if (dim % 16 == 0) return int8_head_avx512(src, dim, dst);
#endif
  return int8_head_scalar(src, dim, dst);
}

// int8 KV encode + scatter (kvserve.kv.quant.Int8Codec.encode_tokens, then put_tokens): per token
// and KV head, scale = max(amax / 127, 1e-12) and q = clamp(round_half_even(x / scale), -127, 127),
// written to (blocks[t], offsets[t]) of the codec's field views. Built without fast-math so every
// division and rounding is the IEEE one torch's ops do: the codes are torch's, bit for bit.
template <typename T>
void int8_rows(const T* x, float* scale, int8_t* q, const int64_t* blocks, const int64_t* offsets, int64_t tokens,
               int64_t heads, int64_t dim, int64_t sb, int64_t so, int64_t qb, int64_t qo) {
  for (int64_t t = 0; t < tokens; ++t) {
    for (int64_t h = 0; h < heads; ++h) {
      scale[blocks[t] * sb + offsets[t] * so + h] =
          int8_head(x + (t * heads + h) * dim, dim, q + blocks[t] * qb + offsets[t] * qo + h * dim);
    }
  }
}
#pragma GCC pop_options

// The int8 codec's field views (scale [blocks, block_size, H] fp32, q [blocks, block_size, H, D]
// int8) and T slots (blocks, offsets) in range.
void check_int8_slots(const at::Tensor& scale, const at::Tensor& q, const at::Tensor& blocks,
                      const at::Tensor& offsets, int64_t T, int64_t H, int64_t D) {
  TORCH_CHECK(scale.dim() == 3 && scale.scalar_type() == at::kFloat && scale.size(2) == H && scale.stride(2) == 1 &&
              scale.stride(1) == H, "scale must be a float [blocks, block_size, kv_heads] view");
  TORCH_CHECK(q.dim() == 4 && q.scalar_type() == at::kChar && q.size(2) == H && q.size(3) == D && q.stride(3) == 1 &&
              q.stride(2) == D && q.stride(1) == H * D, "q must be an int8 [blocks, block_size, kv_heads, head_dim] view");
  TORCH_CHECK(scale.size(0) == q.size(0) && scale.size(1) == q.size(1), "scale and q views differ in blocks");
  TORCH_CHECK(blocks.scalar_type() == at::kLong && offsets.scalar_type() == at::kLong && blocks.is_contiguous() &&
              offsets.is_contiguous() && blocks.numel() == T && offsets.numel() == T, "blocks/offsets: int64 [tokens]");
  const int64_t* b = blocks.data_ptr<int64_t>();
  const int64_t* o = offsets.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t)
    TORCH_CHECK(b[t] >= 0 && b[t] < q.size(0) && o[t] >= 0 && o[t] < q.size(1), "slot out of range");
}

void int8_write(const at::Tensor& x, at::Tensor& scale, at::Tensor& q, const at::Tensor& blocks,
                const at::Tensor& offsets) {
  TORCH_CHECK(x.dim() == 3 && x.is_contiguous(), "x must be [tokens, kv_heads, head_dim] contiguous");
  const int64_t T = x.size(0), H = x.size(1), D = x.size(2);
  check_int8_slots(scale, q, blocks, offsets, T, H, D);
  const int64_t* b = blocks.data_ptr<int64_t>();
  const int64_t* o = offsets.data_ptr<int64_t>();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "int8_write", [&] {
    const scalar_t* xp = x.data_ptr<scalar_t>();
    at::parallel_for(0, T, kRowGrain, [&](int64_t t0, int64_t t1) {  // each token its own slot
      int8_rows<scalar_t>(xp + t0 * H * D, scale.data_ptr<float>(), q.data_ptr<int8_t>(), b + t0, o + t0, t1 - t0,
                          H, D, scale.stride(0), scale.stride(1), q.stride(0), q.stride(1));
    });
  });
}

// An attention layer's prologue in one call: qkv [T, heads + 2 * kv_heads, d] (the projection's
// output; each token's row contiguous), cos/sin [T, d], the float KV pool's layer tensor
// cache [2, blocks, block_size, kv_heads, d] (contiguous, qkv's dtype), slots [T] int64. Returns
// the rotated queries [T, heads, d]; the rotated keys and the values are written at their slots.
// Equal to rotary() on q and k, then index_copy_ of k and v into the flattened pool.
void check_qkv(const at::Tensor& qkv, int64_t heads, int64_t kv_heads, const at::Tensor& cos, const at::Tensor& sin) {
  TORCH_CHECK(qkv.dim() == 3 && qkv.size(1) == heads + 2 * kv_heads && qkv.stride(2) == 1 &&
              qkv.stride(1) == qkv.size(2), "qkv must be [T, heads + 2 * kv_heads, d], each row contiguous");
  const int64_t t = qkv.size(0), d = qkv.size(2);
  TORCH_CHECK(d % 2 == 0, "head_dim must be even");
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.dim() == 2 && cos.size(0) == t && cos.size(1) == d &&
              sin.sizes() == cos.sizes() && cos.scalar_type() == qkv.scalar_type() &&
              sin.scalar_type() == qkv.scalar_type(), "cos/sin must be [T, d] contiguous in qkv's dtype");
}

at::Tensor rope_write(const at::Tensor& qkv, int64_t heads, int64_t kv_heads, const at::Tensor& cos,
                      const at::Tensor& sin, at::Tensor& cache, const at::Tensor& slots) {
  check_qkv(qkv, heads, kv_heads, cos, sin);
  const int64_t t = qkv.size(0), d = qkv.size(2);
  TORCH_CHECK(cache.dim() == 5 && cache.size(0) == 2 && cache.size(3) == kv_heads && cache.size(4) == d &&
              cache.is_contiguous() && cache.scalar_type() == qkv.scalar_type(),
              "cache must be a contiguous [2, blocks, block_size, kv_heads, d] tensor in qkv's dtype");
  TORCH_CHECK(slots.dim() == 1 && slots.numel() == t && slots.scalar_type() == at::kLong && slots.is_contiguous(),
              "slots must be int64 [T]");
  const int64_t n_slots = cache.size(1) * cache.size(2);
  const int64_t* sl = slots.data_ptr<int64_t>();
  for (int64_t i = 0; i < t; ++i) TORCH_CHECK(sl[i] >= 0 && sl[i] < n_slots, "slot out of range");
  auto q = at::empty({t, heads, d}, qkv.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, qkv.scalar_type(), "rope_write", [&] {
    using T = scalar_t;
    const T* xp = qkv.data_ptr<T>();
    const T* cp = cos.data_ptr<T>();
    const T* sp = sin.data_ptr<T>();
    T* qp = q.data_ptr<T>();
    T* kp = cache.data_ptr<T>();
    T* vp = kp + n_slots * kv_heads * d;
    const int64_t s0 = qkv.stride(0), rows = heads + kv_heads;
    at::parallel_for(0, t, kRowGrain, [&](int64_t b, int64_t e) {
      for (int64_t i = b; i < e; ++i) {
        const T* xr = xp + i * s0;
        const T* c = cp + i * d;
        const T* s = sp + i * d;
        for (int64_t h = 0; h < heads; ++h) rotate_row<T>(xr + h * d, c, s, qp + (i * heads + h) * d, d);
        T* kslot = kp + sl[i] * kv_heads * d;
        for (int64_t h = 0; h < kv_heads; ++h) rotate_row<T>(xr + (heads + h) * d, c, s, kslot + h * d, d);
        std::memcpy(vp + sl[i] * kv_heads * d, xr + rows * d, kv_heads * d * sizeof(T));
      }
    });
  });
  return q;
}

// rope_write for an int8 pool (one joint Int8Codec pair): the rotated queries [T, heads, d] are
// returned; the rotated keys (rounded to qkv's dtype, as rotary() rounds them) and the values are
// encoded and written as int8_write() writes them, to (blocks[t], offsets[t]) of the K and V
// field views. Equal to rotary() on q and k, then int8_write() of k and of v.
at::Tensor rope_int8_write(const at::Tensor& qkv, int64_t heads, int64_t kv_heads, const at::Tensor& cos,
                           const at::Tensor& sin, at::Tensor& k_scale, at::Tensor& k_q, at::Tensor& v_scale,
                           at::Tensor& v_q, const at::Tensor& blocks, const at::Tensor& offsets) {
  check_qkv(qkv, heads, kv_heads, cos, sin);
  const int64_t t = qkv.size(0), d = qkv.size(2);
  check_int8_slots(k_scale, k_q, blocks, offsets, t, kv_heads, d);
  check_int8_slots(v_scale, v_q, blocks, offsets, t, kv_heads, d);
  const int64_t* b = blocks.data_ptr<int64_t>();
  const int64_t* o = offsets.data_ptr<int64_t>();
  auto q = at::empty({t, heads, d}, qkv.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, qkv.scalar_type(), "rope_int8_write", [&] {
    using T = scalar_t;
    const T* xp = qkv.data_ptr<T>();
    const T* cp = cos.data_ptr<T>();
    const T* sp = sin.data_ptr<T>();
    T* qp = q.data_ptr<T>();
    const int64_t s0 = qkv.stride(0), rows = heads + kv_heads;
    at::parallel_for(0, t, kRowGrain, [&](int64_t lo, int64_t hi) {
      std::vector<T> k(kv_heads * d);
      for (int64_t i = lo; i < hi; ++i) {
        const T* xr = xp + i * s0;
        const T* c = cp + i * d;
        const T* s = sp + i * d;
        for (int64_t h = 0; h < heads; ++h) rotate_row<T>(xr + h * d, c, s, qp + (i * heads + h) * d, d);
        for (int64_t h = 0; h < kv_heads; ++h) rotate_row<T>(xr + (heads + h) * d, c, s, k.data() + h * d, d);
        int8_rows<T>(k.data(), k_scale.data_ptr<float>(), k_q.data_ptr<int8_t>(), b + i, o + i, 1, kv_heads, d,
                     k_scale.stride(0), k_scale.stride(1), k_q.stride(0), k_q.stride(1));
        int8_rows<T>(xr + rows * d, v_scale.data_ptr<float>(), v_q.data_ptr<int8_t>(), b + i, o + i, 1, kv_heads, d,
                     v_scale.stride(0), v_scale.stride(1), v_q.stride(0), v_q.stride(1));
      }
    });
  });
  return q;
}

#ifndef KVS_NO_MODULE  // decode_stack.cpp includes this file for its functions
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("rope_write", &rope_write, "rotary on q and k, k and v written into the float pool at their slots");
  m.def("rms_norm", &rms_norm, "weight * rms_norm(x)");
  m.def("add_rms_norm", &add_rms_norm, "(weight * rms_norm(x + residual), x + residual)");
  m.def("rotary", &rotary, "x * cos + rotate_half(x) * sin");
  m.def("silu_mul", &silu_mul, "silu(gate) * up, rounded as the torch ops round");
#ifdef KVS_FUSED_SILU16
  m.def("silu16", []() { return true; }, "whether bf16 silu_mul runs 16 lanes a step (AVX-512 + AVX512-BF16)");
#else
  m.def("silu16", []() { return false; }, "whether bf16 silu_mul runs 16 lanes a step (AVX-512 + AVX512-BF16)");
#endif
  m.def("int8_write", &int8_write, "int8 KV encode (Int8Codec) and scatter into its field views");
  m.def("rope_int8_write", &rope_int8_write, "rotary on q and k, k and v encoded into the int8 pool at their slots");
}
#endif
