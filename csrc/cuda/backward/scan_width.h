// The chunk backward's state scans: columns of V per CTA, planned per call (chunk_bwd.cu, step 4).
// Host code only, so the plan is tested without a device (tests/cpp/test_backward.cpp).
#pragma once

#include <cstdint>

namespace cula {
namespace bwd {

// Two roles per (sequence, value head, column slice), so 2 N HV V / width CTAs.
// - sm_90a (wgmma), the delta rule, K <= 128: the scans with the carried matrix in registers, one CTA
//   per SM, at 32 or 64 columns. A 64-column step takes about 1.38x a 32-column one (H200, KDA 1x4096
//   H16 at one wave either way: 0.353 against 0.256 ms), so 64 where it saves more than a quarter of
//   the waves.
// - Otherwise mma.sync, two CTAs per SM, 16 columns; without the delta rule at K <= 128 (no W tile),
//   32 where that grid keeps at least 1.5 CTAs per SM (below that the step's latency is the scan's
//   time, and half the CTAs means twice the steps' work on each).
inline int scan_width(bool delta, int K, int64_t N, int64_t HV, int64_t V, int64_t sms, bool wgmma) {
  const int64_t ctas64 = 2 * N * HV * (V / 64);
  if (wgmma && delta && K <= 128) {
    const int64_t waves64 = (ctas64 + sms - 1) / sms, waves32 = (2 * ctas64 + sms - 1) / sms;
    return 3 * waves32 > 4 * waves64 ? 64 : 32;
  }
  if (!delta && K <= 128 && 2 * (2 * ctas64) >= 3 * sms) return 32;
  return 16;
}

}  // namespace bwd
}  // namespace cula
