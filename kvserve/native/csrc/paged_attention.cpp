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
// Invariants: tables hold ceil(seq_len / block_size) valid ids per sequence; q_len <= seq_len;
// scratch is per task, so tasks never share mutable state.

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

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

// DC > 0: head_dim known at compile time (64, 128), so the dot products and the V accumulation
// have constant trip counts and vectorize fully; DC = 0: any head_dim.
template <typename T, int DC>
void run(const torch::Tensor& q, torch::Tensor& out, const int64_t* q_start, const int64_t* q_len,
         const int64_t* seq_len, const int64_t* window, const int64_t* tables, int64_t table_stride,
         int64_t num_seqs, float scale, int64_t bs, int64_t kvh, const Side& ks, const Side& vs,
         const Shadow& shk, const Shadow& shv, int64_t q_tile) {
  const int64_t heads = q.size(1), g = heads / kvh;
  const int64_t d = DC > 0 ? DC : q.size(2);
  const T* qp = q.data_ptr<T>();
  T* op = out.data_ptr<T>();
  // Tasks: (seq, kv head, tile) flattened; tile offsets per sequence.
  std::vector<int64_t> tile0(num_seqs + 1, 0);
  for (int64_t s = 0; s < num_seqs; ++s) tile0[s + 1] = tile0[s] + (q_len[s] + q_tile - 1) / q_tile;
  const int64_t tasks = tile0[num_seqs] * kvh;
  at::parallel_for(0, tasks, 1, [&](int64_t begin, int64_t end) {
    const int64_t max_rows = g * q_tile;
    std::vector<float> Q(max_rows * d), acc(max_rows * d), m(max_rows), l(max_rows);
    std::vector<float> K(bs * d), V(bs * d), S(max_rows * bs);
    std::vector<int64_t> qpos(max_rows);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t h = task % kvh, tile = task / kvh;
      const int64_t s = static_cast<int64_t>(std::upper_bound(tile0.begin(), tile0.end(), tile) - tile0.begin()) - 1;
      const int64_t i0 = (tile - tile0[s]) * q_tile, i1 = std::min(q_len[s], i0 + q_tile);
      const int64_t nq = i1 - i0, rows = nq * g, L = seq_len[s], w = window[s];
      const int64_t first_q = L - q_len[s];
      // Rows ordered (query token, head in group): row r = (i - i0) * g + j.
      for (int64_t i = i0; i < i1; ++i) {
        for (int64_t j = 0; j < g; ++j) {
          const int64_t r = (i - i0) * g + j;
          const T* src = qp + ((q_start[s] + i) * heads + h * g + j) * d;
          for (int64_t e = 0; e < d; ++e) Q[r * d + e] = static_cast<float>(src[e]) * scale;
          qpos[r] = first_q + i;
        }
      }
      std::fill(acc.begin(), acc.begin() + rows * d, 0.f);
      std::fill(m.begin(), m.begin() + rows, -std::numeric_limits<float>::infinity());
      std::fill(l.begin(), l.begin() + rows, 0.f);
      const int64_t hi = first_q + i1;                                    // keys < hi
      const int64_t lo = w > 0 ? std::max<int64_t>(0, first_q + i0 - w + 1) : 0;
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
      for (int64_t r = 0; r < rows; ++r) {
        const int64_t i = i0 + r / g, j = r % g;
        T* dst = op + ((q_start[s] + i) * heads + h * g + j) * d;
        const float inv = l[r] > 0.f ? 1.f / l[r] : 0.f;
        for (int64_t e = 0; e < d; ++e) dst[e] = static_cast<T>(acc[r * d + e] * inv);
      }
    }
  });
}

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

// q, out [T, H, D] (same dtype: bf16/fp16/fp32, contiguous). Sequence s attends with its q_len[s]
// queries at rows q_start[s].. (positions seq_len[s] - q_len[s] ..), window[s] (0 = none), block
// table row s of ``tables`` [S, n] int64. ``k_base``/``v_base``: any tensor whose storage holds
// that side's blocks (see the header for the params). ``shadow`` [2, W, bs, kvh, d] or empty.
void paged_attention(torch::Tensor q, torch::Tensor out, torch::Tensor q_start, torch::Tensor q_len,
                     torch::Tensor seq_len, torch::Tensor window, torch::Tensor tables, double scale,
                     int64_t block_size, int64_t kv_heads, torch::Tensor k_base, std::vector<int64_t> k_params,
                     torch::Tensor v_base, std::vector<int64_t> v_params, torch::Tensor shadow,
                     torch::Tensor has_shadow, torch::Tensor shadow_slot, torch::Tensor shadow_rows,
                     int64_t q_tile) {
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
#define KVSERVE_RUN(T, DC) run<T, DC>(q, out, qs, ql, sl, wn, tb, stride, num_seqs, sc, block_size, kv_heads, ks, vs, \
                                    shk, shv, tile)
#define KVSERVE_DISPATCH(T)                 \
  if (d == 64) KVSERVE_RUN(T, 64);          \
  else if (d == 128) KVSERVE_RUN(T, 128);   \
  else KVSERVE_RUN(T, 0);
  if (q.scalar_type() == at::kBFloat16) {
    KVSERVE_DISPATCH(at::BFloat16)
  } else if (q.scalar_type() == at::kHalf) {
    KVSERVE_DISPATCH(at::Half)
  } else {
    TORCH_CHECK(q.scalar_type() == at::kFloat, "q must be bf16, fp16 or fp32");
    KVSERVE_DISPATCH(float)
  }
#undef KVSERVE_DISPATCH
#undef KVSERVE_RUN
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_attention", &paged_attention, "paged attention over block tables (decode and prefill chunks)");
}
