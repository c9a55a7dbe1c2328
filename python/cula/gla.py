"""FLA drop-in for GLA: ``from cula.gla import chunk_gla``."""

from __future__ import annotations

from ._fla_common import offsets_for, resolve_state_layout
from ._front import chunk, reject_unknown

__all__ = ["chunk_gla"]


def chunk_gla(q, k, v, g, scale=None, initial_state=None, output_final_state=False, state_v_first=False,
              cu_seqlens=None, cu_seqlens_cpu=None, **kwargs):
    """FLA ``chunk_gla``: per-channel log-gate g [B, T, H, K]."""
    state_v_first = resolve_state_layout("chunk_gla", state_v_first, kwargs)
    reject_unknown("chunk_gla", kwargs)  # (FLA's chunk_gla takes no chunk_size either)
    return chunk("gla", q, k, v, g, initial_state=initial_state, scale=scale, output_final_state=output_final_state,
                 cu_seqlens=offsets_for(q, cu_seqlens, cu_seqlens_cpu),
                 state_layout="k_last" if state_v_first else "k_first")
