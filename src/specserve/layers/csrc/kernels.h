// The extension's operators that other files of it call directly (layers.cpp runs a whole decoder stack through
// them, one call from Python per forward).
#pragma once
#include <ATen/ATen.h>

#include <optional>

namespace specserve {

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
