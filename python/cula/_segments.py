"""Long sequences on one device in segments that run in parallel (the forward, without autograd):
the affine-summary algebra of context parallelism (cula.dist), inside one engine call.

The chunk engines run a sequence's chunks in order, one CTA per (sequence, head, value slice); with
few sequences and heads (B x HV x V / 64 well under the SMs) most of the GPU idles while a few CTAs
walk thousands of chunks. Here each sequence is cut into segments of `seg_len` tokens, and all
segments run as the sequences of one varlen call. A segment that does not start its sequence runs
from a zero state, with the value columns extended by K zero columns and the initial state by the
identity: the call also returns, per token, q^ carried through the segment (Q~) and, per segment,
the state it adds (A) and its transition (M). Without the delta rule the transitions are diagonal
and come from the gates (_cp_summary), with no extension. Then, per sequence in segment order,
the state entering each segment is folded from the ones before (E <- A + E M, float32), each
segment's outputs get E Q~, and the last fold is the final state. The pass writes float32; o is
rounded once, after the correction.

`CULA_SEGMENT_TOKENS=L` (a positive multiple of 64) makes `_front.chunk` take this path for calls
that need no gradient and write no caller buffer; it is off by default until the planner that
chooses it from the shapes is measured.
"""

from __future__ import annotations

import os

from . import ops
from ._cp_summary import DIAGONAL, cut, diagonal_summary
from ._lib import CulaError

SEGMENT_TOKENS = "CULA_SEGMENT_TOKENS"
_ALIGN = 64  # segments start on chunk boundaries: the same chunks as the unsegmented call


def segment_tokens():
    """The segment length CULA_SEGMENT_TOKENS asks for, or None."""
    raw = os.environ.get(SEGMENT_TOKENS, "")
    if not raw or raw == "0":
        return None
    try:
        n = int(raw)
    except ValueError:
        n = -1
    if n <= 0 or n % _ALIGN:
        raise CulaError(f"environment variable {SEGMENT_TOKENS}: expected a positive multiple of {_ALIGN}, got {raw!r}")
    return n


def forward(family, q, k, v, g, beta, decay, *, seg_len, initial_state=None, output_final_state=False,
            cu_seqlens=None, state_layout="k_last", state_dtype=None, A_log=None, dt_bias=None, **opts):
    """(o, final state or None), as ops.chunk_fwd returns them for the same call."""
    import torch

    B, T, H, K = (int(s) for s in q.shape)
    HV, V = int(v.shape[2]), int(v.shape[3])
    dev = q.device
    if cu_seqlens is not None:
        offsets = [int(x) for x in cu_seqlens.tolist()]
    else:
        offsets = [b * T for b in range(B + 1)]
    N = len(offsets) - 1
    flat = lambda x: None if x is None else x.reshape(1, B * T, *x.shape[2:])  # noqa: E731
    qf, kf, vf, gf, bf = flat(q), flat(k), flat(v), flat(g), flat(beta)
    segs = cut(offsets, seg_len)
    if not segs:  # no sequence at all: the direct call says what it returns
        return ops.chunk_fwd(family, q, k, v, g, beta, decay, initial_state=initial_state,
                             output_final_state=output_final_state, cu_seqlens=cu_seqlens, state_layout=state_layout,
                             state_dtype=state_dtype, A_log=A_log, dt_bias=dt_bias, **opts)
    S = len(segs)
    diagonal = family in DIAGONAL
    W = V if diagonal else V + K
    acc = torch.float64 if v.dtype == torch.float64 else torch.float32  # (float64 calls stay float64)
    h0 = None
    if initial_state is not None:  # K-last, in acc, inside
        h0 = initial_state.to(acc)
        if state_layout != "k_last":
            h0 = h0.transpose(-1, -2)
    init = torch.zeros(S, HV, W, K, dtype=acc, device=dev)
    for i, (n, _, _, first) in enumerate(segs):
        if first:
            if h0 is not None:
                init[i, :, :V, :] = h0[n]
        elif not diagonal:
            init[i, :, V:, :] = torch.eye(K, dtype=acc, device=dev)
    vw = vf if diagonal else torch.cat([vf, vf.new_zeros(1, B * T, HV, K)], dim=-1)
    cu = torch.tensor([s[1] for s in segs] + [segs[-1][2]], dtype=torch.int32, device=dev)
    out = torch.empty(1, B * T, HV, W, dtype=acc, device=dev)
    _, fw = ops.chunk_fwd(family, qf, kf, vw.contiguous(), gf, bf, decay, initial_state=init, output_final_state=True,
                          cu_seqlens=cu, state_layout="k_last", state_dtype=str(acc).replace("torch.", ""), out=out,
                          A_log=A_log, dt_bias=dt_bias, **opts)
    o = out[..., :V]
    final = torch.zeros(N, HV, V, K, dtype=acc, device=dev)
    entering, into = None, {}  # into: segment -> the state entering it (segments that continue a sequence)
    for i, (n, s, e, first) in enumerate(segs):
        A = fw[i, :, :V, :]
        if first:
            entering = A
        else:
            if diagonal:
                Qc, Md = (x.to(acc) for x in diagonal_summary(family, qf[0, s:e], None if gf is None else gf[0, s:e],
                                                              decay, HV, opts))
                o[0, s:e] += torch.einsum("lhk,hvk->lhv", Qc, entering)
            else:
                Md = fw[i, :, V:, :]
                into[i] = entering
            entering = A + torch.matmul(entering, Md)
        if i + 1 == S or segs[i + 1][0] != n:  # the sequence's last segment
            final[n] = entering
    if into:  # the delta rule's corrections in one product: Q~ of every such segment, padded to seg_len
        ids = list(into)
        start = torch.tensor([segs[i][1] for i in ids], device=dev)[:, None]
        end = torch.tensor([segs[i][2] for i in ids], device=dev)[:, None]
        pos = start + torch.arange(seg_len, device=dev)[None, :]
        valid = pos < end
        pos = torch.minimum(pos, end - 1)
        corr = torch.einsum("slhk,shvk->slhv", out[0, :, :, V:][pos], torch.stack([into[i] for i in ids]))
        o[0].index_put_((pos[valid],), corr[valid], accumulate=True)
    o = o.reshape(B, T, HV, V).to(v.dtype)
    if not output_final_state:
        return o, None
    if state_layout != "k_last":
        final = final.transpose(-1, -2)
    sd = state_dtype or ("float32" if initial_state is None else str(initial_state.dtype).replace("torch.", ""))
    return o, final.to(getattr(torch, sd)).contiguous()
