"""Long sequences on one device in segments that run in parallel (the forward, without autograd):
the affine-summary algebra of context parallelism (cula.dist), as two engine calls.

The chunk engines run a sequence's chunks in order, one CTA per (sequence, head, value slice); with
few sequences and heads (B x HV x V / 64 well under the SMs) most of the GPU idles while a few CTAs
walk thousands of chunks. Here each sequence is cut into segments of `seg_len` tokens (a multiple
of the chunk, so the chunks are those of the uncut call), and every segment runs as a sequence of
one varlen call, in two passes:

1. Summary pass: every segment from a zero state (a sequence's first from its initial state). With
   the delta rule the value columns are extended by K zero columns whose initial state is the
   identity, so the segment's final state holds both the state it adds (A, [V, K] K-last) and its
   transition (M, [K, K]: the extension's final state). Without the delta rule the transition is
   diagonal and comes from the gates (the product of the segment's decays), with no extension.
2. Fold, float32: per sequence in segment order, the state entering segment j is
   E_j = A_{j-1} + E_{j-1} M_{j-1} (E_1 = A_0: the first segment started from the true state),
   one batched product per segment position.
3. Output pass: every segment again, from E_j; its outputs are the call's outputs, and the final
   state of a sequence's last segment is the sequence's final state.

Both passes use the engine as it is (its varlen and initial-state paths), so the result is the
uncut call's up to the float32 fold (within SPEC's tolerance, as context parallelism). The cost is
two passes over the tokens (the first over V + K columns with the delta rule) and the fold, against
a chain of chunks that is seg_len / T as long.

`CULA_SEGMENT_TOKENS=L` (a positive multiple of 64) makes `_front.chunk` take this path for calls
that need no gradient and write no caller buffer. It is off by default: on the H100 it is slower
than the uncut call in every configuration measured (`bench/results/h100/segments.md`: KDA
1x32768 H4 takes 2.13 ms in segments of 4096 tokens against 1.12 ms uncut). The two engine passes
alone cost about as much as the uncut call, and the version measured there added host time per
segment position to the GPU time (it copied the offsets back to the host, which waits for the GPU,
and sent each position's indices separately; both are gone, unmeasured); the gain needs the
segments inside the scan kernel (the design note of chunk_prep_scan says how).
"""

from __future__ import annotations

import os

from . import ops
from ._cp_summary import DIAGONAL, cut, diagonal_decays
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
    """(o, final state or None), as ops.chunk_fwd returns them for the same call. cu_seqlens, when
    given, must be readable on the host (the segments are cut there)."""
    import torch

    B, T, H, K = (int(s) for s in q.shape)
    HV, V = int(v.shape[2]), int(v.shape[3])
    dev = q.device
    host = opts.pop("cu_seqlens_host", None)
    if cu_seqlens is None:
        offsets = [b * T for b in range(B + 1)]
    else:
        offsets = [int(x) for x in (host if host is not None else cu_seqlens).tolist()]
    N = len(offsets) - 1
    flat = lambda x: None if x is None else x.reshape(1, B * T, *x.shape[2:])  # noqa: E731
    qf, kf, vf, gf, bf = flat(q), flat(k), flat(v), flat(g), flat(beta)
    segs = cut(offsets, seg_len)
    if len(segs) == N:  # no sequence is cut: the direct call
        return ops.chunk_fwd(family, q, k, v, g, beta, decay, initial_state=initial_state,
                             output_final_state=output_final_state, cu_seqlens=cu_seqlens, cu_seqlens_host=host,
                             state_layout=state_layout, state_dtype=state_dtype, A_log=A_log, dt_bias=dt_bias, **opts)
    S = len(segs)
    diagonal = family in DIAGONAL
    W = V if diagonal else V + K
    acc = torch.float64 if v.dtype == torch.float64 else torch.float32  # (float64 calls stay float64)
    acc_name = str(acc).replace("torch.", "")
    h0 = None
    if initial_state is not None:  # K-last, in acc
        h0 = initial_state.to(acc)
        if state_layout != "k_last":
            h0 = h0.transpose(-1, -2)
    firsts = [i for i, s in enumerate(segs) if s[3]]
    later = [i for i, s in enumerate(segs) if not s[3]]
    first_ids = torch.tensor(firsts, device=dev)
    cu_host = torch.tensor([s[1] for s in segs] + [segs[-1][2]], dtype=torch.int32)  # (no copy back to the host)
    cu = cu_host.to(dev)

    # 1. summary pass
    init = torch.zeros(S, HV, W, K, dtype=acc, device=dev)
    if h0 is not None:
        init[first_ids, :, :V, :] = h0
    if not diagonal:
        init[torch.tensor(later, device=dev), :, V:, :] = torch.eye(K, dtype=acc, device=dev)  # (v's K more columns: zeros)
    scratch = torch.empty(1, B * T, HV, W, dtype=v.dtype, device=dev)  # its outputs are not used
    _, fw = ops.chunk_fwd(family, qf, kf, vf, gf, bf, decay, initial_state=init, output_final_state=True,
                          cu_seqlens=cu, cu_seqlens_host=cu_host, state_layout="k_last", state_dtype=acc_name,
                          out=scratch, value_dim=W, A_log=A_log, dt_bias=dt_bias, **opts)
    A = fw[:, :, :V, :]
    if diagonal:  # the product of each segment's decays per key channel [S, HV, K]
        d = diagonal_decays(family, None if gf is None else gf[0], decay, B * T, HV, K, [s[1] for s in segs],
                            [s[2] for s in segs], dev).to(acc)
    else:
        M = fw[:, :, V:, :]

    # 2. fold: E_j of every segment that continues a sequence, by position j within the sequence;
    # the segments of every position go to the device in one transfer
    enter = torch.zeros(S, HV, V, K, dtype=acc, device=dev)
    if h0 is not None:
        enter[first_ids] = h0
    position, by_position = [], []  # by_position[j - 1]: the segments at position j >= 1
    for i, (_, _, _, first) in enumerate(segs):
        position.append(0 if first else position[i - 1] + 1)
        if position[i] > len(by_position):
            by_position.append([])
        if position[i]:
            by_position[position[i] - 1].append(i)
    if by_position:
        ids = torch.tensor([i for group in by_position for i in group], device=dev)
        for j, cur in enumerate(ids.split([len(group) for group in by_position])):
            prev = cur - 1
            if j == 0:
                enter[cur] = A[prev]
            elif diagonal:
                enter[cur] = A[prev] + enter[prev] * d[prev].unsqueeze(2)
            else:
                enter[cur] = torch.baddbmm(A[prev].reshape(-1, V, K), enter[prev].reshape(-1, V, K),
                                           M[prev].reshape(-1, K, K)).view(-1, HV, V, K)

    # 3. output pass
    o = torch.empty(1, B * T, HV, V, dtype=v.dtype, device=dev)
    _, fin = ops.chunk_fwd(family, qf, kf, vf, gf, bf, decay, initial_state=enter, output_final_state=True,
                           cu_seqlens=cu, cu_seqlens_host=cu_host, state_layout="k_last", state_dtype=acc_name,
                           out=o, A_log=A_log, dt_bias=dt_bias, **opts)
    o = o.view(B, T, HV, V)
    if not output_final_state:
        return o, None
    lasts = [i for i in range(S) if i + 1 == S or segs[i + 1][0] != segs[i][0]]
    final = fin[torch.tensor(lasts, device=dev)]
    if state_layout != "k_last":
        final = final.transpose(-1, -2)
    sd = state_dtype or ("float32" if initial_state is None else str(initial_state.dtype).replace("torch.", ""))
    return o, final.to(getattr(torch, sd)).contiguous()
