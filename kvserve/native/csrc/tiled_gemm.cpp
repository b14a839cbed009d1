// kvserve's own GEMM for half-precision weights on AVX2 CPUs (kvserve/model/tiled_gemm.py is the
// Python side): y[M, N] = x[M, K] @ W[N, K]^T (+ bias), W kept in its own dtype (bf16 or fp16).
//
// Layout (pack): W's rows in groups of 4 (the last group zero-padded), each group stored as K/8
// chunks of [4 rows][8 values], so one chunk is one 64-byte cache line and a group's weights are
// one sequential stream. Invariant: packed[g][c][r][j] = W[4g + r][8c + j] (0 past row N).
//
// Few rows (M <= kDotRows, a decode step): every group's 4 dot products per input row accumulate
// in fp32 registers, the chunk widened in registers (bf16: a 16-bit shift; fp16: F16C), 2 input
// rows per pass over the group (8 accumulators; 3 rows spilled registers and ran slower), so the
// weights stream from memory once and from L1/L2 for the other passes. Many rows (prefill), in
// blocks of 512 rows: each thread widens a panel of groups, a K slice at a time, to fp32 and
// multiplies it with at::mm (MKL sgemm), so a prefill runs near sgemm speed while the weights stay
// in 2 bytes. Groups are split over at::parallel_for's threads (OpenMP).
//
// Numerics: products and sums in fp32 (each output one dot product over K; only the summation
// order differs from a bf16 GEMM with fp32 accumulation), bias added in fp32, then rounded once to
// the output dtype (round to nearest even).
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <cstdint>
#include <cstring>
#include <vector>
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define KVS_TILED 1
#else
#define KVS_TILED 0
#endif

namespace {

constexpr int64_t kRows = 4;      // weight rows per group
constexpr int64_t kChunk = 8;     // values per row per chunk
constexpr int64_t kDotRows = 16;  // input rows up to which the register kernel runs
constexpr int64_t kPanel = 32;    // groups (128 weight rows) per panel of the many-rows path
constexpr int64_t kSlice = 512;   // K values per widened slice: 128 x 512 fp32 = 256 KiB
constexpr int64_t kRowBlock = 512;  // input rows per pass of the kernel (the caller's rows in blocks)

bool available() { return KVS_TILED == 1; }

// W [N, K] (bf16 or fp16, contiguous) -> packed [ceil(N/4), K/8, 4, 8] in the same dtype.
at::Tensor pack(const at::Tensor& w) {
  TORCH_CHECK(w.dim() == 2 && w.is_contiguous(), "expected a contiguous [N, K] weight");
  TORCH_CHECK(w.scalar_type() == at::kBFloat16 || w.scalar_type() == at::kHalf, "weight must be bf16 or fp16");
  const int64_t n = w.size(0), k = w.size(1);
  TORCH_CHECK(k % kChunk == 0, "K must be a multiple of 8");
  const int64_t groups = (n + kRows - 1) / kRows, chunks = k / kChunk;
  auto out = at::empty({groups, chunks, kRows, kChunk}, w.options());
  const auto* src = reinterpret_cast<const uint16_t*>(w.data_ptr());
  auto* dst = reinterpret_cast<uint16_t*>(out.data_ptr());
  at::parallel_for(0, groups, 64, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g)
      for (int64_t r = 0; r < kRows; ++r) {
        const bool real = g * kRows + r < n;  // the last group's rows past N are zeros
        const uint16_t* row = src + (g * kRows + r) * k;
        for (int64_t c = 0; c < chunks; ++c) {
          uint16_t* to = dst + ((g * chunks + c) * kRows + r) * kChunk;
          if (real) std::memcpy(to, row + c * kChunk, kChunk * sizeof(uint16_t));
          else std::memset(to, 0, kChunk * sizeof(uint16_t));
        }
      }
  });
  return out;
}

#if KVS_TILED
template <bool BF16> inline __m256 widen(const uint16_t* p) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  if constexpr (BF16) return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  else return _mm256_cvtph_ps(h);
}

constexpr int64_t kAhead = 16 * kRows * kChunk;  // prefetch distance: 16 chunks (1 KiB)
// GCC drops __builtin_prefetch in these loops (as in paged_attention.cpp), so an asm prefetch.
inline void prefetch(const void* p) { asm volatile("prefetcht0 %0" : : "m"(*static_cast<const char*>(p))); }

// The 4 lane sums of a0..a3 as one vector [sum a0, sum a1, sum a2, sum a3].
inline __m128 sum4(__m256 a0, __m256 a1, __m256 a2, __m256 a3) {
  const __m256 s = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
  return _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
}

// out[m][0..3] = dot(group rows 0..3, x row m) for MT input rows (x rows xs apart, fp32).
template <int MT, bool BF16>
inline void group_dots(const uint16_t* wg, const float* x, int64_t xs, int64_t chunks, float* out) {
  __m256 acc[MT][kRows];
#pragma GCC unroll 4
  for (int m = 0; m < MT; ++m)
    for (int r = 0; r < kRows; ++r) acc[m][r] = _mm256_setzero_ps();
  for (int64_t c = 0; c < chunks; ++c) {
    const uint16_t* wc = wg + c * kRows * kChunk;
    if constexpr (MT == 1) prefetch(wc + kAhead);
    __m256 xv[MT];
#pragma GCC unroll 4
    for (int m = 0; m < MT; ++m) xv[m] = _mm256_loadu_ps(x + m * xs + c * kChunk);
#pragma GCC unroll 4
    for (int r = 0; r < kRows; ++r) {
      const __m256 w = widen<BF16>(wc + r * kChunk);
#pragma GCC unroll 4
      for (int m = 0; m < MT; ++m) acc[m][r] = _mm256_fmadd_ps(w, xv[m], acc[m][r]);
    }
  }
#pragma GCC unroll 4
  for (int m = 0; m < MT; ++m) _mm_storeu_ps(out + m * kRows, sum4(acc[m][0], acc[m][1], acc[m][2], acc[m][3]));
}

template <bool BF16>
void dots(const uint16_t* wg, const float* x, int64_t xs, int64_t rows, int64_t chunks, float* out) {
  int64_t m = 0;
  for (; m + 2 <= rows; m += 2) group_dots<2, BF16>(wg, x + m * xs, xs, chunks, out + m * kRows);
  if (rows - m == 1) group_dots<1, BF16>(wg, x + m * xs, xs, chunks, out + m * kRows);
}

// packed groups [g0, g0 + groups), chunks [c0, c0 + cn) -> fp32 [groups * 4, cn * 8] row-major
template <bool BF16>
void widen_panel(const uint16_t* w, int64_t g0, int64_t groups, int64_t chunks, int64_t c0, int64_t cn, float* dst) {
  const int64_t ld = cn * kChunk;
  for (int64_t g = 0; g < groups; ++g)
    for (int64_t c = 0; c < cn; ++c)
      for (int64_t r = 0; r < kRows; ++r)
        _mm256_storeu_ps(dst + (g * kRows + r) * ld + c * kChunk,
                         widen<BF16>(w + (((g0 + g) * chunks + c0 + c) * kRows + r) * kChunk));
}
#endif

template <typename O>
void store(O* y, int64_t ldy, int64_t m, int64_t n0, int64_t n, const float* v, const float* bias) {
  for (int64_t r = 0; r < kRows && n0 + r < n; ++r) {
    const float b = bias != nullptr ? bias[n0 + r] : 0.f;
    y[m * ldy + n0 + r] = static_cast<O>(v[r] + b);
  }
}

template <bool BF16, typename O>
void run(const uint16_t* w, const float* x, O* y, const float* bias, int64_t m, int64_t n, int64_t k) {
#if KVS_TILED
  const int64_t groups = (n + kRows - 1) / kRows, chunks = k / kChunk, gsize = chunks * kRows * kChunk;
  if (m <= kDotRows) {
    at::parallel_for(0, groups, 8, [&](int64_t g0, int64_t g1) {
      float out[kDotRows * kRows];
      for (int64_t g = g0; g < g1; ++g) {
        dots<BF16>(w + g * gsize, x, k, m, chunks, out);
        for (int64_t r = 0; r < m; ++r) store<O>(y, n, r, g * kRows, n, out + r * kRows, bias);
      }
    });
    return;
  }
  // Many rows: per panel of groups, K in slices of kSlice, each slice's weights widened
  // to fp32 (at most 256 KiB, L2-resident) and multiplied by at::mm, the slices summed in fp32.
  // Panels of at most kPanel groups, as many as a multiple of the thread count (balanced threads).
  const int64_t threads = at::get_num_threads();
  const int64_t panels = ((groups + kPanel - 1) / kPanel + threads - 1) / threads * threads;
  const int64_t per = (groups + panels - 1) / panels;
  at::parallel_for(0, (groups + per - 1) / per, 1, [&](int64_t p0, int64_t p1) {
    std::vector<float> panel(per * kRows * kSlice), part(m * per * kRows);
    for (int64_t p = p0; p < p1; ++p) {
      const int64_t g0 = p * per, gn = std::min(per, groups - g0), cols = gn * kRows;
      auto pt = at::from_blob(part.data(), {m, cols}, at::kFloat);
      for (int64_t k0 = 0; k0 < k; k0 += kSlice) {
        const int64_t kn = std::min(kSlice, k - k0);
        widen_panel<BF16>(w, g0, gn, chunks, k0 / kChunk, kn / kChunk, panel.data());
        auto wt = at::from_blob(panel.data(), {cols, kn}, at::kFloat);
        auto xs = at::from_blob(const_cast<float*>(x) + k0, {m, kn}, {k, 1}, at::kFloat);
        if (k0 == 0) at::mm_out(pt, xs, wt.t());
        else at::addmm_out(pt, pt, xs, wt.t());
      }
      for (int64_t r = 0; r < m; ++r)
        for (int64_t g = 0; g < gn; ++g) store<O>(y, n, r, (g0 + g) * kRows, n, part.data() + r * cols + g * kRows, bias);
    }
  });
#else
  TORCH_CHECK(false, "kvserve tiled GEMM: built without AVX2/FMA/F16C");
#endif
}

// x [M, K] (any float dtype), packed from pack(W [N, K]); bias [N] fp32 or empty; out_dtype code:
// 0 fp32, 1 bf16, 2 fp16. Returns y [M, N].
at::Tensor gemm(const at::Tensor& x, const at::Tensor& packed, int64_t n, const at::Tensor& bias, int64_t out_code) {
  TORCH_CHECK(packed.dim() == 4 && packed.is_contiguous() && packed.size(2) == kRows && packed.size(3) == kChunk,
              "packed must come from pack()");
  const int64_t k = packed.size(1) * kChunk, m = x.size(0);
  TORCH_CHECK(x.dim() == 2 && x.size(1) == k, "x must be [M, K] with the packed weight's K");
  TORCH_CHECK(packed.size(0) == (n + kRows - 1) / kRows, "n does not match the packed groups");
  TORCH_CHECK(!bias.defined() || bias.numel() == 0 || (bias.scalar_type() == at::kFloat && bias.numel() == n &&
              bias.is_contiguous()), "bias must be fp32 [N]");
  const auto x32 = x.to(at::kFloat).contiguous();
  const float* b = bias.defined() && bias.numel() > 0 ? bias.data_ptr<float>() : nullptr;
  const auto out_type = out_code == 0 ? at::kFloat : out_code == 1 ? at::kBFloat16 : at::kHalf;
  auto y = at::empty({m, n}, x.options().dtype(out_type));
  if (m == 0) return y;
  const auto* w = reinterpret_cast<const uint16_t*>(packed.data_ptr());
  const bool bf16 = packed.scalar_type() == at::kBFloat16;
  auto go = [&](auto* yp) {
    using O = std::remove_pointer_t<decltype(yp)>;
    for (int64_t m0 = 0; m0 < m; m0 += kRowBlock) {  // one 2048-row call was 1.2-1.45x four 512-row ones
      const int64_t mn = std::min(kRowBlock, m - m0);
      const float* xb = x32.data_ptr<float>() + m0 * k;
      if (bf16) run<true, O>(w, xb, yp + m0 * n, b, mn, n, k);
      else run<false, O>(w, xb, yp + m0 * n, b, mn, n, k);
    }
  };
  if (out_code == 0) go(y.data_ptr<float>());
  else if (out_code == 1) go(reinterpret_cast<c10::BFloat16*>(y.data_ptr()));
  else go(reinterpret_cast<c10::Half*>(y.data_ptr()));
  return y;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("available", &available, "whether this build has the AVX2/FMA/F16C kernel");
  m.def("pack", &pack, "W [N, K] -> 4-row interleaved groups [ceil(N/4), K/8, 4, 8]");
  m.def("gemm", &gemm, "y = x @ W.T + bias over a packed weight");
}
