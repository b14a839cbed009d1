// kvserve's own GEMM for half-precision weights on AVX2 CPUs (kvserve/model/tiled_gemm.py is the
// Python side): y[M, N] = x[M, K] @ W[N, K]^T (+ bias), W kept in its own dtype (bf16 or fp16).
//
// Layout: W as loaded, row-major [N, K], read in groups of 4 rows (4 sequential streams; the last
// group's rows past N repeat row N - 1 and their sums are dropped). No repacked copy, so the same
// tensor serves torch's matmul in the bands the plan gives it (kvserve/model/gemm_plan.py).
//
// Few rows (M <= kDotRows, a decode step): every group's 4 dot products per input row accumulate
// in fp32 registers, 8 values of each row widened in registers at a time (bf16: a 16-bit shift;
// fp16: F16C), 2 input rows per pass over the group (8 accumulators; 3 rows spilled registers and
// ran slower), so the weights stream from memory once and from L1/L2 for the other passes. Many rows (prefill), in
// blocks of 512 rows: each thread widens a panel of groups, a K slice at a time, to fp32 and
// multiplies it with at::mm (MKL sgemm), so a prefill runs near sgemm speed while the weights stay
// in 2 bytes. Groups are split over at::parallel_for's threads (OpenMP).
//
// On a CPU with AMX-BF16 (Sapphire Rapids and later), bf16 weights with bf16 inputs and K % 32 == 0
// run on the tiles instead, at every row count (amx_gemm.h; KVSERVE_TILED_AMX=0 switches it off).
//
// Numerics: products and sums in fp32 (each output one dot product over K; only the summation
// order differs from a bf16 GEMM with fp32 accumulation), bias added in fp32, then rounded once to
// the output dtype (round to nearest even).
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>
#include "amx_gemm.h"
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define KVS_TILED 1
#else
#define KVS_TILED 0
#endif

namespace {

constexpr int64_t kRows = 4;      // weight rows per group
constexpr int64_t kChunk = 8;     // values per row per chunk
constexpr int64_t kDotRows = 16;  // input rows up to which the AVX2 register kernel runs
constexpr int64_t kDotRowsBf16 = 128;  // ... and the AVX512-BF16 one (1.2-1.5x torch's matmul at 32-64 rows on a Zen 4;
                                        // 128 since session 18: one pass over the weights for 65-128 rows)
constexpr int64_t kPanel = 32;    // groups (128 weight rows) per panel of the many-rows path
constexpr int64_t kSlice = 512;   // K values per widened slice: 128 x 512 fp32 = 256 KiB
constexpr int64_t kRowBlock = 512;  // input rows per pass of the kernel (the caller's rows in blocks)

bool available() { return KVS_TILED == 1; }

#if KVS_TILED
template <bool BF16> inline __m256 widen(const uint16_t* p) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  if constexpr (BF16) return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  else return _mm256_cvtph_ps(h);
}

// A group's 4 rows are contiguous, and so are consecutive groups: a group is 4 * K values, read
// at 4 x 16 bytes (one 64-byte line's worth) per 8-value chunk step. So while a group is computed,
// the next one is prefetched into L2, one line per step, in address order (a prefetch a fixed
// distance ahead in each row missed most of the logits projection's short rows: 1.57x slower).
// GCC drops __builtin_prefetch in these loops (as in paged_attention.cpp), so an asm prefetch.
inline void prefetch_l2(const void* p) { asm volatile("prefetcht1 %0" : : "m"(*static_cast<const char*>(p))); }

// The 4 lane sums of a0..a3 as one vector [sum a0, sum a1, sum a2, sum a3].
inline __m128 sum4(__m256 a0, __m256 a1, __m256 a2, __m256 a3) {
  const __m256 s = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
  return _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
}

// out[m][0..3] = dot(W rows w[0..3], x row m) for MT input rows (x rows xs apart, fp32), K = 8 * chunks.
// pf: this is the group's first pass (the one that streams it from memory): prefetch the next.
template <int MT, bool BF16>
inline void group_dots(const uint16_t* const* w, const float* x, int64_t xs, int64_t chunks, float* out, bool pf) {
  __m256 acc[MT][kRows];
#pragma GCC unroll 4
  for (int m = 0; m < MT; ++m)
    for (int r = 0; r < kRows; ++r) acc[m][r] = _mm256_setzero_ps();
  for (int64_t c = 0; c < chunks; ++c) {
    if (pf) prefetch_l2(w[0] + (chunks + c) * kRows * kChunk);  // the next group's line c
    __m256 xv[MT];
#pragma GCC unroll 4
    for (int m = 0; m < MT; ++m) xv[m] = _mm256_loadu_ps(x + m * xs + c * kChunk);
#pragma GCC unroll 4
    for (int r = 0; r < kRows; ++r) {
      const __m256 wv = widen<BF16>(w[r] + c * kChunk);
#pragma GCC unroll 4
      for (int m = 0; m < MT; ++m) acc[m][r] = _mm256_fmadd_ps(wv, xv[m], acc[m][r]);
    }
  }
#pragma GCC unroll 4
  for (int m = 0; m < MT; ++m) _mm_storeu_ps(out + m * kRows, sum4(acc[m][0], acc[m][1], acc[m][2], acc[m][3]));
}

template <bool BF16>
void dots(const uint16_t* const* wg, const float* x, int64_t xs, int64_t rows, int64_t chunks, float* out) {
  int64_t m = 0;
  for (; m + 2 <= rows; m += 2) group_dots<2, BF16>(wg, x + m * xs, xs, chunks, out + m * kRows, m == 0);
  if (rows - m == 1) group_dots<1, BF16>(wg, x + m * xs, xs, chunks, out + m * kRows, m == 0);
}

// W rows [n0, n0 + rows), columns [k0, k0 + kn) -> fp32 [rows, kn] row-major (kn % 8 == 0)
template <bool BF16>
void widen_panel(const uint16_t* w, int64_t k, int64_t n0, int64_t rows, int64_t k0, int64_t kn, float* dst) {
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t j = 0; j < kn; j += kChunk) _mm256_storeu_ps(dst + r * kn + j, widen<BF16>(w + (n0 + r) * k + k0 + j));
}
#endif

#if defined(__AVX512F__) && defined(__AVX512BF16__)
#define KVS_BF16DOT 1
// bf16 weights and bf16 inputs, up to kDotRowsBf16 rows, on AVX512-BF16 (vdpbf16ps: 32 bf16 products a step,
// summed in pairs into 16 fp32 lanes). No widening, so the products run at one instruction a cycle
// where the AVX2 path widens first. Products are exact in fp32; only the summation order differs.
//
// A pass takes a group's 4 weight rows against MT <= 6 input rows: 24 accumulators + 4 weight
// vectors + 1 input vector of the 32 registers, 10 loads per 24 products (4 x 4 took 8 per 16 and
// ran 1.3-1.5x slower at 16 rows on a Zen 4). Each pass ends in one reduction tree per input row
// (4 accumulators -> 4 sums: 9 vector ops against 4 x 8 for four horizontal sums). The next group
// is prefetched into L2 spread over every pass of this group (a pass's share of its lines each
// step), so the stream from memory overlaps all the arithmetic, not only the first pass's.
inline __m128 sum4_512(__m512 a0, __m512 a1, __m512 a2, __m512 a3) {
  const __m512 s01 = _mm512_add_ps(_mm512_unpacklo_ps(a0, a1), _mm512_unpackhi_ps(a0, a1));
  const __m512 s23 = _mm512_add_ps(_mm512_unpacklo_ps(a2, a3), _mm512_unpackhi_ps(a2, a3));
  const __m512 t = _mm512_add_ps(_mm512_shuffle_ps(s01, s23, _MM_SHUFFLE(1, 0, 1, 0)),
                                 _mm512_shuffle_ps(s01, s23, _MM_SHUFFLE(3, 2, 3, 2)));
  const __m256 u = _mm256_add_ps(_mm512_castps512_ps256(t), _mm512_extractf32x8_ps(t, 1));
  return _mm_add_ps(_mm256_castps256_ps128(u), _mm256_extractf128_ps(u, 1));
}

// Prefetch of the next group during this one: lines [line, line + per_step * steps) of `next`,
// per_step a step, none past `lines` (the group's size in 64-byte lines).
struct Prefetch {
  const char* next;
  int64_t line, per_step, lines;
  inline void step() {
    for (int64_t l = line, e = std::min(line + per_step, lines); l < e; ++l) prefetch_l2(next + l * 64);
    line += per_step;
  }
};

constexpr int kSeqRows = 2;  // up to this many input rows, a group's weight rows one after another

// acc[m][r] += dot(W row w[r], x row m) over K for the weight rows R0 <= r < R1 (compile-time, so
// the accumulators stay in registers) and MT input rows.
template <int MT, int R0, int R1>
inline __attribute__((always_inline)) void dot_rows(__m512 (&acc)[MT][kRows], const uint16_t* const* w,
                                                    const uint16_t* x, int64_t xs, int64_t k, Prefetch& pf) {
  auto step = [&](int64_t j, __mmask32 mask) {
    __m512bh wv[R1 - R0];
#pragma GCC unroll 4
    for (int r = 0; r < R1 - R0; ++r) wv[r] = (__m512bh)_mm512_maskz_loadu_epi16(mask, w[R0 + r] + j);
#pragma GCC unroll 8
    for (int m = 0; m < MT; ++m) {
      const __m512bh xv = (__m512bh)_mm512_maskz_loadu_epi16(mask, x + m * xs + j);
#pragma GCC unroll 4
      for (int r = 0; r < R1 - R0; ++r) acc[m][R0 + r] = _mm512_dpbf16_ps(acc[m][R0 + r], wv[r], xv);
    }
  };
  int64_t j = 0;
  for (; j + 32 <= k; j += 32) {
    pf.step();
    step(j, ~__mmask32(0));  // all-ones mask: a plain load
  }
  if (j < k) step(j, (__mmask32(1) << (k - j)) - 1);
}

// out[m][0..3] = dot(W rows w[0..3], x row m) for MT input rows (bf16, xs apart), any K % 8 == 0.
//
// Up to kSeqRows input rows: one weight row after another, each read once from start to end, so a
// group is read in address order, one sequential stream per thread that the hardware prefetchers
// follow. The 4 rows side by side (4 streams 2K bytes apart) read the 0.5B shape's MLPs at 0.57x
// torch's streaming sum's bandwidth on a Zen 4 when the host's memory was free, this order at
// 0.87x (0.98x against 0.91x when it was contended; python benchmarks/gemv_bandwidth.py). More
// input rows: the 4 rows side by side, so each input vector loaded feeds 4 products (the input
// loads would bound the pass otherwise).
// Either way each (input row, weight row) pair keeps its one accumulator over K, in order, and
// sum4_512 reduces it at its place in the four: the same bits in both orders.
template <int MT>
inline void group_dots_bf16(const uint16_t* const* w, const uint16_t* x, int64_t xs, int64_t k, float* out, Prefetch& pf) {
  __m512 acc[MT][kRows];
#pragma GCC unroll 8
  for (int m = 0; m < MT; ++m)
    for (int r = 0; r < kRows; ++r) acc[m][r] = _mm512_setzero_ps();
  if constexpr (MT <= kSeqRows) {
    dot_rows<MT, 0, 1>(acc, w, x, xs, k, pf);
    dot_rows<MT, 1, 2>(acc, w, x, xs, k, pf);
    dot_rows<MT, 2, 3>(acc, w, x, xs, k, pf);
    dot_rows<MT, 3, 4>(acc, w, x, xs, k, pf);
  } else {
    dot_rows<MT, 0, kRows>(acc, w, x, xs, k, pf);
  }
#pragma GCC unroll 8
  for (int m = 0; m < MT; ++m) _mm_storeu_ps(out + m * kRows, sum4_512(acc[m][0], acc[m][1], acc[m][2], acc[m][3]));
}

constexpr int kPassRows = 6;  // input rows per pass (see above)

void dots_bf16(const uint16_t* const* wg, const uint16_t* x, int64_t xs, int64_t rows, int64_t k, float* out) {
  const int64_t rest = rows % kPassRows;
  const int64_t passes = rows / kPassRows + (rest >= 4) + ((rest % 4) >= 2) + (rest % 2);
  // One or two input rows (a group's rows read in order): no software prefetch, the hardware
  // prefetchers follow the one stream (the next group a line a step read at 0.79x a streaming
  // read's bandwidth, none at 0.88x: python benchmarks/gemv_bandwidth.py).
  const int64_t steps = (k + 31) / 32, lines = rows <= kSeqRows ? 0 : kRows * k / 32;
  Prefetch pf{reinterpret_cast<const char*>(wg[0] + kRows * k), 0, (lines + passes * steps - 1) / (passes * steps), lines};
  int64_t m = 0;
  for (; m + kPassRows <= rows; m += kPassRows) group_dots_bf16<kPassRows>(wg, x + m * xs, xs, k, out + m * kRows, pf);
  for (; m + 4 <= rows; m += 4) group_dots_bf16<4>(wg, x + m * xs, xs, k, out + m * kRows, pf);
  for (; m + 2 <= rows; m += 2) group_dots_bf16<2>(wg, x + m * xs, xs, k, out + m * kRows, pf);
  if (rows - m == 1) group_dots_bf16<1>(wg, x + m * xs, xs, k, out + m * kRows, pf);
}
#else
#define KVS_BF16DOT 0
#endif

template <typename O>
void store(O* y, int64_t ldy, int64_t m, int64_t n0, int64_t n, const float* v, const float* bias) {
  for (int64_t r = 0; r < kRows && n0 + r < n; ++r) {
    const float b = bias != nullptr ? bias[n0 + r] : 0.f;
    y[m * ldy + n0 + r] = static_cast<O>(v[r] + b);
  }
}

// The few-rows regime on bf16 inputs and weights (KVS_BF16DOT builds only).
template <typename O>
void run_bf16(const uint16_t* w, const uint16_t* x, O* y, const float* bias, int64_t m, int64_t n, int64_t k) {
#if KVS_BF16DOT
  at::parallel_for(0, (n + kRows - 1) / kRows, 8, [&](int64_t g0, int64_t g1) {
    float out[kDotRowsBf16 * kRows];
    for (int64_t g = g0; g < g1; ++g) {
      const uint16_t* rows[kRows];
      for (int64_t r = 0; r < kRows; ++r) rows[r] = w + std::min(g * kRows + r, n - 1) * k;
      dots_bf16(rows, x, k, m, k, out);
      for (int64_t r = 0; r < m; ++r) store<O>(y, n, r, g * kRows, n, out + r * kRows, bias);
    }
  });
#endif
}

template <bool BF16, typename O>
void run(const uint16_t* w, const float* x, O* y, const float* bias, int64_t m, int64_t n, int64_t k) {
#if KVS_TILED
  const int64_t groups = (n + kRows - 1) / kRows, chunks = k / kChunk;
  if (m <= kDotRows) {
    at::parallel_for(0, groups, 8, [&](int64_t g0, int64_t g1) {
      float out[kDotRows * kRows];
      for (int64_t g = g0; g < g1; ++g) {
        const uint16_t* rows[kRows];
        for (int64_t r = 0; r < kRows; ++r) rows[r] = w + std::min(g * kRows + r, n - 1) * k;
        dots<BF16>(rows, x, k, m, chunks, out);
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
      const int64_t g0 = p * per, gn = std::min(per, groups - g0), cols = std::min(gn * kRows, n - g0 * kRows);
      auto pt = at::from_blob(part.data(), {m, cols}, at::kFloat);
      for (int64_t k0 = 0; k0 < k; k0 += kSlice) {
        const int64_t kn = std::min(kSlice, k - k0);
        widen_panel<BF16>(w, k, g0 * kRows, cols, k0, kn, panel.data());
        auto wt = at::from_blob(panel.data(), {cols, kn}, at::kFloat);
        auto xs = at::from_blob(const_cast<float*>(x) + k0, {m, kn}, {k, 1}, at::kFloat);
        if (k0 == 0) at::mm_out(pt, xs, wt.t());
        else at::addmm_out(pt, pt, xs, wt.t());
      }
      for (int64_t r = 0; r < m; ++r)
        for (int64_t c = 0; c < cols; c += kRows) store<O>(y, n, r, g0 * kRows + c, n, part.data() + r * cols + c, bias);
    }
  });
#else
  TORCH_CHECK(false, "kvserve tiled GEMM: built without AVX2/FMA/F16C");
#endif
}

// x [M, K] (any float dtype), W [N, K] bf16/fp16 contiguous, K % 8 == 0; bias [N] fp32 or empty;
// out_dtype code: 0 fp32, 1 bf16, 2 fp16. Returns y [M, N].
at::Tensor gemm(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias, int64_t out_code) {
  TORCH_CHECK(weight.dim() == 2 && weight.is_contiguous() && weight.size(0) > 0 && weight.size(1) % kChunk == 0,
              "weight must be a contiguous [N, K] matrix with K a multiple of 8");
  TORCH_CHECK(weight.scalar_type() == at::kBFloat16 || weight.scalar_type() == at::kHalf, "weight must be bf16 or fp16");
  const int64_t n = weight.size(0), k = weight.size(1), m = x.size(0);
  TORCH_CHECK(x.dim() == 2 && x.size(1) == k, "x must be [M, K] with the weight's K");
  TORCH_CHECK(!bias.defined() || bias.numel() == 0 || (bias.scalar_type() == at::kFloat && bias.numel() == n &&
              bias.is_contiguous()), "bias must be fp32 [N]");
  const float* b = bias.defined() && bias.numel() > 0 ? bias.data_ptr<float>() : nullptr;
  const auto out_type = out_code == 0 ? at::kFloat : out_code == 1 ? at::kBFloat16 : at::kHalf;
  auto y = at::empty({m, n}, x.options().dtype(out_type));
  if (m == 0) return y;
  const auto* w = reinterpret_cast<const uint16_t*>(weight.data_ptr());
  const bool bf16 = weight.scalar_type() == at::kBFloat16;
  const bool tiles = bf16 && x.scalar_type() == at::kBFloat16 && k % 32 == 0 && amx::usable();
  const bool dot16 = KVS_BF16DOT && bf16 && x.scalar_type() == at::kBFloat16 && m <= kDotRowsBf16;
  const auto xin = tiles || dot16 ? x.contiguous() : x.to(at::kFloat).contiguous();
  auto go = [&](auto* yp) {
    using O = std::remove_pointer_t<decltype(yp)>;
    if (tiles) return amx::gemm<O>(w, reinterpret_cast<const uint16_t*>(xin.data_ptr()), yp, b, m, n, k);
    if (dot16) return run_bf16<O>(w, reinterpret_cast<const uint16_t*>(xin.data_ptr()), yp, b, m, n, k);
    const auto& x32 = xin;
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

#ifndef KVS_NO_MODULE  // decode_stack.cpp includes this file for its functions
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("available", &available, "whether this build has the AVX2/FMA/F16C kernel");
  m.def("bf16_dot", []() { return KVS_BF16DOT == 1; }, "whether bf16 x bf16 few-row calls use AVX512-BF16");
  m.def("amx", []() { return amx::usable(); }, "whether bf16 x bf16 calls (K % 32 == 0) run on AMX tiles");
  m.def("gemm", &gemm, "y = x @ W.T + bias, W [N, K] as loaded");
}
#endif
