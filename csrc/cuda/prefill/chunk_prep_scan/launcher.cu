// The chunk engine's host side below the C ABI's dispatch table: what it accepts, and the ladder
// from a call to the family and head size that run it. Design: DESIGN.md beside this file.
#include <cuda_runtime.h>

#include <cstdlib>

#include "common/error.h"
#include "cuda/prefill/chunk_engines.h"
#include "cuda/prefill/chunk_prep_scan/config.cuh"
#include "cuda/prefill/chunk_prep_scan/launcher.h"
#include "cuda/runtime/runtime.h"

namespace cula {
namespace chunk_prep_scan {
namespace {

// Shared memory of the scan for a family at head size K and slice width VB (the prep needs less).
template <int K>
int scan_bytes(const Recurrence& r, int vb) {
  if (!r.tr.delta) return vb == 32 ? ScanLayout<K, 32, Gla>::bytes : ScanLayout<K, 64, Gla>::bytes;
  if (r.tr.gate != GateKind::PerChannel) return vb == 32 ? ScanLayout<K, 32, Gdn>::bytes : ScanLayout<K, 64, Gdn>::bytes;
  return vb == 32 ? ScanLayout<K, 32, Kda>::bytes : ScanLayout<K, 64, Kda>::bytes;
}
int scan_bytes(const Recurrence& r, int vb) {
  return r.K == 64 ? scan_bytes<64>(r, vb) : r.K == 128 ? scan_bytes<128>(r, vb) : scan_bytes<256>(r, vb);
}

}  // namespace
}  // namespace chunk_prep_scan

using namespace chunk_prep_scan;

const char* chunk_fwd_mma_declines(const Recurrence& r, const cula_chunk_fwd_args& a) {
  if (!r.tr.delta && r.tr.gate != GateKind::PerChannel) return "scalar or constant decay without the delta rule (chunk_fused)";
  if (r.tr.gate == GateKind::PerChannel) {
    // Any decay: factors <= 1 off the diagonal, steep diagonal blocks taken per element (DESIGN.md)
    if (a.g->dtype != CULA_BFLOAT16 && a.g->dtype != CULA_FLOAT16 && a.g->dtype != CULA_FLOAT32)
      return "g is not bfloat16, float16 or float32";
    if (!chunk::aligned16(a.g)) return "g is not 16-byte aligned";
  }
  // Scalar and constant gates: the exponent is taken per pair (any decay); g is read per element.
  if (!head_size_supported(r.K)) return "key head size K other than 64, 128 and 256";
  if (const char* why = chunk::tensor_core_declines(a)) return why;
  // The scan's two stages must fit (at K = 128 the 32-column scans do on an A100, 163 KB per block)
  if (scan_bytes(r, 32) > cuda_smem_per_block(a.q->device_id)) return "the scan's shared memory exceeds the device's";
  return nullptr;
}

// Three engines: per-channel gate with the delta rule (KDA), scalar gate with it (GDN), per-channel
// gate without it (GLA).
template <int K>
void run_family(const Recurrence& r, const FwdParams& p, int device, cudaStream_t stream, bool block_barriers_only) {
  if (!r.tr.delta) run_vb<K, Gla>(r, p, device, stream, block_barriers_only);
  else if (r.tr.gate != GateKind::PerChannel) run_vb<K, Gdn>(r, p, device, stream, block_barriers_only);
  else run_vb<K, Kda>(r, p, device, stream, block_barriers_only);
}

void cuda_chunk_fwd_mma(const Recurrence& r, const cula_chunk_fwd_args& given) {
  // CULA_BLOCK_BARRIERS_ONLY=1 (read once per process): the debug instantiation whose named
  // barriers are block barriers, for compute-sanitizer's racecheck (DESIGN.md)
  static const bool block_barriers_only = [] {
    const char* e = std::getenv("CULA_BLOCK_BARRIERS_ONLY");
    return e && *e && *e != '0' ? 1 : 0;
  }();
  if (r.N == 0) return;
  const int dev = given.q->device_id;
  chunk::check(cudaSetDevice(dev), "cudaSetDevice");
  const cudaStream_t stream = static_cast<cudaStream_t>(given.opt.stream);
  chunk::EngineInputs in(given, dev, stream);  // float32 q, k, v: bf16 copies
  const FwdParams p = make_fwd_params(r, in.args());
  if (r.K == 64) run_family<64>(r, p, dev, stream, block_barriers_only);
  else if (r.K == 128) run_family<128>(r, p, dev, stream, block_barriers_only);
  else run_family<256>(r, p, dev, stream, block_barriers_only);
  in.release();
}

}  // namespace cula
