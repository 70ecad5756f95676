// The machine's arithmetic peaks, for the roofline benchmark (benchmarks/roofline.py): tight loops of independent
// accumulators on every thread of torch's pool, each the instruction a kernel path multiplies with.
//   int8 AVX512-VNNI: vpdpbusd on 512 bits (64 multiply-adds each), the VNNI path's product;
//   int8 AVX2: vpmaddubsw + vpaddw on 256 bits (32 multiply-adds each), the AVX2 path's product;
//   float32: FMA on the widest vectors the CPU has (zmm with AVX512F, else ymm), 2 flops per lane.
// Each returns operations per second over all threads (multiply-adds for int8, flops for float32); 0 where the
// CPU lacks the instructions.
#include <torch/library.h>
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <atomic>
#include <chrono>
#include <cstdint>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define SPECSERVE_X86 1
#endif

namespace {

enum Peak : int64_t { INT8_VNNI = 0, INT8_AVX2 = 1, FP32_FMA = 2 };

#ifdef SPECSERVE_X86
// the empty asm keeps the compiler from folding the constant operands or hoisting the loop
#define SPECSERVE_OPAQUE(v) asm volatile("" : "+v"(v))

__attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni"))) int64_t loop_vnni(int64_t iters) {
  __m512i a[10];
  for (int j = 0; j < 10; ++j) a[j] = _mm512_set1_epi32(j);
  __m512i w = _mm512_set1_epi8(3), x = _mm512_set1_epi8(-2);
  for (int64_t i = 0; i < iters; ++i) {
    SPECSERVE_OPAQUE(w);
    SPECSERVE_OPAQUE(x);
    for (int j = 0; j < 10; ++j) a[j] = _mm512_dpbusd_epi32(a[j], w, x);
  }
  __m512i s = a[0];
  for (int j = 1; j < 10; ++j) s = _mm512_add_epi32(s, a[j]);
  return _mm512_reduce_add_epi32(s);
}

__attribute__((target("avx2"))) int64_t loop_avx2(int64_t iters) {
  __m256i a[8];
  for (int j = 0; j < 8; ++j) a[j] = _mm256_set1_epi16(static_cast<int16_t>(j));
  __m256i w = _mm256_set1_epi8(3), x = _mm256_set1_epi8(-2);
  for (int64_t i = 0; i < iters; ++i) {
    SPECSERVE_OPAQUE(w);
    SPECSERVE_OPAQUE(x);
    for (int j = 0; j < 8; ++j) a[j] = _mm256_add_epi16(a[j], _mm256_maddubs_epi16(w, x));
  }
  __m256i s = a[0];
  for (int j = 1; j < 8; ++j) s = _mm256_add_epi16(s, a[j]);
  return _mm256_extract_epi16(s, 0);
}

__attribute__((target("avx512f"))) int64_t loop_fma512(int64_t iters) {
  __m512 a[12];
  for (int j = 0; j < 12; ++j) a[j] = _mm512_set1_ps(static_cast<float>(j));
  __m512 w = _mm512_set1_ps(0.999f), x = _mm512_set1_ps(1e-3f);
  for (int64_t i = 0; i < iters; ++i) {
    SPECSERVE_OPAQUE(w);
    SPECSERVE_OPAQUE(x);
    for (int j = 0; j < 12; ++j) a[j] = _mm512_fmadd_ps(a[j], w, x);
  }
  __m512 s = a[0];
  for (int j = 1; j < 12; ++j) s = _mm512_add_ps(s, a[j]);
  return static_cast<int64_t>(_mm512_reduce_add_ps(s));
}

__attribute__((target("avx2,fma"))) int64_t loop_fma256(int64_t iters) {
  __m256 a[12];
  for (int j = 0; j < 12; ++j) a[j] = _mm256_set1_ps(static_cast<float>(j));
  __m256 w = _mm256_set1_ps(0.999f), x = _mm256_set1_ps(1e-3f);
  for (int64_t i = 0; i < iters; ++i) {
    SPECSERVE_OPAQUE(w);
    SPECSERVE_OPAQUE(x);
    for (int j = 0; j < 12; ++j) a[j] = _mm256_fmadd_ps(a[j], w, x);
  }
  __m256 s = a[0];
  for (int j = 1; j < 12; ++j) s = _mm256_add_ps(s, a[j]);
  return static_cast<int64_t>(s[0]);
}
#undef SPECSERVE_OPAQUE
#endif

// Operations per iteration of one thread's loop, and the loop; ops 0 where the CPU lacks it.
struct Loop {
  double ops;
  int64_t (*fn)(int64_t);
};

Loop pick(int64_t which) {
#ifdef SPECSERVE_X86
  __builtin_cpu_init();
  const bool avx512 = __builtin_cpu_supports("avx512f");
  if (which == INT8_VNNI && avx512 && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl") &&
      __builtin_cpu_supports("avx512vnni")) {
    return {10.0 * 64, loop_vnni};
  }
  if (which == INT8_AVX2 && __builtin_cpu_supports("avx2")) return {8.0 * 32, loop_avx2};
  if (which == FP32_FMA && avx512) return {12.0 * 16 * 2, loop_fma512};
  if (which == FP32_FMA && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) {
    return {12.0 * 8 * 2, loop_fma256};
  }
#endif
  return {0.0, nullptr};
}

double peak(int64_t which, int64_t iters) {
  TORCH_CHECK(which >= INT8_VNNI && which <= FP32_FMA, "peak: which must be 0 (int8 VNNI), 1 (int8 AVX2), 2 (fp32)");
  TORCH_CHECK(iters > 0, "peak: iters must be positive");
  const Loop loop = pick(which);
  if (loop.fn == nullptr) return 0.0;
  const int64_t threads = at::get_num_threads();
  std::atomic<int64_t> sink{0};
  loop.fn(iters / 16);  // warm the core's clocks and the pool
  const auto t0 = std::chrono::steady_clock::now();
  at::parallel_for(0, threads, 1, [&](int64_t a, int64_t b) {
    for (int64_t i = a; i < b; ++i) sink += loop.fn(iters);
  });
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return sink.load() == 42 ? 0.0 : loop.ops * static_cast<double>(iters) * static_cast<double>(threads) / s;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(specserve_q, lib) {
  lib.def("peak(int which, int iters) -> float", peak);
}
