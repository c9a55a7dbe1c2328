// Small device helpers of the prep kernel's stages: the exponent table's rows, the lower block
// pairs, strided loops over channels, and 8-channel scaling.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include "cuda/kerutils/mma.cuh"
#include "cuda/prefill/chunk_prep_scan/config.cuh"

namespace cula {
namespace chunk_prep_scan {

// Rows of the per-channel exponent table.
__device__ __forceinline__ int tab_pair(int I, int J) { return I * (I - 1) / 2 + J; }  // e^{G_bI - G_bJ}, J < I
constexpr int kTabEb = 6;     // + I: e^{G_bI}
constexpr int kTabEd = 10;    // + J: e^{G_last - G_bJ}
constexpr int kTabLast = 14;  // e^{G_last}

// The forms of KDA's gate pass: lb sigmoid(eA (x + dt_bias)) (use_gate_in_kernel with a lower
// bound), -eA softplus(x + dt_bias) (without one), or a precomputed log-decay g.
enum KdaGateForm : int { kBoundedGate, kSoftplusGate, kLogDecay };

// Block pair number m >= 0 of the lower triangle, (0,0) (1,0) (1,1) (2,0) ... (3,3) for m = 0..9, as
// (I, J); I = J = -1 for m >= 10.
__device__ __forceinline__ void pair_of(int m, int& I, int& J) {
  I = m < 1 ? 0 : m < 3 ? 1 : m < 6 ? 2 : m < 10 ? 3 : -1;
  J = I < 0 ? -1 : m - I * (I + 1) / 2;
}

// fn(i) for i = tid, tid + NT, ... below N: one guarded call where N <= NT (K = 256 has more
// channels than GDN's and GLA's 128 threads).
template <int N, int NT, class Fn>
__device__ __forceinline__ void for_strided(int tid, Fn&& fn) {
#pragma unroll
  for (int j = 0; j < (N + NT - 1) / NT; ++j)
    if (tid + j * NT < N) fn(tid + j * NT);
}

// Eight consecutive per-channel factors (two 16-byte loads from shared memory).
__device__ __forceinline__ void load8(const float* p, float (&f)[8]) {
  *reinterpret_cast<float4*>(f) = *reinterpret_cast<const float4*>(p);
  *reinterpret_cast<float4*>(f + 4) = *reinterpret_cast<const float4*>(p + 4);
}
// Eight bf16 values (16 bytes) times their channels' factors, each rounded once.
__device__ __forceinline__ uint4 scale8(uint4 v, const float (&f)[8]) {
  uint32_t* w = reinterpret_cast<uint32_t*>(&v);
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const float2 x = unpack(w[j]);
    w[j] = pack(x.x * f[2 * j], x.y * f[2 * j + 1]);
  }
  return v;
}

}  // namespace chunk_prep_scan
}  // namespace cula
