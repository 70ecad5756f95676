// The extension's operators that other files of it call directly (layers.cpp runs a whole decoder stack through
// them, one call from Python per forward).
#pragma once
#include <ATen/ATen.h>

#include <c10/util/Half.h>

#include <cstdint>
#include <optional>

namespace specserve {

// One quantized projection as the products read it (qmatmul.cpp): packed blocks, G groups of 16 channels, nb
// blocks of 32 along K, kind 4 (Q4_1) or 8 (Q8_0), n_out <= G * 16 outputs, an optional float32 bias [n_out].
struct QProj {
  const uint8_t* w;
  const c10::Half* d;
  const c10::Half* m;
  const int32_t* corr;
  int64_t kind, groups, nb, n_out;
  const float* bias;
};

// The projection's view, its tensors checked (they must outlive it).
QProj qproj(const at::Tensor& w, const at::Tensor& d, const at::Tensor& m, const at::Tensor& corr, int64_t kind,
            int64_t n_out, const std::optional<at::Tensor>& bias);
// The product path this CPU runs best (what qlinear runs).
int64_t best_path();
// RMSNorm's per-row scale 1 / sqrt(mean(x^2) + eps) of rows [r0, r1) of x [M, ld] over its first k columns.
void norm_scales(const float* x, int64_t ld, int64_t k, float eps, int64_t r0, int64_t r1, float* out);
// Blocks [i0, i1) of a product's quantized input (q [M, K], d and s [M, nb]) made from x [M, ld] by the prologue
// (0 none, 1 RMSNorm with `scales` and weight nw, 2 SiLU-mul of x's two halves).
void quantize_blocks(const float* x, int64_t ld, const QProj& p, int64_t path, int64_t prologue, const float* nw,
                     const float* scales, int64_t i0, int64_t i1, int8_t* q, float* d, float* s);
// Groups [g0, g1) of y [rows, G * 16] = input . W^T, then y = (y + bias) + residual [rows, n_out] where given.
void product_groups(const QProj& p, int64_t path, const int8_t* q, const float* d, const float* s, int64_t rows,
                    int64_t g0, int64_t g1, float* y, const float* residual);

// attention.cpp: the arguments of a paged attention call, checked (what `check_paged` returns: contiguous
// tensors, the head dimension, RoPE width, keys per row and query rows per grid row).
struct PagedCall {
  at::Tensor cos, sin, write, read, mask, grid;  // mask and grid undefined where not given
  int64_t d = 0, rot = 0, nk = 0, nq = 0;
};
PagedCall check_paged(int64_t t_all, int64_t qkv_width, const at::Tensor& cos, const at::Tensor& sin,
                      const at::Tensor& kc, const at::Tensor& vc, const at::Tensor& write, const at::Tensor& read,
                      const std::optional<at::Tensor>& mask, const std::optional<at::Tensor>& grid, int64_t n_heads,
                      int64_t n_kv);
// RoPE on tokens [t0, t1) of qkv [T, (Hq + 2 Hkv) D] (cos/sin [T, rot]): q heads into qbuf
// [T, Hq, D], k heads and v written to the caches [S, Hkv, D] at `write`.
void rope_write_range(const float* qkv, const float* cos, const float* sin, int64_t rot, int64_t d, int64_t n_heads,
                      int64_t n_kv, const int64_t* write, float* kc, float* vc, float* qbuf, int64_t t0, int64_t t1);
// Attention rows [r0, r1) (row = token * Hq + head) over the slots of read [B, K] that mask [B, 1, Q, K] admits
// (null: all), token t at grid[t] (null: t) of the [B, Q] grid -> out [T, Hq * D].
void attend_range(const float* qbuf, const float* kc, const float* vc, const int64_t* read, int64_t nk,
                  const bool* mask, int64_t nq, const int64_t* grid, int64_t n_heads, int64_t n_kv, int64_t d,
                  float scale, int64_t r0, int64_t r1, float* out);

// qmatmul.cpp: prologue (0 none, 1 RMSNorm, 2 SiLU-mul) + quantized product + bias + residual -> [M, n_out].
at::Tensor qlinear(const at::Tensor& x, const at::Tensor& w, const at::Tensor& d, const at::Tensor& m,
                   const at::Tensor& corr, int64_t kind, int64_t n_out, int64_t prologue,
                   const std::optional<at::Tensor>& norm_w, double eps, const std::optional<at::Tensor>& bias,
                   const std::optional<at::Tensor>& residual);

// attention.cpp: RoPE + paged KV write + row-invariant attention in place on the cache -> [T, Hq * D].
at::Tensor attend_paged(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin, at::Tensor kc,
                        at::Tensor vc, const at::Tensor& write, const at::Tensor& read,
                        const std::optional<at::Tensor>& mask, const std::optional<at::Tensor>& grid,
                        int64_t n_heads, int64_t n_kv, double scale);

}  // namespace specserve
