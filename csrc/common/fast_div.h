// Division by a divisor fixed at launch (a head-group size, a tile count) as a multiply-high, an
// add and a shift instead of the ~20 dependent instructions of an integer division, which sit on a
// latency-bound kernel's path to its first load. Exact for dividends below 2^31 (any divisor >= 1).
// Plain C++ with CUDA qualifiers where nvcc compiles it, so the host tests check the same formula.
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#define CULA_HOST_DEVICE __host__ __device__
#else
#define CULA_HOST_DEVICE
#endif

namespace cula {

struct FastDiv {
  uint32_t divisor = 1, mul = 0, shift = 0;
  FastDiv() = default;
  // shift = ceil(log2 d), mul = floor(2^32 (2^shift - d) / d) + 1 (0 for d = 1)
  explicit FastDiv(uint32_t d) : divisor(d) {
    while ((uint64_t{1} << shift) < d) ++shift;
    mul = d <= 1 ? 0 : static_cast<uint32_t>(((uint64_t{1} << 32) * ((uint64_t{1} << shift) - d)) / d + 1);
  }
  CULA_HOST_DEVICE uint32_t div(uint32_t n) const {
#if defined(__CUDA_ARCH__)
    const uint32_t hi = __umulhi(n, mul);
#else
    const uint32_t hi = static_cast<uint32_t>((uint64_t{n} * mul) >> 32);
#endif
    return (hi + n) >> shift;
  }
};

}  // namespace cula
