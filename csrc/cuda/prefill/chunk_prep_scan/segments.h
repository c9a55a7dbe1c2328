// Segments inside the chunk engine (segment_len): the small kernels between its two scans. A dense
// call's sequences run as segments of L tokens in parallel (DESIGN.md, "Segments"): a summary scan
// over V + K columns from `init`, the fold, an output scan from `enter`, and the final states'
// scatter. Every buffer here is float32, K-last, indexed [segment, HV, rows, K]; segment
// b * per + j is segment j of sequence b. p is the caller's call (its N, HV, K, V, states, layout).
#pragma once

#include <cuda_runtime.h>

#include "cuda/common/fwd_params.cuh"

namespace cula {
namespace chunk_prep_scan {
namespace segments {

// init [N per, HV, V + K, K]: a sequence's first segment from its initial state (zeros without
// one), the others from zero with the identity in rows V.. (whose final value is the segment's
// state transition: the rows' values are zeros).
void launch_init(const FwdParams& p, int per, float* init, cudaStream_t stream);

// enter [N per, HV, V, K]: the state each segment starts from, E_0 = the initial state,
// E_1 = A_0, E_j = A_{j-1} + E_{j-1} M_{j-1}, with A_j = summary rows [0, V) and M_j = rows [V, V + K)
// of segment j's summary state (float32, a fixed order of sums).
void launch_fold(const FwdParams& p, int per, const float* summary, float* enter, cudaStream_t stream);

// The final state of each sequence's last segment (fin [N per, HV, V, K]) to p.ht, in its layout and dtype.
void launch_final(const FwdParams& p, int per, const float* fin, cudaStream_t stream);

}  // namespace segments
}  // namespace chunk_prep_scan
}  // namespace cula
