// The int8-dot path of paged_attention.cpp (included there, inside its anonymous namespace, after
// the bf16-dot path whose helpers it shares): bf16 queries on an int8 pool (both sides int8, no
// shadows), head_dim % 32 == 0 and <= 128, on CPUs with AVX512-VNNI. Integer dot products on
// the codes themselves, with nothing widened to floats first:
// * scores: each query row is rounded to int16 codes (|qi| <= Q_RANGE, row scale qs = max|q| /
//   Q_RANGE: finer than the bf16 query itself) and split into two int8 halves, qi = 256 qh + ql
//   (ql in [-128, 127]). A tile's K codes are transposed as 32-bit words (4 adjacent head_dim
//   codes of one key: one 16 x 16 transpose per 64 codes, half the bf16 path's) and offset by
//   128 to unsigned; vpdpbusd multiplies 4 code pairs per int32 lane. In exact int32:
//     sum_e qi_e k_e = 256 (H - 128 sum qh) + (L - 128 sum ql) = 256 H + L - 128 sum qi,
//   H, L the two halves' sums over (k_e + 128). The float score is that times qs and the key's scale;
//   |256 H + L| <= 2^30 for head_dim <= 128;
// * values: the probabilities (times each key's V scale) are rounded to int16 per row and flush
//   (p = pi * ps, ps = max p / P_RANGE), V codes sign-extended to int16 and paired over keys as the
//   bf16 path pairs them, and vpdpwssd sums 2 products per int32 lane: at most 64 keys x 32767 x
//   128 < 2^31 per flush, then O += ps * sum.
// Against the bf16-dot path on the same pool, the scores carry the query's rounding to 15 bits
// instead of none, and the probabilities 15 bits relative to the row's largest instead of bf16's 8.
#if defined(KVSERVE_BF16DOT) && defined(__AVX512VNNI__)
#define KVSERVE_INT8DOT 1

constexpr float Q_RANGE = 32000.f;  // (qi + 128) >> 8 stays in int8 for |qi| <= 32639
constexpr float P_RANGE = 32767.f;

// Row r of the query (d bf16 values at src) as int16 codes split into int8 halves qh, ql (d bytes
// each), its scale (*qs; 0 for a row of zeros) and 128 * sum(qi) (*c).
inline void quantize_q_row(const uint16_t* src, int64_t d, int8_t* qh, int8_t* ql, float* qs, int32_t* c) {
  auto load = [&](int64_t e) {
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + e));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  };
  __m512 mx = _mm512_setzero_ps();
  for (int64_t e = 0; e < d; e += 16) mx = _mm512_max_ps(mx, _mm512_abs_ps(load(e)));
  const float m = _mm512_reduce_max_ps(mx);
  if (!(m > 0.f)) {
    std::memset(qh, 0, d);
    std::memset(ql, 0, d);
    *qs = 0.f;
    *c = 0;
    return;
  }
  const __m512 inv = _mm512_set1_ps(Q_RANGE / m);
  __m512i sum = _mm512_setzero_si512();
  for (int64_t e = 0; e < d; e += 16) {
    const __m512i qi = _mm512_cvtps_epi32(_mm512_mul_ps(load(e), inv));
    const __m512i hi = _mm512_srai_epi32(_mm512_add_epi32(qi, _mm512_set1_epi32(128)), 8);
    const __m512i lo = _mm512_sub_epi32(qi, _mm512_slli_epi32(hi, 8));
    sum = _mm512_add_epi32(sum, qi);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(qh + e), _mm512_cvtepi32_epi8(hi));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(ql + e), _mm512_cvtepi32_epi8(lo));
  }
  *qs = m / Q_RANGE;
  *c = 128 * _mm512_reduce_add_epi32(sum);
}

// The int8 code rows of keys c0..c0+nt-1 of block b, head h (row[k]; nullptr past nt) and their
// scales (rsc[k]; 0 past nt).
inline void int8_rows(const Side& s, int64_t b, int64_t h, int64_t c0, int64_t nt, int64_t kvh, int64_t d,
                      const int8_t** row, float* rsc) {
  const uint8_t* blk = s.base + b * s.block_stride;
  for (int64_t k = 0; k < KT; ++k) {
    const int64_t th = (c0 + k) * kvh + h;
    row[k] = k < nt ? reinterpret_cast<const int8_t*>(blk + s.q_off) + th * d : nullptr;
    rsc[k] = k < nt ? reinterpret_cast<const float*>(blk + s.scale_off)[th] : 0.f;
  }
}

// Kw[w * 16 + k] = word w (codes 4w..4w+3) of key k, each code + 128 (a missing key: code 0).
inline void load_int8_key_words(const int8_t* const* row, int64_t d, uint32_t* Kw) {
  const __m512i off = _mm512_set1_epi32(static_cast<int32_t>(0x80808080u));
  for (int64_t w0 = 0; w0 < d / 4; w0 += 16) {
    const int64_t n = std::min<int64_t>(16, d / 4 - w0);  // 16, or 8 (d % 64 == 32)
    __m512i r[16];
    for (int64_t k = 0; k < 16; ++k) {
      if (row[k] == nullptr) r[k] = _mm512_setzero_si512();
      else if (n == 16) r[k] = _mm512_loadu_si512(row[k] + w0 * 4);
      else r[k] = _mm512_zextsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(row[k] + w0 * 4)));
    }
    transpose16x16(r);
    for (int64_t i = 0; i < n; ++i) _mm512_storeu_si512(Kw + (w0 + i) * 16, _mm512_xor_si512(r[i], off));
  }
}

// Vw[(k * d + e) * 2 + {0, 1}] = (v_2k[e], v_2k+1[e]) as int16 codes (a missing row: 0).
inline void load_int8_value_pairs(const int8_t* const* row, int64_t d, int16_t* Vw) {
  const __m512i lo = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8,
                                      39, 7, 38, 6, 37, 5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
  const __m512i hi = _mm512_add_epi16(lo, _mm512_set1_epi16(16));
  auto widen = [](const int8_t* p) {
    return p ? _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))) : _mm512_setzero_si512();
  };
  for (int64_t k = 0; k < KT / 2; ++k) {
    const int8_t *a = row[2 * k], *z = row[2 * k + 1];
    for (int64_t e = 0; e < d; e += 32) {
      const __m512i wa = widen(a ? a + e : nullptr), wb = widen(z ? z + e : nullptr);
      _mm512_storeu_si512(Vw + (k * d + e) * 2, _mm512_permutex2var_epi16(wa, lo, wb));
      _mm512_storeu_si512(Vw + (k * d + e + 16) * 2, _mm512_permutex2var_epi16(wa, hi, wb));
    }
  }
}

#define KVSERVE_ROWS8(X) X(0) X(1) X(2) X(3) X(4) X(5) X(6) X(7)

// S[r][0..16) = qs[r] * (256 H + L - c[r]) for R rows (the header; Qh, Ql rows d bytes apart).
template <int R>
inline void qk_int8(const int8_t* Qh, const int8_t* Ql, int64_t d, const uint32_t* Kw, const int32_t* c,
                    const float* qs, float* S, int64_t ss) {
#define KVSERVE_DECL(r) __m512i h##r = _mm512_setzero_si512(), l##r = _mm512_setzero_si512();
  KVSERVE_ROWS8(KVSERVE_DECL)
#undef KVSERVE_DECL
  const int64_t words = d / 4;
  const int32_t* qh = reinterpret_cast<const int32_t*>(Qh);
  const int32_t* ql = reinterpret_cast<const int32_t*>(Ql);
  for (int64_t w = 0; w < words; ++w) {
    const __m512i k = _mm512_loadu_si512(Kw + w * 16);
#define KVSERVE_DOT(r)                                                            \
  if (R > r) {                                                                    \
    h##r = _mm512_dpbusd_epi32(h##r, k, _mm512_set1_epi32(qh[r * words + w]));    \
    l##r = _mm512_dpbusd_epi32(l##r, k, _mm512_set1_epi32(ql[r * words + w]));    \
  }
    KVSERVE_ROWS8(KVSERVE_DOT)
#undef KVSERVE_DOT
  }
#define KVSERVE_STORE(r)                                                                                   \
  if (R > r) {                                                                                             \
    const __m512i x = _mm512_sub_epi32(_mm512_add_epi32(_mm512_slli_epi32(h##r, 8), l##r), _mm512_set1_epi32(c[r])); \
    _mm512_storeu_ps(S + r * ss, _mm512_mul_ps(_mm512_cvtepi32_ps(x), _mm512_set1_ps(qs[r])));            \
  }
  KVSERVE_ROWS8(KVSERVE_STORE)
#undef KVSERVE_STORE
}
#undef KVSERVE_ROWS8

// O[r][e0..e0+16C) += ps[r] * sum_k Pw[r][k] . Vw[k][e0..] over ``pairs`` key pairs (int16 words),
// for R <= 4 rows.
template <int R, int C>
inline void pv_int8(const uint32_t* Pw, int64_t ps, const int16_t* Vw, int64_t pairs, int64_t d, int64_t e0,
                    const float* psc, float* O) {
#define KVSERVE_DECL(r, c) __m512i a##r##c = _mm512_setzero_si512();
#define KVSERVE_ROW(r) KVSERVE_DECL(r, 0) KVSERVE_DECL(r, 1) KVSERVE_DECL(r, 2) KVSERVE_DECL(r, 3)
  KVSERVE_ROW(0) KVSERVE_ROW(1) KVSERVE_ROW(2) KVSERVE_ROW(3)
#undef KVSERVE_ROW
#undef KVSERVE_DECL
  for (int64_t k = 0; k < pairs; ++k) {
    const int16_t* v = Vw + (k * d + e0) * 2;
    const __m512i v0 = _mm512_loadu_si512(v);
    const __m512i v1 = C > 1 ? _mm512_loadu_si512(v + 32) : v0;
    const __m512i v2 = C > 2 ? _mm512_loadu_si512(v + 64) : v0;
    const __m512i v3 = C > 3 ? _mm512_loadu_si512(v + 96) : v0;
#define KVSERVE_DOT(r)                                                      \
  if (R > r) {                                                              \
    const __m512i p = _mm512_set1_epi32(static_cast<int>(Pw[r * ps + k]));  \
    a##r##0 = _mm512_dpwssd_epi32(a##r##0, v0, p);                          \
    if (C > 1) a##r##1 = _mm512_dpwssd_epi32(a##r##1, v1, p);               \
    if (C > 2) a##r##2 = _mm512_dpwssd_epi32(a##r##2, v2, p);               \
    if (C > 3) a##r##3 = _mm512_dpwssd_epi32(a##r##3, v3, p);               \
  }
    KVSERVE_DOT(0) KVSERVE_DOT(1) KVSERVE_DOT(2) KVSERVE_DOT(3)
#undef KVSERVE_DOT
  }
#define KVSERVE_STORE(r, c)                                                                                 \
  if (R > r && C > c) {                                                                                     \
    float* o = O + r * d + e0 + 16 * c;                                                                     \
    _mm512_storeu_ps(o, _mm512_fmadd_ps(_mm512_cvtepi32_ps(a##r##c), _mm512_set1_ps(psc[r]), _mm512_loadu_ps(o))); \
  }
#define KVSERVE_ROW(r) KVSERVE_STORE(r, 0) KVSERVE_STORE(r, 1) KVSERVE_STORE(r, 2) KVSERVE_STORE(r, 3)
  KVSERVE_ROW(0) KVSERVE_ROW(1) KVSERVE_ROW(2) KVSERVE_ROW(3)
#undef KVSERVE_ROW
#undef KVSERVE_STORE
}

inline void qk_int8_rows(const int8_t* Qh, const int8_t* Ql, int64_t rows, int64_t d, const uint32_t* Kw,
                         const int32_t* c, const float* qs, float* S, int64_t ss) {
  row_blocks<8>(rows, [&](int64_t r0, auto n) {
    qk_int8<decltype(n)::value>(Qh + r0 * d, Ql + r0 * d, d, Kw, c + r0, qs + r0, S + r0 * ss, ss);
  });
}

template <int C>
inline void pv_int8_rows_c(const uint32_t* Pw, int64_t ps, const int16_t* Vw, int64_t pairs, int64_t rows,
                           int64_t d, const float* psc, float* O) {
  for (int64_t e0 = 0; e0 < d; e0 += 16 * C)
    row_blocks<4>(rows, [&](int64_t r0, auto n) {
      pv_int8<decltype(n)::value, C>(Pw + r0 * ps, ps, Vw, pairs, d, e0, psc + r0, O + r0 * d);
    });
}

// Tiles per softmax step of this path: 128 keys (P V sums at most 128 x 32767 x 128 < 2^31).
constexpr int64_t KG8 = 8;
static_assert(KG8 <= KG, "softmax_rows holds at most KG tiles");

void run_int8dot(const torch::Tensor& q, torch::Tensor& out, const int64_t* q_start, const int64_t* q_len,
                 const int64_t* seq_len, const int64_t* window, const int64_t* tables, int64_t table_stride,
                 int64_t num_seqs, float scale, int64_t bs, int64_t kvh, const Side& ks, const Side& vs,
                 int64_t q_tile) {
  using T = at::BFloat16;
  const int64_t heads = q.size(1), g = heads / kvh, d = q.size(2);
  const int64_t ss = KT * KG8, ps = KT / 2 * KG8;  // S and Pw row strides
  const T* qp = q.data_ptr<T>();
  T* op = out.data_ptr<T>();
  const std::vector<int64_t> tile0 = query_tiles(q_len, num_seqs, q_tile);
  const int64_t tasks = tile0[num_seqs] * kvh;
  at::parallel_for(0, tasks, 1, [&](int64_t begin, int64_t end) {
    const int64_t max_rows = g * q_tile;
    std::vector<float> O(max_rows * d), m(max_rows), l(max_rows), lv(max_rows * 16), S(max_rows * ss), qs(max_rows),
        psc(max_rows);
    std::vector<int32_t> qc(max_rows);
    std::vector<int8_t> Qh(max_rows * d), Ql(max_rows * d);
    std::vector<uint32_t> Kw(d / 4 * KT), Pw(max_rows * ps);
    std::vector<int16_t> Vw(KT * KG8 * d);
    std::vector<int64_t> qpos(max_rows);
    int64_t kpos[KG8], ntl[KG8], ng = 0;
    const int8_t* row[KT];
    float ksc[KG8][KT], vsc[KG8][KT];
    const __m512 scv = _mm512_set1_ps(scale);
    for (int64_t task = begin; task < end; ++task) {
      const Task tk = begin_task(task, tile0, kvh, g, heads, d, q_tile, qp, q_start, q_len, seq_len, window, scale,
                                 nullptr, qpos.data(), O.data(), m.data(), l.data());
      const int64_t h = tk.h, s = tk.s, rows = tk.rows, w = tk.w, lo = tk.lo, hi = tk.hi;
      std::fill(lv.begin(), lv.begin() + rows * 16, 0.f);
      for (int64_t r = 0; r < rows; ++r) {  // row r = (token, head in group)
        const int64_t i = tk.i0 + r / g, j = r % g;
        const auto* src = reinterpret_cast<const uint16_t*>(qp + ((q_start[s] + i) * heads + h * g + j) * d);
        quantize_q_row(src, d, Qh.data() + r * d, Ql.data() + r * d, qs.data() + r, qc.data() + r);
      }
      // The online softmax over the ng tiles gathered (scores in S, value pairs in Vw), then O += P V.
      // The rows of one query token (g in a row) share its masks; P's scale is the flush's largest
      // V scale over P_RANGE (p <= 1), one for every row; l stays 16 lanes wide until the task ends.
      auto flush = [&]() {
        __m512 kss[KG8], vmx = _mm512_setzero_ps();
        for (int64_t t = 0; t < ng; ++t) {
          kss[t] = _mm512_mul_ps(scv, _mm512_loadu_ps(ksc[t]));
          vmx = _mm512_max_ps(vmx, _mm512_loadu_ps(vsc[t]));
        }
        const float vm = _mm512_reduce_max_ps(vmx);
        const __m512 inv = _mm512_set1_ps(vm > 0.f ? P_RANGE / vm : 0.f);
        std::fill(psc.begin(), psc.begin() + rows, vm / P_RANGE);
        softmax_rows(rows, g, qpos.data(), w, kpos, ntl, ng, kss, S.data(), ss, Pw.data(), ps, m.data(), lv.data(),
                     O.data(), d, [&](uint32_t* pw, int64_t t, __m512 p) {
                       const __m512 pi = _mm512_mul_ps(_mm512_mul_ps(p, _mm512_loadu_ps(vsc[t])), inv);
                       _mm256_storeu_si256(reinterpret_cast<__m256i*>(pw + t * KT / 2),
                                           _mm512_cvtsepi32_epi16(_mm512_cvtps_epi32(pi)));
                     });
        const int64_t pairs = ng * KT / 2;
        if (d % 64 == 0) pv_int8_rows_c<4>(Pw.data(), ps, Vw.data(), pairs, rows, d, psc.data(), O.data());
        else pv_int8_rows_c<2>(Pw.data(), ps, Vw.data(), pairs, rows, d, psc.data(), O.data());
        ng = 0;
      };
      const int64_t* table = tables + s * table_stride;
      for_each_key_tile(table, lo, hi, bs, ks, vs, h, kvh, d, [&](int64_t b, int64_t kpos0, int64_t c0, int64_t nt) {
        int8_rows(ks, b, h, c0, nt, kvh, d, row, ksc[ng]);
        load_int8_key_words(row, d, Kw.data());
        qk_int8_rows(Qh.data(), Ql.data(), rows, d, Kw.data(), qc.data(), qs.data(), S.data() + ng * KT, ss);
        int8_rows(vs, b, h, c0, nt, kvh, d, row, vsc[ng]);
        load_int8_value_pairs(row, d, Vw.data() + ng * KT * d);
        kpos[ng] = kpos0;
        ntl[ng] = nt;
        if (++ng == KG8) flush();
      });
      if (ng > 0) flush();
      for (int64_t r = 0; r < rows; ++r) l[r] = _mm512_reduce_add_ps(_mm512_loadu_ps(lv.data() + r * 16));
      end_task(tk, g, heads, d, q_start, O.data(), l.data(), op);
    }
  });
}
#endif  // KVSERVE_INT8DOT
