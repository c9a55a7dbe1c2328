// The chunk engine's launch of one family at one head size K: workspace, the prep and the scan on
// the caller's stream (or, for segments, the prep and two scans), and the choice of the scan's
// slice width VB. Included by the instantiation
// units only (instantiations/), so each family and K compiles in a translation unit of its own.
#pragma once

#include <cuda_runtime.h>

#include <cstdlib>
#include <type_traits>

#include "common/error.h"
#include "cuda/prefill/chunk_prep_scan/launcher.h"
#include "cuda/prefill/chunk_prep_scan/prep.cuh"
#include "cuda/prefill/chunk_prep_scan/scan.cuh"
#include "cuda/prefill/chunk_prep_scan/segments.h"
#include "cuda/runtime/runtime.h"

namespace cula {
namespace chunk_prep_scan {

// The prep of every chunk of the call (chunk_base: the varlen chunk numbering, or null).
template <int K, class F, bool kBlockBarriersOnly>
void launch_prep(const Recurrence& r, const FwdParams& p, const int32_t* chunk_base, unsigned char* work,
                 int64_t blocks, cudaStream_t stream) {
  using Prep = PrepLayout<K, F>;
  auto prep = [&](auto kernel) {
    chunk::allow_smem(kernel, Prep::bytes);
    kernel<<<static_cast<unsigned>(blocks), 32 * prep_warps<F>(), Prep::bytes, stream>>>(p, chunk_base, work);
  };
  // KDA: the prep without the steep-block machinery for the bounded in-kernel gate
  if constexpr (F::kDelta && !F::kScalarGate) {
    if (kda_bounded_gate(r)) prep(chunk_prep_kernel<K, F, false, kBlockBarriersOnly>);
    else prep(chunk_prep_kernel<K, F, true, kBlockBarriersOnly>);
  } else {
    prep(chunk_prep_kernel<K, F, false, kBlockBarriersOnly>);
  }
}

// The scan's slice width VB for `tasks` sequences (or segments) of V columns: one CTA per
// (sequence, head, V slice), one CTA per SM. Slices of 32 columns when those still fit in one wave
// (or when 64 columns do not fit the device's shared memory). KDA and GLA on equal-length sequences
// take all 128 columns in one CTA of 16 warps (the stage read once for the whole head) when
// 64-column slices would need more than one wave: a loaded SM moves a head through about as fast
// either way, so what it saves is the partial last wave (docs/history; GDN's 16-warp scan was
// slower, and varlen calls, whose lengths the host does not know, lost where one long sequence
// started late). Else 64. CULA_SCAN_VB=32|64|128 (read once per process) forces a width where it
// fits, for benchmarks. (V and v's columns v_cols are multiples of 64: chunk::tensor_core_declines.)
// (The segments' summary scan runs two CTAs of up to 64 columns an SM at K <= 128,
// compact_summary; KDA's still takes 128 columns where it would.)
template <int K, class F>
int pick_vb(int64_t tasks, int64_t HV, int64_t V, int64_t v_cols, bool varlen, int device) {
  static const int forced = [] {
    const char* e = std::getenv("CULA_SCAN_VB");
    return e ? std::atoi(e) : 0;
  }();
  if constexpr (K > 128) {
    return 32;  // (one stage of 32 columns fits)
  } else {
    const int sms = cuda_sm_count(device), smem = cuda_smem_per_block(device);
    const int64_t heads = tasks * HV;
    const bool fit64 = ScanLayout<K, 64, F>::bytes <= smem;
    if constexpr (!F::kScalarGate) {
      // (a slice reads v's columns whole or not at all: with value_dim, v's own V a multiple of it too)
      const bool wide = V % 128 == 0 && v_cols % 128 == 0 && (forced ? forced == 128 : !varlen && heads * (V / 64) > sms);
      if (wide && ScanLayout<K, 128, F>::bytes <= smem) return 128;
    }
    return (forced ? forced == 32 || !fit64 : heads * (V / 32) <= sms || !fit64) ? 32 : 64;
  }
}

// The scan of p (p.N sequences, or segments with p.seg) at slice width vb; kStatesOnly: the
// segments' summary scan (states only, no o).
template <int K, class F, bool kBlockBarriersOnly, bool kStatesOnly = false>
void launch_scan(const FwdParams& p, int vb, const int32_t* chunk_base, const unsigned char* work, cudaStream_t stream) {
  auto scan = [&](auto width) {  // the kernel of slice width VB and its layout's shared memory
    constexpr int VB = decltype(width)::value;
    const auto kernel = chunk_scan_kernel<K, VB, F, kBlockBarriersOnly, kStatesOnly>;
    constexpr int bytes = ScanLayoutOf<K, VB, F, kStatesOnly>::bytes;
    chunk::allow_smem(kernel, bytes);
    const int64_t tasks = p.seg ? static_cast<int64_t>(p.N) * segments_per_sequence(p.T, p.seg) : p.N;
    kernel<<<static_cast<unsigned>(tasks * p.HV * (p.V / VB)), 32 * scan_warps(VB), bytes, stream>>>(p, chunk_base,
                                                                                                      work);
  };
  if constexpr (K <= 128 && !F::kScalarGate) {
    if (vb == 128) return scan(std::integral_constant<int, 128>{});
  }
  if constexpr (K <= 128) {
    if (vb == 64) return scan(std::integral_constant<int, 64>{});
  }
  scan(std::integral_constant<int, 32>{});
}

// Workspace, prep and scan of one call; with r.segment_len < T, the segments (segments.h): the prep
// once for both scans (its chunks are the uncut call's), a summary scan over V + K columns that
// writes states only, the fold, the output scan, and the final states' scatter.
template <int K, class F, bool kBlockBarriersOnly>
void run(const Recurrence& r, const FwdParams& p, int device, cudaStream_t stream) {
  const int64_t max_chunks = chunk::max_chunks(p), base_bytes = chunk::base_bytes(p);
  const bool cut = r.segment_len > 0 && r.T > r.segment_len;
  const int per = cut ? segments_per_sequence(r.T, r.segment_len) : 1;
  const int64_t segs = r.N * per, W = r.V + K;
  // segments: init (then the final states) [segs, HV, W, K], summary the same, enter [segs, HV, V, K]
  const int64_t state_floats = cut ? segs * r.HV * K * (2 * W + r.V) : 0;
  const int64_t work_bytes = max_chunks * r.HV * Work<K, F>::bytes;
  const int64_t bytes = base_bytes + work_bytes + state_floats * 4;
  const int64_t prep_blocks = max_chunks * r.HV, scan_blocks = segs * r.HV * ((cut ? W : r.V) / 32);
  if (prep_blocks >= (int64_t{1} << 31) || scan_blocks >= (int64_t{1} << 31))
    throw_unsupported("chunk_fwd", "too many chunks x heads for one launch");
  if (max_chunks == 0) return;
  chunk::Workspace ws(bytes, device, stream, "chunk_fwd");
  int32_t* chunk_base = p.cu ? static_cast<int32_t*>(ws.get()) : nullptr;
  unsigned char* work = static_cast<unsigned char*>(ws.get()) + base_bytes;
  if (p.cu) chunk::launch_chunk_base(p, chunk_base, stream);
  launch_prep<K, F, kBlockBarriersOnly>(r, p, chunk_base, work, prep_blocks, stream);
  if (!cut) {
    launch_scan<K, F, kBlockBarriersOnly>(p, pick_vb<K, F>(r.N, r.HV, r.V, r.v_cols, p.cu, device), chunk_base, work, stream);
  } else {
    float* init = reinterpret_cast<float*>(work + work_bytes);  // (16-byte aligned: Work's bytes are)
    float* summary = init + segs * r.HV * W * K;
    float* enter = summary + segs * r.HV * W * K;
    FwdParams ps = p;  // the summary scan: states only, over the values extended by K zero columns
    ps.seg = static_cast<int>(r.segment_len), ps.V = static_cast<int>(W), ps.k_last = 1;
    ps.h0 = init, ps.h0_dt = CULA_FLOAT32, ps.ht = summary, ps.ht_dt = CULA_FLOAT32, ps.out = nullptr;
    segments::launch_init(p, per, init, stream);
    launch_scan<K, F, kBlockBarriersOnly, true>(ps, pick_vb<K, F>(segs, r.HV, W, r.V, false, device), nullptr,
                                                work, stream);
    segments::launch_fold(p, per, summary, enter, stream);
    FwdParams po = p;  // the output scan from the folded states; final states into init's room
    po.seg = ps.seg, po.k_last = 1, po.h0 = enter, po.h0_dt = CULA_FLOAT32;
    po.ht = p.ht ? init : nullptr, po.ht_dt = CULA_FLOAT32;
    launch_scan<K, F, kBlockBarriersOnly>(po, pick_vb<K, F>(segs, r.HV, r.V, r.V, false, device), nullptr, work, stream);
    if (p.ht) segments::launch_final(p, per, init, stream);
  }
  const cudaError_t launched = cudaGetLastError();
  ws.release();
  chunk::check(launched, "kernel launch");
}

template <int K, class F>
void run_vb(const Recurrence& r, const FwdParams& p, int device, cudaStream_t stream, bool block_barriers_only) {
  // The debug instantiation exists for the families whose kernels have named barriers to replace
  // (the delta rule's B2 in the scan, KDA's B_f in the prep).
  if constexpr (F::kDelta) {
    if (block_barriers_only) return run<K, F, true>(r, p, device, stream);
  }
  run<K, F, false>(r, p, device, stream);
}

// One translation unit per family and head size K instantiates this.
#define CULA_CHUNK_PREP_SCAN_INSTANTIATE(K, F) \
  template void run_vb<K, F>(const Recurrence&, const FwdParams&, int, cudaStream_t, bool);

}  // namespace chunk_prep_scan
}  // namespace cula
