// The tiled GEMM on AMX tiles (Intel AMX-BF16), for bf16 weights and bf16 inputs, on the weight
// as loaded (row-major [N, K]): included by tiled_gemm.cpp, which calls it for every row count
// where it is usable (amx::usable(), K % 32 == 0).
//
// The product is computed transposed, C^T[N, M] = W[N, K] . X^T, so the weight needs no repacked
// copy: a tile of A is 16 weight rows x 32 values loaded straight from W (a row stride of 2K
// bytes), and B is X in the tiles' pair-interleaved ("VNNI") form, built once per call
// (pack_x: 16 input rows a block, each 32 K values a 16 x 16 transpose of 32-bit pairs; rows past
// M are zeros). Each step of K (32 values) multiplies 2 weight tiles (32 rows) by 1 or 2 input
// tiles (16 or 32 rows) into 2 or 4 fp32 accumulator tiles: all 8 tile registers at 2 x 2. The
// result tiles are transposed back in registers and rounded once to the output dtype, bias added
// in fp32. Inputs past a multiple of 32 weight rows (N % 32) run on a zero-padded copy of those rows.
//
// Order: per thread a contiguous range of 32-row weight panels; input rows in chunks of at most
// ~1 MiB of packed X (kChunkBytes) so a chunk stays in L2 while every panel passes over it.
//
// Why not oneDNN's AMX GEMM: it needs the weight reordered into its own layout, a second copy of
// every matrix where the one-row band reads the loaded tensor (session 20: +645 MiB on the 0.5B
// shape). Measured on a 2-core AMX Xeon (session 21, the GEMM plan's own timings of the 0.5B
// shape, python benchmarks/gemm_plan.py, docs/kernels.md): one row in 0.64-0.97x the time of
// oneDNN's reordered copy and 0.73-0.88x the AVX512-BF16 dot kernel's (the same loaded tensor);
// 16-128 rows in 0.63-0.98x oneDNN's, where the dot kernel takes 2-6x oneDNN's time.
//
// Numerics: TDPBF16PS multiplies bf16 pairs and accumulates in fp32 (denormal inputs read as
// zero, as oneDNN's AMX path does); each output is one fp32 sum over K in a fixed order that does
// not depend on M or on the row's place in the batch (batch-invariant).
// Tile state: each thread of a call loads its own configuration and releases it at the end, so
// oneDNN's and torch's AMX kernels, which configure the tiles at the start of their own calls,
// find them as they would without this path.
// Whether the tiles may be used at all (the process's AMX permission, KVSERVE_TILED_AMX): usable(),
// amx_state.h; where not, the AVX512-BF16 kernel runs.
#pragma once
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <algorithm>

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__) && defined(__linux__)
#include <immintrin.h>
#include <strings.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace amx {

#include "amx_state.h"

#if KVS_AMX
constexpr int64_t kChunkBytes = 1 << 20;

#include "transpose16.h"

// Input block q (rows 16q..16q+15 of x [m, k] bf16) -> dst [k/2][16] 32-bit pairs, zeros past m.
inline void pack_block(const uint16_t* x, int64_t m, int64_t k, int64_t q, uint32_t* dst) {
  const int64_t kp = k / 2, rows = std::min<int64_t>(16, m - q * 16);
  const auto* x32 = reinterpret_cast<const uint32_t*>(x) + q * 16 * kp;
  for (int64_t p = 0; p < kp; p += 16) {
    __m512i r[16];
    for (int i = 0; i < 16; ++i) r[i] = i < rows ? _mm512_loadu_si512(x32 + i * kp + p) : _mm512_setzero_si512();
    transpose16x16(r);
    for (int i = 0; i < 16; ++i) _mm512_storeu_si512(dst + (p + i) * 16, r[i]);
  }
}

// Accumulates 32 weight rows (w, row stride k) against MB input blocks (xv, kp * 16 apart) over K
// into tiles 0-1 (block 0) and 2-3 (block 1).
template <int MB>
inline void panel(const uint16_t* w, int64_t k, const uint32_t* xv) {
  const int64_t ws = k * 2, kp16 = k / 2 * 16;
  _tile_zero(0);
  _tile_zero(1);
  if constexpr (MB == 2) {
    _tile_zero(2);
    _tile_zero(3);
  }
  for (int64_t j = 0; j < k; j += 32) {
    _tile_loadd(4, w + j, ws);
    _tile_loadd(6, xv + j * 8, 64);
    _tile_dpbf16ps(0, 4, 6);
    _tile_loadd(5, w + 16 * k + j, ws);
    _tile_dpbf16ps(1, 5, 6);
    if constexpr (MB == 2) {
      _tile_loadd(7, xv + kp16 + j * 8, 64);
      _tile_dpbf16ps(2, 4, 7);
      _tile_dpbf16ps(3, 5, 7);
    }
  }
}

template <typename O>
inline void store_row(O* y, __m512 v, int cols) {
  const __mmask16 mask = cols >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << cols) - 1);
  if constexpr (std::is_same_v<O, float>) _mm512_mask_storeu_ps(y, mask, v);
  else if constexpr (std::is_same_v<O, c10::BFloat16>) _mm256_mask_storeu_epi16(y, mask, (__m256i)_mm512_cvtneps_pbh(v));
  else _mm256_mask_storeu_epi16(y, mask, _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}

// c: a C^T tile (16 weight rows x 16 input rows, fp32) -> y rows [0, rows), columns [0, cols).
template <typename O>
inline void store_tile(const float* c, O* y, int64_t ldy, int64_t rows, int cols, const float* bias) {
  __m512i r[16];
  for (int i = 0; i < 16; ++i) r[i] = _mm512_load_si512(c + i * 16);
  transpose16x16(r);
  const __mmask16 mask = cols >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << cols) - 1);
  const __m512 b = bias != nullptr ? _mm512_maskz_loadu_ps(mask, bias) : _mm512_setzero_ps();
  for (int64_t i = 0; i < rows; ++i) store_row<O>(y + i * ldy, _mm512_add_ps(_mm512_castsi512_ps(r[i]), b), cols);
}

// y [m, n] = x [m, k] @ w [n, k]^T (+ bias [n] fp32), x and w bf16, k % 32 == 0.
template <typename O>
void gemm(const uint16_t* w, const uint16_t* x, O* y, const float* bias, int64_t m, int64_t n, int64_t k) {
  const int64_t blocks = (m + 15) / 16, kp16 = k / 2 * 16, panels = (n + 31) / 32;
  std::unique_ptr<uint32_t[]> xv(new uint32_t[blocks * kp16]);
  if (blocks <= 2) {
    for (int64_t q = 0; q < blocks; ++q) pack_block(x, m, k, q, xv.get() + q * kp16);
  } else {
    at::parallel_for(0, blocks, 1, [&](int64_t q0, int64_t q1) {
      for (int64_t q = q0; q < q1; ++q) pack_block(x, m, k, q, xv.get() + q * kp16);
    });
  }
  const int64_t chunk = std::max<int64_t>(2, kChunkBytes / (kp16 * 4) / 2 * 2);  // input blocks a chunk
  at::parallel_for(0, panels, 1, [&](int64_t p0, int64_t p1) {
    configure_tiles();
    alignas(64) float c[4 * 256];
    std::unique_ptr<uint16_t[]> pad;  // the last panel's rows, zero-padded to 32, when n % 32 != 0
    for (int64_t q0 = 0; q0 < blocks; q0 += chunk) {
      const int64_t q1 = std::min(blocks, q0 + chunk);
      for (int64_t p = p0; p < p1; ++p) {
        const int64_t n0 = p * 32, live = std::min<int64_t>(32, n - n0);
        const uint16_t* wp = w + n0 * k;
        if (live < 32) {
          if (!pad) {
            pad.reset(new uint16_t[32 * k]());
            std::memcpy(pad.get(), wp, live * k * sizeof(uint16_t));
          }
          wp = pad.get();
        }
        for (int64_t q = q0; q < q1; q += 2) {
          const int mb = q1 - q >= 2 ? 2 : 1;
          if (mb == 2) {
            panel<2>(wp, k, xv.get() + q * kp16);
            _tile_stored(2, c + 512, 64);
            _tile_stored(3, c + 768, 64);
          } else {
            panel<1>(wp, k, xv.get() + q * kp16);
          }
          _tile_stored(0, c, 64);
          _tile_stored(1, c + 256, 64);
          for (int u = 0; u < mb; ++u) {
            const int64_t rows = std::min<int64_t>(16, m - (q + u) * 16);
            for (int h = 0; h < 2; ++h) {
              const int cols = static_cast<int>(std::clamp<int64_t>(live - 16 * h, 0, 16));
              if (cols > 0)
                store_tile<O>(c + (2 * u + h) * 256, y + (q + u) * 16 * n + n0 + 16 * h, n, rows, cols,
                              bias != nullptr ? bias + n0 + 16 * h : nullptr);
            }
          }
        }
      }
    }
    _tile_release();
  });
}
#else
template <typename O>
void gemm(const uint16_t*, const uint16_t*, O*, const float*, int64_t, int64_t, int64_t) {}
#endif

}  // namespace amx
