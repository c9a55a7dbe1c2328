// Gdn at head size K = 256: the prep and scan kernels and their launch (launch.cuh).
#include "cuda/prefill/chunk_prep_scan/launch.cuh"

namespace cula {
namespace chunk_prep_scan {
CULA_CHUNK_PREP_SCAN_INSTANTIATE(256, Gdn)
}  // namespace chunk_prep_scan
}  // namespace cula
