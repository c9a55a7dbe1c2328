"""Shared machinery of the PyTorch-facing layers (FLA drop-ins, Level 1): autograd wiring and
keyword-argument discipline. Every path ends in cula.ops (Level 0), i.e. the C ABI."""

from __future__ import annotations

import sys

from . import ops
from ._lib import CulaError, CulaUnsupportedError
from ._tensor import is_torch
from .options import NAMES as OPTION_NAMES

_DIFF_NAMES = ("q", "k", "v", "g", "beta", "A_log", "dt_bias", "initial_state")
# the gradient of each differentiable input (the names cula.ops.chunk_bwd returns them under)
GRAD_OF = {"q": "dq", "k": "dk", "v": "dv", "g": "dg", "beta": "dbeta", "A_log": "dA_log", "dt_bias": "ddt_bias",
           "initial_state": "d_initial_state"}


def reject_unknown(fn_name: str, kwargs: dict) -> None:
    if kwargs:
        raise TypeError(f"{fn_name}: unexpected keyword argument(s) {sorted(kwargs)}; cula does not silently ignore "
                        f"arguments it cannot honour")


def _needs_grad(*tensors) -> bool:
    torch = sys.modules.get("torch")  # no torch imported: no torch tensors
    if torch is None or not torch.is_grad_enabled():
        return False
    return any(t is not None and is_torch(t) and t.requires_grad for t in tensors)


# The options the registered op cula::chunk_fwd takes (torch_ops.chunk_fwd); a call with others
# (intermediate states, state pools, caller buffers) runs eagerly through cula.ops.
_OP_OPTIONS = frozenset({*OPTION_NAMES, "cu_seqlens", "chunk_size", "output_final_state", "state_dtype", "backend"})
# the backends a call may name through the registered op (the float32 CUDA rows, which FLA's
# fused_recurrent drop-ins take for float32 inputs, traced by torch.compile like AUTO)
_OP_BACKENDS = ("auto", "cuda_fp32")


def _through_op(q, opts) -> bool:
    """Torch tensors go through the registered op (traceable by torch.compile, one node in a graph)."""
    if not is_torch(q):
        return False
    if opts.get("return_intermediate_states") or opts.get("backend", "auto") not in _OP_BACKENDS:
        return False
    return all(n in _OP_OPTIONS or n == "return_intermediate_states" for n in opts)


def compiling() -> bool:
    """Whether torch.compile is tracing this call (host-side checks that call the C ABI are skipped
    then: the op checks the call when it runs)."""
    torch = sys.modules.get("torch")
    return torch is not None and torch.compiler.is_compiling()


def _widen_half_state(state):
    """A float16 initial state is read as float32, as FLA's kernels read it (its final state is float32
    either way); the conversion is differentiable, so its gradient comes back in float16. The kernels
    keep states in float32 or bfloat16."""
    if state is None or str(getattr(state, "dtype", "")) not in ("torch.float16", "float16"):
        return state
    return state.float() if is_torch(state) else state.astype("float32")


def _same_kind(q, **arrays):
    """Every array argument of q's kind (torch tensors with torch q, numpy arrays with numpy q): a
    number or a numpy array beside torch tensors would otherwise fail deep in the call, or not at all."""
    torch_q = is_torch(q)
    if not torch_q and not hasattr(q, "__array_interface__"):
        raise CulaError(f"argument 'q': expected a torch tensor or a numpy array, got {type(q).__name__}")
    for name, x in arrays.items():
        if x is not None and (is_torch(x) != torch_q or (not torch_q and not hasattr(x, "__array_interface__"))):
            raise CulaError(f"argument '{name}': expected a {'torch tensor' if torch_q else 'numpy array'} as q is, "
                            f"got {type(x).__name__}")


def chunk(family: str, q, k, v, g=None, beta=None, decay=None, *, A_log=None, dt_bias=None, initial_state=None,
          **opts):
    """chunk_fwd with autograd when any torch input requires grad (backward: cula.ops.chunk_bwd).
    Torch tensors go through torch_ops.chunk_fwd: the registered op cula::chunk_fwd, whose autograd
    formula calls cula::chunk_bwd, while torch.compile traces (forward and backward); eagerly the same
    formula without the op's dispatch."""
    _same_kind(q, k=k, v=v, g=g, beta=beta, decay=decay, A_log=A_log, dt_bias=dt_bias, initial_state=initial_state)
    initial_state = _widen_half_state(initial_state)
    if _fit_needed(q, v, opts):
        return _fit_head_size(family, q, k, v, g, beta, decay, A_log, dt_bias, initial_state, opts)
    seg_len = _segment_len(family, q, k, v, g, beta, A_log, dt_bias, initial_state, opts)
    if seg_len:
        from . import _segments

        rest = {n: x for n, x in opts.items() if n != "return_intermediate_states"}
        return _segments.forward(family, q, k, v, g, beta, decay, seg_len=seg_len, A_log=A_log, dt_bias=dt_bias,
                                 initial_state=initial_state, **rest)
    if _through_op(q, opts):
        from . import torch_ops

        opts = {n: x for n, x in opts.items() if n in _OP_OPTIONS}
        return torch_ops.chunk_fwd(family, q, k, v, g, beta, decay, A_log=A_log, dt_bias=dt_bias,
                                   initial_state=initial_state, **opts)
    if not _needs_grad(q, k, v, g, beta, A_log, dt_bias, initial_state):
        return ops.chunk_fwd(family, q, k, v, g, beta, decay, A_log=A_log, dt_bias=dt_bias,
                             initial_state=initial_state, **opts)
    inputs = dict(q=q, k=k, v=v, g=g, beta=beta, A_log=A_log, dt_bias=dt_bias, initial_state=initial_state)
    if decay is not None:
        opts = {**opts, "decay": decay}  # a constant of Lightning: no gradient
    if opts.get("return_intermediate_states"):
        raise CulaError("argument 'return_intermediate_states': expected False when gradients are required, got True")
    if opts.get("state_pool") is not None:
        raise CulaError("argument 'state_pool': expected None when gradients are required (in-place pool updates "
                        "are not differentiable)")
    return _ChunkFn.apply(family, opts, *(inputs[n] for n in _DIFF_NAMES))


def _segment_len(family, q, k, v, g, beta, A_log, dt_bias, initial_state, opts):
    """The segment length a call runs in parallel segments with (_segments), or None: torch
    tensors, no gradient, no intermediate states or caller buffers, not while torch.compile traces.
    CULA_SEGMENT_TOKENS=L asks for segments of L tokens, =0 for none; unset, the planner
    (_segments.plan) cuts dense bf16 KDA, GDN and GLA calls on CUDA whose few sequences and heads
    leave most SMs idle (GLA not while a CUDA graph is captured)."""
    from . import _segments

    seg_len = _segments.segment_tokens()
    if seg_len == 0 or not is_torch(q) or compiling():
        return None
    if seg_len is None:
        seg_len = _planned_segment_len(family, q, k, v, opts)
        if seg_len is None:
            return None
    if opts.get("return_intermediate_states") or any(opts.get(n) is not None for n in _CALLER_BUFFERS):
        return None
    return None if _needs_grad(q, k, v, g, beta, A_log, dt_bias, initial_state) else seg_len


def _planned_segment_len(family, q, k, v, opts):
    from . import _segments

    # (the cheapest tests first: every CUDA chunk call passes here)
    if q.dim() != 4 or q.shape[1] < _segments.PLAN_MIN_TOKENS or family not in _segments.PLAN_FAMILIES:
        return None
    if not q.is_cuda or v.dim() != 4 or opts.get("cu_seqlens") is not None or opts.get("backend", "auto") != "auto":
        return None
    B, T, _, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    if V % _V_MULTIPLE or K not in _CUDA_HEAD_SIZES:
        return None
    if any(str(x.dtype) != "torch.bfloat16" for x in (q, k, v)):  # (measured on bf16)
        return None
    import torch

    if family not in _segments.ENGINE_FAMILIES and torch.cuda.is_current_stream_capturing():
        return None  # (the two-call cut copies host-made indices; the engine's own segments need none)
    sms = torch.cuda.get_device_properties(q.device).multi_processor_count
    return _segments.plan(int(B), int(T), int(HV), int(K), int(V), sms, delta=family in _DELTA_RULE)


# The key head sizes (K) the CUDA kernels are built for. Another K runs zero-padded to the next one:
# exact, since padded key channels add nothing to q.k and their state rows stay zero whatever their
# gate (a zero log-gate, or a raw gate of zero activated with zero dt_bias: finite either way, and
# the chunked kernels floor the log-decay, so no zero is scaled by an overflowing exponential). For the
# families without the delta rule, whose state rows are independent, a K over 256 runs as slices
# of at most 256 whose outputs add (_key_slice). Value columns
# are independent in every family: calls whose V is not a multiple of 64 (which the
# tensor-core engines' column slices need) run with V zero-padded to one, instead of on the
# recurrent kernel.
_CUDA_HEAD_SIZES = (64, 128, 256)
_V_MULTIPLE = 64
_KEY_GATED = ("kda", "gla")  # the families whose gate has a K axis
_DELTA_RULE = ("kda", "gdn")
# Simple GLA and Lightning (the fused engine) run a K over 256 as slices of 256 that are heads of
# one call (_key_slices_as_heads), not one call per slice.
_FUSED = ("simple_gla", "lightning")
_CALLER_BUFFERS = ("state_pool", "out", "final_state_out", "intermediate_states_out")
# The input types the tensor-core engines take (bf16 and fp16 as they are, float32 through a bf16
# copy: chunk::EngineInputs).
_ENGINE_DTYPES = ("torch.bfloat16", "torch.float16", "torch.float32")


def _padded_v(q, V: int) -> int:
    """The value head size a call runs with: V, or for the engines' input types the next multiple of 64."""
    if V % _V_MULTIPLE and str(q.dtype) in _ENGINE_DTYPES:
        return (V + _V_MULTIPLE - 1) // _V_MULTIPLE * _V_MULTIPLE
    return V


def _fit_needed(q, v, opts) -> bool:
    """A CUDA call with a K the kernels are not built for, or a call whose V the tensor-core engines
    do not take, and no caller buffer (those are written in place, at the caller's sizes: the op's
    error names the head sizes then)."""
    if not (is_torch(q) and q.is_cuda and len(q.shape) == 4 and len(v.shape) == 4 and q.shape[-1] > 0
            and all(opts.get(n) is None for n in _CALLER_BUFFERS)):
        return False
    K = q.shape[-1]
    return K not in _CUDA_HEAD_SIZES or _padded_v(q, v.shape[-1]) != v.shape[-1]


def _key_slice(family, q) -> int:
    """The widest K slice a call runs in: the largest head size the CUDA kernels take (every engine
    takes K = 256)."""
    return _CUDA_HEAD_SIZES[-1]


def _pad_to(x, axis, width):
    """x zero-padded along axis to width (contiguous: the kernels read states dense)."""
    if x is None:
        return None
    n = x.shape[axis]
    if n == width:
        return x.contiguous()
    import torch.nn.functional as F

    return F.pad(x, [0, 0] * (-axis - 1) + [0, width - n])


def _fit_head_size(family, q, k, v, g, beta, decay, A_log, dt_bias, initial_state, opts):
    """chunk() of a call whose head sizes the CUDA kernels do not take, through zero-padded K slices
    and zero-padded value columns (above). The padding and slicing are torch ops, so autograd and
    torch.compile see through them."""
    import torch

    K, V = q.shape[-1], v.shape[-1]
    if K > _CUDA_HEAD_SIZES[-1] and family in _DELTA_RULE:
        raise CulaUnsupportedError(f"chunk_fwd: the CUDA kernels take K up to {_CUDA_HEAD_SIZES[-1]} with the delta "
                                   f"rule (family {family!r}), got K = {K}; use host tensors (the CPU backend)")
    opts = dict(opts)
    if opts.get("scale") is None:
        opts["scale"] = K ** -0.5  # the caller's K, not the padded one
    k_last = opts.get("state_layout", "k_last") == "k_last"
    k_axis, v_axis = (-1, -2) if k_last else (-2, -1)
    Vp = _padded_v(q, V)
    v, initial_state = _pad_to(v, -1, Vp), _pad_to(initial_state, v_axis, Vp)
    step = _key_slice(family, q)
    if (family in _FUSED and K > step and A_log is None and dt_bias is None
            and not opts.get("return_intermediate_states")):
        return _key_slices_as_heads(family, q, k, v, g, decay, initial_state, opts, step, Vp, k_axis)
    spans = [(lo, min(step, K - lo)) for lo in range(0, K, step)]  # (first key, keys) of each slice
    keyed = family in _KEY_GATED
    pieces = []
    for lo, n in spans:
        width = next(w for w in _CUDA_HEAD_SIZES if w >= n)

        def cut(x, axis=-1):
            return None if x is None else _pad_to(x.narrow(axis, lo, n) if n != K else x, axis, width)

        bias = dt_bias
        if keyed and dt_bias is not None and dt_bias.numel() == v.shape[2] * K:  # per key (else per head)
            bias = cut(dt_bias.reshape(-1, K)).reshape(-1)
        pieces.append(chunk(family, cut(q), cut(k), v, cut(g) if keyed else g, beta, decay, A_log=A_log,
                            dt_bias=bias, initial_state=cut(initial_state, k_axis), **opts))
    o = pieces[0][0]
    if len(pieces) > 1:  # the slices' outputs add, in float32 at least
        acc = torch.promote_types(o.dtype, torch.float32)
        o = sum(p[0].to(acc) for p in pieces).to(o.dtype)
    o = o.narrow(-1, 0, V).contiguous() if Vp != V else o

    def join(i):  # states: each slice's K rows and the caller's V columns, without the padding
        if pieces[0][i] is None:
            return None
        parts = [p[i].narrow(k_axis, 0, n) for p, (_, n) in zip(pieces, spans)]
        x = parts[0] if len(parts) == 1 else torch.cat(parts, dim=k_axis)
        return (x.narrow(v_axis, 0, V) if Vp != V else x).contiguous()

    return (o, *(join(i) for i in range(1, len(pieces[0]))))


def _key_slices_as_heads(family, q, k, v, g, decay, initial_state, opts, step, Vp, k_axis):
    """A fused-engine family with K over the engine's widest slice (step): the S key slices as S
    heads of one call, not S calls. q and k [B, T, H, S step] are [B, T, H S, step] as they lie
    (K zero-padded to S step first); each value head, its gate and its decay repeat over the slices
    (value head (h S + s) G + j of the call is the caller's h G + j, G = HV / H); the slices' outputs
    add in float32 and their state rows join along K. One launch with S times the heads fills the
    GPU where S calls of H heads each would run one after another; exact, as the slices are (the state
    rows of a family without the delta rule are independent)."""
    import torch

    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[-1]
    S, G = -(-K // step), HV // H
    Kp = S * step
    q, k = (_pad_to(x, -1, Kp).reshape(B, T, H * S, step) for x in (q, k))

    def per_slice(x, heads_axis):  # [..., HV, ...] -> [..., HV S, ...] in the call's head order
        if x is None or not is_torch(x) or x.dim() == 0:
            return x
        n = x.shape[heads_axis]
        shape = list(x.shape)
        g = G if n == HV else 1
        grouped = x.reshape(shape[:heads_axis] + [n // g, g] + shape[heads_axis + 1:])
        # S stacked copies: one vectorised copy (an expanded view's copy is not: 2x the time for v)
        wide = torch.stack([grouped] * S, dim=heads_axis + 1)
        return wide.reshape(shape[:heads_axis] + [n * S] + shape[heads_axis + 1:])

    v = per_slice(v, 2)
    if g is not None and is_torch(g) and g.dim() >= 3:
        g = per_slice(g, 2)
    if decay is not None and is_torch(decay) and decay.dim() == 1:
        decay = per_slice(decay, 0)
    k_first = k_axis == -2
    if initial_state is not None:
        x = _pad_to(initial_state, k_axis, Kp)
        N = x.shape[0]
        if k_first:  # [N, HV, S step, V] -> [N, H, G, S, step, V] -> [N, H, S, G, step, V]
            x = x.reshape(N, H, G, S, step, Vp).permute(0, 1, 3, 2, 4, 5)
        else:  # [N, HV, V, S step] -> [N, H, G, V, S, step] -> [N, H, S, G, V, step]
            x = x.reshape(N, H, G, Vp, S, step).permute(0, 1, 4, 2, 3, 5)
        initial_state = x.reshape(N, HV * S, *((step, Vp) if k_first else (Vp, step)))
    o, *states = chunk(family, q, k, v, g, None, decay, initial_state=initial_state, **opts)
    # one reduction over the slices: torch adds 16-bit floats in float32 and rounds once, as a
    # float32 round trip would, without its two conversion passes over the widened output. Two
    # slices (K = 256) as one elementwise add, about half the time of torch's reduction over them
    o = o.reshape(B, T, H, S, G, Vp)
    o = (o[:, :, :, 0] + o[:, :, :, 1] if S == 2 else o.sum(3)).reshape(B, T, HV, Vp)
    o = o.narrow(-1, 0, V).contiguous() if Vp != V else o

    def join(x):  # [N, HV S, step, V] or [N, HV S, V, step] -> the caller's [N, HV, K, V] or [N, HV, V, K]
        if x is None:
            return None
        N = x.shape[0]
        if k_first:
            x = x.reshape(N, H, S, G, step, Vp).permute(0, 1, 3, 2, 4, 5).reshape(N, HV, Kp, Vp)
        else:
            x = x.reshape(N, H, S, G, Vp, step).permute(0, 1, 3, 4, 2, 5).reshape(N, HV, Vp, Kp)
        x = x.narrow(k_axis, 0, K) if Kp != K else x
        return (x.narrow(-1 if k_first else -2, 0, V) if Vp != V else x).contiguous()

    return (o, *(join(x) for x in states))


def chunk_input_grads(family, inputs, d_out, d_final, needed, grads=None, **bwd_args):
    """The backward of chunk_fwd for the autograd Functions (ChunkFn below, torch_ops._EagerChunk):
    cula.ops.chunk_bwd on the saved inputs (a dict by name), then each gradient in its input's dtype,
    or None where the input is absent or needed[name] is false. d_out None (only the final state
    reached the loss) is zeros; d_final None is no final-state gradient."""
    if d_out is None:
        d_out = inputs["q"].new_zeros(inputs["v"].shape)
    got = ops.chunk_bwd(family, inputs["q"], inputs["k"], inputs["v"], inputs.get("g"), inputs.get("beta"),
                        d_out.contiguous(), d_final_state=None if d_final is None else d_final.contiguous(),
                        initial_state=inputs.get("initial_state"), A_log=inputs.get("A_log"),
                        dt_bias=inputs.get("dt_bias"), grads=grads, **bwd_args)
    return grads_in_input_dtypes(inputs, got, needed)


def grads_in_input_dtypes(inputs, got, needed):
    """{input name: its gradient in the input's dtype} from chunk_bwd's gradients (got, by gradient
    name): None where the input is absent, needed[name] is false or got holds none."""
    out = {}
    for n in _DIFF_NAMES:
        x, gr = inputs.get(n), got.get(GRAD_OF[n])
        out[n] = None if x is None or gr is None or not needed.get(n) else gr.to(x.dtype)
    return out


def _make_fn():
    import torch

    class ChunkFn(torch.autograd.Function):
        @staticmethod
        def forward(ctx, family, opts, q, k, v, g, beta, A_log, dt_bias, initial_state):
            o, final = ops.chunk_fwd(family, q, k, v, g, beta, A_log=A_log, dt_bias=dt_bias,
                                     initial_state=initial_state, **opts)
            ctx.family, ctx.opts = family, opts
            ctx.save_for_backward(q, k, v, g, beta, A_log, dt_bias, initial_state)
            ctx.set_materialize_grads(False)
            return o, final

        @staticmethod
        def backward(ctx, do, dht):
            inputs = dict(zip(_DIFF_NAMES, ctx.saved_tensors))
            keep = (*OPTION_NAMES, "cu_seqlens", "decay")
            needed = dict(zip(_DIFF_NAMES, ctx.needs_input_grad[2:]))
            grads = chunk_input_grads(ctx.family, inputs, do, dht, needed,
                                      **{n: ctx.opts[n] for n in keep if n in ctx.opts})
            return (None, None, *(grads[n] for n in _DIFF_NAMES))

    return ChunkFn


class LazyFunction:
    """An autograd Function built by make() on first use, so that importing cula does not import torch."""

    def __init__(self, make):
        self._make, self._fn = make, None

    def apply(self, *args):
        if self._fn is None:
            self._fn = self._make()
        return self._fn.apply(*args)


_ChunkFn = LazyFunction(_make_fn)
