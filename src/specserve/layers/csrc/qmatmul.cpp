// Quantized products for the CPU: y[M, N] = x[M, K] . W[N, K]^T with W in GGUF-style blocks of 32 along K
// (Q4_1: w = d*q + m, q in 0..15; Q8_0: w = d*q, q in -127..127), every width from one row up.
//
// Activations are quantized per row and block of 32 to int8 (xd = amax/127), as llama.cpp's Q8 activations are,
// so each block's dot product is an exact integer sum. Weights are laid out 16 output channels at a time
// ("groups"): a group's block is 16 lanes x 32 bytes, one int32 lane per channel holding 4 consecutive k, which
// is what one VNNI dot product (vpdpbusd) consumes. A weight block is loaded and unpacked once and used for up to
// 8 rows, and a group's weights stay in L1 across row chunks, so rows cost arithmetic, not memory.
//
// Row invariance: every path computes each (row, channel) output with the same float operations in the same
// order (per block: t = wd*xd; acc = fma(isum, t, acc); acc = fma(wm, xs, acc)), independent of how many rows
// are multiplied together and of which path runs, so a row's result is bit-identical alone or in a batch.
#include <torch/library.h>
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include "kernels.h"
#include "vec16.h"
#include <c10/util/Half.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <optional>
#include <vector>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define SPECSERVE_X86 1
#endif

namespace {

constexpr int BLK = 32;   // weights per block along K
constexpr int LANES = 16; // output channels per group
constexpr int MAXR = 8;   // rows per chunk

enum Kind : int64_t { Q4 = 4, Q8 = 8 };
enum Path : int64_t { AUTO = 0, SCALAR = 1, AVX512VNNI = 2, AVX2 = 3 };

// Per row and block: int8 values (for the scalar path's Q8 products offset by 128, as unsigned bytes), the scale
// and the block's sum: for Q4 weights xd * sum(q) (the zero-point term), for Q8 sum(q) itself (exact in a float,
// |sum| <= 4064: the VNNI path's correction for its unsigned weights).
struct QuantRows {
  at::Tensor q;   // [M, K] int8 (or uint8 holding q + 128)
  at::Tensor d;   // [M, K/32] float32
  at::Tensor s;   // [M, K/32] float32
};

// The same, as pointers (what the products read).
struct QRows {
  const int8_t* q;
  const float* d;
  const float* s;
};

inline void quant_block_scalar(const float* x, int8_t* q, float* d, float* s, bool offset,
                               bool raw_sum) {
  float amax = 0.f;
  for (int i = 0; i < BLK; ++i) amax = std::fmax(amax, std::fabs(x[i]));
  const float xd = amax / 127.f;
  const float id = amax > 0.f ? 127.f / amax : 0.f;
  int32_t sum = 0;
  for (int i = 0; i < BLK; ++i) {
    int32_t v = static_cast<int32_t>(std::nearbyint(x[i] * id));
    v = v > 127 ? 127 : (v < -127 ? -127 : v);
    sum += v;
    q[i] = static_cast<int8_t>(offset ? (v ^ 0x80) : v);  // v ^ 0x80 as a byte is v + 128
  }
  *d = xd;
  *s = raw_sum ? static_cast<float>(sum) : xd * static_cast<float>(sum);
}

#ifdef SPECSERVE_X86
__attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni")))
inline void quant_block_avx512(const float* x, int8_t* q, float* d, float* s, bool offset, bool raw_sum) {
  const __m512 a = _mm512_loadu_ps(x), b = _mm512_loadu_ps(x + 16);
  const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(b)));
  const float xd = amax / 127.f;
  const float id = amax > 0.f ? 127.f / amax : 0.f;
  const __m512 vid = _mm512_set1_ps(id);
  // cvtps rounds to nearest even under the default MXCSR, as nearbyint does; |x * id| <= 127 needs no clamp
  // beyond the scalar path's, which only guards the same bound
  __m512i qa = _mm512_cvtps_epi32(_mm512_mul_ps(a, vid));
  __m512i qb = _mm512_cvtps_epi32(_mm512_mul_ps(b, vid));
  const __m512i lo = _mm512_set1_epi32(-127), hi = _mm512_set1_epi32(127);
  qa = _mm512_min_epi32(_mm512_max_epi32(qa, lo), hi);
  qb = _mm512_min_epi32(_mm512_max_epi32(qb, lo), hi);
  const int32_t sum = _mm512_reduce_add_epi32(_mm512_add_epi32(qa, qb));
  if (offset) {
    const __m512i off = _mm512_set1_epi32(0x80);
    qa = _mm512_xor_si512(qa, off);
    qb = _mm512_xor_si512(qb, off);
  }
  _mm_storeu_si128(reinterpret_cast<__m128i*>(q), _mm512_cvtepi32_epi8(qa));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(q + 16), _mm512_cvtepi32_epi8(qb));
  *d = xd;
  *s = raw_sum ? static_cast<float>(sum) : xd * static_cast<float>(sum);
}

bool has_avx512vnni() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni");
}

bool has_avx2() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
}
#else
bool has_avx512vnni() { return false; }
bool has_avx2() { return false; }
#endif

// How a product's input rows are made from x before quantizing (`qlinear`), so a decoder layer needs no separate
// norm or activation calls: NONE x itself; NORM RMSNorm(x) * w; SILU_MUL silu(x[:, :K]) * x[:, K:].
enum Prologue : int64_t { NONE = 0, NORM = 1, SILU_MUL = 2 };

// silu(a) * b on 32 elements, silu(a) = a / (1 + exp(-a)), exp by the fixed polynomial attention uses (the same bits
// in every build), its argument clamped to [-87, 88].
template <int BUILD>
__attribute__((always_inline)) inline void silu_mul_body(const float* a, const float* b, float* y) {
  using specserve::v16;
  using specserve::v16u;
  for (int h = 0; h < 2; ++h) {
    const v16 x = *reinterpret_cast<const v16u*>(a + 16 * h);
    v16 t = -x;
    t = t < -87.f ? v16{} - 87.f : t;
    t = t > 88.f ? v16{} + 88.f : t;
    const v16 bv = *reinterpret_cast<const v16u*>(b + 16 * h);
    *reinterpret_cast<v16u*>(y + 16 * h) = (x / (1.f + specserve::exp_fixed(t))) * bv;
  }
}
#ifdef SPECSERVE_X86
__attribute__((target("avx512f"))) void silu_mul_avx512(const float* a, const float* b, float* y) {
  silu_mul_body<1>(a, b, y);
}
#endif
void silu_mul_base(const float* a, const float* b, float* y) { silu_mul_body<0>(a, b, y); }

// Per row: r = 1 / sqrt(sum(x^2) / k + eps), the squares summed in 16 lanes (lane = i % 16) then a fixed pairwise
// tree, so a row's scale does not depend on the rows beside it.
float norm_scale(const float* x, int64_t k, float eps) {
  float lane[16] = {0.f};
  for (int64_t i = 0; i < k; ++i) lane[i % 16] += x[i] * x[i];
  for (int width = 8; width >= 1; width /= 2) {
    for (int i = 0; i < width; ++i) lane[i] = lane[i] + lane[i + width];
  }
  return 1.f / std::sqrt(lane[0] / static_cast<float>(k) + eps);
}

using SiluFn = void (*)(const float*, const float*, float*);

SiluFn pick_silu() {
#ifdef SPECSERVE_X86
  return __builtin_cpu_supports("avx512f") ? silu_mul_avx512 : silu_mul_base;
#else
  return silu_mul_base;
#endif
}

// Blocks [i0, i1) (block i = row i / nb, column block i % nb) of the product's quantized input rows, made from x
// [M, ld] by the prologue (NONE: ld >= K; NORM: (x * scale[row]) * nw; SILU_MUL: silu(x[:, :K]) * x[:, K:]).
void quantize_range(const float* xp, int64_t ld, int64_t nb, int64_t prologue, const float* nw, const float* scale,
                    bool offset, bool raw_sum, bool vnni, SiluFn silu, int64_t i0, int64_t i1, int8_t* qp, float* dp,
                    float* sp) {
  const int64_t k = nb * BLK;
  alignas(64) float buf[BLK];
  for (int64_t i = i0; i < i1; ++i) {
    const int64_t row = i / nb, b = i % nb;
    const float* src = xp + row * ld + b * BLK;
    if (prologue == NORM) {
      const float rs = scale[row];
      for (int j = 0; j < BLK; ++j) buf[j] = (src[j] * rs) * nw[b * BLK + j];
      src = buf;
    } else if (prologue == SILU_MUL) {
      silu(src, src + k, buf);
      src = buf;
    }
#ifdef SPECSERVE_X86
    if (vnni) {
      quant_block_avx512(src, qp + i * BLK, dp + i, sp + i, offset, raw_sum);
      continue;
    }
#endif
    quant_block_scalar(src, qp + i * BLK, dp + i, sp + i, offset, raw_sum);
  }
}

// x [M, K'] float32 contiguous -> the product's quantized input rows [M, K]: the prologue (NONE: K' = K; NORM:
// (x * r) * w; SILU_MUL: K' = 2K) applied block by block, each block then quantized; blocks run in parallel.
QuantRows quantize_rows(const at::Tensor& x, int64_t k, bool offset, bool raw_sum, bool vnni, int64_t prologue,
                        const float* nw, float eps) {
  const int64_t m = x.size(0), ld = x.size(1), nb = k / BLK;
  QuantRows r{at::empty({m, k}, x.options().dtype(at::kChar)), at::empty({m, nb}, x.options()),
              at::empty({m, nb}, x.options())};
  const float* xp = x.data_ptr<float>();
  std::vector<float> scale(prologue == NORM ? m : 0);
  for (int64_t row = 0; row < static_cast<int64_t>(scale.size()); ++row) scale[row] = norm_scale(xp + row * ld, k, eps);
  const SiluFn silu = pick_silu();
  at::parallel_for(0, m * nb, 96, [&](int64_t i0, int64_t i1) {
    quantize_range(xp, ld, nb, prologue, nw, scale.data(), offset, raw_sum, vnni, silu, i0, i1, r.q.data_ptr<int8_t>(),
                   r.d.data_ptr<float>(), r.s.data_ptr<float>());
  });
  return r;
}

// Weight layout, per group g and block b (gb = g * nb + b):
//   Q4: 256 bytes = [4 (j), 16 (lane), 4 (t)], low nibble k = 8j + t, high nibble k = 8j + 4 + t;
//   Q8: 512 bytes = [8 (p), 16 (lane), 4 (t)], k = 4p + t, int8;
//   scales: fp16 [16] d per gb (and [16] m for Q4); Q8 also int32 [16] corr = 128 * sum(q) per gb.
struct Weights {
  const uint8_t* w;
  const c10::Half* d;
  const c10::Half* m;    // Q4 only
  const int32_t* corr;   // Q8 only
  int64_t nb;
};

void scalar_group(const Weights& W, int kind, int64_t g, const QRows& X, int64_t r0, int64_t rows,
                  float* y, int64_t ldy) {
  const int64_t nb = W.nb, k = nb * BLK;
  const int8_t* xq = X.q;
  const float* xd = X.d;
  const float* xs = X.s;
  for (int64_t r = r0; r < r0 + rows; ++r) {
    float acc[LANES] = {0.f};
    for (int64_t b = 0; b < nb; ++b) {
      const int64_t gb = g * nb + b;
      const int8_t* xb = xq + r * k + b * BLK;
      const float rd = xd[r * nb + b], rs = xs[r * nb + b];
      for (int l = 0; l < LANES; ++l) {
        int32_t isum = 0;
        if (kind == Q4) {
          const uint8_t* wb = W.w + gb * 256;
          for (int j = 0; j < 4; ++j) {
            for (int t = 0; t < 4; ++t) {
              const uint8_t byte = wb[(j * LANES + l) * 4 + t];
              isum += static_cast<int32_t>(byte & 0x0F) * xb[8 * j + t];
              isum += static_cast<int32_t>(byte >> 4) * xb[8 * j + 4 + t];
            }
          }
        } else {
          const int8_t* wb = reinterpret_cast<const int8_t*>(W.w + gb * 512);
          for (int p = 0; p < 8; ++p) {
            for (int t = 0; t < 4; ++t) {
              isum += static_cast<int32_t>(static_cast<uint8_t>(xb[4 * p + t])) * wb[(p * LANES + l) * 4 + t];
            }
          }
          isum -= W.corr[gb * LANES + l];
        }
        const float tsc = static_cast<float>(W.d[gb * LANES + l]) * rd;
        acc[l] = std::fmaf(static_cast<float>(isum), tsc, acc[l]);
        if (kind == Q4) acc[l] = std::fmaf(static_cast<float>(W.m[gb * LANES + l]), rs, acc[l]);
      }
    }
    std::memcpy(y + r * ldy + g * LANES, acc, sizeof(acc));
  }
}

#ifdef SPECSERVE_X86
// s += dot4(u8 w, s8 broadcast *x) per lane, the broadcast taken from memory by the instruction itself (the
// intrinsic form made the compiler emit one separate broadcast per product)
__attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni"), always_inline))
inline void dpbusd_bcast(__m512i& s, __m512i w, const int32_t* x) {
  asm("vpdpbusd %[x]%{1to16%}, %[w], %[s]" : [s] "+v"(s) : [w] "v"(w), [x] "m"(*x));
}

template <int R, int KIND>
__attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,f16c")))
void vnni_chunk(const Weights& W, int64_t g, const int8_t* xq, const float* xd, const float* xs, int64_t r0,
                float* y, int64_t ldy) {
  const int64_t nb = W.nb, k = nb * BLK;
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  const __m512i low = _mm512_set1_epi8(0x0F);
  for (int64_t b = 0; b < nb; ++b) {
    const int64_t gb = g * nb + b;
    __m512i w[8];
    // a few rows are bound by reading: ask for the blocks a few ahead (groups are contiguous), as non-temporal
    // data, read once a step: the stream of weights then leaves the caches' other contents (the interpreter's,
    // the next op's) in place (batch-1 decode about 4% faster, 8 of 9 paired runs)
    if (R <= 2) {
      const uint8_t* ahead = W.w + (gb + 6) * (KIND == Q4 ? 256 : 512);
      for (int c = 0; c < (KIND == Q4 ? 4 : 8); ++c) {
        _mm_prefetch(reinterpret_cast<const char*>(ahead + 64 * c), _MM_HINT_NTA);
      }
    }
    if (KIND == Q4) {
      const uint8_t* wb = W.w + gb * 256;
      for (int j = 0; j < 4; ++j) {
        const __m512i v = _mm512_loadu_si512(wb + j * 64);
        w[2 * j] = _mm512_and_si512(v, low);
        w[2 * j + 1] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
      }
    } else {  // w + 128 as unsigned bytes (w ^ 0x80), so the signed activations broadcast from memory as Q4's do
      const uint8_t* wb = W.w + gb * 512;
      const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));
      for (int p = 0; p < 8; ++p) w[p] = _mm512_xor_si512(_mm512_loadu_si512(wb + p * 64), flip);
    }
    const __m512 wd = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(W.d + gb * LANES)));
    __m512 wm = _mm512_setzero_ps();
    if (KIND == Q4) wm = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(W.m + gb * LANES)));
    for (int r = 0; r < R; ++r) {
      const int32_t* xb = reinterpret_cast<const int32_t*>(xq + (r0 + r) * k + b * BLK);
      // two chains of four dot products, so that rows overlap less on the instruction's latency
      __m512i s = _mm512_setzero_si512(), s1 = _mm512_setzero_si512();
      for (int p = 0; p < 8; p += 2) {
        // unsigned weights (Q4: 0..15; Q8: w + 128, 0..255) times signed activations, 4 bytes a lane
        dpbusd_bcast(s, w[p], xb + p);
        dpbusd_bcast(s1, w[p + 1], xb + p + 1);
      }
      s = _mm512_add_epi32(s, s1);
      const int64_t rb = (r0 + r) * nb + b;
      // Q8: sum((w + 128) x) - 128 sum(x), the block's exact integer sum as every path computes it
      if (KIND == Q8) s = _mm512_sub_epi32(s, _mm512_set1_epi32(128 * static_cast<int32_t>(xs[rb])));
      const __m512 tsc = _mm512_mul_ps(wd, _mm512_set1_ps(xd[rb]));
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), tsc, acc[r]);
      if (KIND == Q4) acc[r] = _mm512_fmadd_ps(wm, _mm512_set1_ps(xs[rb]), acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(y + (r0 + r) * ldy + g * LANES, acc[r]);
}

template <int KIND>
void vnni_group(const Weights& W, int64_t g, const QRows& X, int64_t m, float* y, int64_t ldy) {
  const int8_t* xq = X.q;
  const float* xd = X.d;
  const float* xs = X.s;
  for (int64_t r0 = 0; r0 < m; r0 += MAXR) {
    switch (std::min<int64_t>(MAXR, m - r0)) {
      case 1: vnni_chunk<1, KIND>(W, g, xq, xd, xs, r0, y, ldy); break;
      case 2: vnni_chunk<2, KIND>(W, g, xq, xd, xs, r0, y, ldy); break;
      case 3: vnni_chunk<3, KIND>(W, g, xq, xd, xs, r0, y, ldy); break;
      case 4: vnni_chunk<4, KIND>(W, g, xq, xd, xs, r0, y, ldy); break;
      case 5: vnni_chunk<5, KIND>(W, g, xq, xd, xs, r0, y, ldy); break;
      case 6: vnni_chunk<6, KIND>(W, g, xq, xd, xs, r0, y, ldy); break;
      case 7: vnni_chunk<7, KIND>(W, g, xq, xd, xs, r0, y, ldy); break;
      default: vnni_chunk<8, KIND>(W, g, xq, xd, xs, r0, y, ldy); break;
    }
  }
}
// AVX2 (no VNNI): a group's 16 lanes as two halves of 8; the 4-byte dot products from vpmaddubsw (u8 x s8 into
// s16 pairs) and vpmaddwd against ones. Q4: nibbles 0..15 times activations -127..127, |pair| <= 3810, and the
// eight pairs of a lane sum to <= 30480 in s16 before widening; Q8: |w| (0..128, as unsigned) times activations
// carrying w's sign, |pair| <= 32512, widened per product. So no step saturates and each block's integer sum is
// the one every other path computes; the float steps that follow are the same too.
template <int R, int KIND>
__attribute__((target("avx2,fma,f16c")))
void avx2_chunk(const Weights& W, int64_t g, int h, const int8_t* xq, const float* xd, const float* xs,
                int64_t r0, float* y, int64_t ldy) {
  const int64_t nb = W.nb, k = nb * BLK;
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  const __m256i low = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
  for (int64_t b = 0; b < nb; ++b) {
    const int64_t gb = g * nb + b;
    __m256i w[8];  // [p]: the 8 lanes of half h, 4 bytes each (k = 4p + t)
    if (KIND == Q4) {
      const uint8_t* wb = W.w + gb * 256 + h * 32;
      for (int j = 0; j < 4; ++j) {
        const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb + j * 64));
        w[2 * j] = _mm256_and_si256(v, low);
        w[2 * j + 1] = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
      }
    } else {
      const uint8_t* wb = W.w + gb * 512 + h * 32;
      for (int p = 0; p < 8; ++p) w[p] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb + p * 64));
    }
    const int64_t lane0 = gb * LANES + h * 8;
    const __m256 wd = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(W.d + lane0)));
    const __m256 wm = KIND == Q4 ? _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(W.m + lane0)))
                                 : _mm256_setzero_ps();
    for (int r = 0; r < R; ++r) {
      const int32_t* xb = reinterpret_cast<const int32_t*>(xq + (r0 + r) * k + b * BLK);
      __m256i s;
      if (KIND == Q4) {
        __m256i s16 = _mm256_maddubs_epi16(w[0], _mm256_set1_epi32(xb[0]));
        for (int p = 1; p < 8; ++p) s16 = _mm256_add_epi16(s16, _mm256_maddubs_epi16(w[p], _mm256_set1_epi32(xb[p])));
        s = _mm256_madd_epi16(s16, ones);
      } else {
        s = _mm256_setzero_si256();
        for (int p = 0; p < 8; ++p) {
          const __m256i sx = _mm256_sign_epi8(_mm256_set1_epi32(xb[p]), w[p]);
          s = _mm256_add_epi32(s, _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_abs_epi8(w[p]), sx), ones));
        }
      }
      const int64_t rb = (r0 + r) * nb + b;
      const __m256 tsc = _mm256_mul_ps(wd, _mm256_set1_ps(xd[rb]));
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), tsc, acc[r]);
      if (KIND == Q4) acc[r] = _mm256_fmadd_ps(wm, _mm256_set1_ps(xs[rb]), acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) _mm256_storeu_ps(y + (r0 + r) * ldy + g * LANES + h * 8, acc[r]);
}

template <int KIND>
void avx2_group(const Weights& W, int64_t g, const QRows& X, int64_t m, float* y, int64_t ldy) {
  const int8_t* xq = X.q;
  const float* xd = X.d;
  const float* xs = X.s;
  for (int h = 0; h < 2; ++h) {
    for (int64_t r0 = 0; r0 < m; r0 += 4) {
      switch (std::min<int64_t>(4, m - r0)) {
        case 1: avx2_chunk<1, KIND>(W, g, h, xq, xd, xs, r0, y, ldy); break;
        case 2: avx2_chunk<2, KIND>(W, g, h, xq, xd, xs, r0, y, ldy); break;
        case 3: avx2_chunk<3, KIND>(W, g, h, xq, xd, xs, r0, y, ldy); break;
        default: avx2_chunk<4, KIND>(W, g, h, xq, xd, xs, r0, y, ldy); break;
      }
    }
  }
}
#endif

// The path a call runs: `path` itself (checked against the CPU) or, for AUTO, the best this CPU has.
Path resolve(int64_t path) {
  TORCH_CHECK(path == AUTO || path == SCALAR || path == AVX512VNNI || path == AVX2, "qmatmul: unknown path ", path);
  TORCH_CHECK(path != AVX512VNNI || has_avx512vnni(), "qmatmul: this CPU has no AVX512-VNNI");
  TORCH_CHECK(path != AVX2 || has_avx2(), "qmatmul: this CPU has no AVX2 (with FMA and F16C)");
  if (path != AUTO) return static_cast<Path>(path);
  return has_avx512vnni() ? AVX512VNNI : has_avx2() ? AVX2 : SCALAR;
}

void check_weights(const at::Tensor& w, const at::Tensor& d, const at::Tensor& m, const at::Tensor& corr,
                   int64_t kind) {
  TORCH_CHECK(kind == Q4 || kind == Q8, "qmatmul: kind must be 4 or 8, got ", kind);
  TORCH_CHECK(d.dim() == 3 && d.size(2) == LANES && d.scalar_type() == at::kHalf && d.is_contiguous(),
              "qmatmul: d must be contiguous fp16 [G, nb, 16]");
  TORCH_CHECK(w.scalar_type() == at::kByte && w.is_contiguous() &&
                  w.numel() == d.size(0) * d.size(1) * (kind == Q4 ? 256 : 512),
              "qmatmul: packed weight of the wrong size or type");
  if (kind == Q4) {
    TORCH_CHECK(m.sizes() == d.sizes() && m.scalar_type() == at::kHalf && m.is_contiguous(), "qmatmul: m like d");
  } else {
    TORCH_CHECK(corr.sizes() == d.sizes() && corr.scalar_type() == at::kInt && corr.is_contiguous(),
                "qmatmul: corr int32 like d");
  }
}

// Groups [g0, g1) of y [M, G*16] = X . W^T on `run`; then, per output, y = (y + bias) + residual where given (the
// order an unfused layer adds them in). bias [N], residual [M, N] float32, N <= G*16.
void groups_range(const Weights& W, int64_t kind, Path run, const QRows& X, int64_t rows, int64_t g0, int64_t g1,
                  float* yp, int64_t n, const float* bias, const float* residual, int64_t n_out) {
  for (int64_t g = g0; g < g1; ++g) {
#ifdef SPECSERVE_X86
    if (run == AVX512VNNI) {
      if (kind == Q4) vnni_group<Q4>(W, g, X, rows, yp, n);
      else vnni_group<Q8>(W, g, X, rows, yp, n);
    } else if (run == AVX2) {
      if (kind == Q4) avx2_group<Q4>(W, g, X, rows, yp, n);
      else avx2_group<Q8>(W, g, X, rows, yp, n);
    } else {
      scalar_group(W, static_cast<int>(kind), g, X, 0, rows, yp, n);
    }
#else
    scalar_group(W, static_cast<int>(kind), g, X, 0, rows, yp, n);
#endif
    if (bias == nullptr && residual == nullptr) continue;
    const int64_t c1 = std::min<int64_t>((g + 1) * LANES, n_out);
    for (int64_t r = 0; r < rows; ++r) {
      float* yr = yp + r * n;
      for (int64_t c = g * LANES; c < c1; ++c) {
        float v = yr[c];
        if (bias != nullptr) v = v + bias[c];
        if (residual != nullptr) v = residual[r * n_out + c] + v;
        yr[c] = v;
      }
    }
  }
}

// y [M, G*16] = xc [M, K] . W^T on `run`, the prologue applied to xc first, bias and residual added after.
void product(const at::Tensor& xc, int64_t prologue, const float* nw, float eps, const specserve::QProj& p, Path run,
             const float* residual, at::Tensor& y) {
  const int64_t rows = xc.size(0);
  // the scalar Q8 product takes activations offset to unsigned (its sums corrected by corr)
  const QuantRows X = quantize_rows(xc, p.nb * BLK, p.kind == Q8 && run == SCALAR, p.kind == Q8, run == AVX512VNNI,
                                    prologue, nw, eps);
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, p.groups, 1, [&](int64_t g0, int64_t g1) {
    specserve::product_groups(p, run, X.q.data_ptr<int8_t>(), X.d.data_ptr<float>(), X.s.data_ptr<float>(), rows,
                              g0, g1, yp, residual);
  });
}

// x [M, K] float32; w packed uint8; d/m fp16 [G, nb, 16]; corr int32 [G, nb, 16] (Q8) -> [M, G*16] float32.
at::Tensor qmatmul(const at::Tensor& x, const at::Tensor& w, const at::Tensor& d, const at::Tensor& m,
                   const at::Tensor& corr, int64_t kind, int64_t path) {
  const specserve::QProj p = specserve::qproj(w, d, m, corr, kind, d.size(0) * LANES, std::nullopt);
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "qmatmul: x must be a 2-D float32 tensor");
  TORCH_CHECK(x.size(1) == p.nb * BLK, "qmatmul: x has ", x.size(1), " columns, the weight ", p.nb * BLK);
  const at::Tensor xc = x.contiguous();
  at::Tensor y = at::empty({xc.size(0), p.n_out}, xc.options());
  if (xc.size(0) == 0) return y;
  product(xc, NONE, nullptr, 0.f, p, resolve(path), nullptr, y);
  return y;
}

// One projection of a decoder layer in one call: the prologue (none, RMSNorm, SiLU-mul) makes the input rows from
// x, the product runs on the best path, and the bias and the residual are added -> [M, n_out] float32.
at::Tensor qlinear_impl(const at::Tensor& x, const at::Tensor& w, const at::Tensor& d, const at::Tensor& m,
                        const at::Tensor& corr, int64_t kind, int64_t n_out, int64_t prologue,
                        const std::optional<at::Tensor>& norm_w, double eps, const std::optional<at::Tensor>& bias,
                        const std::optional<at::Tensor>& residual) {
  const specserve::QProj p = specserve::qproj(w, d, m, corr, kind, n_out, bias);
  const int64_t k = p.nb * BLK, n = p.groups * LANES;
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "qlinear: x must be a 2-D float32 tensor");
  TORCH_CHECK(prologue == NONE || prologue == NORM || prologue == SILU_MUL, "qlinear: unknown prologue ", prologue);
  const at::Tensor xc = x.contiguous();
  TORCH_CHECK(xc.size(1) == (prologue == SILU_MUL ? 2 * k : k), "qlinear: x has ", xc.size(1), " columns, the weight ",
              k, prologue == SILU_MUL ? " (silu-mul takes x of 2K columns)" : "");
  at::Tensor nw, rc;
  if (prologue == NORM) {
    TORCH_CHECK(norm_w.has_value() && norm_w->numel() == k && norm_w->scalar_type() == at::kFloat,
                "qlinear: a norm prologue needs a float32 weight of ", k);
    nw = norm_w->contiguous();
  }
  if (residual.has_value() && residual->defined()) {
    rc = residual->contiguous();
    TORCH_CHECK(rc.scalar_type() == at::kFloat && rc.dim() == 2 && rc.size(0) == xc.size(0) && rc.size(1) == n_out,
                "qlinear: residual must be float32 [M, n_out]");
  }
  at::Tensor y = at::empty({xc.size(0), n}, xc.options());
  if (xc.size(0) > 0) {
    product(xc, prologue, nw.defined() ? nw.data_ptr<float>() : nullptr, static_cast<float>(eps), p, resolve(AUTO),
            rc.defined() ? rc.data_ptr<float>() : nullptr, y);
  }
  return n_out == n ? y : y.narrow(1, 0, n_out);
}

bool path_available(int64_t path) {
  return path == SCALAR || (path == AVX512VNNI && has_avx512vnni()) || (path == AVX2 && has_avx2());
}

}  // namespace

namespace specserve {

QProj qproj(const at::Tensor& w, const at::Tensor& d, const at::Tensor& m, const at::Tensor& corr, int64_t kind,
            int64_t n_out, const std::optional<at::Tensor>& bias) {
  check_weights(w, d, m, corr, kind);
  const int64_t groups = d.size(0);
  TORCH_CHECK(n_out <= groups * LANES && n_out > groups * LANES - LANES, "qlinear: n_out ", n_out,
              " does not match the weight's ", groups * LANES);
  const float* b = nullptr;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == n_out,
                "qlinear: bias must be contiguous float32 [n_out]");
    b = bias->data_ptr<float>();
  }
  return {w.data_ptr<uint8_t>(), d.data_ptr<c10::Half>(), kind == Q4 ? m.data_ptr<c10::Half>() : nullptr,
          kind == Q8 ? corr.data_ptr<int32_t>() : nullptr, kind, groups, d.size(1), n_out, b};
}

int64_t best_path() { return resolve(AUTO); }

void norm_scales(const float* x, int64_t ld, int64_t k, float eps, int64_t r0, int64_t r1, float* out) {
  for (int64_t r = r0; r < r1; ++r) out[r] = norm_scale(x + r * ld, k, eps);
}

void quantize_blocks(const float* x, int64_t ld, const QProj& p, int64_t path, int64_t prologue, const float* nw,
                     const float* scales, int64_t i0, int64_t i1, int8_t* q, float* d, float* s) {
  quantize_range(x, ld, p.nb, prologue, nw, scales, p.kind == Q8 && path == SCALAR, p.kind == Q8,
                 path == AVX512VNNI, pick_silu(), i0, i1, q, d, s);
}

void product_groups(const QProj& p, int64_t path, const int8_t* q, const float* d, const float* s, int64_t rows,
                    int64_t g0, int64_t g1, float* y, const float* residual) {
  const Weights W{p.w, p.d, p.m, p.corr, p.nb};
  groups_range(W, p.kind, static_cast<Path>(path), QRows{q, d, s}, rows, g0, g1, y, p.groups * LANES, p.bias,
               residual, p.n_out);
}

at::Tensor qlinear(const at::Tensor& x, const at::Tensor& w, const at::Tensor& d, const at::Tensor& m,
                   const at::Tensor& corr, int64_t kind, int64_t n_out, int64_t prologue,
                   const std::optional<at::Tensor>& norm_w, double eps, const std::optional<at::Tensor>& bias,
                   const std::optional<at::Tensor>& residual) {
  return qlinear_impl(x, w, d, m, corr, kind, n_out, prologue, norm_w, eps, bias, residual);
}
}  // namespace specserve

TORCH_LIBRARY(specserve_q, lib) {
  lib.def("qmatmul(Tensor x, Tensor w, Tensor d, Tensor m, Tensor corr, int kind, int path=0) -> Tensor");
  lib.def("path_available(int path) -> bool", path_available);
  lib.def("qlinear(Tensor x, Tensor w, Tensor d, Tensor m, Tensor corr, int kind, int n_out, int prologue, "
          "Tensor? norm_w, float eps, Tensor? bias, Tensor? residual) -> Tensor");
}

TORCH_LIBRARY_IMPL(specserve_q, CPU, lib) {
  lib.impl("qmatmul", qmatmul);
  lib.impl("qlinear", specserve::qlinear);
}
