// The small kernels of the chunk engine's segments (segments.h). Each is a few microseconds: one
// pass over the segments' states, or (the fold) a chain of per-segment [V, K] x [K, K] products.
#include <cuda_runtime.h>

#include "cuda/kerutils/device_utils.cuh"
#include "cuda/prefill/chunk_common.cuh"
#include "cuda/prefill/chunk_prep_scan/segments.h"

namespace cula {
namespace chunk_prep_scan {
namespace segments {
namespace {

constexpr int kThreads = 256;

// One thread per element of a (segment, head)'s [V + K, K] state.
__global__ void __launch_bounds__(kThreads) init_kernel(const FwdParams p, int per, float* init) {
  const int W = p.V + p.K, s = blockIdx.x / p.HV, hv = blockIdx.x % p.HV;
  const int e = blockIdx.y * kThreads + threadIdx.x;
  if (e >= W * p.K) return;
  const int w = e / p.K, c = e % p.K, b = s / per, j = s % per;
  float x = 0.0f;
  if (j == 0) {
    if (w < p.V && p.h0) x = dev::ld(p.h0, p.h0_dt, state_elem(p, b, hv, w, c));
  } else if (w - p.V == c) {
    x = 1.0f;
  }
  init[(static_cast<int64_t>(s) * p.HV + hv) * W * p.K + e] = x;
}

// CTA (sequence, head, kRows value rows) of kFoldThreads: thread (c, s) takes key column c and the
// s-th of KS = kFoldThreads / K ranges of the k index; E_{j-1}'s rows in shared memory by k (two
// vector loads give all kRows), M_{j-1}'s rows read from L2 as the k loop needs them; group 0 adds
// the other groups' partial sums in order s = 1, 2, ... (one thread per column had each warp walk
// all of k with a load and eight scalar shared reads per step: issue-bound at four warps per SM).
constexpr int kRows = 8, kFoldThreads = 512;
__global__ void __launch_bounds__(kFoldThreads) fold_kernel(const FwdParams p, int per, const float* __restrict__ summary,
                                                            float* __restrict__ enter) {
  __shared__ __align__(16) float e_t[256][kRows];                      // E_{j-1}^T rows of this CTA, by k
  __shared__ float part[(kFoldThreads - 64) * kRows];                  // [s - 1][r][c]
  const int K = p.K, V = p.V, W = V + K, b = blockIdx.x / p.HV, hv = blockIdx.x % p.HV;
  const int r0 = blockIdx.y * kRows, c = threadIdx.x % K, grp = threadIdx.x / K, KS = kFoldThreads / K, KQ = K / KS;
  const int64_t s0 = static_cast<int64_t>(b) * per;
  auto sum_at = [&](int64_t s, int w) { return summary + ((s * p.HV + hv) * W + w) * K + c; };
  auto enter_at = [&](int64_t s, int w) { return enter + ((s * p.HV + hv) * V + w) * K + c; };
  float acc[kRows];
  if (grp == 0) {
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      *enter_at(s0, r0 + r) = p.h0 ? dev::ld(p.h0, p.h0_dt, state_elem(p, b, hv, r0 + r, c)) : 0.0f;
      acc[r] = *sum_at(s0, r0 + r);  // E_1 = A_0 (segment 0 started from the initial state)
      *enter_at(s0 + 1, r0 + r) = acc[r];
    }
  }
  for (int j = 2; j < per; ++j) {
    if (grp == 0) {
      *reinterpret_cast<float4*>(&e_t[c][0]) = make_float4(acc[0], acc[1], acc[2], acc[3]);
      *reinterpret_cast<float4*>(&e_t[c][4]) = make_float4(acc[4], acc[5], acc[6], acc[7]);
    }
    __syncthreads();  // e_t written
    const int64_t prev = s0 + j - 1;
#pragma unroll
    for (int r = 0; r < kRows; ++r) acc[r] = grp == 0 ? *sum_at(prev, r0 + r) : 0.0f;
    const int k0 = grp * KQ;
#pragma unroll 4
    for (int kk = k0; kk < k0 + KQ; ++kk) {
      const float m = *sum_at(prev, V + kk);
      const float4 e0 = *reinterpret_cast<const float4*>(&e_t[kk][0]), e1 = *reinterpret_cast<const float4*>(&e_t[kk][4]);
      acc[0] = fmaf(e0.x, m, acc[0]), acc[1] = fmaf(e0.y, m, acc[1]), acc[2] = fmaf(e0.z, m, acc[2]);
      acc[3] = fmaf(e0.w, m, acc[3]), acc[4] = fmaf(e1.x, m, acc[4]), acc[5] = fmaf(e1.y, m, acc[5]);
      acc[6] = fmaf(e1.z, m, acc[6]), acc[7] = fmaf(e1.w, m, acc[7]);
    }
    if (grp > 0)
#pragma unroll
      for (int r = 0; r < kRows; ++r) part[((grp - 1) * kRows + r) * K + c] = acc[r];
    __syncthreads();  // partial sums written; e_t read by every thread before group 0 writes it again
    if (grp == 0) {
      for (int q = 1; q < KS; ++q)
#pragma unroll
        for (int r = 0; r < kRows; ++r) acc[r] += part[((q - 1) * kRows + r) * K + c];
#pragma unroll
      for (int r = 0; r < kRows; ++r) *enter_at(s0 + j, r0 + r) = acc[r];
    }
  }
}

__global__ void __launch_bounds__(kThreads) final_kernel(const FwdParams p, int per, const float* fin) {
  const int b = blockIdx.x / p.HV, hv = blockIdx.x % p.HV;
  const int e = blockIdx.y * kThreads + threadIdx.x;
  if (e >= p.V * p.K) return;
  const int64_t s = static_cast<int64_t>(b) * per + per - 1;
  dev::st(p.ht, p.ht_dt, state_elem(p, b, hv, e / p.K, e % p.K), fin[(s * p.HV + hv) * p.V * p.K + e]);
}

unsigned blocks(int64_t n, int per_block) { return static_cast<unsigned>((n + per_block - 1) / per_block); }

}  // namespace

void launch_init(const FwdParams& p, int per, float* init, cudaStream_t stream) {
  const dim3 grid(static_cast<unsigned>(p.N) * per * p.HV, blocks(int64_t{p.V + p.K} * p.K, kThreads));
  init_kernel<<<grid, kThreads, 0, stream>>>(p, per, init);
}

void launch_fold(const FwdParams& p, int per, const float* summary, float* enter, cudaStream_t stream) {
  // (K in {64, 128, 256} divides the threads; V a multiple of 64, so of kRows)
  const dim3 grid(static_cast<unsigned>(p.N) * p.HV, static_cast<unsigned>(p.V / kRows));
  fold_kernel<<<grid, kFoldThreads, 0, stream>>>(p, per, summary, enter);
}

void launch_final(const FwdParams& p, int per, const float* fin, cudaStream_t stream) {
  const dim3 grid(static_cast<unsigned>(p.N) * p.HV, blocks(int64_t{p.V} * p.K, kThreads));
  final_kernel<<<grid, kThreads, 0, stream>>>(p, per, fin);
}

}  // namespace segments
}  // namespace chunk_prep_scan
}  // namespace cula
