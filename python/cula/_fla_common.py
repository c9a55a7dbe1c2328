"""Helpers shared by the FLA drop-in modules."""

from __future__ import annotations

import warnings

import numpy as np

from . import ops
from ._front import chunk, reject_unknown
from ._lib import CulaError
from ._tensor import is_torch


def resolve_state_layout(fn_name: str, state_v_first: bool, kwargs: dict) -> bool:
    """FLA's deprecated alias ``transpose_state_layout`` for ``state_v_first``."""
    if "transpose_state_layout" in kwargs:
        if state_v_first:
            raise ValueError("Cannot pass both `state_v_first` and the deprecated `transpose_state_layout`.")
        warnings.warn("`transpose_state_layout` is deprecated and renamed to `state_v_first`.", DeprecationWarning,
                      stacklevel=3)
        state_v_first = kwargs.pop("transpose_state_layout")
    return bool(state_v_first)


def offsets_for(q, cu_seqlens, cu_seqlens_cpu):
    """FLA takes the offsets on q's device (cu_seqlens) and, optionally, the same offsets on the host
    (cu_seqlens_cpu). The kernels read them where q lives: the CUDA kernels take no host offsets."""
    if cu_seqlens is None or cu_seqlens_cpu is None:
        return cu_seqlens if cu_seqlens is not None else cu_seqlens_cpu
    return cu_seqlens if is_torch(q) and q.is_cuda else cu_seqlens_cpu


def gate_param(x):
    """A_log / dt_bias as the kernels take them, flat: FLA accepts any shape holding HV (A_log) or HV
    or HV * K (dt_bias) values ([1, 1, HV, 1], [HV, K], ...); a contiguous tensor is reshaped in place
    (no copy), another copied once. The count is checked by the op."""
    if x is None or not is_torch(x):
        return x if x is None else np.ascontiguousarray(x).reshape(-1)
    return x.contiguous().reshape(-1)


# FLA's chunk_size rules per drop-in: the accepted values, and its ValueError's message
_CHUNK_SIZES = {
    "chunk_kda": ((32, 64), "`chunk_size` must be either 32 or 64 for KDA, got {}."),
    "chunk_gated_delta_rule": ((16, 32, 64), "`chunk_size` must be 16, 32, or 64 for Gated Delta Rule, got {}."),
    "chunk_delta_rule": ((16, 32, 64), "`chunk_size` must be 16, 32, or 64, got {}."),
}


def fla_chunk_size(fn_name: str, chunk_size, return_intermediate_states: bool = False) -> int:
    """The chunk length a drop-in passes on, after FLA's check of its ``chunk_size`` keyword (the same
    ValueError for the values FLA refuses: 32 or 64 for KDA, 16, 32 or 64 for GDN, a power of 2 for
    simple GLA and Lightning). The function computed does not depend on it, so every accepted value
    runs the engines' 64-token chunks; only the intermediate states (one per chunk) follow it."""
    whole = isinstance(chunk_size, (int, np.integer)) and not isinstance(chunk_size, bool)
    if fn_name in _CHUNK_SIZES:
        allowed, msg = _CHUNK_SIZES[fn_name]
        if not whole or chunk_size not in allowed:
            raise ValueError(msg.format(chunk_size))
    elif chunk_size is not None and (not whole or chunk_size != 2 ** (int(chunk_size).bit_length() - 1)):
        raise ValueError(f"`chunk_size` must be a power of 2, got {chunk_size}.")
    return int(chunk_size) if return_intermediate_states and chunk_size is not None else 64


def contiguous(x):
    """x itself when contiguous (or not a torch tensor), else a contiguous copy: FLA's input_guard,
    for the arguments cula's CUDA kernels read without strides (parameters, decode inputs)."""
    return x.contiguous() if x is not None and is_torch(x) else x


def float32_or_64(*xs):
    """The dtype, of xs[0]'s kind (torch or numpy), of what a drop-in makes from xs: float64 when any
    of them is float64 (a float64 call stays on the float64 reference), else float32."""
    wide = any(str(x.dtype) in ("torch.float64", "float64") for x in xs)
    if is_torch(xs[0]):
        import torch

        return torch.float64 if wide else torch.float32
    return np.float64 if wide else np.float32


def _filled(like, like_name, value: float, dims: int):
    """A tensor of ``value`` (float32_or_64) shaped like the first dims dimensions of the argument
    like_name, on its device and of its kind."""
    if like is None:
        raise CulaError(f"argument '{like_name}': expected a tensor, got None")
    shape = tuple(like.shape[:dims])
    if is_torch(like):
        import torch

        return torch.full(shape, value, dtype=float32_or_64(like), device=like.device)
    return np.full(shape, value, float32_or_64(like))


def per_token_head(v, value: float):
    """[B, T, HV] of ``value`` shaped after v [B, T, HV, V]: FLA's defaults for an omitted gate or beta."""
    return _filled(v, "v", value, 3)


def zero_gate(k):
    """A zero log-gate shaped like k [B, T, H, K] (FLA's omitted per-key gate: no decay)."""
    return _filled(k, "k", 0.0, 4)


def unsupported(fn_name: str, use_graph=False, max_num_seqs=None) -> None:
    if use_graph or max_num_seqs is not None:
        raise NotImplementedError(f"{fn_name}: use_graph/max_num_seqs (FLA's padded graph mode) are not supported by "
                                  f"cula; cula's decode kernels capture into CUDA graphs as they are")


def recurrent_dropin(fn_name, family, q, k, v, g, beta, *, A_log, dt_bias, scale, initial_state, output_final_state,
                     use_qk_l2norm_in_kernel, use_gate_in_kernel, use_beta_sigmoid_in_kernel, allow_neg_eigval,
                     lower_bound, state_v_first, cu_seqlens, kwargs):
    """FLA fused_recurrent_* semantics on cula: a fresh final state by default; with
    ``ssm_state_indices``/``inplace_final_state`` the initial_state is a pool updated in place."""
    idx = kwargs.pop("ssm_state_indices", None)
    acc = kwargs.pop("num_accepted_tokens", None)
    inplace = kwargs.pop("inplace_final_state", idx is not None)
    out = kwargs.pop("out", None)
    reject_unknown(fn_name, kwargs)
    if allow_neg_eigval and not use_beta_sigmoid_in_kernel:
        raise ValueError("`allow_neg_eigval=True` requires `use_beta_sigmoid_in_kernel=True`.")
    layout = "k_last" if state_v_first else "k_first"
    common = dict(scale=scale, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, use_gate_in_kernel=use_gate_in_kernel,
                  use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel, allow_neg_eigval=allow_neg_eigval,
                  lower_bound=lower_bound, A_log=gate_param(A_log), dt_bias=gate_param(dt_bias), state_layout=layout)
    if inplace or idx is not None:
        if initial_state is None:
            raise ValueError(f"{fn_name}: in-place state updates need initial_state (the state pool)")
        # Decode: one sequence per row. Varlen with one token per sequence is the serving layout.
        if cu_seqlens is not None:
            if q.shape[0] != 1:
                raise ValueError(f"{fn_name}: batch size 1 expected with cu_seqlens")
            n = int(cu_seqlens.shape[0]) - 1
            if q.shape[1] % max(n, 1) != 0:
                raise NotImplementedError(f"{fn_name}: in-place decode needs the same number of tokens per sequence")
            t = q.shape[1] // max(n, 1)
            # Host offsets are checked; device offsets are taken to be the serving layout (t tokens
            # each) without a host synchronisation.
            offsets = ops._host_offsets(cu_seqlens)
            if offsets is not None and offsets != [i * t for i in range(n + 1)]:
                raise NotImplementedError(f"{fn_name}: in-place decode needs the same number of tokens per sequence, "
                                          f"got cu_seqlens {offsets}")
            split = lambda x: x.reshape(n, t, *x.shape[2:])  # noqa: E731
        else:
            split = lambda x: x  # noqa: E731

        def dense(x):
            # FLA's fused_recurrent functions make their inputs contiguous (input_guard), and the CUDA
            # decode kernel reads them so: q, k, v out of a fused projection come as strided views.
            return None if x is None else contiguous(split(x))

        if idx is not None and is_torch(idx):
            import torch

            idx = idx if idx.dtype == torch.int32 else idx.to(torch.int32)
        if is_torch(q) and out is None:  # the registered op: traceable by torch.compile
            from . import torch_ops

            o, _ = torch_ops.decode(dense(q), dense(k), dense(v), initial_state, mode=family, g=dense(g),
                                    beta=dense(beta), state_indices=idx, num_accepted_tokens=acc, **common)
        else:
            o, _ = ops.decode(dense(q), dense(k), dense(v), initial_state, mode=family, g=dense(g), beta=dense(beta),
                              state_indices=idx, num_accepted_tokens=acc, out=split(out) if out is not None else None,
                              **common)
        return o.reshape(v.shape), initial_state
    if _decode_serves(q, k, v, g, beta, initial_state, cu_seqlens, common):
        # a few tokens per sequence with its state: the decode kernel reads initial_state and writes
        # the final states fresh (no chunk engine for a handful of tokens, no copy of the states)
        from . import torch_ops

        o, final = torch_ops.decode_to(contiguous(q), contiguous(k), contiguous(v), initial_state, mode=family,
                                       g=None if g is None else contiguous(g),
                                       beta=None if beta is None else contiguous(beta), **common)
        return o, (final if output_final_state else None)
    return chunk(family, q, k, v, g, beta, initial_state=initial_state, output_final_state=output_final_state,
                 cu_seqlens=cu_seqlens, **common, **_float32_arithmetic(q, v))


def _float32_arithmetic(q, v) -> dict:
    """FLA's fused_recurrent kernels compute float32 inputs in float32, and its tests hold them to
    2e-3 of a float32 reference: float32 q and v on CUDA run on cula's float32 recurrent kernel
    (backend "cuda_fp32"), not through the tensor-core engines' bf16 copy (~4e-3)."""
    if not (is_torch(q) and q.is_cuda):
        return {}
    import torch

    return {"backend": "cuda_fp32"} if q.dtype == torch.float32 and v.dtype == torch.float32 else {}


DECODE_MAX_TOKENS = 16  # fused_recurrent calls with at most this many tokens per sequence run on the decode kernel


def _decode_serves(q, k, v, g, beta, initial_state, cu_seqlens, common) -> bool:
    """Whether a fused_recurrent call without in-place update goes to the decode kernel: CUDA tensors,
    dense rows of at most DECODE_MAX_TOKENS tokens, a float32 state per row, a head size the decode
    kernel takes, and no gradient wanted (the chunked path carries autograd)."""
    if cu_seqlens is not None or initial_state is None or not is_torch(q) or q.device.type != "cuda":
        return False
    import torch

    if q.dim() != 4 or q.shape[1] > DECODE_MAX_TOKENS or q.shape[-1] not in (64, 128, 256):
        return False
    if not is_torch(initial_state) or initial_state.dtype != torch.float32 or initial_state.device != q.device:
        return False
    if initial_state.dim() != 4 or initial_state.shape[0] != q.shape[0] or not initial_state.is_contiguous():
        return False
    if torch.is_grad_enabled():
        params = (q, k, v, g, beta, initial_state, common.get("A_log"), common.get("dt_bias"))
        if any(is_torch(x) and x.requires_grad for x in params):
            return False
    return True
