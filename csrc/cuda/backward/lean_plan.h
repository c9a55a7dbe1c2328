// The lean backward's path per call (lean_bwd.cu, DESIGN.md "The lean form"). Host code only, so the
// plan is tested without a device (tests/cpp/test_backward.cpp).
#pragma once

#include "cula/cula.h"

namespace cula {
namespace bwd {

enum class LeanPath {
  Precise,  // fp32 states, three TF32 products; prepare and chain kernels
  Bf16,     // bf16 states and gradient-kernel operands; prepare and chain kernels
  Direct,   // bf16 throughout, inputs read as they lie, dq / dk / dg written by the gradient kernel
};

struct LeanCall {
  bool gate_in_kernel;   // the gate activated in the kernel (dA_log, d dt_bias sum terms that cancel)
  bool l2norm;           // q / k L2 norm in the kernel
  bool grouped;          // more value heads than q/k heads
  bool param_grads;      // dbeta, dA_log or d dt_bias asked (the chain kernels make them)
  bool qk_rows16;        // q and k with unit column stride and 16-byte aligned rows
  int q_dt, k_dt, v_dt, d_out_dt;  // DLPack dtype codes
};

// Three TF32 products and fp32 states where the gate is activated in the kernel or an input is not
// bf16 (the general form's rule); otherwise bf16, read directly where nothing needs the prepare or
// chain kernels (no L2 norm, no grouped heads, no parameter gradients) and every input can be copied
// as it lies.
inline LeanPath lean_path(const LeanCall& c) {
  if (c.gate_in_kernel || c.q_dt != CULA_BFLOAT16 || c.k_dt != CULA_BFLOAT16 || c.v_dt != CULA_BFLOAT16)
    return LeanPath::Precise;
  if (!c.l2norm && !c.grouped && !c.param_grads && c.d_out_dt == CULA_BFLOAT16 && c.qk_rows16) return LeanPath::Direct;
  return LeanPath::Bf16;
}

}  // namespace bwd
}  // namespace cula
