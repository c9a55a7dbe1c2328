"""Shared machinery of the PyTorch-facing layers (FLA drop-ins, Level 1): autograd wiring and
keyword-argument discipline. Every path ends in cula.ops (Level 0), i.e. the C ABI."""

from __future__ import annotations

import sys

from . import ops
from ._lib import CulaError
from ._tensor import is_torch
from .options import NAMES as OPTION_NAMES

_DIFF_NAMES = ("q", "k", "v", "g", "beta", "A_log", "dt_bias", "initial_state")


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
_OP_OPTIONS = frozenset({*OPTION_NAMES, "cu_seqlens", "chunk_size", "output_final_state", "state_dtype"})


def _through_op(q, opts) -> bool:
    """Torch tensors go through the registered op (traceable by torch.compile, one node in a graph)."""
    if not is_torch(q):
        return False
    if opts.get("return_intermediate_states") or opts.get("backend", "auto") != "auto":
        return False
    return all(n in _OP_OPTIONS or n in ("return_intermediate_states", "backend") for n in opts)


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


def chunk(family: str, q, k, v, g=None, beta=None, decay=None, *, A_log=None, dt_bias=None, initial_state=None,
          **opts):
    """chunk_fwd with autograd when any torch input requires grad (backward: cula.ops.chunk_bwd).
    Torch tensors go through the registered op cula::chunk_fwd, whose autograd formula calls
    cula::chunk_bwd (traceable by torch.compile, forward and backward)."""
    initial_state = _widen_half_state(initial_state)
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


def _make_fn():
    import torch

    class ChunkFn(torch.autograd.Function):
        @staticmethod
        def forward(ctx, family, opts, q, k, v, g, beta, A_log, dt_bias, initial_state):
            o, final = ops.chunk_fwd(family, q, k, v, g, beta, A_log=A_log, dt_bias=dt_bias,
                                     initial_state=initial_state, **opts)
            ctx.family, ctx.opts = family, opts
            ctx.save_for_backward(q, k, v, g, beta, A_log, dt_bias, initial_state)
            return o, final

        @staticmethod
        def backward(ctx, do, dht):
            q, k, v, g, beta, A_log, dt_bias, initial_state = ctx.saved_tensors
            o = ctx.opts
            keep = (*OPTION_NAMES, "cu_seqlens", "decay")
            grads = ops.chunk_bwd(ctx.family, q, k, v, g, beta, do.contiguous(),
                                  d_final_state=None if dht is None else dht.contiguous(), initial_state=initial_state,
                                  A_log=A_log, dt_bias=dt_bias, **{n: o[n] for n in keep if n in o})
            names = {"q": "dq", "k": "dk", "v": "dv", "g": "dg", "beta": "dbeta", "A_log": "dA_log",
                     "dt_bias": "ddt_bias", "initial_state": "d_initial_state"}
            saved = dict(zip(_DIFF_NAMES, (q, k, v, g, beta, A_log, dt_bias, initial_state)))
            out = []
            for n in _DIFF_NAMES:
                x, gr = saved[n], grads.get(names[n])
                out.append(None if x is None or gr is None or not ctx.needs_input_grad[2 + _DIFF_NAMES.index(n)]
                           else gr.to(x.dtype))
            return (None, None, *out)

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
