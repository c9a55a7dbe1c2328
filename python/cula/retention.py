"""FLA drop-in for RetNet's retention: ``from cula.retention import chunk_retention,
fused_chunk_retention, fused_recurrent_retention, parallel_retention``. Retention is simple GLA
with FLA's fixed per-head log-decay g_gamma[h] = log(1 - 2^(-5 - h)): each entry is the simple-GLA
entry of the same form with that decay (on the Lightning kernels, forward and backward)."""

from __future__ import annotations

from . import simple_gla
from ._tensor import is_torch

__all__ = ["chunk_retention", "fused_chunk_retention", "fused_recurrent_retention", "parallel_retention"]


def _g_gamma(q):
    """FLA's retention decay per head, float32 on q's device."""
    H = int(q.shape[2])
    if is_torch(q):
        import torch

        return (1 - 2.0 ** (-5.0 - torch.arange(H, dtype=torch.float, device=q.device))).log()
    import numpy as np

    return np.log(1 - 2.0 ** (-5.0 - np.arange(H, dtype=np.float32))).astype(np.float32)


def chunk_retention(q, k, v, scale=None, initial_state=None, output_final_state=False, cu_seqlens=None, **kwargs):
    """FLA ``chunk_retention``: K-first states [N, H, K, V]."""
    if "head_first" in kwargs:
        raise DeprecationWarning("head_first has been removed. Inputs must be in `[B, T, H, ...]` format.")
    return simple_gla.chunk_simple_gla(q, k, v, g_gamma=_g_gamma(q), scale=scale, initial_state=initial_state,
                                       output_final_state=output_final_state, cu_seqlens=cu_seqlens, **kwargs)


def fused_chunk_retention(q, k, v, scale=None, initial_state=None, output_final_state=False, cu_seqlens=None):
    """FLA ``fused_chunk_retention``: the function chunk_retention computes."""
    return simple_gla.fused_chunk_simple_gla(q, k, v, g_gamma=_g_gamma(q), scale=scale, initial_state=initial_state,
                                             output_final_state=output_final_state, cu_seqlens=cu_seqlens)


def fused_recurrent_retention(q, k, v, scale=None, initial_state=None, output_final_state=False, reverse=False,
                              state_v_first=False, cu_seqlens=None, **kwargs):
    """FLA ``fused_recurrent_retention``: the function chunk_retention computes; ``reverse=True`` is
    not supported."""
    return simple_gla.fused_recurrent_simple_gla(q, k, v, g_gamma=_g_gamma(q), scale=scale,
                                                 initial_state=initial_state, output_final_state=output_final_state,
                                                 reverse=reverse, state_v_first=state_v_first, cu_seqlens=cu_seqlens,
                                                 **kwargs)


def parallel_retention(q, k, v, scale=None, output_attentions=False, cu_seqlens=None):
    """FLA ``parallel_retention``: (o, attn) as parallel_simple_gla returns them, with the retention
    decay as its per-token gate."""
    gamma = _g_gamma(q)
    if is_torch(q):
        g = gamma[None, None, :].expand(*q.shape[:3]).contiguous()
    else:
        import numpy as np

        g = np.broadcast_to(gamma[None, None, :], tuple(q.shape[:3])).copy()
    return simple_gla.parallel_simple_gla(q, k, v, g=g, scale=scale, output_attentions=output_attentions,
                                          cu_seqlens=cu_seqlens)
