// Row-invariant attention for the CPU: each query row is computed on its own, over the keys its mask admits,
// with the same float operations whatever the number of query rows, of padded keys or of threads. So a token's
// output in a 16-token verify equals its output in a one-token step bit for bit (SDPA's kernels block the
// queries and can round differently with the row count).
//
// Per row, over the keys its mask admits, taken in key order as a compact list (k = 0, 1, ...), so neither
// masked keys nor where the admitted ones sit change anything:
//   s_k = scale * dot(q, key_k) (lanes of 16 over the head dimension, then a fixed pairwise tree);
//   p_k = exp(s_k - max) (a polynomial exp, the same in every build);
//   out_c = (sum_k p_k v_kc in order of k) / (sum of p_k in lanes k % 16, then the tree).
#include <torch/library.h>
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include "kernels.h"
#include "vec16.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#pragma GCC diagnostic ignored "-Wpsabi"

namespace {

constexpr int L = 16;
using specserve::exp_fixed;
using specserve::v16;
using specserve::v16u;
typedef float v8 __attribute__((vector_size(32)));
typedef float v4 __attribute__((vector_size(16)));

#define SPECSERVE_INLINE __attribute__((always_inline)) inline
SPECSERVE_INLINE v16 load(const float* p) { return *reinterpret_cast<const v16u*>(p); }
SPECSERVE_INLINE void store(float* p, v16 x) { *reinterpret_cast<v16u*>(p) = x; }
SPECSERVE_INLINE v16 splat(float x) { return v16{} + x; }

// Lanes summed by a fixed pairwise tree (16 -> 8 -> 4 -> 2 -> 1).
SPECSERVE_INLINE float hsum(v16 a) {
  const v8 b = __builtin_shufflevector(a, a, 0, 1, 2, 3, 4, 5, 6, 7) +
               __builtin_shufflevector(a, a, 8, 9, 10, 11, 12, 13, 14, 15);
  const v4 c = __builtin_shufflevector(b, b, 0, 1, 2, 3) + __builtin_shufflevector(b, b, 4, 5, 6, 7);
  const float e0 = c[0] + c[2], e1 = c[1] + c[3];
  return e0 + e1;
}

// One query row over the n keys it admits: q [nd * 16], keys/values [*, nd * 16], idx [n] their rows (in key
// order), s [n rounded up to 16]. The k-th admitted key always takes lane k % 16, whichever slot it sits in, so
// a tree verify (siblings' slots in between) computes what the compact one-token step computes.
template <int ND>
SPECSERVE_INLINE void row_body(const float* qi, const float* kb, const float* vb, const int32_t* idx, int64_t n,
                               int nd_rt, float sc, float* s, float* oi) {
  const int nd = ND ? ND : nd_rt;
  if (n == 0) {  // no key admitted: zeros, as a guard
    for (int c = 0; c < nd * L; ++c) oi[c] = 0.f;
    return;
  }
  v16 qv[16];
  for (int c = 0; c < nd; ++c) qv[c] = load(qi + c * L);
  float mx = -std::numeric_limits<float>::infinity();
  for (int64_t k = 0; k < n; ++k) {
    const float* kj = kb + static_cast<int64_t>(idx[k]) * nd * L;
    v16 a = qv[0] * load(kj);
    for (int c = 1; c < nd; ++c) a += qv[c] * load(kj + c * L);
    s[k] = hsum(a) * sc;
    mx = s[k] > mx ? s[k] : mx;
  }
  const int64_t np = (n + L - 1) / L * L;
  for (int64_t k = 0; k < n; ++k) {  // s_k - max, clamped where exp underflows anyway
    const float x = s[k] - mx;
    s[k] = x < -87.f ? -87.f : x;
  }
  for (int64_t k = n; k < np; ++k) s[k] = 0.f;
  for (int64_t k0 = 0; k0 < np; k0 += L) store(s + k0, exp_fixed(load(s + k0)));
  for (int64_t k = n; k < np; ++k) s[k] = 0.f;
  v16 tot{};
  for (int64_t k0 = 0; k0 < np; k0 += L) tot += load(s + k0);
  v16 o[16];
  for (int c = 0; c < nd; ++c) o[c] = v16{};
  for (int64_t k = 0; k < n; ++k) {
    const v16 p = splat(s[k]);
    const float* vj = vb + static_cast<int64_t>(idx[k]) * nd * L;
    for (int c = 0; c < nd; ++c) o[c] += p * load(vj + c * L);
  }
  const v16 inv = splat(1.f / hsum(tot));
  for (int c = 0; c < nd; ++c) store(oi + c * L, o[c] * inv);
}

// G query rows of one KV head (a GQA group) over the same n keys: per row exactly `row_body`'s float operations in
// its order, each key's and value's vectors loaded once for all G rows. Rows g at q0 + g D, out at o0 + g D; their
// scores at s + g * sstride (sstride >= n rounded up to 16).
template <int ND, int G>
SPECSERVE_INLINE void group_body(const float* q0, const float* kb, const float* vb, const int32_t* idx, int64_t n,
                                 float sc, float* s, int64_t sstride, float* o0) {
  constexpr int D = ND * L;
  if (n == 0) {
    for (int c = 0; c < G * D; ++c) o0[c] = 0.f;
    return;
  }
  v16 qv[G][ND];
  float mx[G];
  for (int g = 0; g < G; ++g) {
    for (int c = 0; c < ND; ++c) qv[g][c] = load(q0 + g * D + c * L);
    mx[g] = -std::numeric_limits<float>::infinity();
  }
  for (int64_t k = 0; k < n; ++k) {
    const float* kj = kb + static_cast<int64_t>(idx[k]) * D;
    v16 kk[ND];
    for (int c = 0; c < ND; ++c) kk[c] = load(kj + c * L);
    for (int g = 0; g < G; ++g) {
      v16 a = qv[g][0] * kk[0];
      for (int c = 1; c < ND; ++c) a += qv[g][c] * kk[c];
      const float sg = hsum(a) * sc;
      s[g * sstride + k] = sg;
      mx[g] = sg > mx[g] ? sg : mx[g];
    }
  }
  const int64_t np = (n + L - 1) / L * L;
  v16 tot[G];
  for (int g = 0; g < G; ++g) {
    float* sg = s + g * sstride;
    for (int64_t k = 0; k < n; ++k) {
      const float x = sg[k] - mx[g];
      sg[k] = x < -87.f ? -87.f : x;
    }
    for (int64_t k = n; k < np; ++k) sg[k] = 0.f;
    for (int64_t k0 = 0; k0 < np; k0 += L) store(sg + k0, exp_fixed(load(sg + k0)));
    for (int64_t k = n; k < np; ++k) sg[k] = 0.f;
    tot[g] = v16{};
    for (int64_t k0 = 0; k0 < np; k0 += L) tot[g] += load(sg + k0);
  }
  v16 o[G][ND];
  for (int g = 0; g < G; ++g) {
    for (int c = 0; c < ND; ++c) o[g][c] = v16{};
  }
  for (int64_t k = 0; k < n; ++k) {
    const float* vj = vb + static_cast<int64_t>(idx[k]) * D;
    v16 vv[ND];
    for (int c = 0; c < ND; ++c) vv[c] = load(vj + c * L);
    for (int g = 0; g < G; ++g) {
      const v16 p = splat(s[g * sstride + k]);
      for (int c = 0; c < ND; ++c) o[g][c] += p * vv[c];
    }
  }
  for (int g = 0; g < G; ++g) {
    const v16 inv = splat(1.f / hsum(tot[g]));
    for (int c = 0; c < ND; ++c) store(o0 + g * D + c * L, o[g][c] * inv);
  }
}

// Whether this CPU runs the AVX512 builds of the row and group bodies.
bool wide_vectors() {
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512dq") &&
         __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl");
}

using GroupFn = void (*)(const float*, const float*, const float*, const int32_t*, int64_t, float, float*, int64_t,
                         float*);

#define SPECSERVE_GROUP_FNS(ND, G)                                                                             \
  __attribute__((target("avx512f,avx512dq,avx512bw,avx512vl"))) void group_avx512_##ND##_##G(                  \
      const float* q0, const float* kb, const float* vb, const int32_t* idx, int64_t n, float sc, float* s,     \
      int64_t sstride, float* o0) {                                                                            \
    group_body<ND, G>(q0, kb, vb, idx, n, sc, s, sstride, o0);                                                 \
  }                                                                                                            \
  void group_base_##ND##_##G(const float* q0, const float* kb, const float* vb, const int32_t* idx, int64_t n, \
                             float sc, float* s, int64_t sstride, float* o0) {                                 \
    group_body<ND, G>(q0, kb, vb, idx, n, sc, s, sstride, o0);                                                 \
  }
SPECSERVE_GROUP_FNS(4, 2)
SPECSERVE_GROUP_FNS(4, 3)
SPECSERVE_GROUP_FNS(4, 4)
SPECSERVE_GROUP_FNS(8, 2)
SPECSERVE_GROUP_FNS(8, 3)
SPECSERVE_GROUP_FNS(8, 4)
#undef SPECSERVE_GROUP_FNS

// The grouped body for nd chunks of 16 and a group of g rows, or null (run rows one by one).
GroupFn pick_group(int nd, int64_t g) {
  const bool wide = wide_vectors();
  if (nd == 4 && g == 2) return wide ? group_avx512_4_2 : group_base_4_2;
  if (nd == 4 && g == 3) return wide ? group_avx512_4_3 : group_base_4_3;
  if (nd == 4 && g == 4) return wide ? group_avx512_4_4 : group_base_4_4;
  if (nd == 8 && g == 2) return wide ? group_avx512_8_2 : group_base_8_2;
  if (nd == 8 && g == 3) return wide ? group_avx512_8_3 : group_base_8_3;
  if (nd == 8 && g == 4) return wide ? group_avx512_8_4 : group_base_8_4;
  return nullptr;
}

// The same body built for AVX512 and for the baseline; the generic vectors give the same lane-wise float
// operations in both (no contraction into FMAs: -ffp-contract=off).
#define SPECSERVE_ROW_FNS(ND)                                                                                 \
  __attribute__((target("avx512f,avx512dq,avx512bw,avx512vl"))) void row_avx512_##ND(                         \
      const float* qi, const float* kb, const float* vb, const int32_t* idx, int64_t n, int nd, float sc,      \
      float* s, float* oi) {                                                                                  \
    row_body<ND>(qi, kb, vb, idx, n, nd, sc, s, oi);                                                          \
  }                                                                                                           \
  void row_base_##ND(const float* qi, const float* kb, const float* vb, const int32_t* idx, int64_t n, int nd, \
                     float sc, float* s, float* oi) {                                                         \
    row_body<ND>(qi, kb, vb, idx, n, nd, sc, s, oi);                                                          \
  }
SPECSERVE_ROW_FNS(0)
SPECSERVE_ROW_FNS(4)
SPECSERVE_ROW_FNS(8)
#undef SPECSERVE_ROW_FNS

using RowFn = void (*)(const float*, const float*, const float*, const int32_t*, int64_t, int, float, float*,
                       float*);

RowFn pick_row(int nd) {
  const bool wide = wide_vectors();
  if (nd == 4) return wide ? row_avx512_4 : row_base_4;
  if (nd == 8) return wide ? row_avx512_8 : row_base_8;
  return wide ? row_avx512_0 : row_base_0;
}

// q [B, Hq, Q, D], k/v [B, Hkv, K, D] float32; mask [B|1, 1, Q, K] bool or undefined -> [B, Hq, Q, D].
at::Tensor attend_rows(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                       const std::optional<at::Tensor>& mask, double scale) {
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4, "attend_rows: q, k, v must be 4-D");
  TORCH_CHECK(q.scalar_type() == at::kFloat && k.scalar_type() == at::kFloat && v.scalar_type() == at::kFloat,
              "attend_rows: float32 only");
  const int64_t b = q.size(0), hq = q.size(1), nq = q.size(2), d = q.size(3);
  const int64_t hkv = k.size(1), nk = k.size(2);
  TORCH_CHECK(k.size(0) == b && v.sizes() == k.sizes() && k.size(3) == d && hq % hkv == 0,
              "attend_rows: shapes do not match");
  TORCH_CHECK(d % L == 0 && d <= 16 * L, "attend_rows: the head dimension must be a multiple of 16, at most 256");
  const int64_t nkp = (nk + L - 1) / L * L;
  const at::Tensor qc = q.contiguous(), kc = k.contiguous(), vc = v.contiguous();
  at::Tensor mc;
  int64_t mask_b = 0;
  if (mask.has_value() && mask->defined()) {
    mc = mask->to(at::kBool).contiguous();
    TORCH_CHECK(mc.dim() == 4 && mc.size(1) == 1 && mc.size(2) == nq && mc.size(3) == nk &&
                (mc.size(0) == b || mc.size(0) == 1), "attend_rows: mask must be [B|1, 1, Q, K]");
    mask_b = mc.size(0) == 1 ? 0 : nq * nk;
  }
  at::Tensor out = at::empty({b, hq, nq, d}, qc.options());
  const float* qp = qc.data_ptr<float>();
  const float* kp = kc.data_ptr<float>();
  const float* vp = vc.data_ptr<float>();
  const bool* mp = mc.defined() ? mc.data_ptr<bool>() : nullptr;
  float* op = out.data_ptr<float>();
  const int64_t group = hq / hkv;
  const float sc = static_cast<float>(scale);
  const int nd = static_cast<int>(d / L);
  const RowFn row = pick_row(nd);
  at::parallel_for(0, b * hq * nq, 1, [&](int64_t r0, int64_t r1) {
    std::vector<float> s(nkp);
    std::vector<int32_t> idx(nk);
    for (int64_t r = r0; r < r1; ++r) {
      const int64_t i = r % nq, h = (r / nq) % hq, bi = r / (nq * hq), kh = h / group;
      const bool* mi = mp ? mp + bi * mask_b + i * nk : nullptr;
      int64_t n = 0;
      for (int64_t j = 0; j < nk; ++j) {
        if (!mi || mi[j]) idx[n++] = static_cast<int32_t>(j);
      }
      row(qp + r * d, kp + (bi * hkv + kh) * nk * d, vp + (bi * hkv + kh) * nk * d, idx.data(), n, nd, sc,
          s.data(), op + r * d);
    }
  });
  return out;
}

// RoPE in the "rotate half" layout on one head: y = x * cos + rotate_half(x) * sin over the first `rot` dims
// (rotate_half(x) = [-x2, x1]), the rest copied; the same products and sum PyTorch's three ops compute per element.
void rope_head(const float* x, const float* cos, const float* sin, int64_t rot, int64_t d, float* y) {
  const int64_t half = rot / 2;
  for (int64_t c = 0; c < half; ++c) y[c] = x[c] * cos[c] + (-x[c + half]) * sin[c];
  for (int64_t c = half; c < rot; ++c) y[c] = x[c] * cos[c] + x[c - half] * sin[c];
  for (int64_t c = rot; c < d; ++c) y[c] = x[c];
}

// One decoder layer's attention on the paged KV cache in one call: RoPE on the q and k heads of qkv, the new keys
// and values written to their slots, then each (token, head) row attended over the slots its mask admits, read in
// place from the cache (no gathered copies). Computes what `kv.update` + `attend_rows` compute, bit for bit.
// qkv [T, (Hq + 2 Hkv) D]; cos/sin [T, rot]; kc/vc [S, Hkv, D] (written); write [T]; read [B, K];
// mask [B, 1, Q, K] bool or undefined (every row attends all K); grid [T]: token t's place b * Q + i in the
// [B, Q] grid (undefined: t itself) -> [T, Hq * D].
at::Tensor attend_paged_impl(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin, at::Tensor kc,
                             at::Tensor vc, const at::Tensor& write, const at::Tensor& read,
                             const std::optional<at::Tensor>& mask, const std::optional<at::Tensor>& grid,
                             int64_t n_heads, int64_t n_kv, double scale) {
  TORCH_CHECK(qkv.dim() == 2 && qkv.scalar_type() == at::kFloat,
              "attend_paged: qkv must be float32 [T, (Hq + 2 Hkv) D]");
  const specserve::PagedCall c = specserve::check_paged(qkv.size(0), qkv.size(1), cos, sin, kc, vc, write, read, mask,
                                                        grid, n_heads, n_kv);
  const at::Tensor xc = qkv.contiguous();
  const int64_t t_all = xc.size(0), d = c.d, rot = c.rot, nk = c.nk, nq = c.nq;
  const float* xp = xc.data_ptr<float>();
  const float* cp = c.cos.data_ptr<float>();
  const float* sp = c.sin.data_ptr<float>();
  const int64_t* wp = c.write.data_ptr<int64_t>();
  const int64_t* rp = c.read.data_ptr<int64_t>();
  float* kp = kc.data_ptr<float>();
  float* vp = vc.data_ptr<float>();
  at::Tensor qbuf = at::empty({t_all, n_heads, d}, xc.options());
  float* qp = qbuf.data_ptr<float>();
  at::parallel_for(0, t_all, 1, [&](int64_t t0, int64_t t1) {
    specserve::rope_write_range(xp, cp, sp, rot, d, n_heads, n_kv, wp, kp, vp, qp, t0, t1);
  });
  at::Tensor out = at::empty({t_all, n_heads * d}, xc.options());
  float* op = out.data_ptr<float>();
  const bool* mp = c.mask.defined() ? c.mask.data_ptr<bool>() : nullptr;
  const int64_t* gp = c.grid.defined() ? c.grid.data_ptr<int64_t>() : nullptr;
  at::parallel_for(0, t_all * n_heads, 1, [&](int64_t r0, int64_t r1) {
    specserve::attend_range(qp, kp, vp, rp, nk, mp, nq, gp, n_heads, n_kv, d, static_cast<float>(scale), r0, r1, op);
  });
  return out;
}

}  // namespace

namespace specserve {

PagedCall check_paged(int64_t t_all, int64_t qkv_width, const at::Tensor& cos, const at::Tensor& sin,
                      const at::Tensor& kc, const at::Tensor& vc, const at::Tensor& write, const at::Tensor& read,
                      const std::optional<at::Tensor>& mask, const std::optional<at::Tensor>& grid, int64_t n_heads,
                      int64_t n_kv) {
  TORCH_CHECK(kc.dim() == 3 && kc.is_contiguous() && vc.is_contiguous() && kc.sizes() == vc.sizes() &&
                  kc.scalar_type() == at::kFloat && vc.scalar_type() == at::kFloat && kc.size(1) == n_kv,
              "attend_paged: the cache must be contiguous float32 [S, Hkv, D], keys and values alike");
  PagedCall c;
  c.d = kc.size(2);
  TORCH_CHECK(c.d % L == 0 && c.d <= 16 * L, "attend_paged: the head dimension must be a multiple of 16, at most 256");
  TORCH_CHECK(qkv_width == (n_heads + 2 * n_kv) * c.d && n_heads % n_kv == 0,
              "attend_paged: qkv must be float32 [T, (Hq + 2 Hkv) D]");
  TORCH_CHECK(cos.dim() == 2 && cos.size(0) == t_all && cos.sizes() == sin.sizes() && cos.size(1) <= c.d &&
                  cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat,
              "attend_paged: cos/sin must be float32 [T, rot]");
  TORCH_CHECK(write.dim() == 1 && write.size(0) == t_all && write.scalar_type() == at::kLong &&
                  read.dim() == 2 && read.scalar_type() == at::kLong,
              "attend_paged: write [T] and read [B, K] must be int64");
  c.cos = cos.contiguous();
  c.sin = sin.contiguous();
  c.write = write.contiguous();
  c.read = read.contiguous();
  const int64_t b = c.read.size(0);
  c.nk = c.read.size(1);
  c.rot = c.cos.size(1);
  if (mask.has_value() && mask->defined()) {
    c.mask = mask->contiguous();
    TORCH_CHECK(c.mask.scalar_type() == at::kBool && c.mask.dim() == 4 && c.mask.size(0) == b &&
                    c.mask.size(1) == 1 && c.mask.size(3) == c.nk, "attend_paged: mask must be bool [B, 1, Q, K]");
    c.nq = c.mask.size(2);
  } else {
    TORCH_CHECK(t_all % b == 0, "attend_paged: without a mask every row has T / B tokens");
    c.nq = t_all / b;
  }
  if (grid.has_value() && grid->defined()) {
    c.grid = grid->contiguous();
    TORCH_CHECK(c.grid.scalar_type() == at::kLong && c.grid.numel() == t_all, "attend_paged: grid must be int64 [T]");
  } else {
    TORCH_CHECK(b * c.nq == t_all, "attend_paged: without a grid the tokens fill [B, Q]");
  }
  const int64_t slots = kc.size(0);
  const int64_t* wp = c.write.data_ptr<int64_t>();
  const int64_t* rp = c.read.data_ptr<int64_t>();
  for (int64_t t = 0; t < t_all; ++t) TORCH_CHECK(wp[t] >= 0 && wp[t] < slots, "attend_paged: write slot out of range");
  for (int64_t i = 0; i < b * c.nk; ++i) {
    TORCH_CHECK(rp[i] >= 0 && rp[i] < slots, "attend_paged: read slot out of range");
  }
  return c;
}

void rope_write_range(const float* qkv, const float* cos, const float* sin, int64_t rot, int64_t d, int64_t n_heads,
                      int64_t n_kv, const int64_t* write, float* kc, float* vc, float* qbuf, int64_t t0, int64_t t1) {
  const int64_t heads = n_heads + 2 * n_kv;
  for (int64_t t = t0; t < t1; ++t) {
    const float* x = qkv + t * heads * d;
    const float* ct = cos + t * rot;
    const float* st = sin + t * rot;
    for (int64_t h = 0; h < n_heads; ++h) rope_head(x + h * d, ct, st, rot, d, qbuf + (t * n_heads + h) * d);
    float* krow = kc + write[t] * n_kv * d;
    for (int64_t h = 0; h < n_kv; ++h) rope_head(x + (n_heads + h) * d, ct, st, rot, d, krow + h * d);
    std::memcpy(vc + write[t] * n_kv * d, x + (n_heads + n_kv) * d, sizeof(float) * n_kv * d);
  }
}

// keys and values are read in place: slot s, head kh is row s * Hkv + kh of the cache seen as [S * Hkv, D]
void attend_range(const float* qbuf, const float* kc, const float* vc, const int64_t* read, int64_t nk,
                  const bool* mask, int64_t nq, const int64_t* grid, int64_t n_heads, int64_t n_kv, int64_t d,
                  float scale, int64_t r0, int64_t r1, float* out) {
  const int64_t group = n_heads / n_kv, nkp = (nk + L - 1) / L * L;
  const int nd = static_cast<int>(d / L);
  const RowFn row = pick_row(nd);
  const GroupFn grouped = pick_group(nd, group);  // a KV head's query rows together, where built for its shape
  std::vector<float> s(nkp * std::max<int64_t>(group, 1));
  std::vector<int32_t> idx(nk);
  int64_t have_t = -1, have_kh = -1, n = 0;  // the token and KV head whose admitted slots `idx` holds
  for (int64_t r = r0; r < r1;) {
    const int64_t t = r / n_heads, h = r % n_heads, kh = h / group;
    if (t != have_t || kh != have_kh) {
      const int64_t at_grid = grid ? grid[t] : t, bi = at_grid / nq, i = at_grid % nq;
      const bool* mi = mask ? mask + (bi * nq + i) * nk : nullptr;
      const int64_t* slots_b = read + bi * nk;
      n = 0;
      for (int64_t j = 0; j < nk; ++j) {
        if (!mi || mi[j]) idx[n++] = static_cast<int32_t>(slots_b[j] * n_kv + kh);
      }
      have_t = t;
      have_kh = kh;
    }
    const int64_t at = (t * n_heads + h) * d;
    if (grouped != nullptr && h % group == 0 && r + group <= r1) {
      grouped(qbuf + at, kc, vc, idx.data(), n, scale, s.data(), nkp, out + at);
      r += group;
    } else {
      row(qbuf + at, kc, vc, idx.data(), n, nd, scale, s.data(), out + at);
      r += 1;
    }
  }
}

at::Tensor attend_paged(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin, at::Tensor kc,
                        at::Tensor vc, const at::Tensor& write, const at::Tensor& read,
                        const std::optional<at::Tensor>& mask, const std::optional<at::Tensor>& grid,
                        int64_t n_heads, int64_t n_kv, double scale) {
  return attend_paged_impl(qkv, cos, sin, kc, vc, write, read, mask, grid, n_heads, n_kv, scale);
}
}  // namespace specserve

TORCH_LIBRARY_FRAGMENT(specserve_q, lib) {
  lib.def("attend_rows(Tensor q, Tensor k, Tensor v, Tensor? mask, float scale) -> Tensor");
  lib.def("attend_paged(Tensor qkv, Tensor cos, Tensor sin, Tensor(a!) kc, Tensor(b!) vc, Tensor write, "
          "Tensor read, Tensor? mask, Tensor? grid, int n_heads, int n_kv, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(specserve_q, CPU, lib) {
  lib.impl("attend_rows", attend_rows);
  lib.impl("attend_paged", specserve::attend_paged);
}
