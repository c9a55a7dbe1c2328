// The carried-state correction of context parallelism on host tensors (cula_cp_correct's CPU and
// reference row): o[t, h, j] = round(ow[t, h, j] + sum_k X[h, j, k] ow[t, h, V + k]), the sum in
// float64.
#include "common/parallel.h"
#include "cpu/cpu_backend.h"
#include "cuda/dist/cp_correct.h"

namespace cula {

void host_cp_correct(const CpCorrectShape& s, const cula_cp_correct_args& a) {
  const View ow(a.ow), x(a.state), o(a.o);
  parallel_for(s.L, [&](int64_t t) {
    for (int64_t h = 0; h < s.HV; ++h)
      for (int64_t j = 0; j < s.V; ++j) {
        double y = ow.at(t, h, j);
        for (int64_t k = 0; k < s.K; ++k) y += x.at(h, j, k) * ow.at(t, h, s.V + k);
        o.set(y, t, h, j);
      }
  });
}

}  // namespace cula
