// A stack of quantized decoder layers on the paged KV cache in one call from Python (`models/fused.py`,
// `FusedStack`): per layer the steps of `FusedLayer` (norm + qkv, RoPE + KV write + attention, o + residual,
// norm + gate/up, SiLU-mul + down + residual) on one team of threads that lives for the whole forward, with a
// barrier between dependent steps: a forward pays Python and the dispatcher once, not 150 times, and starts no
// parallel region per product. Each element is computed by the per-layer operators' own code: the same bits.
#include <torch/library.h>
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <omp.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "kernels.h"

namespace {

constexpr int64_t NONE = 0, NORM = 1, SILU_MUL = 2;  // qlinear's prologues
constexpr int64_t PROJ = 4;                          // projections per layer: qkv, o, gate_up, down
constexpr int64_t PARTS = 4;                         // tensors per projection: w, d, m, corr

// x [T, H] float32 -> [x after the last layer, then x after each layer listed in `capture` (1-based, in order)].
// Per layer l: w[16 l .. 16 l + 15] the four projections' (w, d, m, corr); bias[4 l + p] optional; kinds and n_out
// [4 l + p]; norms[2 l], norms[2 l + 1] and eps alike the input and post-attention RMSNorms; k_caches[l],
// v_caches[l] [S, Hkv, D] written at `write`. cos/sin [T, rot]; write [T]; read [B, K]; mask [B, 1, Q, K] or
// undefined; grid [T] or undefined (as `attend_paged`).
std::vector<at::Tensor> decoder_stack(const at::Tensor& x, at::TensorList w,
                                      const c10::List<std::optional<at::Tensor>>& bias, at::IntArrayRef kinds,
                                      at::IntArrayRef n_out, at::TensorList norms, at::ArrayRef<double> eps,
                                      const at::Tensor& cos, const at::Tensor& sin, at::TensorList k_caches,
                                      at::TensorList v_caches, const at::Tensor& write, const at::Tensor& read,
                                      const std::optional<at::Tensor>& mask, const std::optional<at::Tensor>& grid,
                                      int64_t n_heads, int64_t n_kv, double scale, at::IntArrayRef capture) {
  const int64_t layers = static_cast<int64_t>(k_caches.size());
  TORCH_CHECK(static_cast<int64_t>(v_caches.size()) == layers &&
                  static_cast<int64_t>(w.size()) == layers * PROJ * PARTS &&
                  static_cast<int64_t>(bias.size()) == layers * PROJ &&
                  static_cast<int64_t>(kinds.size()) == layers * PROJ &&
                  static_cast<int64_t>(n_out.size()) == layers * PROJ &&
                  static_cast<int64_t>(norms.size()) == layers * 2 && static_cast<int64_t>(eps.size()) == layers * 2,
              "decoder_stack: per layer 16 weight tensors, 4 biases, kinds and widths, 2 norms and eps, 1 K and V "
              "cache");
  TORCH_CHECK(layers > 0 && std::is_sorted(capture.begin(), capture.end()) &&
                  (capture.empty() || (capture.front() >= 0 && capture.back() <= layers)),
              "decoder_stack: capture must be ascending layer numbers 0..", layers);
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "decoder_stack: x must be float32 [T, H]");
  const int64_t t_all = x.size(0), hidden = x.size(1);
  // every projection checked once, then read as plain pointers inside the parallel region
  std::vector<specserve::QProj> proj;
  int64_t k_max = 0;
  for (int64_t i = 0; i < layers * PROJ; ++i) {
    const int64_t o = i * PARTS;
    proj.push_back(specserve::qproj(w[o], w[o + 1], w[o + 2], w[o + 3], kinds[i], n_out[i], bias.get(i)));
    TORCH_CHECK(proj.back().n_out == proj.back().groups * 16, "decoder_stack: widths must be multiples of 16");
    k_max = std::max(k_max, proj.back().nb * 32);
  }
  const int64_t qkv_w = proj[0].n_out, att_w = n_heads * (qkv_w / (n_heads + 2 * n_kv)), gu_w = proj[2].n_out;
  for (int64_t l = 0; l < layers; ++l) {
    const specserve::QProj* p = &proj[l * PROJ];
    TORCH_CHECK(p[0].nb * 32 == hidden && p[0].n_out == qkv_w && p[1].nb * 32 == att_w && p[1].n_out == hidden &&
                    p[2].nb * 32 == hidden && p[2].n_out == gu_w && 2 * p[3].nb * 32 == gu_w && p[3].n_out == hidden,
                "decoder_stack: layer ", l, "'s projections do not chain (qkv, o, gate_up, down)");
    for (int j = 0; j < 2; ++j) {
      TORCH_CHECK(norms[2 * l + j].scalar_type() == at::kFloat && norms[2 * l + j].is_contiguous() &&
                      norms[2 * l + j].numel() == hidden, "decoder_stack: norms must be float32 [H]");
    }
    TORCH_CHECK(k_caches[l].sizes() == k_caches[0].sizes() && k_caches[l].is_contiguous() &&
                    v_caches[l].sizes() == k_caches[0].sizes() && v_caches[l].is_contiguous() &&
                    k_caches[l].scalar_type() == at::kFloat && v_caches[l].scalar_type() == at::kFloat,
                "decoder_stack: every layer's K and V caches alike, contiguous float32");
  }
  const specserve::PagedCall c =
      specserve::check_paged(t_all, qkv_w, cos, sin, k_caches[0], v_caches[0], write, read, mask, grid, n_heads, n_kv);
  const int64_t path = specserve::best_path(), d = c.d;
  const auto f32 = x.options();
  at::Tensor a_buf = x.contiguous().clone(), b_buf = at::empty({t_all, hidden}, f32);
  at::Tensor q_buf = at::empty({t_all, k_max}, f32.dtype(at::kChar));
  at::Tensor qd_buf = at::empty({t_all, k_max / 32}, f32), qs_buf = at::empty({t_all, k_max / 32}, f32);
  at::Tensor qkv_buf = at::empty({t_all, qkv_w}, f32), qh_buf = at::empty({t_all, n_heads, d}, f32);
  at::Tensor att_buf = at::empty({t_all, att_w}, f32), gu_buf = at::empty({t_all, gu_w}, f32);
  std::vector<at::Tensor> out(1);
  std::vector<float*> capture_at(layers + 1, nullptr);  // where x after layer l is copied (0: before the first)
  for (const int64_t l : capture) {
    out.push_back(at::empty({t_all, hidden}, f32));
    capture_at[l] = out.back().data_ptr<float>();
  }
  float* xa = a_buf.data_ptr<float>();
  float* xb = b_buf.data_ptr<float>();
  int8_t* q = q_buf.data_ptr<int8_t>();
  float* qd = qd_buf.data_ptr<float>();
  float* qs = qs_buf.data_ptr<float>();
  float* qkv = qkv_buf.data_ptr<float>();
  float* qh = qh_buf.data_ptr<float>();
  float* att = att_buf.data_ptr<float>();
  float* gu = gu_buf.data_ptr<float>();
  const float* cp = c.cos.data_ptr<float>();
  const float* sp = c.sin.data_ptr<float>();
  const int64_t* wp = c.write.data_ptr<int64_t>();
  const int64_t* rp = c.read.data_ptr<int64_t>();
  const bool* mp = c.mask.defined() ? c.mask.data_ptr<bool>() : nullptr;
  const int64_t* gp = c.grid.defined() ? c.grid.data_ptr<int64_t>() : nullptr;
  std::vector<float*> kcp, vcp;
  std::vector<const float*> nwp;
  for (int64_t l = 0; l < layers; ++l) {
    kcp.push_back(k_caches[l].data_ptr<float>());
    vcp.push_back(v_caches[l].data_ptr<float>());
    nwp.push_back(norms[2 * l].data_ptr<float>());
    nwp.push_back(norms[2 * l + 1].data_ptr<float>());
  }
  const float sc = static_cast<float>(scale);
  const int threads = std::max(1, at::get_num_threads());
  // One team for the whole stack: each step split evenly over the threads, a barrier where the next step reads
  // what this one wrote; each element is computed by the same code as the per-layer operators (the same bits).
#pragma omp parallel num_threads(threads)
  {
    const int64_t tid = omp_get_thread_num(), nt = omp_get_num_threads();
    auto lo = [&](int64_t total) { return total * tid / nt; };
    auto hi = [&](int64_t total) { return total * (tid + 1) / nt; };
    std::vector<float> scales(t_all);
    // the input rows of projection p from `in` (ld columns), then its product into y (+ residual)
    auto project = [&](const specserve::QProj& pr, const float* in, int64_t ld, int64_t prologue, const float* nw,
                       float e, float* y, const float* residual) {
      if (prologue == NORM) specserve::norm_scales(in, ld, pr.nb * 32, e, 0, t_all, scales.data());
      const int64_t blocks = t_all * pr.nb;
      specserve::quantize_blocks(in, ld, pr, path, prologue, nw, scales.data(), lo(blocks), hi(blocks), q, qd, qs);
#pragma omp barrier
      specserve::product_groups(pr, path, q, qd, qs, t_all, lo(pr.groups), hi(pr.groups), y, residual);
#pragma omp barrier
    };
    if (capture_at[0] != nullptr) {
      std::memcpy(capture_at[0] + lo(t_all) * hidden, xa + lo(t_all) * hidden,
                  sizeof(float) * (hi(t_all) - lo(t_all)) * hidden);
    }
    for (int64_t l = 0; l < layers; ++l) {
      const specserve::QProj* p = &proj[l * PROJ];
      project(p[0], xa, hidden, NORM, nwp[2 * l], static_cast<float>(eps[2 * l]), qkv, nullptr);
      specserve::rope_write_range(qkv, cp, sp, c.rot, d, n_heads, n_kv, wp, kcp[l], vcp[l], qh, lo(t_all),
                                  hi(t_all));
#pragma omp barrier
      specserve::attend_range(qh, kcp[l], vcp[l], rp, c.nk, mp, c.nq, gp, n_heads, n_kv, d, sc, lo(t_all * n_heads),
                              hi(t_all * n_heads), att);
#pragma omp barrier
      project(p[1], att, att_w, NONE, nullptr, 0.f, xb, xa);
      project(p[2], xb, hidden, NORM, nwp[2 * l + 1], static_cast<float>(eps[2 * l + 1]), gu, nullptr);
      project(p[3], gu, gu_w, SILU_MUL, nullptr, 0.f, xa, xb);
      if (capture_at[l + 1] != nullptr) {  // xa is written again only after the next layer's barriers
        std::memcpy(capture_at[l + 1] + lo(t_all) * hidden, xa + lo(t_all) * hidden,
                    sizeof(float) * (hi(t_all) - lo(t_all)) * hidden);
      }
    }
  }
  out[0] = a_buf;
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(specserve_q, lib) {
  lib.def("decoder_stack(Tensor x, Tensor[] w, Tensor?[] bias, int[] kinds, int[] n_out, Tensor[] norms, "
          "float[] eps, Tensor cos, Tensor sin, Tensor(a!)[] k_caches, Tensor(b!)[] v_caches, Tensor write, "
          "Tensor read, Tensor? mask, Tensor? grid, int n_heads, int n_kv, float scale, int[] capture) -> Tensor[]");
}

TORCH_LIBRARY_IMPL(specserve_q, CPU, lib) { lib.impl("decoder_stack", decoder_stack); }
