"""FLA drop-in for simple GLA: ``from cula.simple_gla import chunk_simple_gla, fused_recurrent_simple_gla,
fused_chunk_simple_gla, parallel_simple_gla`` (FLA's four entries of one function)."""

from __future__ import annotations

from ._fla_common import fla_chunk_size, float32_or_64, offsets_for, per_token_head, resolve_state_layout
from ._front import chunk, reject_unknown
from ._tensor import is_torch

__all__ = ["chunk_simple_gla", "fused_recurrent_simple_gla", "fused_chunk_simple_gla", "parallel_simple_gla"]


def chunk_simple_gla(q, k, v, g=None, g_gamma=None, scale=None, initial_state=None, output_final_state=False,
                     state_v_first=False, cu_seqlens=None, cu_seqlens_cpu=None, **kwargs):
    """FLA ``chunk_simple_gla``: a scalar log-gate g [B, T, H], or a constant per-head g_gamma [H]
    (then it is Lightning attention with decay = -g_gamma)."""
    state_v_first = resolve_state_layout("chunk_simple_gla", state_v_first, kwargs)
    chunk_size = fla_chunk_size("chunk_simple_gla", kwargs.pop("chunk_size", None))
    reject_unknown("chunk_simple_gla", kwargs)
    if (g is None) == (g_gamma is None):
        raise ValueError("chunk_simple_gla: exactly one of 'g' and 'g_gamma' must be given")
    common = dict(initial_state=initial_state, scale=scale, output_final_state=output_final_state,
                  chunk_size=chunk_size, cu_seqlens=offsets_for(q, cu_seqlens, cu_seqlens_cpu),
                  state_layout="k_last" if state_v_first else "k_first")
    if g is not None:
        return chunk("simple_gla", q, k, v, g, **common)
    decay = -g_gamma.float() if is_torch(g_gamma) else -g_gamma.astype("float32")
    return chunk("lightning", q, k, v, decay=decay, **common)


def fused_recurrent_simple_gla(q, k, v, g=None, g_gamma=None, scale=None, initial_state=None,
                               output_final_state=False, reverse=False, state_v_first=False, cu_seqlens=None,
                               **kwargs):
    """FLA ``fused_recurrent_simple_gla`` (decode and short sequences): the function chunk_simple_gla
    computes. As in FLA, g [B, T, H] and g_gamma [H] may both be given (their sum is the log-decay)
    and neither means no decay. ``reverse=True`` is not supported."""
    if reverse:
        raise NotImplementedError("fused_recurrent_simple_gla: reverse=True is not supported by cula")
    if g is not None and g_gamma is not None:
        g, g_gamma = _sum_gates(g, g_gamma), None
    elif g is None and g_gamma is None:
        g = per_token_head(v, 0.0)
    return chunk_simple_gla(q, k, v, g=g, g_gamma=g_gamma, scale=scale, initial_state=initial_state,
                            output_final_state=output_final_state, state_v_first=state_v_first,
                            cu_seqlens=cu_seqlens, **kwargs)


def _sum_gates(g, g_gamma):
    """g [B, T, H] + g_gamma [H] in float32_or_64."""
    dt = float32_or_64(g, g_gamma)
    return g.to(dt) + g_gamma.to(dt) if is_torch(g) else g.astype(dt) + g_gamma.astype(dt)


def fused_chunk_simple_gla(q, k, v, g=None, g_gamma=None, scale=None, initial_state=None, output_final_state=False,
                           cu_seqlens=None):
    """FLA ``fused_chunk_simple_gla``: the function chunk_simple_gla computes, K-first states; as in
    FLA's fused forms, neither gate means no decay."""
    return fused_recurrent_simple_gla(q, k, v, g=g, g_gamma=g_gamma, scale=scale, initial_state=initial_state,
                                      output_final_state=output_final_state, cu_seqlens=cu_seqlens)


def parallel_simple_gla(q, k, v, g=None, scale=None, output_attentions=False, cu_seqlens=None, cu_seqlens_cpu=None):
    """FLA ``parallel_simple_gla``: (o, attn), o the outputs of the function chunk_simple_gla computes
    from a zero state (no g: no decay); attn None, or with ``output_attentions=True`` (dense batches,
    as in FLA) the scores FLA materialises, float32 [B, H, T, T]:
    scale q_i.k_j exp(G_i - G_j) for j <= i (G the cumulative log-gate), computed apart in torch
    (no gradient flows through them)."""
    if output_attentions and cu_seqlens is not None:
        raise ValueError("parallel_simple_gla: output_attentions=True is not supported with variable-length "
                         "sequences (as in FLA)")
    o, _ = chunk_simple_gla(q, k, v, g=g if g is not None else per_token_head(v, 0.0), scale=scale,
                            cu_seqlens=cu_seqlens, cu_seqlens_cpu=cu_seqlens_cpu)
    return o, (_attention_scores(q, k, g, scale) if output_attentions else None)


def _attention_scores(q, k, g, scale):
    import torch

    with torch.no_grad():
        qh, kh = (x.transpose(1, 2).float() for x in (q, k))  # [B, H, T, K]
        A = qh @ kh.transpose(-1, -2) * (scale if scale is not None else q.shape[-1] ** -0.5)
        if g is None:
            return A.tril()
        G = g.transpose(1, 2).float().cumsum(-1)  # [B, H, T]
        return A * (G.unsqueeze(-1) - G.unsqueeze(-2)).tril().exp().tril()
