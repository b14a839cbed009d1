// Every decoder layer of a small step (a decode, a verify, a short chunk) in one call from Python
// (kvserve/model/decode_stack.py is the Python side).
//
// The per-layer Python path makes ~25 Python-level calls and ~20 pybind11 crossings a layer, while
// the other OpenMP thread waits for the next parallel call (benchmarks/decode_stack.py). This file
// compiles the three kernels' sources into one module (each inside a namespace of its own) and runs
// the same functions in the same order the Python path runs them:
//
//   x = rms_norm(h, in_norm)                    fused_ops.cpp
//   qkv = gemm(x, W_qkv, b_qkv)                 tiled_gemm.cpp
//   q = rope_write(qkv, cos, sin, pool, slots)  fused_ops.cpp (an int8 pool: rope_int8_write)
//   o = paged_attention(q, plan, pool)          paged_attention.cpp
//   a = gemm(o, W_o, b_o)
//   x, h = add_rms_norm(a, h, post_norm)
//   g = gemm(x, W_gate_up); s = silu_mul(g)     (torch's silu * up past fused.silu_native_rows)
//   h = h + gemm(s, W_down)
//
// so the result is bit-equal to the per-layer path (tests/model/test_decode_stack.py).
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#endif
#include <strings.h>  // the system headers amx_gemm.h uses, here outside the namespaces below
#include <sys/syscall.h>
#include <unistd.h>

#define KVS_NO_MODULE
namespace kgemm {
#include "tiled_gemm.cpp"
}
namespace kfused {
#include "fused_ops.cpp"
}
namespace kpaged {
#include "paged_attention.cpp"
}

namespace {

constexpr int64_t kPerLayer = 8;  // in_norm, qkv, qkv bias, o, o bias, post_norm, gate_up, down

// h [T, hidden] (the embeddings), cos/sin [T, d]; weights: kPerLayer per layer (biases fp32 or
// empty); pools: one float pool layer tensor [2, blocks, block_size, kv_heads, d] per layer;
// slots [T]; the attention plan as paged_attention() takes it (k/v params from the pool);
// silu_rows: up to how many rows the fused SiLU·mul runs (fused.silu_native_rows).
// A codec pool's layer (codec_write not None): rope as rotary() on q and k, then
// codec_write(layer, k, v) (the pool's own write, in Python), then attention over sources[layer]:
// (k_base, k_params, v_base, v_params, shadow, has_shadow, shadow_slot, shadow_rows) as
// paged_attention() takes them. pools then only give each layer's block size and head_dim.
// int8_views (4 a layer: K scale, K codes, V scale, V codes) with write_blocks/offsets [T]: the
// step's write is rope_int8_write() there (what rotary() and the pool's write would do), not codec_write.
at::Tensor run_layers(at::Tensor h, const at::Tensor& cos, const at::Tensor& sin, const std::vector<at::Tensor>& w,
                      const std::vector<at::Tensor>& pools, const at::Tensor& slots, const at::Tensor& q_start,
                      const at::Tensor& q_len, const at::Tensor& seq_len, const at::Tensor& window,
                      const at::Tensor& tables, double scale, int64_t heads, int64_t kv_heads, int64_t inter,
                      double eps, int64_t q_tile, int64_t impl, int64_t silu_rows, int64_t float_kind,
                      const py::object& codec_write, const py::list& sources,
                      const std::vector<at::Tensor>& int8_views, const at::Tensor& write_blocks,
                      const at::Tensor& write_offsets) {
  const int64_t layers = static_cast<int64_t>(pools.size());
  const bool codec = !codec_write.is_none();
  TORCH_CHECK(!codec || static_cast<int64_t>(sources.size()) == layers, "one KV source per layer");
  TORCH_CHECK(int8_views.empty() || (codec && static_cast<int64_t>(int8_views.size()) == 4 * layers),
              "int8 views: 4 per layer, with a codec pool");
  TORCH_CHECK(static_cast<int64_t>(w.size()) == kPerLayer * layers, "expected ", kPerLayer, " weights per layer");
  TORCH_CHECK(h.dim() == 2 && h.is_contiguous(), "h must be contiguous [T, hidden]");
  const int64_t t = h.size(0);
  const int64_t out_code = h.scalar_type() == at::kFloat ? 0 : h.scalar_type() == at::kBFloat16 ? 1 : 2;
  const at::Tensor none = at::empty({0});
  const at::Tensor no_shadow = at::empty({0}, h.options()), no_flags = at::empty({0}, at::kBool),
                   no_index = at::empty({0}, at::kLong);
  for (int64_t l = 0; l < layers; ++l) {
    const at::Tensor* lw = w.data() + l * kPerLayer;
    const at::Tensor& pool = pools[l];
    const int64_t d = pool.size(4);  // a codec layer's pool argument: an empty [2, 1, block_size, kv_heads, d]
    at::Tensor x = kfused::rms_norm(h, lw[0], eps);
    at::Tensor qkv = kgemm::gemm(x, lw[1], lw[2], out_code).view({t, heads + 2 * kv_heads, d});
    at::Tensor q, o;
    if (codec) {
      if (int8_views.empty()) {
        at::Tensor qk = kfused::rotary(qkv.slice(1, 0, heads + kv_heads), cos, sin);
        codec_write(l, qk.slice(1, heads), qkv.slice(1, heads + kv_heads));
        q = qk.slice(1, 0, heads).contiguous();
      } else {  // one joint int8 pair, every row: its write without the call back into Python
        at::Tensor* iv = const_cast<at::Tensor*>(int8_views.data()) + 4 * l;
        q = kfused::rope_int8_write(qkv, heads, kv_heads, cos, sin, iv[0], iv[1], iv[2], iv[3], write_blocks,
                                    write_offsets);
      }
      o = at::empty_like(q);
      const py::tuple src = sources[l].cast<py::tuple>();
      kpaged::paged_attention(q, o, q_start, q_len, seq_len, window, tables, scale, pool.size(2), kv_heads,
                              src[0].cast<at::Tensor>(), src[1].cast<std::vector<int64_t>>(), src[2].cast<at::Tensor>(),
                              src[3].cast<std::vector<int64_t>>(), src[4].cast<at::Tensor>(), src[5].cast<at::Tensor>(),
                              src[6].cast<at::Tensor>(), src[7].cast<at::Tensor>(), q_tile, impl);
    } else {
      q = kfused::rope_write(qkv, heads, kv_heads, cos, sin, const_cast<at::Tensor&>(pool), slots);
      o = at::empty_like(q);
      const int64_t block_bytes = pool[0][0].numel() * pool.element_size();
      std::vector<int64_t> params{float_kind, block_bytes, 0, 0, 0, 1};
      kpaged::paged_attention(q, o, q_start, q_len, seq_len, window, tables, scale, pool.size(2), kv_heads, pool[0],
                              params, pool[1], params, no_shadow, no_flags, no_index, no_index, q_tile, impl);
    }
    at::Tensor a = kgemm::gemm(o.view({t, heads * d}), lw[3], lw[4], out_code);
    std::vector<at::Tensor> nh = kfused::add_rms_norm(a, h, lw[5], eps);
    at::Tensor g = kgemm::gemm(nh[0], lw[6], none, out_code);
    at::Tensor s = t <= silu_rows ? kfused::silu_mul(g, inter, out_code)
                                  : at::silu(g.slice(1, 0, inter)) * g.slice(1, inter);
    h = nh[1] + kgemm::gemm(s, lw[7], none, out_code);
  }
  return h;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("run_layers", &run_layers, "every decoder layer of a small step, as the per-layer path computes it");
}
