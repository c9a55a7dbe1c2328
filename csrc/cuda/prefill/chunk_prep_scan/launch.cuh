// The chunk engine's launch of one family at one head size K: workspace, the prep and the scan on
// the caller's stream, and the choice of the scan's slice width VB. Included by the instantiation
// units only (instantiations/), so each family and K compiles in a translation unit of its own.
#pragma once

#include <cuda_runtime.h>

#include <cstdlib>

#include "common/error.h"
#include "cuda/prefill/chunk_prep_scan/launcher.h"
#include "cuda/prefill/chunk_prep_scan/prep.cuh"
#include "cuda/prefill/chunk_prep_scan/scan.cuh"
#include "cuda/runtime/runtime.h"

namespace cula {
namespace chunk_prep_scan {

template <int K, int VB, class F, bool kBlockBarriersOnly>
void run(const Recurrence& r, const FwdParams& p, int device, cudaStream_t stream) {
  const int64_t max_chunks = chunk::max_chunks(p), base_bytes = chunk::base_bytes(p);
  const int64_t bytes = base_bytes + max_chunks * r.HV * Work<K, F>::bytes;
  const int64_t prep_blocks = max_chunks * r.HV, scan_blocks = r.N * r.HV * (r.V / VB);
  if (prep_blocks >= (int64_t{1} << 31) || scan_blocks >= (int64_t{1} << 31))
    throw_unsupported("chunk_fwd", "too many chunks x heads for one launch");
  if (max_chunks == 0) return;
  chunk::Workspace ws(bytes, device, stream, "chunk_fwd");
  int32_t* chunk_base = p.cu ? static_cast<int32_t*>(ws.get()) : nullptr;
  unsigned char* work = static_cast<unsigned char*>(ws.get()) + base_bytes;
  if (p.cu) chunk::launch_chunk_base(p, chunk_base, stream);
  using Scan = ScanLayout<K, VB, F>;
  using Prep = PrepLayout<K, F>;
  auto prep = [&](auto kernel) {
    chunk::allow_smem(kernel, Prep::bytes);
    kernel<<<static_cast<unsigned>(prep_blocks), 32 * prep_warps<F>(), Prep::bytes, stream>>>(p, chunk_base, work);
  };
  // KDA: the prep without the steep-block machinery for the bounded in-kernel gate
  if constexpr (F::kDelta && !F::kScalarGate) {
    if (kda_bounded_gate(r)) prep(chunk_prep_kernel<K, F, false, kBlockBarriersOnly>);
    else prep(chunk_prep_kernel<K, F, true, kBlockBarriersOnly>);
  } else {
    prep(chunk_prep_kernel<K, F, false, kBlockBarriersOnly>);
  }
  chunk::allow_smem(chunk_scan_kernel<K, VB, F, kBlockBarriersOnly>, Scan::bytes);
  chunk_scan_kernel<K, VB, F, kBlockBarriersOnly>
      <<<static_cast<unsigned>(scan_blocks), 32 * scan_warps(VB), Scan::bytes, stream>>>(p, chunk_base, work);
  const cudaError_t launched = cudaGetLastError();
  ws.release();
  chunk::check(launched, "kernel launch");
}

template <int K, class F, bool kBlockBarriersOnly>
void run_vb_barriers(const Recurrence& r, const FwdParams& p, int device, cudaStream_t stream) {
  // The scan has one CTA per (sequence, head, V slice), one CTA per SM. Slices of 32 columns when
  // those still fit in one wave (or when 64 columns do not fit the device's shared memory). KDA and
  // GLA on equal-length sequences take all 128 columns in one CTA of 16 warps (the stage read once
  // for the whole head) when 64-column slices would need more than one wave: a loaded SM moves a
  // head through about as fast either way, so what it saves is the partial last wave (docs/history;
  // GDN's 16-warp scan was slower, and varlen calls, whose lengths the host does not know, lost
  // where one long sequence started late). Else 64.
  // CULA_SCAN_VB=32|64|128 (read once per process) forces a width where it fits, for benchmarks.
  // (V is a multiple of 64: chunk::tensor_core_declines; 128 columns where V is a multiple of 128.)
  static const int forced = [] {
    const char* e = std::getenv("CULA_SCAN_VB");
    return e ? std::atoi(e) : 0;
  }();
  if constexpr (K > 128) {
    return run<K, 32, F, kBlockBarriersOnly>(r, p, device, stream);  // (one stage of 32 columns fits)
  } else {
    const int sms = cuda_sm_count(device), smem = cuda_smem_per_block(device);
    const int64_t heads = static_cast<int64_t>(r.N) * r.HV;
    const bool fit64 = ScanLayout<K, 64, F>::bytes <= smem;
    if constexpr (!F::kScalarGate) {
      const bool wide = r.V % 128 == 0 && (forced ? forced == 128 : !p.cu && heads * (r.V / 64) > sms);
      if (wide && ScanLayout<K, 128, F>::bytes <= smem) return run<K, 128, F, kBlockBarriersOnly>(r, p, device, stream);
    }
    if (forced ? forced == 32 || !fit64 : heads * (r.V / 32) <= sms || !fit64)
      run<K, 32, F, kBlockBarriersOnly>(r, p, device, stream);
    else
      run<K, 64, F, kBlockBarriersOnly>(r, p, device, stream);
  }
}

template <int K, class F>
void run_vb(const Recurrence& r, const FwdParams& p, int device, cudaStream_t stream, bool block_barriers_only) {
  // The debug instantiation exists for the families whose kernels have named barriers to replace
  // (the delta rule's B2 in the scan, KDA's B_f in the prep).
  if constexpr (F::kDelta) {
    if (block_barriers_only) return run_vb_barriers<K, F, true>(r, p, device, stream);
  }
  run_vb_barriers<K, F, false>(r, p, device, stream);
}

// One translation unit per family and head size K instantiates this.
#define CULA_CHUNK_PREP_SCAN_INSTANTIATE(K, F) \
  template void run_vb<K, F>(const Recurrence&, const FwdParams&, int, cudaStream_t, bool);

}  // namespace chunk_prep_scan
}  // namespace cula
