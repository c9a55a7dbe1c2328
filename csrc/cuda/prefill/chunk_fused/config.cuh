// Configuration of the fused chunk engine (design: DESIGN.md beside this file): the chunk, warp
// counts, the row-factor block, the split-sequence workspace and both fused kernels' shared-memory
// layouts with their budgets.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/kerutils/mma.cuh"
#include "cuda/prefill/chunk_common.cuh"
#include "cuda/prefill/half_inputs.cuh"

namespace cula {
namespace chunk_fused {

using bf16 = __nv_bfloat16;
using mma::pack;
using mma::unpack;

constexpr int kBT = kChunk;
constexpr int kThreads = 256;
constexpr int kFactorWarps = 4;
// Per chunk and head, per row: G; qs; qs e^{G}; ks e^{G_last - G}; G - ln ks (the pair factor
// qs_i ks_j e^{G_i - G_j} is then qs_i e^{G_i - (G_j - ln ks_j)}: one exponential per pair, whose
// argument G_i - G_j + ln ks_j stays below ln 1e3 as G_i <= G_j); then e^{G_last}.
constexpr int kFG = 0, kFQS = kBT, kFO = 2 * kBT, kFV = 3 * kBT, kFP = 4 * kBT, kFL = 5 * kBT;
constexpr int kFactorFloats = 5 * kBT + 4;  // 16-byte multiple

// kLocal: the local pass of a split sequence (state updates only: no q, no bf16 S, no partial o).
template <int K, int VB, bool kLocal>
struct FusedLayout {
  static constexpr int LDK = K + 8, LDV = VB + 8;
  static constexpr int sQ = 0, sK = sQ + (kLocal ? 0 : kBT * LDK * 2), sV = sK + kBT * LDK * 2,
                       sF = sV + kBT * LDV * 2, stage = sF + kFactorFloats * 4;
  static constexpr int LDX = VB + 8;  // fp32 partial o of the partner warp (conflict-free float2 rows)
  static constexpr int oS = 2 * stage, oVD = oS + (kLocal ? 0 : K * LDV * 2), oX = oVD + kBT * LDV * 2,
                       bytes = oX + (kLocal ? 0 : kBT * LDX * 4);
};

// A sequence split into nseg segments of nsub parts each (nseg = 1: not split). Part j of a
// sequence with C chunks is chunks [j P, (j + 1) P) with P = ceil(C / (nseg nsub)), clipped to C;
// segment s is parts [s nsub, (s + 1) nsub). Workspace, for the parts before the last segment:
// loc, each part's own state contribution from a zero state, per (sequence, part, value head, V
// slice), K x VB floats in StateSlice::save order; dec, each part's total decay (the product of
// its chunks' e^{G_last}) per (sequence, part, value head); s0, the initial state per (sequence,
// value head, V slice), copied by the local pass so that the fused pass never reads a pool slot
// that its last segment writes.
struct SplitState {
  float *loc, *dec, *s0;
  int nseg, nsub;
};

// The 16-bit pair at p (bf16 or fp16) as one word.
template <class E>
__device__ __forceinline__ uint32_t& u32at(E* p) {
  return *reinterpret_cast<uint32_t*>(p);
}

// Warp-specialized kernel: output warps, state warps (DESIGN.md).
constexpr int kWsOutWarps = 8, kWsStateWarps = 4, kWsThreads = 32 * (kWsOutWarps + kWsStateWarps);

template <int K, int VB>
struct WsLayout {
  static constexpr int kStages = 4;
  static constexpr int kABlocks = 10;  // the 16 x 16 blocks Jb <= I of the causal triangle
  static constexpr int LDK = K + 8, LDV = VB + 8;
  static constexpr int sQ = 0, sK = kBT * LDK * 2, sV = 2 * kBT * LDK * 2, sF = sV + kBT * LDV * 2,
                       stage = sF + kFactorFloats * 4;
  // oA: the A blocks exchanged by the two warps of a row block, bf16 in fragment order (16 bytes
  // per lane and block), double-buffered by chunk parity
  static constexpr int oS = kStages * stage, oA = oS + 2 * K * LDV * 2, oBar = oA + 2 * kABlocks * 32 * 16,
                       bytes = oBar + 8 * (2 * kStages + 4);
  static_assert(stage % 16 == 0 && oA % 16 == 0 && oBar % 8 == 0, "aligned buffers");
  static_assert(K * VB * 4 <= 2 * K * LDV * 2, "a state slice fits the ring (the fold of a split sequence)");
};

// Key head sizes with kernels (the instantiations/ folder holds one translation unit per K and VB).
// The value head size is cut into VB-column slices, one CTA each, so any multiple of 64 runs
// (chunk::tensor_core_declines). K = 256 runs the 8-warp kernel with slices of 64 columns
// (DESIGN.md: why not the warp-specialized one).
constexpr bool head_size_supported(int64_t n) { return n == 64 || n == 128 || n == 256; }

// The most shared memory a block may take on the devices the kernels are built for (sm_80, sm_90).
constexpr int kMaxBlockSmem = 227 * 1024;

}  // namespace chunk_fused
}  // namespace cula
