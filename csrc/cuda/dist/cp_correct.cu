// The carried-state correction of context parallelism in one pass (cula_cp_correct): a rank's
// engine pass over values extended by K columns wrote ow = [o_local | Q~] in float32 ([L, HV, V + K]);
// with the incoming state X of each head ([HV, V, K]),
//   o[t, h, :] = round(ow[t, h, :V] + X[h] ow[t, h, V:V+K])      (o bf16 or fp16)
// torch runs it as a TF32 GEMM accumulated into o's float32 view and a rounding copy: ow read twice,
// o_local written once more; here ow is read once and o written once.
//
// Design: grid (blocks per head, HV), 4 warps, up to 3 blocks per SM. A block keeps its head's X in
// shared memory (rounded to TF32, [V][K] with an XOR swizzle of the columns) and its warps take 16
// tokens at a time, each warp on its own: no block barrier after X is stored.
//   - The accumulators start as o_local (float2 loads in the mma's C layout), so the product adds
//     onto them and no separate add is needed.
//   - A (Q~, 16 x K) comes straight from global memory into registers, 16 bytes per load: the sum
//     over k is order-free, so k-step (m, j) takes at position t the columns 16m + 4t + 2j and +1
//     (a thread reads columns [16m + 4t, +4) of its two rows); B reads X at the same columns, one
//     8-byte shared load per n-tile and k-step.
//   - Swizzle: row n of X at n K + (c ^ s(n)), s(n) = 2 (n & 1) + 16 ((n >> 1) & 1), which puts the
//     16 lanes of a half-warp (4 rows, 4 column groups) on distinct bank pairs; bit 0 is untouched,
//     so each pair of columns stays one 8-byte word.
//   - One TF32 product (operands rounded by an integer add): its error, about 2^-11 of the term,
//     stays under the 16-bit rounding of o; float32 outputs keep torch's float32 product.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <string>

#include "common/error.h"
#include "cuda/dist/cp_correct.h"
#include "cuda/kerutils/tf32_gemm.cuh"
#include "cuda/prefill/chunk_common.cuh"
#include "cuda/runtime/check.h"
#include "cuda/runtime/runtime.h"

namespace cula {
namespace {

constexpr int kWarps = 4;
constexpr int kRows = 16;  // tokens per warp tile

__device__ __forceinline__ int swizzle(int n) { return 2 * (n & 1) + 16 * ((n >> 1) & 1); }

__device__ __forceinline__ uint32_t pack16(float lo, float hi, __nv_bfloat16*) {
  const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&v);
}
__device__ __forceinline__ uint32_t pack16(float lo, float hi, __half*) {
  const __half2 v = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&v);
}
__device__ __forceinline__ float part(const float4& f, int i) { return i == 0 ? f.x : i == 1 ? f.y : i == 2 ? f.z : f.w; }

template <int K, int V, typename Tout>
__global__ void __launch_bounds__(kWarps * 32, 3) cp_correct_kernel(const float* __restrict__ ow, int64_t ow_st,
                                                                     int64_t ow_sh, const float* __restrict__ x,
                                                                     Tout* __restrict__ o, int64_t o_st, int64_t o_sh,
                                                                     int64_t L) {
  extern __shared__ float4 smem_raw[];
  float* xs = reinterpret_cast<float*>(smem_raw);  // [V][K], columns swizzled, TF32
  const int h = blockIdx.y;
  const float* xh = x + static_cast<int64_t>(h) * V * K;
  for (int i = threadIdx.x; i < V * K / 4; i += kWarps * 32) {
    const int n = i / (K / 4), c = (i % (K / 4)) * 4, s = swizzle(n);
    const float4 f = reinterpret_cast<const float4*>(xh)[i];
    *reinterpret_cast<uint2*>(xs + n * K + (c ^ s)) = make_uint2(tf32::round_tf32(f.x), tf32::round_tf32(f.y));
    *reinterpret_cast<uint2*>(xs + n * K + ((c + 2) ^ s)) = make_uint2(tf32::round_tf32(f.z), tf32::round_tf32(f.w));
  }
  __syncthreads();
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const int sg = swizzle(g);  // rows 8 nt + g share it
  const int64_t tiles = (L + kRows - 1) / kRows;
  for (int64_t tile = static_cast<int64_t>(blockIdx.x) * kWarps + warp; tile < tiles;
       tile += static_cast<int64_t>(gridDim.x) * kWarps) {
    const int64_t r0 = tile * kRows + g, r1 = r0 + 8;  // this thread's two rows (clamped for the loads)
    const float* p0 = ow + min(r0, L - 1) * ow_st + h * ow_sh;
    const float* p1 = ow + min(r1, L - 1) * ow_st + h * ow_sh;
    float4 a0[K / 16], a1[K / 16];
#pragma unroll
    for (int m = 0; m < K / 16; ++m) {
      a0[m] = __ldcs(reinterpret_cast<const float4*>(p0 + V + 16 * m + 4 * t));
      a1[m] = __ldcs(reinterpret_cast<const float4*>(p1 + V + 16 * m + 4 * t));
    }
    float acc[V / 8][4];
#pragma unroll
    for (int nt = 0; nt < V / 8; ++nt) {
      const float2 u = __ldcs(reinterpret_cast<const float2*>(p0 + 8 * nt + 2 * t));
      const float2 w = __ldcs(reinterpret_cast<const float2*>(p1 + 8 * nt + 2 * t));
      acc[nt][0] = u.x, acc[nt][1] = u.y, acc[nt][2] = w.x, acc[nt][3] = w.y;
    }
#pragma unroll
    for (int m = 0; m < K / 16; ++m)
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        const uint32_t a[4] = {tf32::round_tf32(part(a0[m], 2 * j)), tf32::round_tf32(part(a1[m], 2 * j)),
                               tf32::round_tf32(part(a0[m], 2 * j + 1)), tf32::round_tf32(part(a1[m], 2 * j + 1))};
        const int c = (16 * m + 4 * t + 2 * j) ^ sg;
#pragma unroll
        for (int nt = 0; nt < V / 8; ++nt) {
          const uint2 b = *reinterpret_cast<const uint2*>(xs + (8 * nt + g) * K + c);
          tf32::mma1688(acc[nt], a, b.x, b.y);
        }
      }
    Tout* q0 = o + r0 * o_st + h * o_sh + 2 * t;
    Tout* q1 = o + r1 * o_st + h * o_sh + 2 * t;
#pragma unroll
    for (int nt = 0; nt < V / 8; ++nt) {
      if (r0 < L) *reinterpret_cast<uint32_t*>(q0 + 8 * nt) = pack16(acc[nt][0], acc[nt][1], q0);
      if (r1 < L) *reinterpret_cast<uint32_t*>(q1 + 8 * nt) = pack16(acc[nt][2], acc[nt][3], q1);
    }
  }
}

void check(cudaError_t e, const char* what) { cuda_check(e, "cp_correct", what); }

template <int K, int V, typename Tout>
void launch(const CpCorrectShape& s, const cula_cp_correct_args& a) {
  constexpr int bytes = V * K * static_cast<int>(sizeof(float));
  auto kernel = cp_correct_kernel<K, V, Tout>;
  const int dev = a.ow->device_id;
  chunk::allow_smem(kernel, bytes);
  const int64_t tiles = (s.L + kRows - 1) / kRows;
  // three blocks per SM over the heads; each keeps X and its warps walk their share of the tiles
  const int64_t per_head =
      std::max<int64_t>(1, std::min<int64_t>((tiles + kWarps - 1) / kWarps, (3 * cuda_sm_count(dev) + s.HV - 1) / s.HV));
  const dim3 grid(static_cast<unsigned>(per_head), static_cast<unsigned>(s.HV));
  kernel<<<grid, kWarps * 32, bytes, static_cast<cudaStream_t>(a.opt.stream)>>>(
      static_cast<const float*>(a.ow->data), a.ow->strides[0], a.ow->strides[1], static_cast<const float*>(a.state->data),
      static_cast<Tout*>(a.o->data), a.o->strides[0], a.o->strides[1], s.L);
  check(cudaGetLastError(), "kernel launch");
}

template <int K, int V>
void launch_out(const CpCorrectShape& s, const cula_cp_correct_args& a) {
  if (a.o->dtype == CULA_BFLOAT16) launch<K, V, __nv_bfloat16>(s, a);
  else launch<K, V, __half>(s, a);
}

bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }

}  // namespace

Refusal cuda_cp_correct_declines(const CpCorrectShape& s, const cula_cp_correct_args& a) {
  if (a.o->dtype != CULA_BFLOAT16 && a.o->dtype != CULA_FLOAT16)
    return Refusal::unsupported("the CUDA correction writes a 16-bit o (one TF32 product under its rounding), got " +
                                std::string(dtype_name(a.o->dtype)));
  const bool sizes = (s.K == 64 || s.K == 128) && (s.V == 64 || s.V == 128);
  if (!sizes)
    return Refusal::unsupported("the CUDA correction takes K and V in {64, 128}, got K = " + std::to_string(s.K) +
                                ", V = " + std::to_string(s.V));
  if (s.HV > 65535) return Refusal::unsupported("more than 65535 heads");
  if (!aligned16(a.ow->data) || a.ow->strides[0] % 4 || a.ow->strides[1] % 4)
    return Refusal::bad_argument("ow", "16-byte aligned rows (data and outer strides multiples of 4 floats)",
                                 describe(a.ow));
  if (!aligned16(a.state->data)) return Refusal::bad_argument("state", "16-byte aligned data", describe(a.state));
  if (!aligned16(a.o->data) || a.o->strides[0] % 8 || a.o->strides[1] % 8)
    return Refusal::bad_argument("o", "16-byte aligned rows (data and outer strides multiples of 8 elements)", describe(a.o));
  return Refusal::takes();
}

void cuda_cp_correct(const CpCorrectShape& s, const cula_cp_correct_args& a) {
  if (s.L == 0 || s.HV == 0) return;
  check(cudaSetDevice(a.ow->device_id), "cudaSetDevice");
  if (s.K == 64 && s.V == 64) launch_out<64, 64>(s, a);
  else if (s.K == 64) launch_out<64, 128>(s, a);
  else if (s.V == 64) launch_out<128, 64>(s, a);
  else launch_out<128, 128>(s, a);
}

}  // namespace cula
