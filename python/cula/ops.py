"""Level 0: the raw ops, explicit about every option (SPEC §3).

Every function accepts torch tensors or numpy arrays and returns results of the same kind on
the same device. State layout is explicit: ``state_layout="k_last"`` ([.., HV, V, K], the RFC's
canonical layout) or ``"k_first"`` ([.., HV, K, V], FLA's default).
"""

from __future__ import annotations

import dataclasses
import os
from typing import NamedTuple

from . import _lib
from ._lib import CulaError
from .options import NAMES as OPTION_NAMES
from .options import Options
from ._tensor import as_array, call, dtype_name, empty_like_family, is_torch, stream_of

__all__ = [
    "chunk_fwd", "chunk_kda", "chunk_gdn", "chunk_gated_delta_rule", "chunk_gla", "chunk_simple_gla",
    "chunk_lightning", "decode", "chunk_bwd", "kda_gate", "cp_correct", "backend_for", "set_num_threads",
]


def _host_offsets(cu_seqlens):
    """The offsets of a host cu_seqlens as ints (None for device offsets, which stay unread)."""
    if cu_seqlens is None:
        return None
    if len(cu_seqlens.shape) != 1:
        raise CulaError(f"argument 'cu_seqlens': expected a 1-D tensor [N+1], got shape {list(cu_seqlens.shape)}")
    if is_torch(cu_seqlens):
        if cu_seqlens.device.type != "cpu":
            return None
        return [int(x) for x in cu_seqlens.tolist()]
    return [int(x) for x in cu_seqlens]


def _given(**tensors):
    """The arrays given (not None), each through as_array (the C ABI leaves the others NULL)."""
    return {n: as_array(x, n) for n, x in tensors.items() if x is not None}


def _state_shape(n, hv, k, v, layout):
    return (n, hv, v, k) if layout == "k_last" else (n, hv, k, v)


def _shape(x, name, ndim):
    if x is None:
        raise CulaError(f"argument '{name}': expected a tensor, got None")
    if len(x.shape) != ndim:
        raise CulaError(f"argument '{name}': expected a {ndim}-D tensor, got shape {list(x.shape)}")
    return tuple(x.shape)  # ints for numpy and torch alike


def _options(fn: str, options, kw: dict) -> Options:
    """The call's options: ``options`` (an Options, or None for the defaults) with the keyword
    options of the call on top; any other keyword is an error naming it."""
    unknown = sorted(set(kw) - set(OPTION_NAMES))
    if unknown:
        raise TypeError(f"{fn}() got unexpected keyword argument(s) {unknown}")
    if options is not None and not isinstance(options, Options):
        raise CulaError(f"argument 'options': expected a cula.Options or None, got {type(options).__name__}")
    return dataclasses.replace(options or Options(), **kw) if kw else (options or Options())


CHECK_DEVICE_INDICES = "CULA_CHECK_DEVICE_INDICES"


def _device_indices_to_check(state_indices, _entry):
    """With CULA_CHECK_DEVICE_INDICES set (not "0"), a host copy of device slot indices, which the
    caller validates as host indices are (slots in range, no slot named by two sequences), at the
    cost of one synchronisation; else None. Device indices are otherwise read by the kernels only."""
    if state_indices is None or _entry is not None or os.environ.get(CHECK_DEVICE_INDICES, "0") in ("", "0"):
        return None
    return state_indices.cpu() if is_torch(state_indices) and state_indices.device.type != "cpu" else None


def chunk_fwd(family, q, k, v, g=None, beta=None, decay=None, *, initial_state=None, output_final_state=False,
              A_log=None, dt_bias=None, cu_seqlens=None, state_pool=None, state_indices=None,
              return_intermediate_states=False, chunk_size=64, state_dtype=None, intermediate_dtype=None, out=None,
              final_state_out=None, intermediate_states_out=None, cu_seqlens_host=None, value_dim=None, segment_len=None,
              backend="auto", options=None, _entry=None, **option_kw):
    """Chunked forward of any family ("kda", "gdn", "gla", "simple_gla", "lightning").

    The options (cula.Options: scale, use_qk_l2norm_in_kernel, use_gate_in_kernel,
    use_beta_sigmoid_in_kernel, allow_neg_eigval, safe_gate, lower_bound, state_layout) come as
    keywords, or as one ``options`` object with keywords on top.

    Returns ``(o, final_state)`` or ``(o, final_state, intermediate_states)`` when
    ``return_intermediate_states``; final_state is None unless ``output_final_state`` (or a
    caller buffer ``final_state_out`` is given). ``out`` and ``intermediate_states_out`` are optional
    caller buffers for o and the intermediate states. With device ``cu_seqlens``, the intermediate
    states' count is taken from ``cu_seqlens_host`` (the same offsets on the host, FLA's
    cu_seqlens_cpu), or from a copy of cu_seqlens to the host (one synchronisation, as in FLA).
    With ``state_pool`` the initial states are read from ``state_pool[state_indices[n]]`` and the
    final states written back there in place (negative index: zero state, pool untouched).
    ``value_dim`` (at least v's V): the value size of o and the states, v holding the first columns of
    each value row and the rest read as zeros (a pass over zero-extended values without the copy).
    ``segment_len`` (a positive multiple of 64; dense calls): the tensor-core chunk engine runs each
    sequence as segments of that many tokens in parallel, joined by their state summaries (for few
    sequences and heads on long sequences; the result is the uncut call's within float32 rounding);
    the other backends compute the call uncut.
    """
    opts = _options("chunk_fwd", options, option_kw)
    host_slots = _device_indices_to_check(state_indices, _entry)
    if host_slots is not None:  # the host checks first (validated, not run)
        chunk_fwd(family, q, k, v, g, beta, decay, initial_state=initial_state, output_final_state=output_final_state,
                  A_log=A_log, dt_bias=dt_bias, cu_seqlens=cu_seqlens, state_pool=state_pool,
                  state_indices=host_slots, return_intermediate_states=return_intermediate_states,
                  chunk_size=chunk_size, state_dtype=state_dtype, intermediate_dtype=intermediate_dtype, out=out,
                  final_state_out=final_state_out, intermediate_states_out=intermediate_states_out,
                  cu_seqlens_host=cu_seqlens_host, value_dim=value_dim, segment_len=segment_len, backend=backend,
                  options=opts, _entry=_lib.LIB.cula_chunk_fwd_validate)
    state_layout = opts.state_layout
    arrays = _given(q=q, k=k, v=v, g=g, beta=beta, decay=decay, initial_state=initial_state, A_log=A_log,
                    dt_bias=dt_bias, cu_seqlens=cu_seqlens, state_pool=state_pool, state_indices=state_indices, out=out)
    q, k, v = arrays.get("q"), arrays.get("k"), arrays.get("v")
    B, T, H, K = _shape(q, "q", 4)
    _, _, HV, V = _shape(v, "v", 4)
    if value_dim is not None:
        if isinstance(value_dim, bool) or not isinstance(value_dim, int) or value_dim < V:
            raise CulaError(f"argument 'value_dim': expected an int at least v's V = {V}, got {value_dim!r}")
        V = value_dim
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or not 0 < chunk_size < 2 ** 31:
        raise CulaError(f"argument 'chunk_size': expected a positive 32-bit int, got {chunk_size!r}")
    cu = arrays.get("cu_seqlens")
    offsets = _host_offsets(cu)
    N = (len(offsets) - 1 if offsets is not None else int(cu.shape[0]) - 1) if cu is not None else B
    o = arrays["out"] if out is not None else empty_like_family(q, (B, T, HV, V))
    final = as_array(final_state_out, "final_state")
    if final is None and output_final_state and state_pool is None:
        sd = state_dtype or ("float32" if initial_state is None else dtype_name(arrays["initial_state"]))
        final = empty_like_family(q, _state_shape(max(N, 0), HV, K, V, state_layout), sd)
    inter = None
    if return_intermediate_states:
        if offsets is None and cu is not None:  # device offsets: their count from the host copy
            if cu_seqlens_host is None:
                cu_seqlens_host = cu.cpu()
            offsets = _host_offsets(cu_seqlens_host)
            if offsets is None:
                raise CulaError("argument 'cu_seqlens_host': expected a host tensor, got a device tensor")
        nt = sum((offsets[i + 1] - offsets[i] + chunk_size - 1) // chunk_size for i in range(N)) if offsets is not None \
            else (T + chunk_size - 1) // chunk_size
        b = 1 if offsets is not None else B
        idt = intermediate_dtype or ("bfloat16" if is_torch(q) else "float32")
        shape = (b, nt, HV, V, K) if state_layout == "k_last" else (b, nt, HV, K, V)
        inter = as_array(intermediate_states_out, "intermediate_states")
        if inter is None:
            inter = empty_like_family(q, shape, idt)
    opt = opts.pack(family, backend, stream_of(q))
    arrays["out"] = o
    if final is not None:
        arrays["final_state"] = final
    if inter is not None:
        arrays["intermediate_states"] = inter
    if cu_seqlens_host is not None:
        arrays["cu_seqlens_host"] = as_array(cu_seqlens_host, "cu_seqlens_host")
    extra = {"value_dim": value_dim} if value_dim is not None else {}
    if segment_len is not None:
        if isinstance(segment_len, bool) or not isinstance(segment_len, int):
            raise CulaError(f"argument 'segment_len': expected an int (0 or a positive multiple of 64), "
                            f"got {segment_len!r}")
        extra["segment_len"] = segment_len
    call(_lib.ChunkFwdArgs, _entry or _lib.LIB.cula_chunk_fwd, opt, arrays,
         fast=_entry is None and cu_seqlens_host is None and value_dim is None, chunk_size=chunk_size, **extra)
    if return_intermediate_states:
        return o, final, inter
    return o, final


def chunk_kda(q, k, v, g, beta, **kw):
    """KDA: per-channel gate g [B,T,HV,K], delta rule with beta [B,T,HV]. See chunk_fwd."""
    return chunk_fwd("kda", q, k, v, g, beta, **kw)


def chunk_gdn(q, k, v, g, beta, **kw):
    """Gated DeltaNet: scalar gate g [B,T,HV], delta rule with beta [B,T,HV]. See chunk_fwd."""
    return chunk_fwd("gdn", q, k, v, g, beta, **kw)


chunk_gated_delta_rule = chunk_gdn


def chunk_gla(q, k, v, g, **kw):
    """GLA: per-channel gate g [B,T,HV,K], no delta rule. See chunk_fwd."""
    return chunk_fwd("gla", q, k, v, g, **kw)


def chunk_simple_gla(q, k, v, g, **kw):
    """Simple GLA: scalar gate g [B,T,HV], no delta rule. See chunk_fwd."""
    return chunk_fwd("simple_gla", q, k, v, g, **kw)


def chunk_lightning(q, k, v, decay, **kw):
    """Lightning attention: constant per-head decay rate decay [H] or [HV] >= 0; the per-step
    log-decay is -decay[h] (MiniMax slope convention; FLA's g_gamma = -decay). See chunk_fwd."""
    return chunk_fwd("lightning", q, k, v, decay=decay, **kw)


def decode(q, k, v, state_pool, *, mode="kda", g=None, beta=None, decay=None, state_indices=None,
           num_accepted_tokens=None, A_log=None, dt_bias=None, out=None, final_state_out=None, backend="auto",
           options=None, _entry=None, **option_kw):
    """Decode T tokens per sequence (q [N,T,H,K]) against ``state_pool`` [P,HV,V,K], in place.

    ``state_indices`` [N] int32 maps sequence -> slot (negative = padding: output zeros, pool
    untouched); [N, T] int32 gives one slot per draft token for speculative decoding, with
    ``num_accepted_tokens`` [N] choosing the slot to start from (FLA fused_recurrent_kda).
    Returns ``(o, state_pool)``. Options as for chunk_fwd. ``final_state_out`` ([N] states of the
    pool's dtype and layout; no state_indices): the final states are written there and the pool is only read
    (FLA's fused_recurrent without in-place update); returns ``(o, final_state_out)`` then.
    """
    opts = _options("decode", options, option_kw)
    host_slots = _device_indices_to_check(state_indices, _entry)
    if host_slots is not None:  # the host checks first (validated, not run)
        decode(q, k, v, state_pool, mode=mode, g=g, beta=beta, decay=decay, state_indices=host_slots,
               num_accepted_tokens=num_accepted_tokens, A_log=A_log, dt_bias=dt_bias, out=out,
               final_state_out=final_state_out, backend=backend, options=opts, _entry=_lib.LIB.cula_decode_validate)
    arrays = _given(q=q, k=k, v=v, state_pool=state_pool, g=g, beta=beta, decay=decay, state_indices=state_indices,
                    num_accepted_tokens=num_accepted_tokens, A_log=A_log, dt_bias=dt_bias, out=out,
                    final_state_out=final_state_out)
    q = arrays.get("q")
    N, T, H, K = _shape(q, "q", 4)
    _, _, HV, V = _shape(arrays.get("v"), "v", 4)
    o = arrays["out"] if out is not None else empty_like_family(q, (N, T, HV, V))
    opt = opts.pack(mode, backend, stream_of(q))
    arrays["out"] = o
    call(_lib.DecodeArgs, _entry or _lib.LIB.cula_decode, opt, arrays, fast=_entry is None)
    return o, arrays.get("final_state_out" if final_state_out is not None else "state_pool")


def chunk_bwd(family, q, k, v, g, beta, d_out, *, decay=None, d_final_state=None, initial_state=None, A_log=None,
              dt_bias=None, cu_seqlens=None, backend="auto", grads=None, options=None, _entry=None, **option_kw):
    """Backward of every family: returns a dict with dq, dk, dv, dg (gated families), dbeta
    (delta families), dA_log and ddt_bias (gate in kernel, when given) and d_initial_state.
    Lightning takes its constant decay and has no decay gradient. Deterministic: the same call
    gives bitwise-identical gradients. grads: caller buffers by name (e.g. {"dq": t}) written in
    place of fresh ones. Options as for chunk_fwd."""
    opts = _options("chunk_bwd", options, option_kw)
    arrays = _given(q=q, k=k, v=v, g=g, beta=beta, d_out=d_out, d_final_state=d_final_state,
                    initial_state=initial_state, A_log=A_log, dt_bias=dt_bias, cu_seqlens=cu_seqlens, decay=decay)

    def like(name):
        x = arrays.get(name)
        if x is None:
            return None
        return empty_like_family(x, tuple(x.shape), "float32" if dtype_name(x) == "bfloat16" else None)

    given = dict(grads or {})
    names = {"dq": "q", "dk": "k", "dv": "v", "dg": "g", "dbeta": "beta", "dA_log": "A_log", "ddt_bias": "dt_bias",
             "d_initial_state": "initial_state"}
    unknown = sorted(set(given) - set(names))
    if unknown:
        raise CulaError(f"argument 'grads': expected names among {sorted(names)}, got {unknown}")
    grads = {n: (as_array(given[n], n) if n in given else like(src)) for n, src in names.items()}
    opt = opts.pack(family, backend, stream_of(arrays.get("q")))
    call(_lib.ChunkBwdArgs, _entry or _lib.LIB.cula_chunk_bwd, opt, {**arrays, **grads})
    return {n: x for n, x in grads.items() if x is not None}


def kda_gate(g, A_log=None, dt_bias=None, lower_bound=None, safe_gate=False, output_dtype="float32", backend="auto",
             _entry=None):
    """KDA gate activation (FLA fused_kda_gate): -exp(A_log) softplus(g + dt_bias), or with a lower
    bound lb * sigmoid(exp(A_log) (g + dt_bias)). g [B,T,HV,K]; returns an array shaped like g."""
    g, A_log, dt_bias = as_array(g, "g"), as_array(A_log, "A_log"), as_array(dt_bias, "dt_bias")
    _shape(g, "g", 4)
    if output_dtype not in ("float32", "bfloat16"):
        raise CulaError(f"argument 'output_dtype': expected 'float32' or 'bfloat16', got {output_dtype!r}")
    out = empty_like_family(g, tuple(g.shape), output_dtype)
    opt = Options(lower_bound=lower_bound, safe_gate=safe_gate).pack("kda", backend, stream_of(g))
    call(_lib.KdaGateArgs, _entry or _lib.LIB.cula_kda_gate, opt, {"g": g, "A_log": A_log, "dt_bias": dt_bias, "g_out": out})
    return out


def cp_correct(ow, state, o, backend="auto", _entry=None):
    """The carried-state correction of context parallelism, in one pass: o = round(ow[..., :V] +
    state[h] ow[..., V:]) per token and head. ow: the extended pass's float32 output [L, HV, V + K]
    (unit last stride; a view of a longer output is fine); state: [HV, V, K] float32, contiguous;
    o: [L, HV, V] (bfloat16, float16 or float32, unit last stride) written in place. On CUDA o is
    16-bit and the product one TF32 product (its error under o's rounding); the host rows sum in
    float64 and take a float32 o too."""
    ow, state, o = as_array(ow, "ow"), as_array(state, "state"), as_array(o, "o")
    opt = Options().pack("kda", backend, stream_of(ow))
    call(_lib.CpCorrectArgs, _entry or _lib.LIB.cula_cp_correct, opt, {"ow": ow, "state": state, "o": o})
    return o


def backend_for(op="chunk_fwd", device="cpu"):
    """Which kernel AUTO picks for an op on a device ("cpu" or "cuda[:i]"): e.g. "cpu", "cuda", "none"."""
    dev = str(device)
    dt = _lib.CUDA if dev.startswith("cuda") else _lib.CPU
    return _lib.LIB.cula_backend_for(op.encode(), dt, 0).decode()


class Explanation(NamedTuple):
    """The dispatch table's answer for one call: the kernel that would run it (as last_kernel()
    names it) and, for each row tried before it, why that row declines the call."""

    kernel: str
    declined: dict


def explain(op, *args, **kwargs) -> Explanation:
    """Which kernel would run ``op(*args, **kwargs)`` ("chunk_fwd", "decode", "chunk_bwd" or
    "kda_gate", with that op's arguments) and why the rows before it declined, without running it.
    The call is validated as the op validates it (same errors; a call no row takes raises the op's
    error); outputs are allocated but not written."""
    entries = {"chunk_fwd": (chunk_fwd, "cula_chunk_fwd_explain"), "decode": (decode, "cula_decode_explain"),
               "chunk_bwd": (chunk_bwd, "cula_chunk_bwd_explain"), "kda_gate": (kda_gate, "cula_kda_gate_explain"),
               "cp_correct": (cp_correct, "cula_cp_correct_explain")}
    if op not in entries:
        raise CulaError(f"argument 'op': expected one of {sorted(entries)}, got {op!r}")
    fn, entry = entries[op]
    fn(*args, _entry=getattr(_lib.LIB, entry), **kwargs)
    lines = _lib.LIB.cula_explained_declines().decode().splitlines()
    return Explanation(_lib.LIB.cula_explained_kernel().decode(), dict(line.split(": ", 1) for line in lines))


def last_kernel() -> str:
    """Name of the kernel that ran the last op call on this thread ("cuda_mma", "cuda", "cpu", ...)."""
    return _lib.LIB.cula_last_kernel().decode()


def set_num_threads(n: int) -> None:
    """Threads used by the CPU backend (0 = all cores)."""
    _lib.LIB.cula_set_num_threads(int(n))
