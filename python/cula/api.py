"""Level 1 (the RFC's ``cula.api``): one function per family, dispatched by device.

Conventions: BSHD tensors; states in K-last layout ``[N, H, V, K]`` float32 (enforced);
``scale`` defaults to ``K ** -0.5``; ``cu_seqlens`` int32 or int64 (normalised to int32);
chunk bookkeeping is internal. ``**kwargs`` are forwarded to the backend, which rejects the
ones it does not know. ``backend_for(op, device)`` tells which kernel runs.
"""

from __future__ import annotations

from . import ops
from ._front import _same_kind, chunk, compiling, reject_unknown
from ._lib import CulaError, CulaUnsupportedError
from ._tensor import is_torch

__all__ = ["cula_kda", "cula_lightning", "cula_decode", "backend_for"]

# Level 1's ops and the library op that serves each. Which kernel runs is the library's dispatch
# table's answer (cula_backend_for), not a second table here.
_OPS = {"kda": "chunk_fwd", "lightning": "chunk_fwd", "decode": "decode"}


def _device_of(x, device):
    if device is not None:
        return str(device)
    if is_torch(x):
        return str(x.device)
    return "cpu"


def backend_for(op: str, device="cpu") -> str:
    """The backend the library's dispatch table puts first for Level 1's op ("kda", "lightning",
    "decode") on device; raises CulaUnsupportedError when no backend of this build runs it there."""
    if op not in _OPS:
        raise CulaError(f"argument 'op': expected one of {sorted(_OPS)}, got {op!r}")
    name = ops.backend_for(_OPS[op], str(device))
    if name == "none":
        on_cuda = str(device).startswith("cuda")
        raise CulaUnsupportedError(f"cula.api: no kernel in this build runs '{op}' on {device}"
                                   + ("; use CPU tensors (the CPU backend) for now" if on_cuda else ""))
    return name


def _require_backend(op: str, x, device) -> None:
    """Raises before any work when no backend of this build runs op on x's device; skipped while
    torch.compile traces the call (the op checks the call when it runs)."""
    if not compiling():
        backend_for(op, _device_of(x, device))


def _int32_offsets(cu_seqlens):
    if cu_seqlens is None:
        return None
    if is_torch(cu_seqlens):
        import torch

        return cu_seqlens.to(torch.int32) if cu_seqlens.dtype != torch.int32 else cu_seqlens
    import numpy as np

    return np.asarray(cu_seqlens).astype(np.int32)


def _arrays(fn, q, dims, **arrays):
    """Every array argument of q's kind (torch or numpy) and the ones named in dims of their number
    of dimensions (a tuple: any of them), before Level 1 reads their shapes; cu_seqlens, when given,
    one dimension."""
    _same_kind(q, **arrays)
    if arrays.get("cu_seqlens") is not None:
        dims = dict(dims, cu_seqlens=(arrays["cu_seqlens"], (1,), "[N + 1] offsets"))
    for name, (x, nd, what) in dims.items():
        if x is None or len(x.shape) not in nd:
            got = "None" if x is None else f"{len(x.shape)} dimensions {list(x.shape)}"
            raise CulaError(f"{fn}: argument '{name}': expected {what}, got {got}")


def _check_state(name, state, expect_shape):
    if state is None:
        return
    shape = tuple(int(s) for s in state.shape)
    dt = str(state.dtype).replace("torch.", "")
    if shape != tuple(expect_shape) or dt != "float32":
        raise CulaError(f"cula.api: argument '{name}': expected a float32 K-last state of shape "
                        f"{list(expect_shape)} [N, H, V, K], got {dt} of shape {list(shape)}")


_KDA_KW = {"A_log", "dt_bias", "use_beta_sigmoid_in_kernel", "allow_neg_eigval", "chunk_size"}


def cula_kda(q, k, v, g, beta, *, scale=None, initial_state=None, output_final_state=False,
             use_qk_l2norm_in_kernel=False, use_gate_in_kernel=False, cu_seqlens=None, safe_gate=False,
             lower_bound=None, disable_recompute=False, return_intermediate_states=False, device=None, **kwargs):
    """KDA (per-channel g [B, T, H, K]) or, with a scalar gate g [B, T, H], Gated DeltaNet.
    States: K-last [N, H, V, K] float32. Returns (o, final_state) or (o, final_state, h)."""
    extra = {n: kwargs.pop(n) for n in list(kwargs) if n in _KDA_KW}
    reject_unknown("cula_kda", kwargs)
    _require_backend("kda", q, device)
    del disable_recompute
    _arrays("cula_kda", q, dict(q=(q, (4,), "[B, T, H, K]"), k=(k, (4,), "[B, T, H, K]"), v=(v, (4,), "[B, T, HV, V]"),
                                g=(g, (3, 4), "[B, T, HV] or [B, T, HV, K]")),
            k=k, v=v, g=g, beta=beta, initial_state=initial_state, cu_seqlens=cu_seqlens)
    family = "gdn" if len(g.shape) == 3 else "kda"
    B, T, H, K = (int(s) for s in q.shape)
    HV, V = int(v.shape[2]), int(v.shape[3])
    n = B if cu_seqlens is None else int(cu_seqlens.shape[0]) - 1
    _check_state("initial_state", initial_state, (n, HV, V, K))
    return chunk(family, q, k, v, g, beta, initial_state=initial_state, scale=scale,
                 output_final_state=output_final_state, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
                 use_gate_in_kernel=use_gate_in_kernel, cu_seqlens=_int32_offsets(cu_seqlens), safe_gate=safe_gate,
                 lower_bound=lower_bound, return_intermediate_states=return_intermediate_states,
                 state_layout="k_last", state_dtype="float32", **extra)


def cula_lightning(Q, K, V, decay, *, scale=None, initial_state=None, output_final_state=False, cu_seqlens=None,
                   state_pool=None, initial_state_indices=None, chunk_size=64, device=None, **kwargs):
    """Lightning attention with per-head decay rate decay [H] (per-step factor exp(-decay)).
    With ``state_pool`` [P, H, V, K] and ``initial_state_indices`` [N] int32 the states are read
    from and written back to the pool in place, and the pool is returned as the final state."""
    reject_unknown("cula_lightning", kwargs)
    _require_backend("lightning", Q, device)
    _arrays("cula_lightning", Q, dict(Q=(Q, (4,), "[B, T, H, K]"), K=(K, (4,), "[B, T, H, K]"),
                                      V=(V, (4,), "[B, T, H, V]")) | (
                {} if state_pool is None else dict(state_pool=(state_pool, (4,), "[P, H, V, K]"))),
            K=K, V=V, decay=decay, initial_state=initial_state, cu_seqlens=cu_seqlens, state_pool=state_pool,
            initial_state_indices=initial_state_indices)
    B, T, H, Kd = (int(s) for s in Q.shape)
    HV, Vd = int(V.shape[2]), int(V.shape[3])
    n = B if cu_seqlens is None else int(cu_seqlens.shape[0]) - 1
    _check_state("initial_state", initial_state, (n, HV, Vd, Kd))
    if state_pool is not None:
        if initial_state is not None:
            raise CulaError("cula_lightning: argument 'initial_state': expected None when state_pool is given")
        _check_state("state_pool", state_pool, (int(state_pool.shape[0]), HV, Vd, Kd))
        o, _ = ops.chunk_fwd("lightning", Q, K, V, decay=decay, scale=scale, cu_seqlens=_int32_offsets(cu_seqlens),
                             state_pool=state_pool, state_indices=initial_state_indices, chunk_size=chunk_size,
                             state_layout="k_last")
        return o, state_pool
    return chunk("lightning", Q, K, V, decay=decay, initial_state=initial_state, scale=scale,
                 output_final_state=output_final_state, cu_seqlens=_int32_offsets(cu_seqlens), chunk_size=chunk_size,
                 state_layout="k_last", state_dtype="float32")


_DECODE_ARRAYS = {"g", "beta", "decay", "A_log", "dt_bias", "num_accepted_tokens", "out"}
_DECODE_KW = _DECODE_ARRAYS | {"lower_bound", "use_qk_l2norm_in_kernel", "use_gate_in_kernel", "use_beta_sigmoid_in_kernel",
                               "allow_neg_eigval"}


def cula_decode(q, k, v, state, *, mode="kda", state_indices=None, scale=None, device=None, **kwargs):
    """One decode step (or a few draft tokens) against a state pool [P, H, V, K] updated in place.
    q, k: [N, T, H, K] or [1, N, H, K] (one token per sequence, packed); mode "kda", "gdn" or
    "lightning". Returns (o shaped like v, state)."""
    extra = {n: kwargs.pop(n) for n in list(kwargs) if n in _DECODE_KW}
    reject_unknown("cula_decode", kwargs)
    if mode not in ("kda", "gdn", "lightning"):
        raise CulaError(f"cula_decode: argument 'mode': expected 'kda', 'gdn' or 'lightning', got {mode!r}")
    _require_backend("decode", q, device)
    _arrays("cula_decode", q, dict(q=(q, (4,), "[N, T, H, K] or [1, N, H, K]"), v=(v, (4,), "[N, T, HV, V]")),
            k=k, v=v, state=state, state_indices=state_indices, **{n: x for n, x in extra.items() if n in _DECODE_ARRAYS})
    packed = int(q.shape[0]) == 1 and int(q.shape[1]) > 1 and state_indices is not None \
        and len(state_indices.shape) == 1 and int(state_indices.shape[0]) == int(q.shape[1])
    if packed:  # [1, N, ...] -> [N, 1, ...]
        sw = lambda x: None if x is None else x.reshape(x.shape[1], 1, *x.shape[2:])  # noqa: E731
        q, k, vv = sw(q), sw(k), sw(v)
        for n in ("g", "beta"):
            if extra.get(n) is not None:
                extra[n] = sw(extra[n])
    else:
        vv = v
    if is_torch(q) and extra.get("out") is None:
        from . import torch_ops  # a registered torch op: traceable by torch.compile

        extra.pop("out", None)
        o, state = torch_ops.decode(q, k, vv, state, mode=mode, state_indices=state_indices, scale=scale,
                                    state_layout="k_last", **extra)
    else:
        o, state = ops.decode(q, k, vv, state, mode=mode, state_indices=state_indices, scale=scale,
                              state_layout="k_last", **extra)
    return o.reshape(v.shape), state
