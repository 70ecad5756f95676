// A stack of quantized decoder layers on the paged KV cache in one call from Python (`models/fused.py`,
// `FusedStack`): per layer the five calls of `FusedLayer` (norm + qkv, RoPE + KV write + attention, o + residual,
// norm + gate/up, SiLU-mul + down + residual), made here so that a forward pays Python and the dispatcher once,
// not 150 times. The same operators with the same arguments: the same bits as the per-layer calls.
#include <torch/library.h>
#include <ATen/ATen.h>

#include <algorithm>
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
  TORCH_CHECK(std::is_sorted(capture.begin(), capture.end()), "decoder_stack: capture must be ascending");
  std::vector<at::Tensor> out(1);
  size_t next = 0;
  at::Tensor h = x;
  auto proj = [&](const at::Tensor& in, int64_t l, int64_t p, int64_t prologue, const std::optional<at::Tensor>& nw,
                  double e, const std::optional<at::Tensor>& residual) {
    const int64_t i = l * PROJ + p, o = i * PARTS;
    return specserve::qlinear(in, w[o], w[o + 1], w[o + 2], w[o + 3], kinds[i], n_out[i], prologue, nw, e,
                              bias.get(i), residual);
  };
  while (next < capture.size() && capture[next] == 0) out.push_back(h), ++next;  // before the first layer
  for (int64_t l = 0; l < layers; ++l) {
    const at::Tensor qkv = proj(h, l, 0, NORM, norms[2 * l], eps[2 * l], std::nullopt);
    const at::Tensor att = specserve::attend_paged(qkv, cos, sin, k_caches[l], v_caches[l], write, read, mask, grid,
                                                   n_heads, n_kv, scale);
    h = proj(att, l, 1, NONE, std::nullopt, 0.0, h);
    const at::Tensor gu = proj(h, l, 2, NORM, norms[2 * l + 1], eps[2 * l + 1], std::nullopt);
    h = proj(gu, l, 3, SILU_MUL, std::nullopt, 0.0, h);
    while (next < capture.size() && capture[next] == l + 1) out.push_back(h), ++next;
  }
  TORCH_CHECK(next == capture.size(), "decoder_stack: capture lists a layer past the last (", layers, ")");
  out[0] = h;
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(specserve_q, lib) {
  lib.def("decoder_stack(Tensor x, Tensor[] w, Tensor?[] bias, int[] kinds, int[] n_out, Tensor[] norms, "
          "float[] eps, Tensor cos, Tensor sin, Tensor(a!)[] k_caches, Tensor(b!)[] v_caches, Tensor write, "
          "Tensor read, Tensor? mask, Tensor? grid, int n_heads, int n_kv, float scale, int[] capture) -> Tensor[]");
}

TORCH_LIBRARY_IMPL(specserve_q, CPU, lib) { lib.impl("decoder_stack", decoder_stack); }
