// K = 256, VB = 64: the fused kernels and their launch (launch.cuh).
#include "cuda/prefill/chunk_fused/launch.cuh"

namespace cula {
namespace chunk_fused {
CULA_CHUNK_FUSED_INSTANTIATE(256, 64)
}  // namespace chunk_fused
}  // namespace cula
