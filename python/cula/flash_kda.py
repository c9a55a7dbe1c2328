"""FlashKDA-compatible entry: ``cula.flash_kda.fwd`` has FlashKDA's signature and writes into
the caller's buffers. As in FlashKDA, q/k are L2-normalised, beta goes through a sigmoid and the
gate is ``lower_bound * sigmoid(exp(A_log) * (g + dt_bias))``, all inside the kernel; states
are K-last ``[B|N, H, V, K]``."""

from __future__ import annotations

from . import ops
from ._lib import CulaError
from ._tensor import dtype_name

__all__ = ["fwd"]


def fwd(q, k, v, g, beta, scale, out, A_log, dt_bias, lower_bound, initial_state=None, final_state=None,
        cu_seqlens=None):
    """Forward KDA into ``out`` (and ``final_state`` when given). Returns None, as FlashKDA does."""
    if out is None:
        raise CulaError("flash_kda.fwd: argument 'out': expected the output buffer [B, T, H, V], got None")
    lb = float(lower_bound)
    if not -5.0 <= lb <= 0.0:
        raise CulaError(f"flash_kda.fwd: argument 'lower_bound': expected a value in [-5, 0], got {lb}")
    if initial_state is not None and final_state is not None and dtype_name(initial_state) != dtype_name(final_state):
        raise CulaError(f"flash_kda.fwd: argument 'final_state': expected the dtype of initial_state "
                        f"({dtype_name(initial_state)}), got {dtype_name(final_state)}")
    if dt_bias is not None and len(dt_bias.shape) == 2:
        dt_bias = dt_bias.reshape(-1)
    if lb == 0.0:  # no decay at all: the gate is identically zero
        g = g * 0
        use_gate, lb_arg = False, None
    else:
        use_gate, lb_arg = True, lb
    ops.chunk_fwd("kda", q, k, v, g, beta, scale=float(scale), A_log=A_log if use_gate else None,
                  dt_bias=dt_bias if use_gate else None, lower_bound=lb_arg, use_gate_in_kernel=use_gate,
                  use_qk_l2norm_in_kernel=True, use_beta_sigmoid_in_kernel=True, initial_state=initial_state,
                  cu_seqlens=cu_seqlens, out=out, final_state_out=final_state, state_layout="k_last")
    return None
