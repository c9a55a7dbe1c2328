// The recurrence's element math on the device, shared by the CUDA kernels of every phase: the gate
// activation (SPEC §2), the chunked kernels' log-decay floor and masked pair factors, and one
// token's update of the state rows a warp holds (recurrent forward and decode).
#pragma once

#include "common/problem.h"
#include "cuda/kerutils/device_utils.cuh"

namespace cula {
namespace dev {

// -eA softplus(x), the gate without a lower bound: log1p(e^x), or x itself above 20 (where the two
// agree in fp32). Selected, not branched: a branch per element made each exponential a divergent
// region of its own. The argument is clamped so that the unselected exponential cannot overflow.
__device__ __forceinline__ float softplus_gate(float x, float eA) {
  const float sp = log1pf(__expf(x > 20.0f ? 20.0f : x));  // not fminf: a NaN stays NaN
  return -eA * (x > 20.0f ? x : sp);
}

// The per-step log-decay of a gate computed in the kernel (SPEC §2) from a raw gate x (dt_bias
// already added) and eA = exp(A_log): lb * sigmoid(eA x) with a lower bound, else -eA softplus(x).
__device__ __forceinline__ float activate_gate(float x, float eA, bool has_lb, float lb) {
  return has_lb ? __fdividef(lb, 1.0f + exp_ftz(-eA * x)) : softplus_gate(x, eA);
}

// The same gate in IEEE precision (expf, log1pf, a true divide), for the standalone gate op, whose
// output is a tensor the caller keeps: lb * sigmoid(eA x), else -eA softplus(x).
__device__ __forceinline__ float activate_gate_precise(float x, float eA, bool has_lb, float lb) {
  if (has_lb) return lb / (1.0f + expf(-eA * x));
  return -eA * (x > 20.0f ? x : log1pf(expf(x)));
}

// beta = mult * sigmoid(b) (SPEC §2: mult is 2 with allow_neg_eigval, else 1), one value per token
// and head, in IEEE arithmetic with the accurate exponential: the float32 value torch's sigmoid
// gives (times 2, exact), so a call with the sigmoid in the kernel computes what the same call
// with beta = sigmoid(b) in float32 does, bit for bit (FLA's test_kda.py holds the two to 1e-4).
__device__ __forceinline__ float beta_sigmoid(float b, float mult) { return mult / (1.0f + expf(-b)); }

// activate_gate over N elements, with the branch on the (uniform) options outside the element
// loop: one branch per element made each exponential a divergent region of its own, so they ran
// one MUFU latency after another.
template <int N>
__device__ __forceinline__ void activate_gates(float (&x)[N], float eA, bool has_lb, float lb) {
  if (has_lb) {
#pragma unroll
    for (int e = 0; e < N; ++e) x[e] = activate_gate(x[e], eA, true, lb);
  } else {
#pragma unroll
    for (int e = 0; e < N; ++e) x[e] = softplus_gate(x[e], eA);
  }
}

// A chunked kernel's log-decay: no lower than kMinChunkLogDecay (a gate of -inf is a reset, not
// NaN; NaN stays NaN).
__device__ __forceinline__ float chunk_log_decay(float a) { return a < kMinChunkLogDecay ? kMinChunkLogDecay : a; }

// keep ? p e^{arg} : 0 without a branch: the exponential is computed for every pair (clamped, so a
// masked pair cannot overflow it) and the mask is a select. A branch around each exponential made
// every one a divergent region of its own, one MUFU latency after another.
__device__ __forceinline__ float masked_exp_scale(bool keep, float p, float arg) {
  const float clamped = arg > 80.0f ? 80.0f : arg;  // not fminf: a NaN stays NaN
  const float x = p * exp_ftz(clamped);
  return keep ? x : 0.0f;
}

// One token's update of R state rows held by a warp (lane l holds row elements
// [l*EPL, (l+1)*EPL)): S' = S * decay; with the delta rule u = beta (v - S'^T k), else u = v;
// S = S' + k u^T; o = S^T q. The rows' reductions run together (warp_sum_scatter); the delta
// rule's dot products go back to every lane from the lanes that hold them.
// On entry u holds v for each row; returns the output of row scatter_index<R>(lane) (every lane).
template <int EPL, int R>
__device__ __forceinline__ float update_rows(float (&s)[R][EPL], const float* q, const float* k, const float* decay,
                                             float (&u)[R], float beta, bool delta, int lane) {
  float dot[R];
#pragma unroll
  for (int r = 0; r < R; ++r) {
    dot[r] = 0;
#pragma unroll
    for (int e = 0; e < EPL; ++e) {
      s[r][e] *= decay[e];
      dot[r] += s[r][e] * k[e];
    }
  }
  if (delta) {
    const float mine = warp_sum_scatter<R>(dot, lane);
#pragma unroll
    for (int r = 0; r < R; ++r) u[r] = (u[r] - __shfl_sync(0xffffffffu, mine, scatter_lane<R>(r))) * beta;
  }
  float o[R];
#pragma unroll
  for (int r = 0; r < R; ++r) {
    o[r] = 0;
#pragma unroll
    for (int e = 0; e < EPL; ++e) {
      s[r][e] += k[e] * u[r];
      o[r] += s[r][e] * q[e];
    }
  }
  return warp_sum_scatter<R>(o, lane);
}

}  // namespace dev
}  // namespace cula
