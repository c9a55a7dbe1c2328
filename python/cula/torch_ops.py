"""torch.library registrations: ``torch.ops.cula.decode`` and ``torch.ops.cula.chunk_fwd`` with
fake (meta) implementations, so torch.compile(fullgraph=True) traces models that call cula
without a graph break, and CUDA-graph capture sees plain kernel launches.

Importing this module registers the ops (it needs torch); ``cula.api`` uses them for torch
tensors.
"""

from __future__ import annotations

from typing import Optional

import torch

from . import ops

__all__ = ["decode", "chunk_fwd"]

_LAYOUTS = ("k_last", "k_first")


# (the family argument is not called "mode": torch's functionalization wrapper owns that name)
@torch.library.custom_op("cula::decode", mutates_args=("state_pool",))
def _decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, state_pool: torch.Tensor, g: Optional[torch.Tensor],
            beta: Optional[torch.Tensor], decay: Optional[torch.Tensor], state_indices: Optional[torch.Tensor],
            num_accepted_tokens: Optional[torch.Tensor], A_log: Optional[torch.Tensor],
            dt_bias: Optional[torch.Tensor], family: str, scale: Optional[float], use_qk_l2norm_in_kernel: bool,
            use_gate_in_kernel: bool, use_beta_sigmoid_in_kernel: bool, allow_neg_eigval: bool,
            lower_bound: Optional[float], state_layout: str) -> torch.Tensor:
    o, _ = ops.decode(q, k, v, state_pool, mode=family, g=g, beta=beta, decay=decay, state_indices=state_indices,
                      num_accepted_tokens=num_accepted_tokens, scale=scale,
                      use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, use_gate_in_kernel=use_gate_in_kernel,
                      use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel, allow_neg_eigval=allow_neg_eigval,
                      lower_bound=lower_bound, A_log=A_log, dt_bias=dt_bias, state_layout=state_layout)
    return o


@_decode.register_fake
def _decode_fake(q, k, v, state_pool, g, beta, decay, state_indices, num_accepted_tokens, A_log, dt_bias, family, scale,
                 use_qk_l2norm_in_kernel, use_gate_in_kernel, use_beta_sigmoid_in_kernel, allow_neg_eigval,
                 lower_bound, state_layout):
    return q.new_empty((q.shape[0], q.shape[1], v.shape[2], v.shape[3]))


@torch.library.custom_op("cula::chunk_fwd", mutates_args=())
def _chunk_fwd(family: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: Optional[torch.Tensor],
               beta: Optional[torch.Tensor], decay: Optional[torch.Tensor], initial_state: Optional[torch.Tensor],
               A_log: Optional[torch.Tensor], dt_bias: Optional[torch.Tensor], cu_seqlens: Optional[torch.Tensor],
               scale: Optional[float], use_qk_l2norm_in_kernel: bool, use_gate_in_kernel: bool,
               use_beta_sigmoid_in_kernel: bool, allow_neg_eigval: bool, safe_gate: bool,
               lower_bound: Optional[float], state_layout: str, chunk_size: int, output_final_state: bool,
               state_dtype: Optional[str]) -> tuple[torch.Tensor, torch.Tensor]:
    o, final = ops.chunk_fwd(family, q, k, v, g, beta, decay, initial_state=initial_state,
                             output_final_state=output_final_state, A_log=A_log, dt_bias=dt_bias,
                             cu_seqlens=cu_seqlens, scale=scale, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
                             use_gate_in_kernel=use_gate_in_kernel, use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel,
                             allow_neg_eigval=allow_neg_eigval, safe_gate=safe_gate, lower_bound=lower_bound,
                             state_layout=state_layout, chunk_size=chunk_size, state_dtype=state_dtype)
    # a custom op returns tensors only: no final state is an empty one (chunk_fwd below maps it to None)
    return o, final if final is not None else q.new_empty(0, dtype=torch.float32)


@_chunk_fwd.register_fake
def _chunk_fwd_fake(family, q, k, v, g, beta, decay, initial_state, A_log, dt_bias, cu_seqlens, scale,
                    use_qk_l2norm_in_kernel, use_gate_in_kernel, use_beta_sigmoid_in_kernel, allow_neg_eigval, safe_gate,
                    lower_bound, state_layout, chunk_size, output_final_state, state_dtype):
    o = q.new_empty(v.shape)  # q's dtype, as cula.ops.chunk_fwd allocates it
    if not output_final_state:
        return o, q.new_empty(0, dtype=torch.float32)
    dt = getattr(torch, state_dtype) if state_dtype else (
        initial_state.dtype if initial_state is not None else torch.float32)
    n = q.shape[0] if cu_seqlens is None else cu_seqlens.shape[0] - 1
    return o, q.new_empty(ops._state_shape(n, v.shape[2], q.shape[3], v.shape[3], state_layout), dtype=dt)


def decode(q, k, v, state_pool, *, mode="kda", g=None, beta=None, decay=None, state_indices=None,
           num_accepted_tokens=None, A_log=None, dt_bias=None, scale=None, use_qk_l2norm_in_kernel=False,
           use_gate_in_kernel=False, use_beta_sigmoid_in_kernel=False, allow_neg_eigval=False, lower_bound=None,
           state_layout="k_last"):
    """cula.ops.decode as a torch op (compile- and graph-friendly). Returns (o, state_pool)."""
    if state_layout not in _LAYOUTS:
        raise ops.CulaError(f"argument 'state_layout': expected 'k_last' or 'k_first', got {state_layout!r}")
    o = torch.ops.cula.decode(q, k, v, state_pool, g, beta, decay, state_indices, num_accepted_tokens, A_log, dt_bias,
                              mode, scale, use_qk_l2norm_in_kernel, use_gate_in_kernel, use_beta_sigmoid_in_kernel,
                              allow_neg_eigval, lower_bound, state_layout)
    return o, state_pool


def chunk_fwd(family, q, k, v, g=None, beta=None, decay=None, *, initial_state=None, A_log=None, dt_bias=None,
              cu_seqlens=None, scale=None, use_qk_l2norm_in_kernel=False, use_gate_in_kernel=False,
              use_beta_sigmoid_in_kernel=False, allow_neg_eigval=False, safe_gate=False, lower_bound=None,
              state_layout="k_last", chunk_size=64, output_final_state=True, state_dtype=None):
    """cula.ops.chunk_fwd as a torch op. Returns (o, final_state); final_state is None unless
    output_final_state."""
    if state_layout not in _LAYOUTS:
        raise ops.CulaError(f"argument 'state_layout': expected 'k_last' or 'k_first', got {state_layout!r}")
    o, final = torch.ops.cula.chunk_fwd(family, q, k, v, g, beta, decay, initial_state, A_log, dt_bias, cu_seqlens,
                                        scale, use_qk_l2norm_in_kernel, use_gate_in_kernel, use_beta_sigmoid_in_kernel,
                                        allow_neg_eigval, safe_gate, lower_bound, state_layout, chunk_size,
                                        output_final_state, state_dtype)
    return o, final if output_final_state else None
