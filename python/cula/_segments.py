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

Dense KDA and GDN calls on CUDA (ENGINE_FAMILIES) run the same three steps inside one call of the
tensor-core chunk engine (ops.chunk_fwd's segment_len; chunk_prep_scan/DESIGN.md): the prep once for
both scans, a summary scan that writes states only, the fold on the device, no host-made index lists
(so a CUDA graph can capture it). GLA, varlen calls and host tensors take the two calls here.

`_front.chunk` (Level 1 and FLA's drop-ins) takes this path for calls that need no gradient and
write no caller buffer, in two ways:
- the planner (`plan`, CULA_SEGMENT_TOKENS unset): dense bf16 KDA, GDN and GLA calls on CUDA
  whose few sequences and heads leave most SMs idle and whose sequences are long (GLA not while a
  CUDA graph is captured: its cut sends host-made index lists to the device);
- `CULA_SEGMENT_TOKENS=L` (a positive multiple of 64) for segments of L tokens in any call of any
  family, and `CULA_SEGMENT_TOKENS=0` for none.
On an H200 (`bench/results/h200/segments.md`, queued): KDA 1x32768 H4 1.13 -> 0.34 ms (FLA 1.55),
1x131072 H4 4.41 -> 1.04 (FLA 5.94); GDN 1x32768 H2/HV4 1.15 -> 0.34 (FLA 0.81), 1x131072 4.50 ->
1.00 (FLA 3.11); GLA 1x32768 H4 1.00 -> 0.68 (FLA 0.78), 1x131072 H4 3.95 -> 2.11 (FLA 3.10). At KDA
1x32768 H4 the engine's own segments take 0.34 ms of GPU time against 0.67 as two calls (the prep
once instead of twice, the summary pass without o), and a single call's host work is one C call.
"""

from __future__ import annotations

import os

from . import ops
from ._cp_summary import DIAGONAL, cut, diagonal_decays, host_to_device, uniform_diagonal_decays
from ._lib import CulaError

SEGMENT_TOKENS = "CULA_SEGMENT_TOKENS"
# Dense calls of these families on CUDA take the chunk engine's own segments (ops.chunk_fwd's
# segment_len: the prep once for both passes, a summary pass that writes states only, the fold on
# the device); the rest (GLA, whose summary here is V columns and diagonal decays; varlen calls;
# host tensors) the two engine calls below.
ENGINE_FAMILIES = ("kda", "gdn")
_ALIGN = 64  # segments start on chunk boundaries: the same chunks as the unsegmented call


def segment_tokens():
    """What CULA_SEGMENT_TOKENS asks for: None (unset: the planner decides), 0 (never cut) or a
    segment length."""
    raw = os.environ.get(SEGMENT_TOKENS, "")
    if not raw:
        return None
    try:
        n = int(raw)
    except ValueError:
        n = -1
    if n < 0 or n % _ALIGN:
        raise CulaError(f"environment variable {SEGMENT_TOKENS}: expected 0 or a positive multiple of {_ALIGN}, "
                        f"got {raw!r}")
    return n


# The planner. The summary pass runs one CTA per (segment, head, 64 of its V + K columns, 32 at
# K = 256; V without the delta rule), N HV (V + K) / 64 "slices" a segment.
# KDA and GDN (the engine's own segments: the prep once, no o's products in the summary pass, no
# host work): as many segments as fill the SMs twice in the summary pass, of at least 2048 tokens
# (up to 8 of at least 1024 where that leaves fewer than 8), at least 4. Measured on an H200
# (bench/results/h200/segments.md, queued): KDA 1x32768 H4 1.13 -> 0.34 ms in 16 segments (0.36 in 8),
# 1x131072 H4 4.41 -> 1.04 in 16, 1x16384 H4 0.57 -> 0.21 in 8 (0.21 in 16), 1x8192 H4 0.29 -> 0.13
# in 8 of 1024 (0.16 in 4 of 2048), 1x32768 H8 1.16 -> 0.55 in 8, 2x16384 H8 0.67 -> 0.54 in 4 a sequence.
PLAN_FAMILIES = ("kda", "gdn", "gla")
PLAN_MIN_TOKENS = 8192
PLAN_MIN_SEGMENT = 2048
PLAN_SHORT_SEGMENT, PLAN_SHORT_SEGMENTS = 1024, 8
PLAN_MIN_SEGMENTS = 4
PLAN_WAVES = 2
# GLA (two engine calls, the prep run twice, host-made index lists): segments that fill the SMs once,
# at least 8 of at least 4096 tokens, sequences of 32768 tokens or more (its prep, per-channel gates,
# is a larger share of a pass than KDA's, and running it twice pays only when the chains shrink more:
# 1x32768 H4 in 8 segments 1.01 -> 0.69 ms, 1x131072 H4 in 16 4.00 -> 2.15, while 1x65536 H16 in 4
# lost, 2.50 -> 4.04).
# Simple GLA and Lightning are not planned: their fused engine runs few heads at 2.4-2.7x FLA uncut,
# and their segments lost (simple GLA 1x32768 H4 0.15 -> 0.47 ms at best); they take segments only
# when asked for.
PLAN_MIN_TOKENS_DIAGONAL = 32768
PLAN_MIN_SEGMENT_DIAGONAL = 4096
PLAN_MIN_SEGMENTS_DIAGONAL = 8


def plan(N, T, HV, K, V, sms, delta=True):
    """The segment length the planner cuts N sequences of T tokens into (dense calls), or None.
    delta: KDA and GDN (the engine's own segments, the summary pass over V + K columns); else GLA
    (two engine calls, the summary pass over V columns)."""
    if T < (PLAN_MIN_TOKENS if delta else PLAN_MIN_TOKENS_DIAGONAL) or N * HV <= 0:
        return None
    width = 32 if K > 128 else 64  # the scan's columns a CTA (K = 256: 32, its one stage's room)
    slices = N * HV * -(-(V + K if delta else V) // width)
    if delta:
        S = min(PLAN_WAVES * sms // slices, max(T // PLAN_MIN_SEGMENT, min(T // PLAN_SHORT_SEGMENT, PLAN_SHORT_SEGMENTS)))
    else:
        S = min(sms // slices, T // PLAN_MIN_SEGMENT_DIAGONAL)
    if S < (PLAN_MIN_SEGMENTS if delta else PLAN_MIN_SEGMENTS_DIAGONAL):
        return None
    return -(-T // (S * _ALIGN)) * _ALIGN


def forward(family, q, k, v, g, beta, decay, *, seg_len, initial_state=None, output_final_state=False,
            cu_seqlens=None, state_layout="k_last", state_dtype=None, A_log=None, dt_bias=None, engine=True, **opts):
    """(o, final state or None), as ops.chunk_fwd returns them for the same call. cu_seqlens, when
    given, must be readable on the host (the segments are cut there). engine=False: the two engine
    calls below also where the engine's own segments would run (for comparing them)."""
    import torch

    host = opts.pop("cu_seqlens_host", None)
    if engine and cu_seqlens is None and family in ENGINE_FAMILIES and q.device.type == "cuda":
        # the engine's own segments (none of the host-made lists below)
        return ops.chunk_fwd(family, q, k, v, g, beta, decay, initial_state=initial_state,
                             output_final_state=output_final_state, state_layout=state_layout,
                             state_dtype=state_dtype, A_log=A_log, dt_bias=dt_bias, segment_len=seg_len, **opts)
    B, T, H, K = (int(s) for s in q.shape)
    HV, V = int(v.shape[2]), int(v.shape[3])
    dev = q.device
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
    lasts = [i for i in range(S) if i + 1 == S or segs[i + 1][0] != segs[i][0]]
    position, by_position = [], []  # by_position[j - 1]: the segments at position j >= 1
    for i, (_, _, _, first) in enumerate(segs):
        position.append(0 if first else position[i - 1] + 1)
        if position[i] > len(by_position):
            by_position.append([])
        if position[i]:
            by_position[position[i] - 1].append(i)
    folded = [i for group in by_position for i in group]
    # Every index list and the segment offsets reach the device in one copy (host_to_device)
    bounds = [s[1] for s in segs] + [segs[-1][2]]  # the segments as the sequences of one varlen call
    cu_host = torch.tensor(bounds, dtype=torch.int64)
    lists = (firsts, later, lasts, folded, bounds)
    on_dev = host_to_device(torch.tensor([x for lst in lists for x in lst], dtype=torch.int64), dev)
    first_ids, later_ids, last_ids, folded_ids, cu = on_dev.split([len(x) for x in lists])

    # 1. summary pass
    init = torch.zeros(S, HV, W, K, dtype=acc, device=dev)
    if h0 is not None:
        init[first_ids, :, :V, :] = h0
    if not diagonal:
        init[later_ids, :, V:, :] = torch.eye(K, dtype=acc, device=dev)  # (v's K more columns: zeros)
    scratch = torch.empty(1, B * T, HV, W, dtype=v.dtype, device=dev)  # its outputs are not used
    _, fw = ops.chunk_fwd(family, qf, kf, vf, gf, bf, decay, initial_state=init, output_final_state=True,
                          cu_seqlens=cu, cu_seqlens_host=cu_host, state_layout="k_last", state_dtype=acc_name,
                          out=scratch, value_dim=W, A_log=A_log, dt_bias=dt_bias, **opts)
    A = fw[:, :, :V, :]
    if diagonal:  # the product of each segment's decays per key channel [S, HV, K]
        if cu_seqlens is None:
            d = uniform_diagonal_decays(family, None if gf is None else gf[0], decay, B, T, HV, K, seg_len, dev)
        else:
            d = diagonal_decays(family, None if gf is None else gf[0], decay, B * T, HV, K, cu[:-1], cu[1:], dev)
        d = d.to(acc)
    else:
        M = fw[:, :, V:, :]

    # 2. fold: E_j of every segment that continues a sequence, by position j within the sequence.
    # One sequence (B = 1, no cu_seqlens): position j is segment j, so views replace the gathers
    enter = torch.zeros(S, HV, V, K, dtype=acc, device=dev)
    if h0 is not None:
        enter[first_ids] = h0
    if N == 1:  # (views by one unbind each: a select per operand and step cost host time per call)
        Es, As = enter.unbind(0), A.unbind(0)
        Ms = (d.unsqueeze(2) if diagonal else M).unbind(0)  # the transitions: [HV, 1, K] diagonals or [HV, K, K]
        Es[1].copy_(As[0])
        for j in range(2, S):
            if diagonal:
                torch.addcmul(As[j - 1], Es[j - 1], Ms[j - 1], out=Es[j])
            else:
                torch.baddbmm(As[j - 1], Es[j - 1], Ms[j - 1], out=Es[j])
    elif by_position:
        for j, cur in enumerate(folded_ids.split([len(group) for group in by_position])):
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
    final = fin[last_ids]
    if state_layout != "k_last":
        final = final.transpose(-1, -2)
    sd = state_dtype or ("float32" if initial_state is None else str(initial_state.dtype).replace("torch.", ""))
    return o, final.to(getattr(torch, sd)).contiguous()
