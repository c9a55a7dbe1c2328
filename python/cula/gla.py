"""FLA drop-in for GLA: ``from cula.gla import chunk_gla, fused_recurrent_gla``."""

from __future__ import annotations

from ._fla_common import offsets_for, resolve_state_layout, zero_gate
from ._front import chunk, reject_unknown

__all__ = ["chunk_gla", "fused_recurrent_gla"]


def chunk_gla(q, k, v, g, scale=None, initial_state=None, output_final_state=False, state_v_first=False,
              cu_seqlens=None, cu_seqlens_cpu=None, **kwargs):
    """FLA ``chunk_gla``: per-channel log-gate g [B, T, H, K]."""
    state_v_first = resolve_state_layout("chunk_gla", state_v_first, kwargs)
    reject_unknown("chunk_gla", kwargs)  # (FLA's chunk_gla takes no chunk_size either)
    return chunk("gla", q, k, v, g, initial_state=initial_state, scale=scale, output_final_state=output_final_state,
                 cu_seqlens=offsets_for(q, cu_seqlens, cu_seqlens_cpu),
                 state_layout="k_last" if state_v_first else "k_first")


def fused_recurrent_gla(q, k, v, gk=None, gv=None, scale=None, initial_state=None, output_final_state=False,
                        reverse=False, state_v_first=False, cu_seqlens=None, **kwargs):
    """FLA ``fused_recurrent_gla`` (decode and short sequences): the function chunk_gla computes with
    the per-key log-gate gk [B, T, H, K]; no gk means no decay, as in FLA. The per-value gate gv and
    ``reverse=True`` are not supported."""
    if gv is not None:
        raise NotImplementedError("fused_recurrent_gla: the per-value gate 'gv' is not supported by cula; pass gk")
    if reverse:
        raise NotImplementedError("fused_recurrent_gla: reverse=True is not supported by cula")
    if gk is None:
        gk = zero_gate(k)
    return chunk_gla(q, k, v, gk, scale=scale, initial_state=initial_state, output_final_state=output_final_state,
                     state_v_first=state_v_first, cu_seqlens=cu_seqlens, **kwargs)
