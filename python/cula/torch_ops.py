"""torch.library registrations: ``torch.ops.cula.decode``, ``torch.ops.cula.chunk_fwd`` and its
backward ``torch.ops.cula.chunk_bwd`` with fake (meta) implementations, and chunk_fwd's autograd
formula, so torch.compile(fullgraph=True) traces models that call cula (forward and backward)
without a graph break, and CUDA-graph capture sees plain kernel launches.

Importing this module registers the ops (it needs torch); ``cula.api`` uses them for torch
tensors.
"""

from __future__ import annotations

from typing import Optional

import torch

from . import ops

__all__ = ["decode", "chunk_fwd"]

# chunk_bwd's outputs, in order (an absent gradient is an empty tensor: custom ops return tensors)
_GRADS = ("dq", "dk", "dv", "dg", "dbeta", "dA_log", "ddt_bias", "d_initial_state")

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


@torch.library.custom_op("cula::chunk_bwd", mutates_args=())
def _chunk_bwd(family: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: Optional[torch.Tensor],
               beta: Optional[torch.Tensor], decay: Optional[torch.Tensor], initial_state: Optional[torch.Tensor],
               A_log: Optional[torch.Tensor], dt_bias: Optional[torch.Tensor], cu_seqlens: Optional[torch.Tensor],
               d_out: torch.Tensor, d_final_state: Optional[torch.Tensor], scale: Optional[float],
               use_qk_l2norm_in_kernel: bool, use_gate_in_kernel: bool, use_beta_sigmoid_in_kernel: bool,
               allow_neg_eigval: bool, safe_gate: bool, lower_bound: Optional[float],
               state_layout: str) -> list[torch.Tensor]:
    grads = ops.chunk_bwd(family, q, k, v, g, beta, d_out, decay=decay, d_final_state=d_final_state, scale=scale,
                          initial_state=initial_state, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
                          use_gate_in_kernel=use_gate_in_kernel, use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel,
                          allow_neg_eigval=allow_neg_eigval, safe_gate=safe_gate, lower_bound=lower_bound,
                          A_log=A_log, dt_bias=dt_bias, cu_seqlens=cu_seqlens, state_layout=state_layout)
    return [grads[n] if n in grads else q.new_empty(0, dtype=torch.float32) for n in _GRADS]


def _grad_like(x):
    """The gradient buffer chunk_bwd allocates for input x (float32 for bfloat16 inputs)."""
    if x is None:
        return None
    return x.new_empty(x.shape, dtype=torch.float32 if x.dtype == torch.bfloat16 else x.dtype)


@_chunk_bwd.register_fake
def _chunk_bwd_fake(family, q, k, v, g, beta, decay, initial_state, A_log, dt_bias, cu_seqlens, d_out, d_final_state,
                    scale, use_qk_l2norm_in_kernel, use_gate_in_kernel, use_beta_sigmoid_in_kernel, allow_neg_eigval,
                    safe_gate, lower_bound, state_layout):
    inputs = (q, k, v, g, beta, A_log, dt_bias, initial_state)
    return [_grad_like(x) if x is not None else q.new_empty(0, dtype=torch.float32) for x in inputs]


# chunk_fwd's inputs by position (its schema), and the gradient of each differentiable one
_FWD_ARGS = ("family", "q", "k", "v", "g", "beta", "decay", "initial_state", "A_log", "dt_bias", "cu_seqlens",
             "scale", "use_qk_l2norm_in_kernel", "use_gate_in_kernel", "use_beta_sigmoid_in_kernel",
             "allow_neg_eigval", "safe_gate", "lower_bound", "state_layout", "chunk_size", "output_final_state",
             "state_dtype")
_GRAD_OF = {"q": "dq", "k": "dk", "v": "dv", "g": "dg", "beta": "dbeta", "A_log": "dA_log", "dt_bias": "ddt_bias",
            "initial_state": "d_initial_state"}
_SAVED = ("q", "k", "v", "g", "beta", "decay", "initial_state", "A_log", "dt_bias", "cu_seqlens")


def _setup_context(ctx, inputs, output):
    args = dict(zip(_FWD_ARGS, inputs))
    ctx.save_for_backward(*(args[n] for n in _SAVED))
    ctx.options = {n: args[n] for n in ("family", "scale", "use_qk_l2norm_in_kernel", "use_gate_in_kernel",
                                        "use_beta_sigmoid_in_kernel", "allow_neg_eigval", "safe_gate", "lower_bound",
                                        "state_layout", "output_final_state")}


def _backward(ctx, d_out, d_final):
    saved = dict(zip(_SAVED, ctx.saved_tensors))
    o = ctx.options
    if d_final is not None and (not o["output_final_state"] or d_final.numel() == 0):
        d_final = None
    grads = torch.ops.cula.chunk_bwd(
        o["family"], saved["q"], saved["k"], saved["v"], saved["g"], saved["beta"], saved["decay"],
        saved["initial_state"], saved["A_log"], saved["dt_bias"], saved["cu_seqlens"], d_out.contiguous(),
        None if d_final is None else d_final.contiguous(), o["scale"], o["use_qk_l2norm_in_kernel"],
        o["use_gate_in_kernel"], o["use_beta_sigmoid_in_kernel"], o["allow_neg_eigval"], o["safe_gate"],
        o["lower_bound"], o["state_layout"])
    by_name = dict(zip(_GRADS, grads))
    out = []
    for i, n in enumerate(_FWD_ARGS):
        x = saved.get(n)
        if n not in _GRAD_OF or x is None or not ctx.needs_input_grad[i]:
            out.append(None)
        else:
            out.append(by_name[_GRAD_OF[n]].to(x.dtype))
    return tuple(out)


_chunk_fwd.register_autograd(_backward, setup_context=_setup_context)


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
