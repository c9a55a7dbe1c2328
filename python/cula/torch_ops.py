"""torch.library registrations: ``torch.ops.cula.decode``, ``torch.ops.cula.chunk_fwd`` and its
backward ``torch.ops.cula.chunk_bwd`` with fake (meta) implementations, and chunk_fwd's autograd
formula, so torch.compile(fullgraph=True) traces models that call cula (forward and backward)
without a graph break, and CUDA-graph capture sees plain kernel launches.

Importing this module registers the ops (it needs torch); ``cula.api`` uses them for torch
tensors.
"""

from __future__ import annotations

import torch

from . import ops
from ._front import GRAD_OF as _GRAD_OF
from ._front import _needs_grad, chunk_input_grads, grads_in_input_dtypes
from .options import NAMES as OPTION_NAMES
from .options import Options, schema_args

__all__ = ["decode", "decode_to", "chunk_fwd"]

# chunk_bwd's outputs are the gradients of chunk_fwd's differentiable inputs (_GRAD_OF), in this
# order (an absent gradient is an empty tensor: custom ops return tensors)
_GRADS = tuple(_GRAD_OF.values())
_TOKEN_INPUTS = ("q", "k", "v", "g", "beta")  # the per-token inputs: gradients in their own dtype

# The ops' arguments by position (their schemas, generated below with the options of cula.Options in
# its field order), so that an option added there reaches every op without a signature restated here.
_DECODE_ARGS = ("q", "k", "v", "state_pool", "g", "beta", "decay", "state_indices", "num_accepted_tokens", "A_log",
                "dt_bias", "family", *OPTION_NAMES)
_FWD_ARGS = ("family", "q", "k", "v", "g", "beta", "decay", "initial_state", "A_log", "dt_bias", "cu_seqlens",
             *OPTION_NAMES, "chunk_size", "output_final_state", "state_dtype", "backend")
_BWD_ARGS = ("family", "q", "k", "v", "g", "beta", "decay", "initial_state", "A_log", "dt_bias", "cu_seqlens", "d_out",
             "d_final_state", *OPTION_NAMES)
_OPTS = schema_args()


def _named(names, args) -> dict:
    return dict(zip(names, args))


def _split_options(a: dict) -> Options:
    return Options(**{n: a.pop(n) for n in OPTION_NAMES})


# (the family argument is not called "mode": torch's functionalization wrapper owns that name)
def _decode_call(args, final_state_out=None):
    a = _named(_DECODE_ARGS, args)
    opts = _split_options(a)
    return ops.decode(a.pop("q"), a.pop("k"), a.pop("v"), a.pop("state_pool"), mode=a.pop("family"), options=opts,
                      final_state_out=final_state_out, **a)


def _decode(*args):
    return _decode_call(args)[0]


def _decode_schema(pool, returns):
    return (f"(Tensor q, Tensor k, Tensor v, {pool} state_pool, Tensor? g, Tensor? beta, Tensor? decay, "
            "Tensor? state_indices, Tensor? num_accepted_tokens, Tensor? A_log, Tensor? dt_bias, str family, "
            f"{_OPTS}) -> {returns}")


def _decode_out_fake(args):
    a = _named(_DECODE_ARGS, args)
    q, v = a["q"], a["v"]
    return q.new_empty((q.shape[0], q.shape[1], v.shape[2], v.shape[3]))


_decode = torch.library.custom_op("cula::decode", _decode, mutates_args=("state_pool",),
                                  schema=_decode_schema("Tensor(a0!)", "Tensor"))


@_decode.register_fake
def _decode_fake(*args):
    return _decode_out_fake(args)


def _final_buffer(q, pool):
    """A fresh buffer for decode_to's final states: one per sequence, as the pool's slots."""
    return pool.new_empty((q.shape[0], *pool.shape[1:]))


def _final_states(args):
    return _final_buffer(args[_DECODE_ARGS.index("q")], args[_DECODE_ARGS.index("state_pool")])


def _decode_to(*args):
    return _decode_call(args, _final_states(args))


# decode that leaves the pool as it is and returns the final states (FLA's fused_recurrent semantics)
_decode_to = torch.library.custom_op("cula::decode_to", _decode_to, mutates_args=(),
                                     schema=_decode_schema("Tensor", "(Tensor, Tensor)"))


@_decode_to.register_fake
def _decode_to_fake(*args):
    return _decode_out_fake(args), _final_states(args)


def _chunk_fwd(*args):
    a = _named(_FWD_ARGS, args)
    opts = _split_options(a)
    o, final = ops.chunk_fwd(a.pop("family"), a.pop("q"), a.pop("k"), a.pop("v"), options=opts, **a)
    # a custom op returns tensors only: no final state is an empty one (chunk_fwd below maps it to None)
    return o, final if final is not None else args[1].new_empty(0, dtype=torch.float32)


_chunk_fwd = torch.library.custom_op(
    "cula::chunk_fwd", _chunk_fwd, mutates_args=(),
    schema="(str family, Tensor q, Tensor k, Tensor v, Tensor? g, Tensor? beta, Tensor? decay, Tensor? initial_state, "
           f"Tensor? A_log, Tensor? dt_bias, Tensor? cu_seqlens, {_OPTS}, SymInt chunk_size, bool output_final_state, "
           "str? state_dtype, str backend=\"auto\") -> (Tensor, Tensor)")


@_chunk_fwd.register_fake
def _chunk_fwd_fake(*args):
    a = _named(_FWD_ARGS, args)
    q, v, initial_state, cu_seqlens = a["q"], a["v"], a["initial_state"], a["cu_seqlens"]
    o = q.new_empty(v.shape)  # q's dtype, as cula.ops.chunk_fwd allocates it
    if not a["output_final_state"]:
        return o, q.new_empty(0, dtype=torch.float32)
    dt = getattr(torch, a["state_dtype"]) if a["state_dtype"] else (
        initial_state.dtype if initial_state is not None else torch.float32)
    n = q.shape[0] if cu_seqlens is None else cu_seqlens.shape[0] - 1
    return o, q.new_empty(ops._state_shape(n, v.shape[2], q.shape[3], v.shape[3], a["state_layout"]), dtype=dt)


def _chunk_bwd(*args):
    a = _named(_BWD_ARGS, args)
    opts = _split_options(a)
    q = a["q"]
    bf16 = _bf16_grads(a)
    grads = ops.chunk_bwd(a.pop("family"), a.pop("q"), a.pop("k"), a.pop("v"), a.pop("g"), a.pop("beta"),
                          a.pop("d_out"), options=opts, grads=bf16, **a)
    return [grads[n] if n in grads else q.new_empty(0, dtype=torch.float32) for n in _GRADS]


# what chunk_fwd's backward keeps
_SAVED = ("q", "k", "v", "g", "beta", "decay", "initial_state", "A_log", "dt_bias", "cu_seqlens")


_chunk_bwd = torch.library.custom_op(
    "cula::chunk_bwd", _chunk_bwd, mutates_args=(),
    schema="(str family, Tensor q, Tensor k, Tensor v, Tensor? g, Tensor? beta, Tensor? decay, Tensor? initial_state, "
           f"Tensor? A_log, Tensor? dt_bias, Tensor? cu_seqlens, Tensor d_out, Tensor? d_final_state, {_OPTS}) "
           "-> Tensor[]")


def _grad_like(x, token):
    """The gradient buffer of input x: its own dtype for the token inputs (_chunk_bwd), else what
    chunk_bwd allocates (float32 for bfloat16 inputs)."""
    if x is None:
        return None
    return x.new_empty(x.shape, dtype=torch.float32 if x.dtype == torch.bfloat16 and not token else x.dtype)


@_chunk_bwd.register_fake
def _chunk_bwd_fake(*args):
    a = _named(_BWD_ARGS, args)
    q = a["q"]
    return [_grad_like(a[n], n in _TOKEN_INPUTS) if a[n] is not None else q.new_empty(0, dtype=torch.float32)
            for n in _GRAD_OF]


def _setup_context(ctx, inputs, output):
    args = _named(_FWD_ARGS, inputs)
    ctx.save_for_backward(*(args[n] for n in _SAVED))
    ctx.family, ctx.output_final_state = args["family"], args["output_final_state"]
    ctx.option_values = tuple(args[n] for n in OPTION_NAMES)


def _bf16_grads(inputs: dict) -> dict:
    """bf16 inputs' token gradients written in bf16 by the kernels (the last rounding of their float32
    sums), not in float32 and cast afterwards: one pass over each fewer."""
    return {_GRAD_OF[n]: torch.empty_like(inputs[n]) for n in _TOKEN_INPUTS
            if inputs.get(n) is not None and inputs[n].dtype == torch.bfloat16}


_EAGER_SAVED = ("q", "k", "v", "g", "beta", "initial_state", "A_log", "dt_bias")  # _EagerChunk's inputs, in order


class _EagerChunk(torch.autograd.Function):
    """chunk_fwd with its autograd formula for eager calls on plain tensors (_eager): the same forward and
    backward as the registered op's (cula.ops.chunk_fwd / chunk_bwd, bf16 token gradients written
    directly), without the op's dispatch, its autograd wrapper and the zeros it makes for an unused final
    state's gradient: the host's time per training step, which small layers wait on, drops by about a
    third (H200, KDA 1x4096 H16: 2.61 -> 1.66 ms). torch.compile and dispatch modes keep the op
    (chunk_fwd below)."""

    @staticmethod
    def forward(ctx, family, opts, decay, cu_seqlens, chunk_size, output_final_state, state_dtype, backend, q, k, v, g,
                beta, initial_state, A_log, dt_bias):
        o, final = ops.chunk_fwd(family, q, k, v, g, beta, decay, initial_state=initial_state, A_log=A_log,
                                 dt_bias=dt_bias, cu_seqlens=cu_seqlens, chunk_size=chunk_size,
                                 output_final_state=output_final_state, state_dtype=state_dtype, backend=backend,
                                 options=opts)
        ctx.save_for_backward(q, k, v, g, beta, initial_state, A_log, dt_bias)  # _EAGER_SAVED
        ctx.family, ctx.opts, ctx.decay, ctx.cu_seqlens = family, opts, decay, cu_seqlens  # (no gradients)
        ctx.set_materialize_grads(False)
        return o, final

    @staticmethod
    def backward(ctx, d_out, d_final):
        inputs = dict(zip(_EAGER_SAVED, ctx.saved_tensors))
        needed = dict(zip(_EAGER_SAVED, ctx.needs_input_grad[8:]))
        grads = chunk_input_grads(ctx.family, inputs, d_out, d_final, needed, grads=_bf16_grads(inputs),
                                  decay=ctx.decay, cu_seqlens=ctx.cu_seqlens, options=ctx.opts)
        return (None,) * 8 + tuple(grads[n] for n in _EAGER_SAVED)  # family .. backend: no gradients


def _backward(ctx, d_out, d_final):
    saved = dict(zip(_SAVED, ctx.saved_tensors))
    if d_final is not None and (not ctx.output_final_state or d_final.numel() == 0):
        d_final = None
    grads = torch.ops.cula.chunk_bwd(
        ctx.family, saved["q"], saved["k"], saved["v"], saved["g"], saved["beta"], saved["decay"],
        saved["initial_state"], saved["A_log"], saved["dt_bias"], saved["cu_seqlens"], d_out.contiguous(),
        None if d_final is None else d_final.contiguous(), *ctx.option_values)
    needed = dict(zip(_FWD_ARGS, ctx.needs_input_grad))
    by_input = grads_in_input_dtypes(saved, dict(zip(_GRADS, grads)), needed)
    return tuple(by_input.get(n) for n in _FWD_ARGS)


_chunk_fwd.register_autograd(_backward, setup_context=_setup_context)


_PLAIN = (torch.Tensor, torch.nn.Parameter)


def _eager(*tensors) -> bool:
    """Whether a call may skip the registered op and run cula.ops directly: the op's dispatch (its
    wrappers, alias checks and dispatcher round trip) costs about as much host time per call as the
    rest of a drop-in's path, which a small decode batch waits on. The op is kept where it is needed:
    while torch.compile traces, under a torch dispatch mode (fake tensors, flop counters), for tensor
    subclasses, and for meta tensors (whose shapes the ops' fake implementations give). An eager call
    that needs gradients takes _EagerChunk, the op's autograd formula without the op."""
    if torch.compiler.is_compiling() or torch._C._len_torch_dispatch_stack():
        return False
    for t in tensors:
        if t is not None and (type(t) not in _PLAIN or t.is_meta):
            return False
    return True


def decode(q, k, v, state_pool, *, mode="kda", g=None, beta=None, decay=None, state_indices=None,
           num_accepted_tokens=None, A_log=None, dt_bias=None, options=None, **option_kw):
    """cula.ops.decode as a torch op (compile- and graph-friendly). Returns (o, state_pool)."""
    opts = ops._options("decode", options, option_kw)
    if _eager(q, k, v, state_pool, g, beta, A_log, dt_bias):
        o, _ = ops.decode(q, k, v, state_pool, mode=mode, g=g, beta=beta, decay=decay, state_indices=state_indices,
                          num_accepted_tokens=num_accepted_tokens, A_log=A_log, dt_bias=dt_bias, options=opts)
        return o, state_pool
    o = torch.ops.cula.decode(q, k, v, state_pool, g, beta, decay, state_indices, num_accepted_tokens, A_log, dt_bias,
                              mode, *opts.values())
    return o, state_pool


def decode_to(q, k, v, state_pool, *, mode="kda", g=None, beta=None, decay=None, A_log=None, dt_bias=None,
              options=None, **option_kw):
    """cula.ops.decode with final_state_out as a torch op: the states of sequence n read from
    state_pool[n], the final states returned fresh. Returns (o, final_states)."""
    opts = ops._options("decode", options, option_kw)
    if _eager(q, k, v, state_pool, g, beta, A_log, dt_bias):
        final = _final_buffer(q, state_pool)
        o, _ = ops.decode(q, k, v, state_pool, mode=mode, g=g, beta=beta, decay=decay, A_log=A_log, dt_bias=dt_bias,
                          final_state_out=final, options=opts)
        return o, final
    return torch.ops.cula.decode_to(q, k, v, state_pool, g, beta, decay, None, None, A_log, dt_bias, mode,
                                    *opts.values())


def chunk_fwd(family, q, k, v, g=None, beta=None, decay=None, *, initial_state=None, A_log=None, dt_bias=None,
              cu_seqlens=None, chunk_size=64, output_final_state=True, state_dtype=None, backend="auto", options=None,
              **option_kw):
    """cula.ops.chunk_fwd as a torch op. Returns (o, final_state); final_state is None unless
    output_final_state."""
    opts = ops._options("chunk_fwd", options, option_kw)
    diff = (q, k, v, g, beta, initial_state, A_log, dt_bias)
    if _eager(*diff):
        if _needs_grad(*diff):
            return _EagerChunk.apply(family, opts, decay, cu_seqlens, chunk_size, output_final_state, state_dtype,
                                     backend, *diff)
        return ops.chunk_fwd(family, q, k, v, g, beta, decay, initial_state=initial_state, A_log=A_log,
                             dt_bias=dt_bias, cu_seqlens=cu_seqlens, chunk_size=chunk_size,
                             output_final_state=output_final_state, state_dtype=state_dtype, backend=backend,
                             options=opts)
    o, final = torch.ops.cula.chunk_fwd(family, q, k, v, g, beta, decay, initial_state, A_log, dt_bias, cu_seqlens,
                                        *opts.values(), chunk_size, output_final_state, state_dtype, backend)
    return o, final if output_final_state else None
