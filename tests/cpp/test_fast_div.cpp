// FastDiv (common/fast_div.h): the multiply-high division the CUDA kernels use for launch-constant
// divisors, checked against integer division on the host (the same formula; the device takes
// __umulhi for the high word).
#include <gtest/gtest.h>

#include <cstdint>
#include <random>

#include "common/fast_div.h"
#include "helpers.h"

namespace {

void expect_exact(uint32_t d, uint32_t n) {
  const cula::FastDiv f(d);
  ASSERT_EQ(f.div(n), n / d) << "n = " << n << ", d = " << d;
}

TEST(FastDiv, SmallDivisorsAgainstEveryDividendUpTo4096AndEdges) {
  for (uint32_t d = 1; d <= 1024; ++d) {
    for (uint32_t n = 0; n <= 4096; ++n) expect_exact(d, n);
    for (uint32_t n : {0x7fffffffu, 0x7ffffffeu, 0x40000000u, 0x3fffffffu}) expect_exact(d, n);
    for (uint32_t m = 1; m < 64; ++m) {  // multiples of d and their neighbours
      const uint64_t x = uint64_t{d} * (uint64_t{1} << 20) * m;
      if (x < 0x80000000ull) {
        expect_exact(d, static_cast<uint32_t>(x));
        expect_exact(d, static_cast<uint32_t>(x - 1));
      }
    }
  }
}

TEST(FastDiv, RandomDivisorsAndDividendsBelow2To31) {
  const uint64_t seed = cula_test::fresh_seed();
  std::mt19937_64 rng(seed);
  std::uniform_int_distribution<uint32_t> dividend(0, 0x7fffffffu);
  for (int i = 0; i < 20000; ++i) {
    const int bits = 1 + static_cast<int>(rng() % 31);
    const uint32_t d = 1 + static_cast<uint32_t>(rng() % ((uint64_t{1} << bits) - 1 + 1));
    for (int j = 0; j < 50; ++j) expect_exact(d, dividend(rng));
  }
  SUCCEED() << "seed " << seed;
}

TEST(FastDiv, PowersOfTwoAreShifts) {
  for (uint32_t s = 0; s < 31; ++s) {
    const cula::FastDiv f(1u << s);
    EXPECT_EQ(f.shift, s);
    EXPECT_EQ(f.div(0x7fffffffu), 0x7fffffffu >> s);
  }
}

}  // namespace
