// Pieces the chunk-form backward kernels share (chunk_bwd.cu, lean_bwd.cu): where a chunk lies,
// tiles into shared memory (fp32 by cp.async, inputs of any float dtype converted on the way), the
// scans' state slices in and out, and the exponent they all take.
#pragma once

#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/common/fwd_params.cuh"
#include "cuda/kerutils/device_utils.cuh"
#include "cuda/kerutils/mma.cuh"
#include "cuda/prefill/chunk_common.cuh"

namespace cula {
namespace bwd {

using dev::ld;
using dev::st;

constexpr int kTileThreads = 512;  // the per-chunk kernels' block (16 warps): the tile loads' default

// e^x on the SFU with results below 2^-126 flushed to zero (what __expf costs, without its
// denormal fix-ups: every exponent here is at most 0, and a flushed factor is below fp32's
// resolution of the terms it multiplies).
__device__ __forceinline__ float fast_exp(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x * 1.4426950408889634f));
  return y;
}

// Where a per-chunk CTA's chunk lies: its sequence row, first token, valid rows and flattened
// first token. False past the last chunk of a varlen call.
struct ChunkAt {
  int b_row, Lc;
  int64_t t0, f0;
};
// Chunk ci of sequence sq (the scans walk a sequence's chunks with it).
__device__ __forceinline__ ChunkAt chunk_in(const FwdParams& p, const Seq& sq, int ci) {
  ChunkAt ch;
  ch.t0 = sq.bos + static_cast<int64_t>(ci) * kChunk;
  ch.Lc = static_cast<int>(min(int64_t{kChunk}, sq.eos - ch.t0));
  ch.b_row = sq.b_row;
  ch.f0 = static_cast<int64_t>(sq.b_row) * p.T + ch.t0;
  return ch;
}
// Rows [0, valid) of a ROWS x COLS fp32 tile (row pitch src_ld floats, 16-byte aligned rows) into
// shared memory (pitch dst_ld) by cp.async; rows past valid are zeroed. The caller commits and waits.
template <int ROWS, int COLS, int THREADS = kTileThreads>
__device__ __forceinline__ void rows_async(float* dst, int dst_ld, const float* src, int64_t src_ld, int valid = ROWS) {
  constexpr int P = COLS / 4;
  for (int i = threadIdx.x; i < ROWS * P; i += THREADS) {
    const int r = i / P, c4 = (i % P) * 4;
    if (r < valid) mma::cp_async16(dst + r * dst_ld + c4, src + r * src_ld + c4);
    else *reinterpret_cast<float4*>(dst + r * dst_ld + c4) = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
  }
}

// Rows [0, valid) of a ROWS x COLS tile of a bf16, fp16 or fp32 input (unit column stride, 16-byte
// aligned rows, row r at element off + r row_stride) into fp32 shared memory, rows past valid
// zeroed: every thread issues all its loads before its first store.
template <int ROWS, int COLS, int THREADS = kTileThreads>
__device__ __forceinline__ void input_rows(float* dst, int dst_ld, const void* src, int dt, int64_t off, int64_t row_stride,
                                           int valid) {
  const int tid = threadIdx.x;
  if (dt == CULA_FLOAT32) {
    constexpr int P = COLS / 4, PER = (ROWS * P + THREADS - 1) / THREADS;
    const float* s = static_cast<const float*>(src) + off;
    float4 x[PER];
#pragma unroll
    for (int u = 0; u < PER; ++u) {
      const int i = tid + u * THREADS, r = i / P, c = (i % P) * 4;
      x[u] = r < valid && i < ROWS * P ? *reinterpret_cast<const float4*>(s + r * row_stride + c)
                                       : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    }
#pragma unroll
    for (int u = 0; u < PER; ++u) {
      const int i = tid + u * THREADS, r = i / P, c = (i % P) * 4;
      if (i < ROWS * P) *reinterpret_cast<float4*>(dst + r * dst_ld + c) = x[u];
    }
  } else {
    constexpr int P = COLS / 8, PER = (ROWS * P + THREADS - 1) / THREADS;
    const uint16_t* s = static_cast<const uint16_t*>(src) + off;
    uint4 x[PER];
#pragma unroll
    for (int u = 0; u < PER; ++u) {
      const int i = tid + u * THREADS, r = i / P, c = (i % P) * 8;
      x[u] = r < valid && i < ROWS * P ? *reinterpret_cast<const uint4*>(s + r * row_stride + c) : make_uint4(0, 0, 0, 0);
    }
    const bool bf = dt == CULA_BFLOAT16;
#pragma unroll
    for (int u = 0; u < PER; ++u) {
      const int i = tid + u * THREADS, r = i / P, c = (i % P) * 8;
      if (i >= ROWS * P) break;
      const uint32_t w[4] = {x[u].x, x[u].y, x[u].z, x[u].w};
      float* d = dst + r * dst_ld + c;
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const uint16_t lo = static_cast<uint16_t>(w[e] & 0xffffu), hi = static_cast<uint16_t>(w[e] >> 16);
        d[2 * e] = bf ? __uint_as_float(static_cast<uint32_t>(lo) << 16) : __half2float(__ushort_as_half(lo));
        d[2 * e + 1] = bf ? __uint_as_float(static_cast<uint32_t>(hi) << 16) : __half2float(__ushort_as_half(hi));
      }
    }
  }
}

// Row i of a row-major matrix scaled by s[i].
struct RowScaled {
  const float* p;
  int ld;
  const float* s;
  __device__ __forceinline__ float operator()(int i, int j) const { return s[i] * p[i * ld + j]; }
};

// The scans' state slices (K x VS, columns v0..): from state row `row` of a state tensor in the
// call's layout (zeros without one), and to one.
template <int K, int VS, int THREADS = kTileThreads>
__device__ __forceinline__ void slice_in(float* S, int pitch, const FwdParams& p, const void* src, int dt, int64_t row, int hv,
                                         int v0) {
  for (int i = threadIdx.x; i < K * VS; i += THREADS) {
    const int c = i / VS, j = i % VS;
    S[c * pitch + j] = src ? ld(src, dt, state_elem(p, row, hv, v0 + j, c)) : 0.0f;
  }
}
template <int K, int VS, int THREADS = kTileThreads>
__device__ __forceinline__ void slice_out(void* dst, int dt, const FwdParams& p, int64_t row, int hv, int v0, const float* S,
                                          int pitch) {
  for (int i = threadIdx.x; i < K * VS; i += THREADS) {
    const int c = i / VS, j = i % VS;
    st(dst, dt, state_elem(p, row, hv, v0 + j, c), S[c * pitch + j]);
  }
}

// Where chunk cidx of the call lies; false past the last chunk of a varlen call.
__device__ __forceinline__ bool chunk_at(const FwdParams& p, const int32_t* chunk_base, int cidx, ChunkAt& ch) {
  int n, ci;
  if (!chunk::locate(p, chunk_base, cidx, n, ci)) return false;
  const Seq sq = seq_of(p, n);
  if (sq.bos + static_cast<int64_t>(ci) * kChunk >= sq.eos) return false;
  ch = chunk_in(p, sq, ci);
  return true;
}

// Element (i, j) of the transpose of a row-major matrix whose row j is scaled by s[j]: a product's
// left operand read down the columns of a token-major tile (rows: tokens), each token weighted.
struct ColsScaled {
  const float* p;
  int ld;
  const float* s;
  __device__ __forceinline__ float operator()(int i, int j) const { return s[j] * p[j * ld + i]; }
};

}  // namespace bwd
}  // namespace cula
