// Sixteen float lanes as a GCC vector, and exp by a fixed polynomial on them: lane-wise float operations only (no
// libm, no compares), so every build of every file that includes this rounds alike (attention's softmax, the
// SiLU of the fused layers).
#pragma once
#include <cstdint>

#pragma GCC diagnostic ignored "-Wpsabi"

namespace specserve {

typedef float v16 __attribute__((vector_size(64)));
typedef float v16u __attribute__((vector_size(64), aligned(4)));
typedef int32_t i16v __attribute__((vector_size(64)));

// exp(x) for -87 <= x <= 88: x = n ln2 + r, exp(r) by a degree-6 polynomial, 2^n through the exponent bits.
__attribute__((always_inline)) inline v16 exp_fixed(v16 x) {
  const v16 t = x * 1.44269504088896341f + 12582912.f;  // round to nearest through the 1.5*2^23 bias
  const v16 n = t - 12582912.f;
  const v16 r = (x - n * 0.693359375f) - n * -2.12194440e-4f;
  v16 p = v16{} + 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.f;
  const i16v bits = (__builtin_convertvector(n, i16v) + 127) << 23;
  return p * (v16)bits;  // vector casts reinterpret the bits
}

}  // namespace specserve
