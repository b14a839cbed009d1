// The bf16-dot path's two products on AMX tiles (Intel AMX-BF16): included by paged_attention.cpp
// inside its bf16-dot section, which calls them for a task (run_bf16dot<true>) where
// amx_attn::usable() and head_dim % 32 == 0. Everything else of that path (reading the blocks,
// the online softmax, the codecs' scales, the masks) is shared: the tiles take the operands in the
// layouts the path already builds.
//
// * scores S = Q K^T: A is the task's query rows as bf16 words (Qw [rows][d/2], a tile = 16 rows
//   x 32 head_dim values), B the key tile's words (Kw [d/2][16 keys]: already the tiles'
//   pair-interleaved form), C 16 rows x 16 keys of fp32 scores, stored into S; two key tiles per
//   pass over a row block (tiles 0-1 accumulate, 2 holds A, 3-4 hold B).
// * O += P V: A is the rows' bf16 probabilities (Pw [rows][ps words], a tile = 16 rows x 32 keys),
//   B the value pairs (Vw [pairs][d] words: a tile = 16 key pairs x 16 head_dim values), C the
//   running output rows (O [rows][d] fp32), loaded, accumulated over the flush's keys, stored;
//   up to 4 C tiles (64 head_dim values) per pass.
//
// Rows are taken 16 at a time: the buffers hold the task's rows rounded up to 16, and what the
// rows past the task compute is never read. A flush with an odd number of key tiles has its
// last 32-key chunk's second half zeroed (P and V) by the caller.
//
// Numerics: TDPBF16PS multiplies bf16 pairs exactly and sums in fp32, as vdpbf16ps does (the
// order of the sums differs; denormal inputs read as zero).
// Tile state: each thread loads the configuration when its share of the tasks starts and
// releases it at the end (as amx_gemm.h does), so torch's and oneDNN's AMX kernels find the tiles
// as they would without this path.
#include "amx_state.h"

#if KVS_AMX
// S[r][t * 16 + n] = sum_w Qw[r][w] . Kw_t[w][n] for key tiles t < ntiles (Kw_t = Kw + t * d / 2 * 16),
// rows in row blocks of 16 (Qw rows d / 2 words apart, S rows ss floats apart).
inline void amx_scores(const uint32_t* Qw, int64_t row_blocks, int64_t d, const uint32_t* Kw, int64_t ntiles,
                       float* S, int64_t ss) {
  const int64_t words = d / 2, tile_words = words * 16;
  for (int64_t t = 0; t < ntiles; t += 2) {
    const bool two = t + 1 < ntiles;
    const uint32_t* k0 = Kw + t * tile_words;
    for (int64_t rb = 0; rb < row_blocks; ++rb) {
      const uint32_t* q = Qw + rb * 16 * words;
      _tile_zero(0);
      if (two) _tile_zero(1);
      for (int64_t w = 0; w < words; w += 16) {
        _tile_loadd(2, q + w, d * 2);
        _tile_loadd(3, k0 + w * 16, 64);
        _tile_dpbf16ps(0, 2, 3);
        if (two) {
          _tile_loadd(4, k0 + tile_words + w * 16, 64);
          _tile_dpbf16ps(1, 2, 4);
        }
      }
      float* s = S + rb * 16 * ss + t * 16;
      _tile_stored(0, s, ss * 4);
      if (two) _tile_stored(1, s + 16, ss * 4);
    }
  }
}

// O[r][e] += sum_p Pw[r][p] . Vw[p][e] over 16 * chunks key pairs (Pw rows ps words apart, Vw rows
// and O rows d apart), rows in row blocks of 16.
inline void amx_values(const uint32_t* Pw, int64_t ps, const uint32_t* Vw, int64_t chunks, int64_t row_blocks,
                       int64_t d, float* O) {
  for (int64_t rb = 0; rb < row_blocks; ++rb) {
    float* o = O + rb * 16 * d;
    const uint32_t* p = Pw + rb * 16 * ps;
    for (int64_t e0 = 0; e0 < d; e0 += 64) {
      const bool four = d - e0 >= 64;  // else 32 values (d % 32 == 0)
      _tile_loadd(0, o + e0, d * 4);
      _tile_loadd(1, o + e0 + 16, d * 4);
      if (four) {
        _tile_loadd(2, o + e0 + 32, d * 4);
        _tile_loadd(3, o + e0 + 48, d * 4);
      }
      for (int64_t c = 0; c < chunks; ++c) {
        const uint32_t* v = Vw + c * 16 * d + e0;
        _tile_loadd(4, p + c * 16, ps * 4);
        _tile_loadd(5, v, d * 4);
        _tile_dpbf16ps(0, 4, 5);
        _tile_loadd(6, v + 16, d * 4);
        _tile_dpbf16ps(1, 4, 6);
        if (four) {
          _tile_loadd(7, v + 32, d * 4);
          _tile_dpbf16ps(2, 4, 7);
          _tile_loadd(5, v + 48, d * 4);
          _tile_dpbf16ps(3, 4, 5);
        }
      }
      _tile_stored(0, o + e0, d * 4);
      _tile_stored(1, o + e0 + 16, d * 4);
      if (four) {
        _tile_stored(2, o + e0 + 32, d * 4);
        _tile_stored(3, o + e0 + 48, d * 4);
      }
    }
  }
}
#endif
