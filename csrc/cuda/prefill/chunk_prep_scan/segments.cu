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

// CTA (sequence, head, kRows value rows), thread c = key column: E_{j-1}'s rows in shared memory,
// M's rows read as the k loop needs them (consecutive threads, consecutive columns).
constexpr int kRows = 8;
__global__ void __launch_bounds__(256) fold_kernel(const FwdParams p, int per, const float* __restrict__ summary,
                                                   float* __restrict__ enter) {
  __shared__ float e_s[kRows][256];
  const int K = p.K, V = p.V, W = V + K, b = blockIdx.x / p.HV, hv = blockIdx.x % p.HV;
  const int r0 = blockIdx.y * kRows, c = threadIdx.x;
  const int64_t s0 = static_cast<int64_t>(b) * per;
  auto sum_at = [&](int64_t s, int w) { return summary + ((s * p.HV + hv) * W + w) * K + c; };
  auto enter_at = [&](int64_t s, int w) { return enter + ((s * p.HV + hv) * V + w) * K + c; };
  float acc[kRows];
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
    *enter_at(s0, r0 + r) = p.h0 ? dev::ld(p.h0, p.h0_dt, state_elem(p, b, hv, r0 + r, c)) : 0.0f;
    acc[r] = *sum_at(s0, r0 + r);  // E_1 = A_0 (segment 0 started from the initial state)
    *enter_at(s0 + 1, r0 + r) = acc[r];
  }
  for (int j = 2; j < per; ++j) {
#pragma unroll
    for (int r = 0; r < kRows; ++r) e_s[r][c] = acc[r];
    __syncthreads();
    const int64_t prev = s0 + j - 1;
#pragma unroll
    for (int r = 0; r < kRows; ++r) acc[r] = *sum_at(prev, r0 + r);
#pragma unroll 8
    for (int kk = 0; kk < K; ++kk) {
      const float m = *sum_at(prev, V + kk);
#pragma unroll
      for (int r = 0; r < kRows; ++r) acc[r] = fmaf(e_s[r][kk], m, acc[r]);
    }
#pragma unroll
    for (int r = 0; r < kRows; ++r) *enter_at(s0 + j, r0 + r) = acc[r];
    __syncthreads();  // e_s read by every thread before the next step's writes
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
  // (K <= 256 threads, one per column; V a multiple of 64, so of kRows)
  const dim3 grid(static_cast<unsigned>(p.N) * p.HV, static_cast<unsigned>(p.V / kRows));
  fold_kernel<<<grid, p.K, 0, stream>>>(p, per, summary, enter);
}

void launch_final(const FwdParams& p, int per, const float* fin, cudaStream_t stream) {
  const dim3 grid(static_cast<unsigned>(p.N) * p.HV, blocks(int64_t{p.V} * p.K, kThreads));
  final_kernel<<<grid, kThreads, 0, stream>>>(p, per, fin);
}

}  // namespace segments
}  // namespace chunk_prep_scan
}  // namespace cula
