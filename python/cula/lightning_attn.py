"""FLA drop-in for Lightning attention:
``from cula.lightning_attn import chunk_lightning_attn, fused_recurrent_lightning_attn``."""

from __future__ import annotations

import functools

import numpy as np

from ._fla_common import fla_chunk_size
from ._front import _same_kind, chunk, compiling, reject_unknown
from ._tensor import is_torch

__all__ = ["chunk_lightning_attn", "fused_recurrent_lightning_attn", "lightning_decay"]


def _decay_rate(num_heads: int, layer_idx: int, num_layers: int) -> float:
    """FLA's per-layer slope factor: head h of the layer decays by h times this per token."""
    return 8 / num_heads * (1 - layer_idx / num_layers)


def lightning_decay(num_heads: int, layer_idx: int, num_layers: int, like=None):
    """FLA's per-head decay rate for a layer: (8 / H) (1 - layer_idx / num_layers) * h (cula's
    `decay`, i.e. -g_gamma)."""
    if like is not None and is_torch(like):
        if compiling():  # traced: torch ops in the graph instead of the host cache below
            import torch

            return torch.arange(num_heads, dtype=torch.float32, device=like.device) * _decay_rate(
                num_heads, layer_idx, num_layers)
        return _device_decay(num_heads, layer_idx, num_layers, like.device)  # cached: no host work per call
    return np.arange(num_heads, dtype=np.float32) * np.float32(_decay_rate(num_heads, layer_idx, num_layers))


@functools.lru_cache(maxsize=256)
def _device_decay(num_heads, layer_idx, num_layers, device):
    """The decay tensor of one layer on one device, made once: a host-to-device copy per call would
    cost a synchronisation and could not be captured in a CUDA graph."""
    import torch

    return torch.from_numpy(lightning_decay(num_heads, layer_idx, num_layers)).to(device)


def chunk_lightning_attn(q, k, v, layer_idx, num_layers, scale=None, initial_state=None, output_final_state=False,
                         cu_seqlens=None, **kwargs):
    """FLA ``chunk_lightning_attn``: K-first states [N, H, K, V]."""
    if "head_first" in kwargs:
        raise DeprecationWarning("head_first has been removed. Inputs must be in `[B, T, H, ...]` format.")
    chunk_size = fla_chunk_size("chunk_lightning_attn", kwargs.pop("chunk_size", None))
    reject_unknown("chunk_lightning_attn", kwargs)
    _same_kind(q)  # (q's heads size the decays)
    decay = lightning_decay(q.shape[2], layer_idx, num_layers, like=q)
    return chunk("lightning", q, k, v, decay=decay, initial_state=initial_state, scale=scale,
                 output_final_state=output_final_state, chunk_size=chunk_size, cu_seqlens=cu_seqlens,
                 state_layout="k_first")


def fused_recurrent_lightning_attn(q, k, v, layer_idx, num_layers, scale=None, initial_state=None,
                                   output_final_state=False, reverse=False, cu_seqlens=None):
    """FLA ``fused_recurrent_lightning_attn`` (decode and short sequences): K-first states
    [N, H, K, V]; the same function as chunk_lightning_attn. ``reverse`` is not supported."""
    if reverse:
        raise NotImplementedError("fused_recurrent_lightning_attn: reverse=True is not supported by cula")
    return chunk_lightning_attn(q, k, v, layer_idx, num_layers, scale=scale, initial_state=initial_state,
                                output_final_state=output_final_state, cu_seqlens=cu_seqlens)
