"""FLA drop-in for DeltaNet: ``from cula.delta_rule import chunk_delta_rule, fused_recurrent_delta_rule``.
The delta rule without decay is Gated DeltaNet with a log-gate of 0: it runs on the GDN kernels
(forward and backward)."""

from __future__ import annotations

from ._fla_common import fla_chunk_size, offsets_for, per_token_head
from ._front import chunk, reject_unknown

__all__ = ["chunk_delta_rule", "fused_recurrent_delta_rule"]


def chunk_delta_rule(q, k, v, beta, scale=None, initial_state=None, output_final_state=False,
                     use_qk_l2norm_in_kernel=False, cu_seqlens=None, cu_seqlens_cpu=None, **kwargs):
    """FLA ``chunk_delta_rule``: beta [B, T, H], K-first states [N, H, K, V]."""
    if "head_first" in kwargs:
        raise DeprecationWarning("head_first has been removed. Inputs must be in `[B, T, H, ...]` format.")
    fla_chunk_size("chunk_delta_rule", kwargs.pop("chunk_size", 64))
    reject_unknown("chunk_delta_rule", kwargs)
    return chunk("gdn", q, k, v, per_token_head(v, 0.0), beta, initial_state=initial_state, scale=scale,
                 output_final_state=output_final_state, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
                 cu_seqlens=offsets_for(q, cu_seqlens, cu_seqlens_cpu), state_layout="k_first")


def fused_recurrent_delta_rule(q, k, v, beta=None, scale=None, initial_state=None, output_final_state=False,
                               use_qk_l2norm_in_kernel=False, cu_seqlens=None):
    """FLA ``fused_recurrent_delta_rule`` (decode and short sequences): the function chunk_delta_rule
    computes; no beta means beta = 1, as in FLA."""
    return chunk_delta_rule(q, k, v, per_token_head(v, 1.0) if beta is None else beta, scale=scale,
                            initial_state=initial_state, output_final_state=output_final_state,
                            use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, cu_seqlens=cu_seqlens)
