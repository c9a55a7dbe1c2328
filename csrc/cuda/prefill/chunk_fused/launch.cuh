// The fused chunk engine's launch at one head size K and slice width VB: workspace, the factor
// kernel, the local pass of split sequences and the fused kernel on the caller's stream. Included
// by the instantiation units only (instantiations/).
#pragma once

#include <cuda_runtime.h>

#include <cstdlib>
#include <type_traits>

#include "common/error.h"
#include "cuda/prefill/chunk_fused/factors.cuh"
#include "cuda/prefill/chunk_fused/fused.cuh"
#include "cuda/prefill/chunk_fused/fused_ws.cuh"
#include "cuda/prefill/chunk_fused/launcher.h"
#include "cuda/runtime/runtime.h"

namespace cula {
namespace chunk_fused {

template <int K, int VB>
void run(const Recurrence& r, const FwdParams& p, int nseg, int nsub, int device, cudaStream_t stream) {
  const int64_t max_chunks = chunk::max_chunks(p), base_bytes = chunk::base_bytes(p);
  const int64_t pairs = max_chunks * r.HV;
  const int64_t fused_blocks = r.N * r.HV * (r.V / VB);
  const int64_t local_parts = static_cast<int64_t>(nseg - 1) * nsub;
  const int64_t slice_floats = int64_t{K} * VB, slices = fused_blocks;  // one per (sequence, head, V slice)
  // CULA_FUSED_8WARP set: the 8-warp kernel on any device (tests of the path small devices take)
  // (a kernel whose layout exceeds every device's budget is not instantiated: K = 256)
  constexpr bool kWsFits = WsLayout<K, VB>::bytes <= kMaxBlockSmem;
  const bool ws = WsLayout<K, VB>::bytes <= cuda_smem_per_block(device) && !std::getenv("CULA_FUSED_8WARP");
  // Lightning without l2norm: the fused kernels write their row factors themselves, which saves
  // the factor kernel and, for one pass over dense inputs, the whole workspace (an allocation, a
  // launch and a release: ~25 us of host time per call when the host's caches are cold)
  const bool own_factors = p.gate_kind == GateKind::Constant && !p.l2norm;
  const int64_t fac_bytes = own_factors ? 0 : pairs * kFactorFloats * 4;
  const int64_t loc_floats = local_parts * slices * slice_floats, dec_floats = (local_parts * r.N * r.HV + 3) / 4 * 4;
  const int64_t s0_floats = nseg > 1 ? slices * slice_floats : 0;
  const int64_t bytes = base_bytes + fac_bytes + (loc_floats + dec_floats + s0_floats) * 4;
  if (pairs >= (int64_t{1} << 31) || fused_blocks >= (int64_t{1} << 31))
    throw_unsupported("chunk_fwd", "too many chunks x heads for one launch");
  if (max_chunks == 0) return;
  chunk::Workspace workspace(bytes, device, stream, "chunk_fwd");
  void* const work = workspace.get();
  int32_t* chunk_base = p.cu ? static_cast<int32_t*>(work) : nullptr;
  float* const after_base = reinterpret_cast<float*>(static_cast<unsigned char*>(work) + base_bytes);
  float* fac = own_factors ? nullptr : after_base;
  SplitState sp{};
  sp.nseg = nseg, sp.nsub = nsub;
  sp.loc = after_base + fac_bytes / 4;
  sp.dec = sp.loc + loc_floats;
  sp.s0 = sp.dec + dec_floats;
  if (p.cu) chunk::launch_chunk_base(p, chunk_base, stream);
  if (!own_factors) launch_chunk_factors(p, chunk_base, fac, pairs, stream);
  const dim3 grid(static_cast<unsigned>(fused_blocks), static_cast<unsigned>(nseg));
  // the kernels of one factor source and element type (own: std::bool_constant; elem: an E* null)
  auto launch = [&](auto own, auto elem) {
    constexpr bool kOwn = decltype(own)::value;
    using E = std::remove_pointer_t<decltype(elem)>;
    if constexpr (VB == 64) {  // segments only with 64-column slices (plan_fused)
      if (nseg > 1) {
        chunk::allow_smem(chunk_fused_kernel<E, K, VB, true, kOwn>, FusedLayout<K, VB, true>::bytes);
        chunk_fused_kernel<E, K, VB, true, kOwn>
            <<<dim3(static_cast<unsigned>(fused_blocks), static_cast<unsigned>(local_parts)), kThreads,
               FusedLayout<K, VB, true>::bytes, stream>>>(p, chunk_base, fac, sp);
      }
    }
    if constexpr (kWsFits) {
      if (ws) {
        chunk::allow_smem(chunk_fused_ws_kernel<E, K, VB, kOwn>, WsLayout<K, VB>::bytes);
        chunk_fused_ws_kernel<E, K, VB, kOwn><<<grid, kWsThreads, WsLayout<K, VB>::bytes, stream>>>(p, chunk_base, fac, sp);
        return;
      }
    }
    {  // the 8-warp kernel: K = 256, or e.g. K = 128, VB = 64 on sm_80 (164 KB)
      chunk::allow_smem(chunk_fused_kernel<E, K, VB, false, kOwn>, FusedLayout<K, VB, false>::bytes);
      chunk_fused_kernel<E, K, VB, false, kOwn>
          <<<grid, kThreads, FusedLayout<K, VB, false>::bytes, stream>>>(p, chunk_base, fac, sp);
    }
  };
  // q, k and v share one type, bf16 or fp16 (float32 inputs arrive as bf16 copies: EngineInputs)
  auto with_elem = [&](auto own) {
    if (p.q_dt == CULA_FLOAT16)
      launch(own, static_cast<__half*>(nullptr));
    else
      launch(own, static_cast<bf16*>(nullptr));
  };
  if (own_factors)
    with_elem(std::true_type{});
  else
    with_elem(std::false_type{});
  const cudaError_t launched = cudaGetLastError();
  workspace.release();
  chunk::check(launched, "kernel launch");
}

// One translation unit per head size K and slice width VB instantiates this.
#define CULA_CHUNK_FUSED_INSTANTIATE(K, VB) \
  template void run<K, VB>(const Recurrence&, const FwdParams&, int, int, int, cudaStream_t);

}  // namespace chunk_fused
}  // namespace cula
