// The fused chunk engine's host side below the C ABI's dispatch table: what it accepts, and the plan
// (slice width, segments) that runs a call. Design: DESIGN.md beside this file.
#include <cuda_runtime.h>

#include <algorithm>

#include "common/error.h"
#include "cuda/prefill/chunk_engines.h"
#include "cuda/prefill/chunk_fused/config.cuh"
#include "cuda/prefill/chunk_fused/launcher.h"
#include "cuda/runtime/runtime.h"

namespace cula {
namespace chunk_fused {
namespace {

// How a call is spread over the GPU (one fused CTA per SM, ~133 KB of shared memory at VB = 64).
// Slices of 64 columns cost ~1.25x a 32-column slice per chunk (the q k^T work is per slice),
// so 64 is the default; when the (sequence, head, 64-column slice) chains fill at most half the
// SMs, sequences are split into 2-16 segments (the chain per CTA shortens by that factor; a local
// pass costing ~1/4 of a fused chunk provides each segment's initial state); otherwise slices of
// 32 columns when those still fit in one wave.
struct FusedPlan {
  int VB, nseg, nsub;
};
FusedPlan plan_fused(const Recurrence& r, bool varlen, int sms) {
  const int64_t chains = r.N * r.HV * (r.V / 64);
  // varlen: the lengths are on the device; their mean decides (each sequence is split evenly)
  const int64_t chunks_per_seq = varlen ? r.T / kBT / std::max<int64_t>(r.N, 1) : (r.T + kBT - 1) / kBT;
  // Up to 16 segments of >= 32 chunks (few heads per GPU, e.g. heads split by tensor parallelism).
  int nseg = 1;
  while (nseg < 16 && chains * nseg * 2 <= sms && chunks_per_seq / (nseg * 2) >= 32) nseg *= 2;
  if (nseg > 1) {
    // Enough local-pass CTAs to cover the SMs (it fits three per SM), parts of >= 16 chunks.
    int nsub = 1;
    while (nsub < 8 && chains * (nseg - 1) * nsub < sms && chunks_per_seq / (nseg * nsub * 2) >= 16) nsub *= 2;
    return {64, nseg, nsub};
  }
  // (K = 256: 64 columns only, as q k^T, half of a chunk's work there, is formed per slice)
  return {r.K <= 128 && r.N * r.HV * (r.V / 32) <= sms ? 32 : 64, 1, 1};
}

}  // namespace
}  // namespace chunk_fused

using namespace chunk_fused;

const char* chunk_fwd_fused_declines(const Recurrence& r, const cula_chunk_fwd_args& a) {
  if (r.tr.delta || r.tr.gate == GateKind::PerChannel) return "the delta rule or a per-channel gate (chunk_prep_scan)";
  if (!head_size_supported(r.K)) return "key head size K other than 64, 128 and 256";
  // (context parallelism extends values only for the delta rule; the fused kernels' v loads stay
  // unconditional, their register budget being tight at K = 256)
  if (r.v_cols != r.V) return "value_dim larger than v's V (the recurrent row takes it)";
  if (const char* why = chunk::tensor_core_declines(a)) return why;
  // K = 256 runs the 8-warp kernel (215.5 KB): not on 164 KB devices
  if (r.K == 256 && FusedLayout<256, 64, false>::bytes > cuda_smem_per_block(a.q->device_id))
    return "K = 256: the fused kernel's shared memory exceeds the device's";
  return nullptr;
}

void cuda_chunk_fwd_fused(const Recurrence& r, const cula_chunk_fwd_args& a) {
  if (r.N == 0) return;
  const int dev = a.q->device_id;
  chunk::check(cudaSetDevice(dev), "cudaSetDevice");
  const cudaStream_t stream = static_cast<cudaStream_t>(a.opt.stream);
  chunk::EngineInputs in(a, dev, stream);  // float32 q, k, v: bf16 copies
  const FwdParams p = make_fwd_params(r, in.args());
  const int sms = cuda_sm_count(dev);
  const FusedPlan plan = plan_fused(r, a.cu_seqlens != nullptr, sms);
  if (r.K == 256)
    run<256, 64>(r, p, plan.nseg, plan.nsub, dev, stream);
  else if (plan.VB == 32)
    r.K == 64 ? run<64, 32>(r, p, 1, 1, dev, stream) : run<128, 32>(r, p, 1, 1, dev, stream);
  else
    r.K == 64 ? run<64, 64>(r, p, plan.nseg, plan.nsub, dev, stream)
              : run<128, 64>(r, p, plan.nseg, plan.nsub, dev, stream);
  in.release();
}

}  // namespace cula
