"""Opt-in registration of cula as a backend of flash-linear-attention's dispatcher, so that code
calling ``fla.ops.kda.chunk_kda`` or ``fla.ops.kda.fused_recurrent.fused_recurrent_kda_fwd``
runs cula's kernels where cula has one for the call (others fall through to FLA's own).

    import cula.fla_backend
    cula.fla_backend.register()      # or set FLA_CULA=0 later to switch it off again
"""

from __future__ import annotations

import functools

from . import kda as _kda
from . import ops

__all__ = ["register", "calls"]

calls = {"chunk_kda": 0, "fused_recurrent_kda_fwd": 0}  # how often cula served FLA calls
_registered = False


def _device_ok(op, x):
    dev = x.device.type if hasattr(x, "device") else "cpu"
    return ops.backend_for(op, dev) != "none", dev


@functools.lru_cache(maxsize=64)
def _cuda_decode_head_size(K: int, V: int, dtype, device):
    """None when the library's CUDA decode takes head sizes K, V in this dtype, else its reason:
    asked of the library once per (K, V, dtype, device) through explain() on a one-token probe, so
    the rule lives in the decode row's declines predicate, not here."""
    import torch

    x = lambda *s, dt=dtype: torch.ones(*s, dtype=dt, device=device)  # noqa: E731
    try:
        ops.explain("decode", x(1, 1, 1, K), x(1, 1, 1, K), x(1, 1, 1, V), x(1, 1, V, K, dt=torch.float32),
                    g=x(1, 1, 1, K), beta=x(1, 1, 1))
    except (ops.CulaError, NotImplementedError, ValueError) as e:
        return str(e)
    return None


def register(priority: int = 1) -> None:
    """Registers cula for FLA's chunk_kda and fused_recurrent_kda_fwd (idempotent)."""
    global _registered
    if _registered:
        return
    from fla.backends import BaseBackend
    from fla.backends import register as fla_register
    from fla.ops.kda.chunk import chunk_kda as fla_chunk_kda

    class CulaBackend(BaseBackend):
        backend_type = "cula"
        package_name = "cula"
        env_var = "FLA_CULA"
        default_enable = True

        def chunk_kda_verifier(self, q, k, v, g, beta, *args, **kwargs):
            ok, dev = _device_ok("chunk_fwd", q)
            if not ok:
                return False, f"cula has no chunk_kda kernel for {dev} tensors yet"
            if kwargs.get("use_graph"):
                return False, "cula does not support use_graph"
            return True, None

        def chunk_kda(self, *args, **kwargs):
            calls["chunk_kda"] += 1
            return _kda.chunk_kda(*args, **kwargs)

        def fused_recurrent_kda_fwd_verifier(self, q, k, v, g, beta, *args, **kwargs):
            ok, dev = _device_ok("decode", q)
            if not ok:
                return False, f"cula has no decode kernel for {dev} tensors"
            if beta.ndim == v.ndim:
                return False, "cula does not support head-wise (per-V) beta"
            if dev == "cuda":
                why = _cuda_decode_head_size(q.shape[-1], v.shape[-1], q.dtype, q.device)
                if why:
                    return False, f"cula's CUDA decode declines the call: {why}"
            return True, None

        def fused_recurrent_kda_fwd(self, q, k, v, g, beta, A_log=None, dt_bias=None, initial_state=None, scale=None,
                                    output_final_state=False, inplace_final_state=True, state_v_first=False,
                                    cu_seqlens=None, ssm_state_indices=None, num_accepted_tokens=None,
                                    use_qk_l2norm_in_kernel=False, use_gate_in_kernel=False,
                                    use_beta_sigmoid_in_kernel=False, allow_neg_eigval=False, lower_bound=None,
                                    out=None, **kwargs):
            calls["fused_recurrent_kda_fwd"] += 1
            extra = dict(ssm_state_indices=ssm_state_indices, num_accepted_tokens=num_accepted_tokens, out=out)
            if inplace_final_state:
                extra["inplace_final_state"] = True
            return _kda.fused_recurrent_kda(q, k, v, g, beta, A_log=A_log, dt_bias=dt_bias, scale=scale,
                                            initial_state=initial_state, output_final_state=output_final_state,
                                            use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
                                            use_gate_in_kernel=use_gate_in_kernel,
                                            use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel,
                                            allow_neg_eigval=allow_neg_eigval, lower_bound=lower_bound,
                                            state_v_first=state_v_first, cu_seqlens=cu_seqlens,
                                            **{n: x for n, x in extra.items() if x is not None}, **kwargs)

    CulaBackend.priority = priority
    fla_register(fla_chunk_kda)(CulaBackend)
    fla_register("kda")(CulaBackend)
    _registered = True
