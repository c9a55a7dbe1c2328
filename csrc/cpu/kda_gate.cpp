// CPU KDA gate activation: the formula of Recurrence::gate_activation, element by element.
#include <cmath>

#include "common/parallel.h"
#include "cpu/cpu_backend.h"

namespace cula {

void cpu_kda_gate(const cula_kda_gate_args& a, const cula_tensor& g, int64_t HV, int64_t K) {
  const int64_t rows = g.shape[0] * g.shape[1];
  const View gin(&g), out(a.g_out), A_log(a.A_log), dt_bias(a.dt_bias);
  const bool has_lb = a.opt.has_lower_bound != 0;
  const double lb = a.opt.lower_bound;
  parallel_for(rows, [&](int64_t row) {
    const int64_t b = row / g.shape[1], t = row % g.shape[1];
    for (int64_t h = 0; h < HV; ++h)
      for (int64_t k = 0; k < K; ++k) {
        double x = gin.at(b, t, h, k);
        if (dt_bias) x += dt_bias.t->ndim == 2 ? dt_bias.at(h, k) : dt_bias.at(h * K + k);
        double y;
        if (has_lb) {
          y = lb * sigmoid(A_log ? std::exp(A_log.at(h)) * x : x);
        } else {
          y = -std::exp(A_log.at(h)) * softplus(x);
        }
        out.set(y, b, t, h, k);
      }
  });
}

}  // namespace cula
