// Paged attention that reads K/V where they are: walks each sequence's block table, decodes one
// block at a time into a small fp32 scratch (L1-resident), and keeps a flash-style online softmax.
//
// One task = (sequence, kv head, tile of query tokens). All g = H / KVH query heads of that KV
// head and every query token of the tile share each K/V block read (GQA-grouped). Tasks run on
// at::parallel_for. Masks: causal (key position <= query position) and an optional sliding window
// (key position > query position - window). Sinks, dropped blocks and block scores are not here
// (kvserve.model.attention_kept handles those sequences on the torch path).
//
// K/V sources, per side (``kind``):
//   0 bf16, 1 fp16, 2 fp32   rows of head_dim elements      (the float pool's own tensor)
//   3 int8                   fp32 scale per (token, head) at scale_off; int8 codes at q_off
//   4 fp8 e4m3               fp32 scale per (token, head) at scale_off; e4m3 codes at q_off
//   5 int4 per token (V)     fp16 scale/zero per (token, head); packed nibbles at q_off
//   6 int4 per channel (K)   fp16 scale/zero per (group, head, channel); packed nibbles at q_off
// A side's block b starts at base + b * block_stride bytes. A block with a shadow (a full-precision
// copy in the model dtype, kvserve.kv.storage) reads its first shadow_rows[b] rows from it.
//
// Paths: int8-dot (AVX512-VNNI builds; bf16 queries on an int8 pool: paged_int8.h), bf16-dot
// (AVX512-BF16 builds; bf16 queries on the bf16, int8 or fp8 pool, head_dim % 32 == 0), tiled (AVX2 + FMA, head_dim % 8 == 0), scalar (any): see each section's header.
//
// Invariants: tables hold ceil(seq_len / block_size) valid ids per sequence; q_len <= seq_len;
// scratch is per task, so tasks never share mutable state.

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define KVSERVE_AVX2 1
#endif
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__) && defined(__linux__)
#include <cstdlib>
#include <strings.h>  // for amx_state.h (amx_attention.h), included inside the namespace below
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace {

inline float bf16_to_f(uint16_t v) {
  uint32_t u = static_cast<uint32_t>(v) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline float fp8_to_f(int8_t v) {
  // e4m3 bits moved into an fp32's exponent/mantissa: exactly 2^-120 times the e4m3 value.
  uint32_t u = (static_cast<uint32_t>(static_cast<int32_t>(v)) << 20) & 0x87F00000u;
  float f;
  std::memcpy(&f, &u, 4);
  return f * 1.329227995784916e36f;  // 2^120
}

// exp(x) for x <= 0 (softmax terms), branch-free so loops over it vectorize: x = n ln2 + r with
// |r| <= ln2 / 2, 2^(r / ln2) by its degree-6 Taylor series (relative error ~2e-7).
inline float fast_exp(float x) {
  x = std::max(x, -87.f);
  const float t = x * 1.44269504088896341f;
  const float n = std::floor(t + 0.5f);
  const float f = (t - n) * 0.693147180559945309f;  // in [-ln2/2, ln2/2]
  float p = 1.f / 720.f;
  p = p * f + 1.f / 120.f;
  p = p * f + 1.f / 24.f;
  p = p * f + 1.f / 6.f;
  p = p * f + 0.5f;
  p = p * f + 1.f;
  p = p * f + 1.f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, 4);
  return p * scale;
}

inline float half_to_f(uint16_t h) { return static_cast<float>(c10::Half(h, c10::Half::from_bits())); }

struct Side {
  int64_t kind;
  const uint8_t* base;
  int64_t block_stride;  // bytes
  int64_t scale_off, zero_off, q_off, group;
};

struct Shadow {
  const uint8_t* base = nullptr;  // [W, bs, kvh, d] for this side, in model dtype
  int64_t kind = 0;               // 0 bf16, 1 fp16, 2 fp32
  const bool* has = nullptr;
  const int64_t* slot = nullptr;
  const int64_t* rows = nullptr;
};

inline void load_float_row(int64_t kind, const uint8_t* p, int64_t d, float* out) {
  if (kind == 0) {
    const uint16_t* s = reinterpret_cast<const uint16_t*>(p);
    for (int64_t i = 0; i < d; ++i) out[i] = bf16_to_f(s[i]);
  } else if (kind == 1) {
    const at::Half* s = reinterpret_cast<const at::Half*>(p);
    for (int64_t i = 0; i < d; ++i) out[i] = static_cast<float>(s[i]);
  } else {
    std::memcpy(out, p, d * sizeof(float));
  }
}

inline int64_t float_size(int64_t kind) { return kind == 2 ? 4 : 2; }

// Decode rows t0..t1-1 of block b, head h, into out[(t - t0) * d + i].
void load_rows(const Side& s, const Shadow& sh, int64_t b, int64_t h, int64_t t0, int64_t t1, int64_t bs,
               int64_t kvh, int64_t d, float* out) {
  const uint8_t* blk = s.base + b * s.block_stride;
  int64_t shadow_rows = 0;
  const uint8_t* sbase = nullptr;
  if (sh.base != nullptr && sh.has[b]) {
    shadow_rows = sh.rows[b];
    sbase = sh.base + sh.slot[b] * bs * kvh * d * float_size(sh.kind);
  }
  for (int64_t t = t0; t < t1; ++t) {
    float* o = out + (t - t0) * d;
    int64_t th = t * kvh + h;
    if (t < shadow_rows) {
      load_float_row(sh.kind, sbase + th * d * float_size(sh.kind), d, o);
      continue;
    }
    switch (s.kind) {
      case 0: case 1: case 2:
        load_float_row(s.kind, blk + th * d * float_size(s.kind), d, o);
        break;
      case 3: {
        const float sc = reinterpret_cast<const float*>(blk + s.scale_off)[th];
        const int8_t* q = reinterpret_cast<const int8_t*>(blk + s.q_off) + th * d;
        for (int64_t i = 0; i < d; ++i) o[i] = static_cast<float>(q[i]) * sc;
        break;
      }
      case 4: {
        const float sc = reinterpret_cast<const float*>(blk + s.scale_off)[th];
        const int8_t* q = reinterpret_cast<const int8_t*>(blk + s.q_off) + th * d;
        for (int64_t i = 0; i < d; ++i) o[i] = fp8_to_f(q[i]) * sc;
        break;
      }
      case 5: case 6: {
        const uint16_t* scp = reinterpret_cast<const uint16_t*>(blk + s.scale_off);
        const uint16_t* zp = reinterpret_cast<const uint16_t*>(blk + s.zero_off);
        const uint8_t* q = blk + s.q_off + th * (d / 2);
        const int64_t half = d / 2;
        if (s.kind == 5) {
          const float sc = half_to_f(scp[th]), z = half_to_f(zp[th]);
          for (int64_t i = 0; i < half; ++i) {
            o[i] = static_cast<float>(q[i] & 0xF) * sc + z;
            o[i + half] = static_cast<float>(q[i] >> 4) * sc + z;
          }
        } else {
          const int64_t gi = t / s.group;
          const uint16_t* scg = scp + (gi * kvh + h) * d;
          const uint16_t* zg = zp + (gi * kvh + h) * d;
          for (int64_t i = 0; i < half; ++i) {
            o[i] = static_cast<float>(q[i] & 0xF) * half_to_f(scg[i]) + half_to_f(zg[i]);
            o[i + half] = static_cast<float>(q[i] >> 4) * half_to_f(scg[i + half]) + half_to_f(zg[i + half]);
          }
        }
        break;
      }
      default:
        break;
    }
  }
}

// tile0[s] = the first query tile of sequence s (tiles of q_tile tokens), tile0[num_seqs] = all.
inline std::vector<int64_t> query_tiles(const int64_t* q_len, int64_t num_seqs, int64_t q_tile) {
  std::vector<int64_t> tile0(num_seqs + 1, 0);
  for (int64_t s = 0; s < num_seqs; ++s) tile0[s + 1] = tile0[s] + (q_len[s] + q_tile - 1) / q_tile;
  return tile0;
}

// One task's query rows: (sequence s, KV head h, query tokens i0..i1-1), rows ordered (query
// token, head in group): row r = (i - i0) * g + j. Fills Q (scaled; skipped when Q is null), qpos, and the accumulators.
struct Task {
  int64_t h, s, i0, i1, rows, w, lo, hi;  // keys lo..hi-1 are visible to some row
};

template <typename T>
Task begin_task(int64_t task, const std::vector<int64_t>& tile0, int64_t kvh, int64_t g, int64_t heads, int64_t d,
                int64_t q_tile, const T* qp, const int64_t* q_start, const int64_t* q_len, const int64_t* seq_len,
                const int64_t* window, float scale, float* Q, int64_t* qpos, float* acc, float* m, float* l) {
  Task t;
  t.h = task % kvh;
  const int64_t tile = task / kvh;
  t.s = static_cast<int64_t>(std::upper_bound(tile0.begin(), tile0.end(), tile) - tile0.begin()) - 1;
  t.i0 = (tile - tile0[t.s]) * q_tile;
  t.i1 = std::min(q_len[t.s], t.i0 + q_tile);
  t.rows = (t.i1 - t.i0) * g;
  t.w = window[t.s];
  const int64_t first_q = seq_len[t.s] - q_len[t.s];
  for (int64_t i = t.i0; i < t.i1; ++i) {
    for (int64_t j = 0; j < g; ++j) {
      const int64_t r = (i - t.i0) * g + j;
      const T* src = qp + ((q_start[t.s] + i) * heads + t.h * g + j) * d;
      if (Q != nullptr)
        for (int64_t e = 0; e < d; ++e) Q[r * d + e] = static_cast<float>(src[e]) * scale;
      qpos[r] = first_q + i;
    }
  }
  std::fill(acc, acc + t.rows * d, 0.f);
  std::fill(m, m + t.rows, -std::numeric_limits<float>::infinity());
  std::fill(l, l + t.rows, 0.f);
  t.hi = first_q + t.i1;
  t.lo = t.w > 0 ? std::max<int64_t>(0, first_q + t.i0 - t.w + 1) : 0;
  return t;
}

// out rows of the task: acc / l (0 where no key was visible).
template <typename T>
void end_task(const Task& t, int64_t g, int64_t heads, int64_t d, const int64_t* q_start, const float* acc,
              const float* l, T* op) {
  for (int64_t r = 0; r < t.rows; ++r) {
    const int64_t i = t.i0 + r / g, j = r % g;
    T* dst = op + ((q_start[t.s] + i) * heads + t.h * g + j) * d;
    const float inv = l[r] > 0.f ? 1.f / l[r] : 0.f;
    for (int64_t e = 0; e < d; ++e) dst[e] = static_cast<T>(acc[r * d + e] * inv);
  }
}

// The scalar path (any head_dim, any CPU; also the reference the tiled path is tested against).
// DC > 0: head_dim known at compile time (64, 128), so the dot products and the V accumulation
// have constant trip counts and vectorize fully; DC = 0: any head_dim.
template <typename T, int DC>
void run_scalar(const torch::Tensor& q, torch::Tensor& out, const int64_t* q_start, const int64_t* q_len,
         const int64_t* seq_len, const int64_t* window, const int64_t* tables, int64_t table_stride,
         int64_t num_seqs, float scale, int64_t bs, int64_t kvh, const Side& ks, const Side& vs,
         const Shadow& shk, const Shadow& shv, int64_t q_tile) {
  const int64_t heads = q.size(1), g = heads / kvh;
  const int64_t d = DC > 0 ? DC : q.size(2);
  const T* qp = q.data_ptr<T>();
  T* op = out.data_ptr<T>();
  // Tasks: (seq, kv head, tile) flattened; tile offsets per sequence.
  const std::vector<int64_t> tile0 = query_tiles(q_len, num_seqs, q_tile);
  const int64_t tasks = tile0[num_seqs] * kvh;
  at::parallel_for(0, tasks, 1, [&](int64_t begin, int64_t end) {
    const int64_t max_rows = g * q_tile;
    std::vector<float> Q(max_rows * d), acc(max_rows * d), m(max_rows), l(max_rows);
    std::vector<float> K(bs * d), V(bs * d), S(max_rows * bs);
    std::vector<int64_t> qpos(max_rows);
    for (int64_t task = begin; task < end; ++task) {
      const Task tk = begin_task(task, tile0, kvh, g, heads, d, q_tile, qp, q_start, q_len, seq_len, window, scale,
                                 Q.data(), qpos.data(), acc.data(), m.data(), l.data());
      const int64_t h = tk.h, s = tk.s, rows = tk.rows, w = tk.w, lo = tk.lo, hi = tk.hi;
      const int64_t* table = tables + s * table_stride;
      for (int64_t blk = lo / bs; blk * bs < hi; ++blk) {
        const int64_t b = table[blk];
        const int64_t t0 = std::max(lo - blk * bs, int64_t(0)), t1 = std::min(hi - blk * bs, bs);
        const int64_t nt = t1 - t0;
        load_rows(ks, shk, b, h, t0, t1, bs, kvh, d, K.data());
        load_rows(vs, shv, b, h, t0, t1, bs, kvh, d, V.data());
        const int64_t kpos0 = blk * bs + t0;
        for (int64_t r = 0; r < rows; ++r) {
          // Visible keys of this row inside the block: kpos in (qpos - w, qpos].
          const int64_t qp_r = qpos[r];
          const int64_t a = w > 0 ? std::max<int64_t>(0, qp_r - w + 1 - kpos0) : 0;
          const int64_t z = std::min<int64_t>(nt, qp_r - kpos0 + 1);
          if (a >= z) continue;
          float* __restrict__ sr = S.data() + r * nt;
          const float* __restrict__ qr = Q.data() + r * d;
          for (int64_t t = a; t < z; ++t) {
            const float* __restrict__ kr = K.data() + t * d;
            float dot = 0.f;
            for (int64_t e = 0; e < d; ++e) dot += qr[e] * kr[e];
            sr[t] = dot;
          }
          float mx = m[r];
          for (int64_t t = a; t < z; ++t) mx = std::max(mx, sr[t]);
          const float corr = m[r] == -std::numeric_limits<float>::infinity() ? 0.f : std::exp(m[r] - mx);
          float sum = 0.f;
          for (int64_t t = a; t < z; ++t) {
            const float p = fast_exp(sr[t] - mx);
            sr[t] = p;
            sum += p;
          }
          l[r] = l[r] * corr + sum;
          m[r] = mx;
          float* __restrict__ ar = acc.data() + r * d;
          if (corr != 1.f)
            for (int64_t e = 0; e < d; ++e) ar[e] *= corr;
          for (int64_t t = a; t < z; ++t) {
            const float p = sr[t];
            const float* __restrict__ vr = V.data() + t * d;
            for (int64_t e = 0; e < d; ++e) ar[e] += p * vr[e];
          }
        }
      }
      end_task(tk, g, heads, d, q_start, acc.data(), l.data(), op);
    }
  });
}

#ifdef KVSERVE_AVX2
// ---- The tiled path (AVX2 + FMA, head_dim a multiple of 8) ----------------------------------
// Keys are taken KT = 16 at a time (a block of 16, or a block's part). Per tile: K's rows are
// decoded into fp32 rows and transposed (8x8 shuffles) to Kt [d][KT], so the scores of R query
// rows are R x 2 vector accumulators over head_dim (keys in lanes: no horizontal sum per key);
// V's rows are decoded into [KT][d] and summed as R x 16-wide accumulators. For int8 and fp8 the
// rows hold the codes (fp8: the e4m3 value) and the per-token scale is applied to the 16 scores
// (K) and to the 16 probabilities (V) instead of to every element.
constexpr int64_t KT = 16;

// fast_exp over a vector (P: the intrinsics' prefix, BITS its width; ROUND: to nearest).
#define KVSERVE_EXP_PS(NAME, V, P, BITS, ROUND)                                                         \
  inline V NAME(V x) {                                                                                  \
    x = P##_max_ps(x, P##_set1_ps(-87.f));                                                              \
    const V t = P##_mul_ps(x, P##_set1_ps(1.44269504088896341f));                                       \
    const V n = ROUND(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);                                \
    const V f = P##_mul_ps(P##_sub_ps(t, n), P##_set1_ps(0.693147180559945309f));                       \
    V p = P##_set1_ps(1.f / 720.f);                                                                     \
    p = P##_fmadd_ps(p, f, P##_set1_ps(1.f / 120.f));                                                   \
    p = P##_fmadd_ps(p, f, P##_set1_ps(1.f / 24.f));                                                    \
    p = P##_fmadd_ps(p, f, P##_set1_ps(1.f / 6.f));                                                     \
    p = P##_fmadd_ps(p, f, P##_set1_ps(0.5f));                                                          \
    p = P##_fmadd_ps(p, f, P##_set1_ps(1.f));                                                           \
    p = P##_fmadd_ps(p, f, P##_set1_ps(1.f));                                                           \
    return P##_mul_ps(p, P##_castsi##BITS##_ps(P##_slli_epi32(                                          \
        P##_add_epi32(P##_cvtps_epi32(n), P##_set1_epi32(127)), 23)));                                  \
  }
KVSERVE_EXP_PS(exp_ps, __m256, _mm256, 256, _mm256_round_ps)  // 8 lanes

inline float hmax(__m256 v) {
  __m128 a = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  a = _mm_max_ps(a, _mm_movehl_ps(a, a));
  a = _mm_max_ss(a, _mm_shuffle_ps(a, a, 1));
  return _mm_cvtss_f32(a);
}

inline float hsum(__m256 v) {
  __m128 a = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  a = _mm_add_ps(a, _mm_movehl_ps(a, a));
  a = _mm_add_ss(a, _mm_shuffle_ps(a, a, 1));
  return _mm_cvtss_f32(a);
}

// dst[j * dstride + i] = src[i * sstride + j] for an 8 x 8 tile.
inline void transpose8(const float* src, int64_t sstride, float* dst, int64_t dstride) {
  __m256 r[8], t[8], u[8];
  for (int i = 0; i < 8; ++i) r[i] = _mm256_loadu_ps(src + i * sstride);
  for (int i = 0; i < 8; i += 2) {
    t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
  }
  for (int i = 0; i < 8; i += 4) {
    u[i] = _mm256_shuffle_ps(t[i], t[i + 2], _MM_SHUFFLE(1, 0, 1, 0));
    u[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], _MM_SHUFFLE(3, 2, 3, 2));
    u[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], _MM_SHUFFLE(1, 0, 1, 0));
    u[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], _MM_SHUFFLE(3, 2, 3, 2));
  }
  for (int i = 0; i < 4; ++i) {
    _mm256_storeu_ps(dst + i * dstride, _mm256_permute2f128_ps(u[i], u[i + 4], 0x20));
    _mm256_storeu_ps(dst + (i + 4) * dstride, _mm256_permute2f128_ps(u[i], u[i + 4], 0x31));
  }
}

// One row of d (a multiple of 8) elements to fp32: bf16, fp16, fp32, int8 codes, fp8 values.
inline void decode_row(int64_t kind, const uint8_t* p, int64_t d, float* o) {
  switch (kind) {
    case 0:
      for (int64_t i = 0; i < d; i += 8) {
        const __m128i x = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 2 * i));
        _mm256_storeu_ps(o + i, _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(x), 16)));
      }
      break;
    case 1:
#ifdef __F16C__
      for (int64_t i = 0; i < d; i += 8)
        _mm256_storeu_ps(o + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 2 * i))));
#else
      load_float_row(1, p, d, o);
#endif
      break;
    case 2:
      std::memcpy(o, p, d * sizeof(float));
      break;
    case 3:
      for (int64_t i = 0; i < d; i += 8) {
        const __m128i x = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + i));
        _mm256_storeu_ps(o + i, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(x)));
      }
      break;
    case 4:
      for (int64_t i = 0; i < d; i += 8) {
        const __m256i x = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + i)));
        const __m256i u = _mm256_and_si256(_mm256_slli_epi32(x, 20), _mm256_set1_epi32(static_cast<int32_t>(0x87F00000u)));
        _mm256_storeu_ps(o + i, _mm256_mul_ps(_mm256_castsi256_ps(u), _mm256_set1_ps(1.329227995784916e36f)));
      }
      break;
    default:
      break;
  }
}

// Rows t0..t1-1 of block b, head h, into out[(t - t0) * d + i], and each row's scale into
// rsc[t - t0]: the int8/fp8 rows hold codes (x = code * rsc), every other row its values (rsc 1).
void load_codes(const Side& s, const Shadow& sh, int64_t b, int64_t h, int64_t t0, int64_t t1, int64_t bs,
                int64_t kvh, int64_t d, float* out, float* rsc) {
  const uint8_t* blk = s.base + b * s.block_stride;
  int64_t shadow_rows = 0;
  const uint8_t* sbase = nullptr;
  if (sh.base != nullptr && sh.has[b]) {
    shadow_rows = sh.rows[b];
    sbase = sh.base + sh.slot[b] * bs * kvh * d * float_size(sh.kind);
  }
  for (int64_t t = t0; t < t1; ++t) {
    float* o = out + (t - t0) * d;
    const int64_t th = t * kvh + h;
    rsc[t - t0] = 1.f;
    if (t < shadow_rows) {
      decode_row(sh.kind, sbase + th * d * float_size(sh.kind), d, o);
    } else if (s.kind <= 2) {
      decode_row(s.kind, blk + th * d * float_size(s.kind), d, o);
    } else if (s.kind == 3 || s.kind == 4) {
      decode_row(s.kind, blk + s.q_off + th * d, d, o);
      rsc[t - t0] = reinterpret_cast<const float*>(blk + s.scale_off)[th];
    } else {
      load_rows(s, sh, b, h, t, t + 1, bs, kvh, d, o);  // int4: decoded values
    }
  }
}

// The R-row microkernels keep their accumulators in named variables (rows 0..5, unused ones
// compiled out by `if (R > r)`): GCC keeps an array of vectors in registers but also stores it
// to the stack on every iteration.
#define KVSERVE_ROWS(X) X(0) X(1) X(2) X(3) X(4) X(5)

// Asks for head h's rows t0..t1-1 of block b (codes and scales), one prefetch per cache line:
// the blocks of a table are scattered, so the hardware prefetchers do not see the next one
// coming and a tile would otherwise wait on each of its lines in turn.
inline void prefetch_line(const uint8_t* p) {
  // An asm statement: GCC dropped __builtin_prefetch / _mm_prefetch inside this file's kernel
  // (none reached the object code), this one it keeps. Into L2 (t1), as the tiled GEMM does: a
  // block's burst of prefetcht0 (64 lines for K and V of one head) stalled the tile's own loads
  // on a Zen 4 (16 x 2,048 decodes 0.82x the time with t1, 0.94x on the int8 pool; smaller
  // contexts unchanged: python benchmarks/paged_kernel.py --rev <before>).
  asm volatile("prefetcht1 %0" : : "m"(*p));
}

inline void prefetch_rows(const Side& s, int64_t b, int64_t h, int64_t t0, int64_t t1, int64_t kvh, int64_t d) {
  const uint8_t* blk = s.base + b * s.block_stride;
  int64_t row, off;
  if (s.kind <= 2) {
    row = d * float_size(s.kind);
    off = 0;
  } else if (s.kind <= 4) {
    row = d;
    off = s.q_off;
    for (int64_t x = t0 * kvh * 4; x < t1 * kvh * 4; x += 64) prefetch_line(blk + s.scale_off + x);
  } else {
    row = d / 2;
    off = s.q_off;
  }
  for (int64_t t = t0; t < t1; ++t) {
    const uint8_t* p = blk + off + (t * kvh + h) * row;
    for (int64_t x = 0; x < row; x += 64) prefetch_line(p + x);
  }
}

// fn(b, kpos0, c0, nt) for each tile of keys lo..hi-1 of a table: block b, its rows c0..c0+nt-1
// (nt <= KT), the first at position kpos0; the next block's rows of head h are prefetched while a
// block is computed.
template <typename F>
inline void for_each_key_tile(const int64_t* table, int64_t lo, int64_t hi, int64_t bs, const Side& ks, const Side& vs,
                              int64_t h, int64_t kvh, int64_t d, F&& fn) {
  for (int64_t blk = lo / bs; blk * bs < hi; ++blk) {
    const int64_t b = table[blk];
    const int64_t t0 = std::max(lo - blk * bs, int64_t(0)), t1 = std::min(hi - blk * bs, bs);
    if ((blk + 1) * bs < hi) {
      const int64_t nb = table[blk + 1], n1 = std::min(hi - (blk + 1) * bs, bs);
      prefetch_rows(ks, nb, h, 0, n1, kvh, d);
      prefetch_rows(vs, nb, h, 0, n1, kvh, d);
    }
    for (int64_t c0 = t0; c0 < t1; c0 += KT) fn(b, blk * bs + c0, c0, std::min(t1 - c0, KT));
  }
}

// S[r][0..KT) = Q[r] . Kt[:, 0..KT) for R rows (Q rows d apart, S rows KT apart).
template <int R>
inline void qk_tile(const float* Q, int64_t d, const float* Kt, float* S) {
#define KVSERVE_DECL(r) __m256 a##r##0 = _mm256_setzero_ps(), a##r##1 = _mm256_setzero_ps();
  KVSERVE_ROWS(KVSERVE_DECL)
#undef KVSERVE_DECL
  for (int64_t e = 0; e < d; ++e) {
    const __m256 k0 = _mm256_loadu_ps(Kt + e * KT), k1 = _mm256_loadu_ps(Kt + e * KT + 8);
#define KVSERVE_FMA(r)                                     \
  if (R > r) {                                             \
    const __m256 qb = _mm256_broadcast_ss(Q + r * d + e);  \
    a##r##0 = _mm256_fmadd_ps(qb, k0, a##r##0);            \
    a##r##1 = _mm256_fmadd_ps(qb, k1, a##r##1);            \
  }
    KVSERVE_ROWS(KVSERVE_FMA)
#undef KVSERVE_FMA
  }
#define KVSERVE_STORE(r)                         \
  if (R > r) {                                   \
    _mm256_storeu_ps(S + r * KT, a##r##0);       \
    _mm256_storeu_ps(S + r * KT + 8, a##r##1);   \
  }
  KVSERVE_ROWS(KVSERVE_STORE)
#undef KVSERVE_STORE
}

// O[r] += sum_t P[r][t] V[t] for R rows, t < nt (O rows d apart, P rows KT apart).
template <int R>
inline void pv_tile(const float* P, const float* V, int64_t nt, int64_t d, float* O) {
  int64_t e0 = 0;
  for (; e0 + 16 <= d; e0 += 16) {
#define KVSERVE_DECL(r)                                                     \
  __m256 a##r##0 = R > r ? _mm256_loadu_ps(O + r * d + e0) : _mm256_setzero_ps(), \
         a##r##1 = R > r ? _mm256_loadu_ps(O + r * d + e0 + 8) : _mm256_setzero_ps();
    KVSERVE_ROWS(KVSERVE_DECL)
#undef KVSERVE_DECL
    for (int64_t t = 0; t < nt; ++t) {
      const __m256 v0 = _mm256_loadu_ps(V + t * d + e0), v1 = _mm256_loadu_ps(V + t * d + e0 + 8);
#define KVSERVE_FMA(r)                                     \
  if (R > r) {                                             \
    const __m256 pb = _mm256_broadcast_ss(P + r * KT + t); \
    a##r##0 = _mm256_fmadd_ps(pb, v0, a##r##0);            \
    a##r##1 = _mm256_fmadd_ps(pb, v1, a##r##1);            \
  }
      KVSERVE_ROWS(KVSERVE_FMA)
#undef KVSERVE_FMA
    }
#define KVSERVE_STORE(r)                            \
  if (R > r) {                                      \
    _mm256_storeu_ps(O + r * d + e0, a##r##0);      \
    _mm256_storeu_ps(O + r * d + e0 + 8, a##r##1);  \
  }
    KVSERVE_ROWS(KVSERVE_STORE)
#undef KVSERVE_STORE
  }
  if (e0 < d) {  // d % 16 == 8
#define KVSERVE_DECL(r) __m256 a##r = R > r ? _mm256_loadu_ps(O + r * d + e0) : _mm256_setzero_ps();
    KVSERVE_ROWS(KVSERVE_DECL)
#undef KVSERVE_DECL
    for (int64_t t = 0; t < nt; ++t) {
      const __m256 v0 = _mm256_loadu_ps(V + t * d + e0);
#define KVSERVE_FMA(r) \
  if (R > r) a##r = _mm256_fmadd_ps(_mm256_broadcast_ss(P + r * KT + t), v0, a##r);
      KVSERVE_ROWS(KVSERVE_FMA)
#undef KVSERVE_FMA
    }
#define KVSERVE_STORE(r) \
  if (R > r) _mm256_storeu_ps(O + r * d + e0, a##r);
    KVSERVE_ROWS(KVSERVE_STORE)
#undef KVSERVE_STORE
  }
}
#undef KVSERVE_ROWS

// Rows in near-equal chunks of at most 6 (12 accumulators + 2 loads + a broadcast: 15 of the 16
// ymm registers); fn(r0, n) runs the n-row instance.
template <typename F>
inline void row_chunks(int64_t rows, F&& fn) {
  const int64_t chunks = (rows + 5) / 6, per = (rows + chunks - 1) / chunks;
  for (int64_t r0 = 0; r0 < rows; r0 += per) fn(r0, std::min(per, rows - r0));
}

#define KVSERVE_TILE_CASES(CALL) \
  switch (n) {                   \
    case 1: CALL(1); break;      \
    case 2: CALL(2); break;      \
    case 3: CALL(3); break;      \
    case 4: CALL(4); break;      \
    case 5: CALL(5); break;      \
    default: CALL(6); break;     \
  }

inline void qk_rows(const float* Q, int64_t rows, int64_t d, const float* Kt, float* S) {
  row_chunks(rows, [&](int64_t r0, int64_t n) {
#define KVSERVE_QK(R) qk_tile<R>(Q + r0 * d, d, Kt, S + r0 * KT)
    KVSERVE_TILE_CASES(KVSERVE_QK)
#undef KVSERVE_QK
  });
}

inline void pv_rows(const float* P, const float* V, int64_t nt, int64_t rows, int64_t d, float* O) {
  row_chunks(rows, [&](int64_t r0, int64_t n) {
#define KVSERVE_PV(R) pv_tile<R>(P + r0 * KT, V, nt, d, O + r0 * d)
    KVSERVE_TILE_CASES(KVSERVE_PV)
#undef KVSERVE_PV
  });
}

template <typename T>
void run_tiled(const torch::Tensor& q, torch::Tensor& out, const int64_t* q_start, const int64_t* q_len,
               const int64_t* seq_len, const int64_t* window, const int64_t* tables, int64_t table_stride,
               int64_t num_seqs, float scale, int64_t bs, int64_t kvh, const Side& ks, const Side& vs,
               const Shadow& shk, const Shadow& shv, int64_t q_tile) {
  const int64_t heads = q.size(1), g = heads / kvh, d = q.size(2);
  const T* qp = q.data_ptr<T>();
  T* op = out.data_ptr<T>();
  const std::vector<int64_t> tile0 = query_tiles(q_len, num_seqs, q_tile);
  const int64_t tasks = tile0[num_seqs] * kvh;
  at::parallel_for(0, tasks, 1, [&](int64_t begin, int64_t end) {
    const int64_t max_rows = g * q_tile;
    std::vector<float> Q(max_rows * d), O(max_rows * d), m(max_rows), l(max_rows);
    std::vector<float> Kr(KT * d, 0.f), Kt(d * KT), V(KT * d), S(max_rows * KT), P(max_rows * KT);
    float ksc[KT], vsc[KT];
    std::vector<int64_t> qpos(max_rows);
    const __m256 iota0 = _mm256_setr_ps(0, 1, 2, 3, 4, 5, 6, 7), iota1 = _mm256_setr_ps(8, 9, 10, 11, 12, 13, 14, 15);
    const __m256 ninf = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
    for (int64_t task = begin; task < end; ++task) {
      const Task tk = begin_task(task, tile0, kvh, g, heads, d, q_tile, qp, q_start, q_len, seq_len, window, scale,
                                 Q.data(), qpos.data(), O.data(), m.data(), l.data());
      const int64_t h = tk.h, s = tk.s, rows = tk.rows, w = tk.w, lo = tk.lo, hi = tk.hi;
      const int64_t* table = tables + s * table_stride;
      for_each_key_tile(table, lo, hi, bs, ks, vs, h, kvh, d, [&](int64_t b, int64_t kpos0, int64_t c0, int64_t nt) {
        load_codes(ks, shk, b, h, c0, c0 + nt, bs, kvh, d, Kr.data(), ksc);
        load_codes(vs, shv, b, h, c0, c0 + nt, bs, kvh, d, V.data(), vsc);
        if (nt < KT) {  // padding keys: zero rows and scales (their scores are masked anyway)
          std::fill(Kr.begin() + nt * d, Kr.end(), 0.f);
          std::fill(ksc + nt, ksc + KT, 0.f);
        }
        for (int64_t tb = 0; tb < KT; tb += 8)
          for (int64_t e = 0; e < d; e += 8) transpose8(Kr.data() + tb * d + e, d, Kt.data() + e * KT + tb, KT);
        qk_rows(Q.data(), rows, d, Kt.data(), S.data());
        const __m256 k0 = _mm256_loadu_ps(ksc), k1 = _mm256_loadu_ps(ksc + 8);
        const __m256 v0s = _mm256_loadu_ps(vsc), v1s = _mm256_loadu_ps(vsc + 8);
        for (int64_t r = 0; r < rows; ++r) {
          const int64_t qp_r = qpos[r];
          const int64_t a = w > 0 ? std::max<int64_t>(0, qp_r - w + 1 - kpos0) : 0;
          const int64_t z = std::min<int64_t>(nt, qp_r - kpos0 + 1);
          float* pr = P.data() + r * KT;
          if (a >= z) {
            _mm256_storeu_ps(pr, _mm256_setzero_ps());
            _mm256_storeu_ps(pr + 8, _mm256_setzero_ps());
            continue;
          }
          const __m256 av = _mm256_set1_ps(static_cast<float>(a)), zv = _mm256_set1_ps(static_cast<float>(z));
          const __m256 mk0 = _mm256_and_ps(_mm256_cmp_ps(iota0, av, _CMP_GE_OQ), _mm256_cmp_ps(iota0, zv, _CMP_LT_OQ));
          const __m256 mk1 = _mm256_and_ps(_mm256_cmp_ps(iota1, av, _CMP_GE_OQ), _mm256_cmp_ps(iota1, zv, _CMP_LT_OQ));
          const float* sr = S.data() + r * KT;
          const __m256 s0 = _mm256_blendv_ps(ninf, _mm256_mul_ps(_mm256_loadu_ps(sr), k0), mk0);
          const __m256 s1 = _mm256_blendv_ps(ninf, _mm256_mul_ps(_mm256_loadu_ps(sr + 8), k1), mk1);
          const float mx = std::max(m[r], hmax(_mm256_max_ps(s0, s1)));
          const __m256 mxv = _mm256_set1_ps(mx);
          const __m256 p0 = _mm256_and_ps(exp_ps(_mm256_sub_ps(s0, mxv)), mk0);
          const __m256 p1 = _mm256_and_ps(exp_ps(_mm256_sub_ps(s1, mxv)), mk1);
          const float corr = m[r] == -std::numeric_limits<float>::infinity() ? 0.f : std::exp(m[r] - mx);
          l[r] = l[r] * corr + hsum(_mm256_add_ps(p0, p1));
          m[r] = mx;
          if (corr != 1.f) {
            float* orow = O.data() + r * d;
            const __m256 cv = _mm256_set1_ps(corr);
            for (int64_t e = 0; e < d; e += 8) _mm256_storeu_ps(orow + e, _mm256_mul_ps(_mm256_loadu_ps(orow + e), cv));
          }
          _mm256_storeu_ps(pr, _mm256_mul_ps(p0, v0s));
          _mm256_storeu_ps(pr + 8, _mm256_mul_ps(p1, v1s));
        }
        pv_rows(P.data(), V.data(), nt, rows, d, O.data());
      });
      end_task(tk, g, heads, d, q_start, O.data(), l.data(), op);
    }
  });
}
#undef KVSERVE_TILE_CASES

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512BF16__)
#define KVSERVE_BF16DOT 1
// ---- The bf16-dot path (AVX512-BF16; bf16 queries on the bf16, int8 or fp8 pool; head_dim % 32 == 0)
// Keys are taken KT = 16 at a time, as in the tiled path, but the products run on vdpbf16ps (two
// bf16 products per fp32 lane per instruction):
// * scores: the tile's K rows are transposed as 32-bit words (one word = 2 adjacent head_dim
//   elements of one key) to Kw [d/2][16 keys]; each query row's word w is broadcast, so d/2
//   instructions give the row's 16 scores. Queries and keys are bf16 and their products exact,
//   sums in fp32: the scores are what the fp32 path computes, up to summation order;
// * values: the probabilities are rounded to bf16 (what torch's CPU flash kernel does for bf16)
//   and paired over keys; the V rows of keys 2k and 2k+1 are interleaved (Vw [8 pairs][d] words,
//   head_dim in the in-lane unpack order, O summed in it and put back when the task ends) and each
//   row's pair (p_2k, p_2k+1) is broadcast: 8 instructions per 16 head_dim values.
// The online softmax (max, correction, sum) is the tiled path's, 16 lanes wide, with its own exp.

// exp(x - mx) over 16 lanes (x <= mx), given mxl = mx log2(e), in 9 instructions where the tiled
// path's sub + exp_ps take 16: (x - mx) log2(e) = n + f with |f| <= 1/2 (one fused multiply-subtract:
// the product is exact, so the error is mxl's rounding, a factor shared by a row's terms), 2^f by
// its degree-5 minimax polynomial (relative error 2.4e-7, as the degree-6 Taylor series of e^r),
// and 2^n applied by vscalefps, which gives 0 below the float range (no clamp, shift or multiply).
// Lanes outside ``keep`` are 0 (the scale instruction's own zero-masking; they may hold -inf).
inline __m512 exp_diff_ps16(__m512 x, __m512 mxl, __mmask16 keep) {
  const __m512 t = _mm512_fmsub_ps(x, _mm512_set1_ps(1.44269504088896341f), mxl);
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(t, n);
  __m512 p = _mm512_set1_ps(1.3276470687692812e-3f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.675541324043649e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.550713277534307e-2f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.24022119724099122f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.6931469670622895f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.000000071654604f));
  return _mm512_maskz_scalef_ps(keep, p, n);
}

#include "transpose16.h"

// The bf16 rows of keys c0..c0+nt-1 of block b, head h (row[k]; nullptr past nt) and their scales
// (rsc[k]; 0 past nt): the pool's own rows (bf16), a shadow's (bf16, scale 1), or int8 codes and
// fp8 e4m3 values widened to bf16 in ``stage`` (exact: both are bf16 values) with the codec's
// per-token scale, which is applied to the 16 scores (K) or the 16 probabilities (V).
inline void bf16_rows(const Side& s, const Shadow& sh, int64_t b, int64_t h, int64_t c0, int64_t nt, int64_t bs,
                      int64_t kvh, int64_t d, uint16_t* stage, const uint16_t** row, float* rsc) {
  const uint8_t* blk = s.base + b * s.block_stride;
  const int64_t shadow_rows = sh.base != nullptr && sh.has[b] ? sh.rows[b] : 0;
  for (int64_t k = 0; k < KT; ++k) {
    const int64_t t = c0 + k, th = t * kvh + h;
    rsc[k] = k < nt ? 1.f : 0.f;
    if (k >= nt) {
      row[k] = nullptr;
    } else if (t < shadow_rows) {
      row[k] = reinterpret_cast<const uint16_t*>(sh.base + (sh.slot[b] * bs * kvh + th) * d * 2);
    } else if (s.kind == 0) {
      row[k] = reinterpret_cast<const uint16_t*>(blk + th * d * 2);
    } else {  // 3 int8, 4 fp8 e4m3: codes at q_off, fp32 scale per (token, head) at scale_off
      const int8_t* c = reinterpret_cast<const int8_t*>(blk + s.q_off) + th * d;
      uint16_t* o = stage + k * d;
      for (int64_t e = 0; e < d; e += 16) {
        const __m512i x = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(c + e)));
        const __m512 f = s.kind == 3 ? _mm512_cvtepi32_ps(x)
                                     : _mm512_mul_ps(_mm512_castsi512_ps(_mm512_and_si512(_mm512_slli_epi32(x, 20),
                                                         _mm512_set1_epi32(static_cast<int32_t>(0x87F00000u)))),
                                                     _mm512_set1_ps(1.329227995784916e36f));  // e4m3 (fp8_to_f)
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(o + e), (__m256i)_mm512_cvtneps_pbh(f));
      }
      row[k] = o;
      rsc[k] = reinterpret_cast<const float*>(blk + s.scale_off)[th];
    }
  }
}

// Kw[w * 16 + k] = word w of key k's row (a missing row: 0).
inline void load_key_words(const uint16_t* const* row, int64_t d, uint32_t* Kw) {
  for (int64_t w0 = 0; w0 < d / 2; w0 += 16) {
    __m512i r[16];
    for (int64_t k = 0; k < 16; ++k) r[k] = row[k] ? _mm512_loadu_si512(row[k] + w0 * 2) : _mm512_setzero_si512();
    transpose16x16(r);
    for (int64_t i = 0; i < 16; ++i) _mm512_storeu_si512(Kw + (w0 + i) * 16, r[i]);
  }
}

// Vw[(k * d + e) * 2 + {0, 1}] = (v_2k[e], v_2k+1[e]) as one word per (pair k, element e) (a missing
// row's values are 0).
inline void load_value_pairs(const uint16_t* const* row, int64_t d, uint16_t* Vw) {
  const __m512i idx = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8,
                                       23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  for (int64_t k = 0; k < KT / 2; ++k) {
    const uint16_t *a = row[2 * k], *z = row[2 * k + 1];
    for (int64_t e = 0; e < d; e += 16) {
      const __m256i va = a ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a + e)) : _mm256_setzero_si256();
      const __m256i vb = z ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(z + e)) : _mm256_setzero_si256();
      const __m512i both = _mm512_inserti64x4(_mm512_castsi256_si512(va), vb, 1);
      _mm512_storeu_si512(Vw + (k * d + e) * 2, _mm512_permutexvar_epi16(idx, both));
    }
  }
}

#define KVSERVE_ROWS8(X) X(0) X(1) X(2) X(3) X(4) X(5) X(6) X(7)

// S[r][0..16) = sum_w Qw[r][w] . Kw[w] for R rows (Qw rows d/2 words apart, S rows ss apart).
template <int R>
inline void qk_words(const uint32_t* Qw, int64_t d, const uint32_t* Kw, float* S, int64_t ss) {
#define KVSERVE_DECL(r) __m512 a##r = _mm512_setzero_ps();
  KVSERVE_ROWS8(KVSERVE_DECL)
#undef KVSERVE_DECL
  const int64_t words = d / 2;
  for (int64_t w = 0; w < words; ++w) {
    const __m512bh k = (__m512bh)_mm512_loadu_si512(Kw + w * 16);
#define KVSERVE_DOT(r) \
  if (R > r) a##r = _mm512_dpbf16_ps(a##r, k, (__m512bh)_mm512_set1_epi32(static_cast<int>(Qw[r * words + w])));
    KVSERVE_ROWS8(KVSERVE_DOT)
#undef KVSERVE_DOT
  }
#define KVSERVE_STORE(r) \
  if (R > r) _mm512_storeu_ps(S + r * ss, a##r);
  KVSERVE_ROWS8(KVSERVE_STORE)
#undef KVSERVE_STORE
}
#undef KVSERVE_ROWS8

// O[r][e0..e0+16C) += sum_k Pw[r][k] . Vw[k][e0..] over ``pairs`` key pairs, for R <= 4 rows (Pw rows
// ps words apart, O rows d apart).
template <int R, int C>
inline void pv_words(const uint32_t* Pw, int64_t ps, const uint16_t* Vw, int64_t pairs, int64_t d, int64_t e0,
                     float* O) {
#define KVSERVE_DECL(r, c) \
  __m512 a##r##c = (R > r && C > c) ? _mm512_loadu_ps(O + r * d + e0 + 16 * c) : _mm512_setzero_ps();
#define KVSERVE_ROW(r) KVSERVE_DECL(r, 0) KVSERVE_DECL(r, 1) KVSERVE_DECL(r, 2) KVSERVE_DECL(r, 3)
  KVSERVE_ROW(0) KVSERVE_ROW(1) KVSERVE_ROW(2) KVSERVE_ROW(3)
#undef KVSERVE_ROW
#undef KVSERVE_DECL
  for (int64_t k = 0; k < pairs; ++k) {
    const uint16_t* v = Vw + (k * d + e0) * 2;
    const __m512bh v0 = (__m512bh)_mm512_loadu_si512(v);
    const __m512bh v1 = C > 1 ? (__m512bh)_mm512_loadu_si512(v + 32) : v0;
    const __m512bh v2 = C > 2 ? (__m512bh)_mm512_loadu_si512(v + 64) : v0;
    const __m512bh v3 = C > 3 ? (__m512bh)_mm512_loadu_si512(v + 96) : v0;
#define KVSERVE_DOT(r)                                                                      \
  if (R > r) {                                                                              \
    const __m512bh p = (__m512bh)_mm512_set1_epi32(static_cast<int>(Pw[r * ps + k]));        \
    a##r##0 = _mm512_dpbf16_ps(a##r##0, v0, p);                                             \
    if (C > 1) a##r##1 = _mm512_dpbf16_ps(a##r##1, v1, p);                                  \
    if (C > 2) a##r##2 = _mm512_dpbf16_ps(a##r##2, v2, p);                                  \
    if (C > 3) a##r##3 = _mm512_dpbf16_ps(a##r##3, v3, p);                                  \
  }
    KVSERVE_DOT(0) KVSERVE_DOT(1) KVSERVE_DOT(2) KVSERVE_DOT(3)
#undef KVSERVE_DOT
  }
#define KVSERVE_STORE(r, c) \
  if (R > r && C > c) _mm512_storeu_ps(O + r * d + e0 + 16 * c, a##r##c);
#define KVSERVE_ROW(r) KVSERVE_STORE(r, 0) KVSERVE_STORE(r, 1) KVSERVE_STORE(r, 2) KVSERVE_STORE(r, 3)
  KVSERVE_ROW(0) KVSERVE_ROW(1) KVSERVE_ROW(2) KVSERVE_ROW(3)
#undef KVSERVE_ROW
#undef KVSERVE_STORE
}

// fn(std::integral_constant<int, n>{}) for n = min(n, R) >= 1: the n-row instance of a kernel.
template <int R, typename F>
inline void with_rows(int64_t n, F&& fn) {
  if constexpr (R > 1) {
    if (n < R) {
      with_rows<R - 1>(n, fn);
      return;
    }
  }
  fn(std::integral_constant<int, R>{});
}

// Rows in blocks of R (the last one shorter): fn(r0, n) with n as in with_rows.
template <int R, typename F>
inline void row_blocks(int64_t rows, F&& fn) {
  for (int64_t r0 = 0; r0 < rows; r0 += R) with_rows<R>(rows - r0, [&](auto n) { fn(r0, n); });
}

inline void qk_word_rows(const uint32_t* Qw, int64_t rows, int64_t d, const uint32_t* Kw, float* S, int64_t ss) {
  row_blocks<8>(rows, [&](int64_t r0, auto n) { qk_words<decltype(n)::value>(Qw + r0 * (d / 2), d, Kw, S + r0 * ss, ss); });
}

template <int C>
inline void pv_word_rows_c(const uint32_t* Pw, int64_t ps, const uint16_t* Vw, int64_t pairs, int64_t rows,
                           int64_t d, float* O) {
  for (int64_t e0 = 0; e0 < d; e0 += 16 * C)
    row_blocks<4>(rows, [&](int64_t r0, auto n) {
      pv_words<decltype(n)::value, C>(Pw + r0 * ps, ps, Vw, pairs, d, e0, O + r0 * d);
    });
}

inline void pv_word_rows(const uint32_t* Pw, int64_t ps, const uint16_t* Vw, int64_t pairs, int64_t rows, int64_t d,
                         float* O) {
  if (d % 64 == 0) pv_word_rows_c<4>(Pw, ps, Vw, pairs, rows, d, O);
  else pv_word_rows_c<2>(Pw, ps, Vw, pairs, rows, d, O);
}

// The keys of a tile (positions kpos.., nt of them) visible to a query at position qpos under the
// causal mask and a window w (0: none), as a lane mask; full tiles give 0xFFFF without compares.
inline __mmask16 visible_keys(int64_t qpos, int64_t w, int64_t kpos, int64_t nt, __m512 iota) {
  const int64_t a = w > 0 ? std::max<int64_t>(0, qpos - w + 1 - kpos) : 0;
  const int64_t z = std::min<int64_t>(nt, qpos - kpos + 1);
  if (a >= z) return 0;
  if (a == 0 && z == KT) return static_cast<__mmask16>(0xFFFF);
  return static_cast<__mmask16>(_mm512_cmp_ps_mask(iota, _mm512_set1_ps(static_cast<float>(a)), _CMP_GE_OQ) &
                                _mm512_cmp_ps_mask(iota, _mm512_set1_ps(static_cast<float>(z)), _CMP_LT_OQ));
}

// An output row's running sums times the softmax's correction (skipped when it is 1).
inline void rescale_row(float* orow, int64_t d, float corr) {
  if (corr == 1.f) return;
  const __m512 cv = _mm512_set1_ps(corr);
  for (int64_t e = 0; e < d; e += 16) _mm512_storeu_ps(orow + e, _mm512_mul_ps(_mm512_loadu_ps(orow + e), cv));
}

// One row's step of the online softmax over ng tiles' scores sv (masked lanes -inf, mk the masks):
// store(t, p) takes tile t's probabilities (0 where masked) against the new running max; *m
// becomes that max, *sum the probabilities' lane sums, *corr the factor for what was summed before.
// False (nothing stored or changed) when no key of the tiles is visible to the row.
template <typename Store>
inline bool softmax_step(const __m512* sv, const __mmask16* mk, int64_t ng, float* m, __m512* sum, float* corr,
                         Store&& store) {
  __m512 vmax = sv[0];
  for (int64_t t = 1; t < ng; ++t) vmax = _mm512_max_ps(vmax, sv[t]);
  const float gmax = _mm512_reduce_max_ps(vmax);
  if (gmax == -std::numeric_limits<float>::infinity()) return false;
  const float mx = std::max(*m, gmax);
  const __m512 mxl = _mm512_set1_ps(mx * 1.44269504088896341f);
  __m512 acc = _mm512_setzero_ps();
  for (int64_t t = 0; t < ng; ++t) {
    const __m512 p = exp_diff_ps16(sv[t], mxl, mk[t]);
    acc = _mm512_add_ps(acc, p);
    store(t, p);
  }
  *corr = *m == -std::numeric_limits<float>::infinity() ? 0.f : std::exp(*m - mx);
  *m = mx;
  *sum = acc;
  return true;
}

// Tiles per softmax step: the scores of up to KG tiles (128 keys) are taken together, so a row's
// max and correction (a horizontal max, a scalar exp) are paid once per 128 keys (session 14: 8
// tiles, masks per query token and the row sums kept 16 lanes wide took 0.85-0.95x the time of
// 4 tiles on prefill chunks, benchmarks/paged_kernel.py --rev).
constexpr int64_t KG = 8;

// One flush's online softmax for every row of a task (row r = query token r / g, head r % g):
// row r's scores are S[r * ss + t * KT ..] times kss[t], masked to the keys its token sees (the
// masks computed once per token); store(pw, t, p) writes tile t's probabilities into the row's P
// words pw (zeroed when no key of the tiles is visible to it); m, the 16-lane sums lv and the
// output rows O are carried over with the correction.
template <typename Store>
inline void softmax_rows(int64_t rows, int64_t g, const int64_t* qpos, int64_t w, const int64_t* kpos,
                         const int64_t* ntl, int64_t ng, const __m512* kss, const float* S, int64_t ss, uint32_t* Pw,
                         int64_t ps, float* m, float* lv, float* O, int64_t d, Store&& store) {
  const __m512 iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const __m512 ninf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  __mmask16 mk[KG];
  for (int64_t r = 0; r < rows; ++r) {
    if (r % g == 0) {  // a new query token: its masks
      for (int64_t t = 0; t < ng; ++t) mk[t] = visible_keys(qpos[r], w, kpos[t], ntl[t], iota);
    }
    __m512 sv[KG];
    for (int64_t t = 0; t < ng; ++t) sv[t] = _mm512_mask_mul_ps(ninf, mk[t], _mm512_loadu_ps(S + r * ss + t * KT), kss[t]);
    uint32_t* pw = Pw + r * ps;
    __m512 sum;
    float corr;
    if (!softmax_step(sv, mk, ng, &m[r], &sum, &corr, [&](int64_t t, __m512 p) { store(pw, t, p); })) {
      std::memset(pw, 0, ng * KT * 2);
      continue;
    }
    float* lr = lv + r * 16;
    _mm512_storeu_ps(lr, _mm512_fmadd_ps(_mm512_loadu_ps(lr), _mm512_set1_ps(corr), sum));
    rescale_row(O + r * d, d, corr);
  }
}

#include "amx_attention.h"  // the two products on AMX tiles (run_bf16dot<true>)

// Calls that took the AMX products (amx_calls(): how tests tell which path ran, as the two give the
// same bits).
std::atomic<int64_t> amx_call_count{0};

// Amx: the scores and the V sums on AMX tiles (amx_attention.h; the caller checks usable()), the
// scores of a flush's tiles taken together when it flushes; else on vdpbf16ps, tile by tile.
template <bool Amx>
void run_bf16dot(const torch::Tensor& q, torch::Tensor& out, const int64_t* q_start, const int64_t* q_len,
                 const int64_t* seq_len, const int64_t* window, const int64_t* tables, int64_t table_stride,
                 int64_t num_seqs, float scale, int64_t bs, int64_t kvh, const Side& ks, const Side& vs,
                 const Shadow& shk, const Shadow& shv, int64_t q_tile) {
  using T = at::BFloat16;
  const int64_t heads = q.size(1), g = heads / kvh, d = q.size(2);
  const int64_t ss = KT * KG, ps = KT / 2 * KG;  // S and Pw row strides
  const T* qp = q.data_ptr<T>();
  T* op = out.data_ptr<T>();
  const std::vector<int64_t> tile0 = query_tiles(q_len, num_seqs, q_tile);
  const int64_t tasks = tile0[num_seqs] * kvh;
  if constexpr (Amx) amx_call_count.fetch_add(1, std::memory_order_relaxed);
  at::parallel_for(0, tasks, 1, [&](int64_t begin, int64_t end) {
    const int64_t max_rows = (g * q_tile + 15) / 16 * 16;  // the tiles' 16-row blocks (past the rows: unread)
    std::vector<float> O(max_rows * d), m(max_rows), l(max_rows), lv(max_rows * 16), S(max_rows * ss);
    std::vector<uint32_t> Qw(max_rows * d / 2), Kw(d / 2 * KT * (Amx ? KG : 1)), Pw(max_rows * ps);
    std::vector<uint16_t> Vw(KT * KG * d), stage(KT * d);
    std::vector<int64_t> qpos(max_rows);
    int64_t kpos[KG], ntl[KG], ng = 0;
    const uint16_t* row[KT];
    float ksc[KG][KT], vsc[KG][KT];
    const __m512 scv = _mm512_set1_ps(scale);
#if KVS_AMX
    if constexpr (Amx) configure_tiles();
#endif
    for (int64_t task = begin; task < end; ++task) {
      const Task tk = begin_task(task, tile0, kvh, g, heads, d, q_tile, qp, q_start, q_len, seq_len, window, scale,
                                 nullptr, qpos.data(), O.data(), m.data(), l.data());  // Q: its own bf16 words
      const int64_t h = tk.h, s = tk.s, rows = tk.rows, w = tk.w, lo = tk.lo, hi = tk.hi;
      for (int64_t r = 0; r < rows; ++r) {  // the rows' own bf16 bits (unscaled): row r = (token, head in group)
        const int64_t i = tk.i0 + r / g, j = r % g;
        std::memcpy(Qw.data() + r * d / 2, qp + ((q_start[s] + i) * heads + h * g + j) * d, d * 2);
      }
      std::fill(lv.begin(), lv.begin() + rows * 16, 0.f);
      // The online softmax over the ng tiles gathered (scores in S, value pairs in Vw), then O += P V.
      // The rows of one query token (g in a row) share its masks; l stays 16 lanes wide until the task ends.
      const int64_t row_blocks = (rows + 15) / 16;
      auto flush = [&]() {
#if KVS_AMX
        if constexpr (Amx) amx_scores(Qw.data(), row_blocks, d, Kw.data(), ng, S.data(), ss);
#endif
        __m512 kss[KG];
        for (int64_t t = 0; t < ng; ++t) kss[t] = _mm512_mul_ps(scv, _mm512_loadu_ps(ksc[t]));
        softmax_rows(rows, g, qpos.data(), w, kpos, ntl, ng, kss, S.data(), ss, Pw.data(), ps, m.data(), lv.data(),
                     O.data(), d, [&](uint32_t* pw, int64_t t, __m512 p) {
                       // A bf16 V side's scales are 1 (0 past nt, where p is masked to 0 already).
                       if (vs.kind != 0) p = _mm512_mul_ps(p, _mm512_loadu_ps(vsc[t]));
                       _mm256_storeu_si256(reinterpret_cast<__m256i*>(pw + t * KT / 2), (__m256i)_mm512_cvtneps_pbh(p));
                     });
#if KVS_AMX
        if constexpr (Amx) {
          if (ng % 2 == 1) {  // the last 32-key chunk's second tile: no keys (P and V zero)
            for (int64_t r = 0; r < row_blocks * 16; ++r) std::memset(Pw.data() + r * ps + ng * KT / 2, 0, KT * 2);
            std::memset(Vw.data() + ng * KT * d, 0, KT * d * 2);
          }
          amx_values(Pw.data(), ps, reinterpret_cast<const uint32_t*>(Vw.data()), (ng + 1) / 2, row_blocks, d,
                     O.data());
        }
#endif
        if constexpr (!Amx) pv_word_rows(Pw.data(), ps, Vw.data(), ng * KT / 2, rows, d, O.data());
        ng = 0;
      };
      const int64_t* table = tables + s * table_stride;
      for_each_key_tile(table, lo, hi, bs, ks, vs, h, kvh, d, [&](int64_t b, int64_t kpos0, int64_t c0, int64_t nt) {
        bf16_rows(ks, shk, b, h, c0, nt, bs, kvh, d, stage.data(), row, ksc[ng]);
        if constexpr (Amx) {
          load_key_words(row, d, Kw.data() + ng * (d / 2) * KT);  // the scores when the flush comes
        } else {
          load_key_words(row, d, Kw.data());
          qk_word_rows(Qw.data(), rows, d, Kw.data(), S.data() + ng * KT, ss);
        }
        bf16_rows(vs, shv, b, h, c0, nt, bs, kvh, d, stage.data(), row, vsc[ng]);
        load_value_pairs(row, d, Vw.data() + ng * KT * d);
        kpos[ng] = kpos0;
        ntl[ng] = nt;
        if (++ng == KG) flush();
      });
      if (ng > 0) flush();
      for (int64_t r = 0; r < rows; ++r) l[r] = _mm512_reduce_add_ps(_mm512_loadu_ps(lv.data() + r * 16));
      end_task(tk, g, heads, d, q_start, O.data(), l.data(), op);
    }
#if KVS_AMX
    if constexpr (Amx) _tile_release();
#endif
  });
}
#include "paged_int8.h"  // the int8-dot path (AVX512-VNNI)
#endif  // KVSERVE_BF16DOT
#endif  // KVSERVE_AVX2

Side make_side(const torch::Tensor& base, const std::vector<int64_t>& p) {
  TORCH_CHECK(p.size() == 6, "side params: kind, block_stride, scale_off, zero_off, q_off, group");
  return Side{p[0], static_cast<const uint8_t*>(base.data_ptr()), p[1], p[2], p[3], p[4], p[5]};
}

int64_t float_kind(const torch::Tensor& t) {
  if (t.scalar_type() == at::kBFloat16) return 0;
  if (t.scalar_type() == at::kHalf) return 1;
  TORCH_CHECK(t.scalar_type() == at::kFloat, "shadow dtype must be bf16, fp16 or fp32");
  return 2;
}

}  // namespace

bool bf16dot_available() {
#ifdef KVSERVE_BF16DOT
  return true;
#else
  return false;
#endif
}

// Whether the bf16-dot path's products run on AMX tiles here (built with AMX and the process may
// use them: amx_state.h); impl 4 turns them off per call.
bool amx_available() {
#ifdef KVSERVE_BF16DOT
  return KVS_AMX && usable();
#else
  return false;
#endif
}

int64_t amx_calls() {
#ifdef KVSERVE_BF16DOT
  return amx_call_count.load();
#else
  return 0;
#endif
}

bool int8dot_available() {
#ifdef KVSERVE_INT8DOT
  return true;
#else
  return false;
#endif
}

bool tiled_available() {
#ifdef KVSERVE_AVX2
  return true;
#else
  return false;
#endif
}

// q, out [T, H, D] (same dtype: bf16/fp16/fp32, contiguous). Sequence s attends with its q_len[s]
// queries at rows q_start[s].. (positions seq_len[s] - q_len[s] ..), window[s] (0 = none), block
// table row s of ``tables`` [S, n] int64. ``k_base``/``v_base``: any tensor whose storage holds
// that side's blocks (see the header for the params). ``shadow`` [2, W, bs, kvh, d] or empty.
// impl: 0 the fastest path that covers the case: int8-dot (AVX512-VNNI builds: bf16 q on an int8
// pool, both sides, no shadows, head_dim % 32 == 0 and <= 128), else bf16-dot (AVX512-BF16 builds:
// bf16 q on the bf16 pool or the int8 / fp8 pools (a bf16 shadow allowed), head_dim % 32 == 0),
// else tiled (AVX2 + FMA, head_dim % 8 == 0), else scalar; 1 scalar; 2 tiled where it exists
// (never a dot path), else scalar; 3 as 0 without the int8-dot path; 4 as 3 with the bf16-dot
// path's products on vdpbf16ps even where AMX tiles are usable (amx_attention.h).
void paged_attention(torch::Tensor q, torch::Tensor out, torch::Tensor q_start, torch::Tensor q_len,
                     torch::Tensor seq_len, torch::Tensor window, torch::Tensor tables, double scale,
                     int64_t block_size, int64_t kv_heads, torch::Tensor k_base, std::vector<int64_t> k_params,
                     torch::Tensor v_base, std::vector<int64_t> v_params, torch::Tensor shadow,
                     torch::Tensor has_shadow, torch::Tensor shadow_slot, torch::Tensor shadow_rows,
                     int64_t q_tile, int64_t impl) {
  TORCH_CHECK(q.is_contiguous() && out.is_contiguous() && q.dim() == 3, "q/out must be contiguous [T, H, D]");
  TORCH_CHECK(q.scalar_type() == out.scalar_type(), "q and out dtypes differ");
  TORCH_CHECK(q.size(1) % kv_heads == 0, "heads must be a multiple of kv_heads");
  for (const auto* t : {&q_start, &q_len, &seq_len, &window, &tables})
    TORCH_CHECK(t->scalar_type() == at::kLong && t->is_contiguous(), "index tensors must be contiguous int64");
  const int64_t num_seqs = seq_len.numel();
  TORCH_CHECK(tables.dim() == 2 && tables.size(0) == num_seqs, "tables must be [S, n]");
  Side ks = make_side(k_base, k_params), vs = make_side(v_base, v_params);
  Shadow shk, shv;
  if (shadow.numel() > 0) {
    TORCH_CHECK(shadow.is_contiguous(), "shadow must be contiguous");
    const auto side_bytes = shadow.numel() / 2 * shadow.element_size();
    shk.kind = shv.kind = float_kind(shadow);
    shk.base = static_cast<const uint8_t*>(shadow.data_ptr());
    shv.base = shk.base + side_bytes;
    shk.has = shv.has = has_shadow.data_ptr<bool>();
    shk.slot = shv.slot = shadow_slot.data_ptr<int64_t>();
    shk.rows = shv.rows = shadow_rows.data_ptr<int64_t>();
  }
  const float sc = static_cast<float>(scale);
  const int64_t tile = std::max<int64_t>(1, q_tile);
  const int64_t* qs = q_start.data_ptr<int64_t>();
  const int64_t* ql = q_len.data_ptr<int64_t>();
  const int64_t* sl = seq_len.data_ptr<int64_t>();
  const int64_t* wn = window.data_ptr<int64_t>();
  const int64_t* tb = tables.data_ptr<int64_t>();
  const int64_t stride = tables.size(1);
  const int64_t d = q.size(2);
  const bool tiled = impl != 1 && tiled_available() && d % 8 == 0;
#ifdef KVSERVE_INT8DOT
  if (impl == 0 && q.scalar_type() == at::kBFloat16 && ks.kind == 3 && vs.kind == 3 && shadow.numel() == 0 &&
      d % 32 == 0 && d <= 128) {
    run_int8dot(q, out, qs, ql, sl, wn, tb, stride, num_seqs, sc, block_size, kv_heads, ks, vs, tile);
    return;
  }
#endif
#ifdef KVSERVE_BF16DOT
  auto bf16_side = [](const Side& x) { return x.kind == 0 || x.kind == 3 || x.kind == 4; };  // bf16, int8, fp8
  if ((impl == 0 || impl == 3 || impl == 4) && q.scalar_type() == at::kBFloat16 && bf16_side(ks) && bf16_side(vs) &&
      (shadow.numel() == 0 || shk.kind == 0) && d % 32 == 0) {
    if (KVS_AMX && impl != 4 && usable())
      run_bf16dot<true>(q, out, qs, ql, sl, wn, tb, stride, num_seqs, sc, block_size, kv_heads, ks, vs, shk, shv, tile);
    else
      run_bf16dot<false>(q, out, qs, ql, sl, wn, tb, stride, num_seqs, sc, block_size, kv_heads, ks, vs, shk, shv, tile);
    return;
  }
#endif
#define KVSERVE_ARGS q, out, qs, ql, sl, wn, tb, stride, num_seqs, sc, block_size, kv_heads, ks, vs, shk, shv, tile
#ifdef KVSERVE_AVX2
#define KVSERVE_TILED(T) if (tiled) run_tiled<T>(KVSERVE_ARGS); else
#else
#define KVSERVE_TILED(T)
#endif
#define KVSERVE_DISPATCH(T)                                    \
  KVSERVE_TILED(T) if (d == 64) run_scalar<T, 64>(KVSERVE_ARGS); \
  else if (d == 128) run_scalar<T, 128>(KVSERVE_ARGS);           \
  else run_scalar<T, 0>(KVSERVE_ARGS);
  if (q.scalar_type() == at::kBFloat16) {
    KVSERVE_DISPATCH(at::BFloat16)
  } else if (q.scalar_type() == at::kHalf) {
    KVSERVE_DISPATCH(at::Half)
  } else {
    TORCH_CHECK(q.scalar_type() == at::kFloat, "q must be bf16, fp16 or fp32");
    KVSERVE_DISPATCH(float)
  }
#undef KVSERVE_DISPATCH
#undef KVSERVE_TILED
#undef KVSERVE_ARGS
}

#ifndef KVS_NO_MODULE  // decode_stack.cpp includes this file for its functions
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_attention", &paged_attention, "paged attention over block tables (decode and prefill chunks)");
  m.def("tiled_available", &tiled_available, "whether this build has the tiled (AVX2 + FMA) path");
  m.def("int8dot_available", &int8dot_available,
        "whether this build has the int8-dot path (AVX512-VNNI: bf16 queries on an int8 pool)");
  m.def("amx_available", &amx_available, "whether the bf16-dot path's products run on AMX tiles (AMX-BF16)");
  m.def("amx_calls", &amx_calls, "how many calls so far took the bf16-dot path's AMX products");
  m.def("bf16dot_available", &bf16dot_available,
        "whether this build has the bf16-dot path (AVX512-BF16: bf16 queries on the bf16, int8 or fp8 pool)");
}
#endif
