// Chooses the build of the CPU kernels that this processor can run (AVX2+FMA or baseline).
#include "cpu/cpu_backend.h"

namespace cula {
namespace isa_baseline {
void cpu_chunk_fwd(const Recurrence& r, const cula_chunk_fwd_args& a);
}
#if defined(CULA_HAVE_AVX2_BUILD)
namespace isa_avx2 {
void cpu_chunk_fwd(const Recurrence& r, const cula_chunk_fwd_args& a);
}
#endif

namespace {
bool has_avx2_fma() {
#if defined(CULA_HAVE_AVX2_BUILD) && (defined(__x86_64__) || defined(__i386__)) && defined(__GNUC__)
  static const bool yes = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  return yes;
#else
  return false;
#endif
}
}  // namespace

const char* cpu_isa() { return has_avx2_fma() ? "avx2+fma" : "baseline"; }

void cpu_chunk_fwd(const Recurrence& r, const cula_chunk_fwd_args& a) {
#if defined(CULA_HAVE_AVX2_BUILD)
  if (has_avx2_fma()) return isa_avx2::cpu_chunk_fwd(r, a);
#endif
  isa_baseline::cpu_chunk_fwd(r, a);
}

}  // namespace cula
