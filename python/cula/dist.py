"""Level 2 (the RFC's ``cula.dist``): tensor and context parallelism on torch.distributed.

Every rank calls the same function with its own shard; any process group works (NCCL for CUDA
tensors, gloo for host tensors). States are K-last ``[N, HV, V, K]`` float32, as in Level 1.

Tensor parallelism (``*_tp``): each rank holds a slice of the heads (q/k heads with their value
heads: ``H`` and ``HV`` both divided by the group size, so a GVA group never straddles ranks).
Linear attention is head-independent, so a rank runs Level 1 on its heads, with no communication;
per-head parameters (``A_log``, ``dt_bias``, ``decay``) may be given whole and are sliced to the
rank's heads. Autograd works as in Level 1.

Context parallelism (``*_cp``): each rank holds a contiguous slice of the tokens, rank order =
token order. One pass per rank computes, with the chunk engine, its outputs from a zero incoming
state together with the affine summary of its slice: the value columns are extended by K zero
columns and the initial state by the identity, so the same pass also returns, per token, q^
carried through the slice's transitions (Q~_t = P_t^T q^_t) and, per sequence, the state it adds
(A) and its K x K transition (M). Without the delta rule (GLA, simple GLA, Lightning) the
transitions are diagonal, the products of the decays: the map of the piece that leaves the rank
(A, M) comes from its keys, values and gates in float32 (one product per head, no engine pass),
and after the exchange one engine pass from the incoming state gives the outputs and final states
with no correction. The ranks exchange (A, M) - a size independent of the number
of tokens - and each composes its predecessors' maps in order (X <- X M_j + A_j, float32), which
gives its incoming state X (``_cp_exchange``: an all-gather, or a log-depth scan of point-to-point
messages beyond 8 ranks); its outputs are then o_t + X Q~_t and its final states A + X M. Dense batches:
every sequence spans every rank. Packed varlen batches (B = 1): ``cu_seqlens`` holds the *global*
offsets (the same tensor on every rank), and sequences may cross rank boundaries; the local slice
is the rank's tokens in rank order (``split_tokens_for_sp`` / ``split_cu_seqlens_for_sp``), in any
proportions (``shares``; ``cp_shares`` gives the first rank, which runs no summary columns, more).
Sequence-complete partitioning is the other mode (``split_sequences_for_sp``: runs of whole
sequences per rank, the boundaries at the sequence boundaries nearest the even token split): given
the same global ``cu_seqlens``, chunk_cp sees that no sequence crosses a rank and runs Level 1 on
each rank's sequences, with no summary and no exchange (the backward is Level 1's); only the final
states meet, in one sum over the ranks. Global offsets are what chunk_cp takes in both modes; the
local ones (the split helpers' first result) are for the caller's own indexing.
Initial states are global ``[N, HV, V, K]`` (read by the rank where a sequence starts); the final
states of all sequences are returned on every rank. The backward mirrors it (``_cp_backward``):
a local backward with no gradient leaving the slice gives, per sequence entering it, the gradient
it sends back (R) beside its transition (M); the ranks exchange (R, M) the same way and each
composes its successors' maps from the last (Y <- Y M^T + R), which gives the gradient arriving at the end of its
slice, and a second local backward uses it. Gradients of the final states are summed over the
ranks (they are returned on every rank); those of inputs every rank holds whole (A_log, dt_bias,
the global initial states) are each rank's part, to be summed over the group as for any weight.

Deterministic mode (``chunk_cp(..., deterministic=True)``, ``_cp_segments``): the same summary
algebra on a grid of segments fixed by the caller instead of the rank boundaries, so that every
result is bitwise the same for any number of ranks.

Head parallelism over the same token split (``chunk_heads``, Ulysses): an all-to-all gives each
rank every token of H / size of the heads, whole sequences run there, and an all-to-all brings the
outputs back; exact for any number of ranks and differentiable, at the price of moving the
activations twice. ``chunk_sp`` picks it when the heads divide over the ranks, else CP, and
``last_plan()`` says which it picked.
"""

from __future__ import annotations

from . import _cp_exchange, _cp_segments, ops
from ._cp_summary import DIAGONAL as _DIAGONAL, diagonal_end_state as _diagonal_end_state, precise_maps
from ._front import LazyFunction, _needs_grad, chunk
from ._lib import CulaError

__all__ = [
    "chunk_tp", "chunk_cp", "chunk_tp_cp", "chunk_fla_cp", "chunk_heads", "chunk_sp", "last_plan", "last_exchange",
    "cula_kda_tp", "cula_kda_cp", "cula_kda_tp_cp", "cula_gdn_tp", "cula_gdn_cp", "cula_gdn_tp_cp",
    "cula_lightning_tp", "cula_lightning_cp",
    "alloc_state_buffer", "alloc_decode_state_pool", "shard_heads", "split_tokens_for_sp", "split_cu_seqlens_for_sp",
    "cp_shares",
    "split_sequences_for_sp",
]


def _dist():
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        raise CulaError("cula.dist: torch.distributed is not initialised (call torch.distributed.init_process_group)")
    return dist


def _group_info(group, size, rank, size_name, rank_name):
    dist = _dist()
    real_size, real_rank = dist.get_world_size(group), dist.get_rank(group)
    if size is not None and size != real_size:
        raise CulaError(f"argument '{size_name}': expected the size of the process group ({real_size}), got {size}")
    if rank is not None and rank != real_rank:
        raise CulaError(f"argument '{rank_name}': expected this process's rank in the group ({real_rank}), got {rank}")
    return dist, real_size, real_rank


def _same_on_every_rank(dist, group, values, names, device):
    """Checks that the integers ``values`` agree across the group; raises naming the first that does not."""
    _check_same(names, _gathered_rows(dist, group, values, device))


def _gathered_rows(dist, group, values, device):
    """Every rank's integers ``values`` (one collective), as one tuple per rank."""
    import torch

    mine = torch.tensor(values, dtype=torch.int64, device=device)
    return [tuple(t.tolist()) for t in _cp_exchange.all_gather(dist, group, mine)]


def _check_same(names, rows):
    for j, column in enumerate(zip(*rows)):
        if len(set(column)) != 1:
            raise CulaError(f"argument '{names[j]}': expected the same value on every rank, got {list(column)} by rank")


_OFFSETS_HASH = (1_000_003, (1 << 61) - 1)  # a polynomial hash of the global offsets (multiplier, modulus)


def _offsets_hash(cu):
    mult, mod = _OFFSETS_HASH
    h = 0
    for x in cu:
        h = (h * mult + x + 1) % mod
    return h


def _slice_param(x, per_head_total, per_head_local, rank, name):
    """A per-head parameter given whole (per_head_total entries per head group) or already sliced."""
    if x is None:
        return None
    n = x.numel()
    if n == per_head_local or per_head_total == per_head_local:
        return x
    if n != per_head_total:
        raise CulaError(f"argument '{name}': expected {per_head_local} values (this rank's heads) or {per_head_total} "
                        f"(all heads), got {n}")
    flat = x.reshape(-1)
    return flat[rank * per_head_local:(rank + 1) * per_head_local].reshape(
        (per_head_local,) if x.dim() == 1 else (-1, *x.shape[1:]))


# ---------------------------------------------------------------- tensor parallelism


def _rank_head_params(A_log, dt_bias, decay, H, HV, K, size, rank):
    """A_log [HV], dt_bias [HV * K] or [HV] and decay [H] or [HV] for this rank's H q/k heads and HV
    value heads, each given for all heads (sliced here) or for this rank's."""
    A_log = _slice_param(A_log, HV * size, HV, rank, "A_log")
    per_channel = dt_bias is not None and dt_bias.numel() in (HV * K, HV * K * size)
    dt_bias = _slice_param(dt_bias, HV * (K if per_channel else 1) * size, HV * (K if per_channel else 1), rank,
                           "dt_bias")
    if decay is not None:
        heads = HV if decay.numel() in (HV, HV * size) and decay.numel() != H * size else H
        decay = _slice_param(decay, heads * size, heads, rank, "decay")
    return A_log, dt_bias, decay


def chunk_tp(family, q, k, v, g=None, beta=None, decay=None, *, tp_group=None, tp_size=None, tp_rank=None,
             A_log=None, dt_bias=None, initial_state=None, **opts):
    """Level 1's chunked forward on this rank's heads (q, k [B, T, H/tp, K]; v [B, T, HV/tp, V]).
    Per-head parameters may be given for all heads (sliced here) or for this rank's heads."""
    dist, size, rank = _group_info(tp_group, tp_size, tp_rank, "tp_size", "tp_rank")
    H, K, HV = int(q.shape[2]), int(q.shape[3]), int(v.shape[2])
    _same_on_every_rank(dist, tp_group, [int(q.shape[0]), int(q.shape[1]), H, HV, K, int(v.shape[3])],
                        ["q (batch size)", "q (tokens)", "q (heads per rank)", "v (value heads per rank)",
                         "q (key head size)", "v (value head size)"], q.device)
    A_log, dt_bias, decay = _rank_head_params(A_log, dt_bias, decay, H, HV, K, size, rank)
    return chunk(family, q, k, v, g, beta, decay, A_log=A_log, dt_bias=dt_bias, initial_state=initial_state,
                 state_layout="k_last", state_dtype="float32", **opts)


# ---------------------------------------------------------------- context parallelism


def _pieces(cu, start, end, rank, size):
    """The local pieces of the global sequences (offsets cu) on tokens [start, end): a list of
    (sequence n, local begin, local end, crosses in, crosses out). An empty sequence belongs to the
    rank holding its offset (the last rank for offsets at the end)."""
    pieces = []
    for n in range(len(cu) - 1):
        a, b = cu[n], cu[n + 1]
        if a == b:
            if start <= a < end or (a == end and rank == size - 1):
                pieces.append((n, a - start, a - start, False, False))
            continue
        lo, hi = max(a, start), min(b, end)
        if lo < hi:
            pieces.append((n, lo - start, hi - start, a < start, b > end))
    return pieces


def _token_split(dist, group, q, v, cu_seqlens):
    """(every rank's number of tokens in rank order, the global offsets as a list or None), after
    checking that the ranks agree on the rest of the shapes and on the global offsets: one
    collective for all of it (the offsets by a 61-bit polynomial hash), which a context-parallel
    call pays before its first kernel."""
    B, T, H, K = (int(s) for s in q.shape)
    cu = None if cu_seqlens is None else [int(x) for x in cu_seqlens.tolist()]
    ncu = 0 if cu is None else len(cu)
    rows = _gathered_rows(dist, group, [B, H, int(v.shape[2]), K, int(v.shape[3]), ncu,
                                        0 if cu is None else _offsets_hash(cu), T], q.device)
    _check_same(["q (batch size)", "q (heads)", "v (value heads)", "q (key head size)", "v (value head size)",
                 "cu_seqlens (length)"], [r[:6] for r in rows])
    if len({r[6] for r in rows}) != 1:
        raise CulaError("argument 'cu_seqlens': expected the same global offsets on every rank")
    return [r[7] for r in rows], cu


def _refuse_cp_options(opts, q, k, v, g, beta, initial_state):
    """Options context parallelism does not take."""
    if opts.get("state_layout", "k_last") == "k_last" and opts.get("state_dtype", "float32") == "float32":
        opts.pop("state_layout", None), opts.pop("state_dtype", None)  # Level 1's convention: K-last float32
    for name in ("return_intermediate_states", "state_pool", "state_indices", "state_layout", "state_dtype"):
        if opts.get(name) not in (None, False):
            raise CulaError(f"cula.dist: argument '{name}': not supported with context parallelism")
        opts.pop(name, None)


def chunk_cp(family, q, k, v, g=None, beta=None, decay=None, *, sp_group=None, sp_size=None, sp_rank=None,
             initial_state=None, output_final_state=True, cu_seqlens=None, deterministic=False, segment_len=4096,
             exchange="auto", _split=None, **opts):
    """The chunked forward of this rank's tokens (q, k, v ... [B, T_rank, ...], rank order = token
    order) with the state carried over from the ranks before: see the module docstring. Returns
    (o of the local tokens, final states [N, HV, V, K] of every sequence on every rank, or None).

    deterministic=True: outputs, final states and gradients bitwise identical for any number of
    ranks (``_cp_segments``): the tokens are cut on a grid of ``segment_len`` global positions, on
    which every rank's slice must start; one engine call per segment.

    exchange: how the ranks' summaries meet (``_cp_exchange``): "all_gather", "scan" (log-depth,
    point to point) or "auto" (the planner: the all-gather up to 8 ranks); ``last_exchange()`` says
    which ran. The deterministic mode folds its segments in order after an all-gather. (_split:
    _token_split's answer when the caller, chunk_sp, has already paid its collective.)"""

    dist, size, rank = _group_info(sp_group, sp_size, sp_rank, "sp_size", "sp_rank")
    _refuse_cp_options(opts, q, k, v, g, beta, initial_state)
    B, T, H, K = (int(s) for s in q.shape)
    HV, V = int(v.shape[2]), int(v.shape[3])
    dev = q.device
    lengths, cu = _split or _token_split(dist, sp_group, q, v, cu_seqlens)
    start = sum(lengths[:rank])
    end, total = start + T, sum(lengths)
    if cu_seqlens is not None:
        if B != 1:
            raise CulaError(f"argument 'q': expected batch size 1 when cu_seqlens is given (sequences packed along T), "
                            f"got batch size {B}")
        if cu[0] != 0 or cu[-1] != total or any(b < a for a, b in zip(cu, cu[1:])):
            raise CulaError(f"argument 'cu_seqlens': expected non-decreasing global offsets from 0 to the total "
                            f"number of tokens over the ranks ({total}), got {cu}")
        pieces = _pieces(cu, start, end, rank, size)
        N = len(cu) - 1
    else:
        N = B
        pieces = [(n, 0, T, rank > 0, rank < size - 1) for n in range(B)]
    if initial_state is not None and tuple(initial_state.shape) != (N, HV, V, K):
        raise CulaError(f"argument 'initial_state': expected the global K-last states [N, HV, V, K] = "
                        f"{[N, HV, V, K]}, got shape {list(initial_state.shape)}")
    packed = cu_seqlens is not None
    A_log, dt_bias = opts.pop("A_log", None), opts.pop("dt_bias", None)
    how, why = ("all_gather", "deterministic=True: segments folded in order") if deterministic else \
        _cp_exchange.choose(size, exchange)
    if deterministic and exchange not in ("auto", "all_gather"):
        raise CulaError(f"argument 'exchange': expected 'auto' or 'all_gather' with deterministic=True (the segments "
                        f"fold in order), got {exchange!r}")
    _LAST_EXCHANGE.clear()
    if packed and not deterministic and _sequences_whole(cu, lengths):
        _LAST_EXCHANGE.update(exchange="none", reason="every sequence whole on one rank (a split on sequence "
                                                     "boundaries): Level 1 per rank, no summary")
        return _cp_whole_sequences(family, q, k, v, g, beta, decay, dist, sp_group, pieces, N, initial_state,
                                   output_final_state, dict(opts, A_log=A_log, dt_bias=dt_bias))
    _LAST_EXCHANGE.update(exchange=how, reason=why)
    if deterministic:
        plan = _cp_segments.Plan(cu if packed else None, B, lengths, rank, segment_len)
        if _needs_grad(q, k, v, g, beta, initial_state, A_log, dt_bias):
            o, out = _SegmentsCP.apply(family, decay, dist, sp_group, rank, plan, N, opts,
                                       q, k, v, g, beta, A_log, dt_bias, initial_state)
        else:
            o, out = _cp_segments.forward(family, q, k, v, g, beta, decay, dist, sp_group, plan, N, initial_state,
                                          dict(opts, A_log=A_log, dt_bias=dt_bias))
        return o, (out if output_final_state else None)
    if _needs_grad(q, k, v, g, beta, initial_state, A_log, dt_bias):
        o, out = _ChunkCP.apply(family, decay, dist, sp_group, rank, size, pieces, packed, N, opts, how,
                                q, k, v, g, beta, A_log, dt_bias, initial_state)
        return o, (out if output_final_state else None)
    o, final, _ = _cp_pieces(family, q, k, v, g, beta, decay, dist, sp_group, rank, pieces, packed, initial_state,
                             dict(opts, A_log=A_log, dt_bias=dt_bias), how)
    if not output_final_state:
        return o, None
    return o, _gather_finals(dist, sp_group, final, N, HV, V, K, dev)


_LAST_EXCHANGE = {}


def _sequences_whole(cu, lengths):
    """Whether no sequence of the global offsets cu crosses a rank boundary (every rank computes the
    same answer from the same global values, so all of them take the same path)."""
    bounds, at = set(cu), 0
    for n in lengths[:-1]:
        at += n
        if at not in bounds:
            return False
    return True


def _cp_whole_sequences(family, q, k, v, g, beta, decay, dist, group, pieces, N, initial_state, output_final_state,
                        opts):
    """chunk_cp where every sequence lies whole on one rank (split_sequences_for_sp): Level 1 on this
    rank's sequences, its autograd the backward, no summary and no exchange; the final states meet
    in one sum over the ranks (each sequence's from its own rank, differentiable)."""
    import torch

    HV, V, K = int(v.shape[2]), int(v.shape[3]), int(q.shape[3])
    dev = q.device
    mine = [p[0] for p in pieces]  # this rank's sequences, consecutive global indices
    if not mine:  # no sequence here (then no token): a call on one empty sequence keeps the inputs in the
        # graph, so that the parameters get (zero) gradients here too and the backward reaches the collective
        o, _ = chunk(family, q, k, v, g, beta, decay, cu_seqlens=torch.zeros(2, dtype=torch.int32, device=dev),
                     state_layout="k_last", state_dtype="float32", **opts)
        fin = q.new_zeros(0, HV, V, K, dtype=torch.float32)
    else:
        h0 = None if initial_state is None else initial_state[mine[0]:mine[-1] + 1]
        o, fin = chunk(family, q, k, v, g, beta, decay, initial_state=h0, output_final_state=output_final_state,
                       cu_seqlens=_local_offsets(pieces, True, dev), state_layout="k_last", state_dtype="float32",
                       **opts)
    if not output_final_state:
        return o, None
    return _SumOverRanks.apply(o, fin, mine[0] if mine else 0, N, dist, group)


def _make_sum_over_ranks():
    import torch

    class SumOverRanks(torch.autograd.Function):
        """(o passed through, the [N, ...] final states): rows [n0, n0 + len) from this rank, zeros
        elsewhere, summed over the group, so every rank ends with all N. Backward: the states'
        gradient summed over the group too (each rank returns them), each rank keeping its rows. o
        rides along so that every rank's backward reaches the collective, also where its final
        states are not in the loss (their gradient is then zero)."""

        @staticmethod
        def forward(ctx, o, local, n0, N, dist, group):
            out = local.new_zeros(N, *local.shape[1:])
            out[n0:n0 + local.shape[0]] = local
            dist.all_reduce(out, group=group)
            ctx.meta = (n0, int(local.shape[0]), dist, group)
            return o.view_as(o), out

        @staticmethod
        def backward(ctx, d_o, d_out):
            n0, n, dist, group = ctx.meta
            d = d_out.contiguous().clone()  # (zeros where the states were unused: gradients materialise)
            dist.all_reduce(d, group=group)
            return d_o, d[n0:n0 + n], None, None, None, None

    return SumOverRanks


_SumOverRanks = LazyFunction(_make_sum_over_ranks)


def last_exchange():
    """{"exchange": "all_gather" | "scan", "reason": ...} of the last chunk_cp call of this process."""
    return dict(_LAST_EXCHANGE)


def _gather_finals(dist, group, final, N, HV, V, K, dev):
    import torch

    out = torch.zeros(N, HV, V, K, dtype=torch.float32, device=dev)
    for n, s in final.items():
        out[n] = s
    dist.all_reduce(out, group=group)  # each sequence's state comes from one rank, zeros from the others
    return out


def _cp_backward(family, q, k, v, g, beta, decay, A_log, dt_bias, dist, group, rank, size, pieces, packed, saved,
                 d_out, d_final, opts, exchange, initial_state=None):
    """The gradients of this rank's inputs (the reverse of _cp_pieces). The gradient leaving a piece
    that continues on the next rank is not known here: a first local backward, with zero for it,
    gives the gradient each crossing-in piece sends back (R, at the piece's start); the ranks
    all-gather (R, M) of their first pieces - a size independent of the number of tokens - and each
    folds its successors from the last (Y <- Y M_j^T + R_j), which gives the gradient arriving at
    its crossing-out piece; the second local backward uses it. Linear attention's state gradient
    at a piece's start is affine in the one at its end (dS_in = dS_out M^T + R), so this is exact."""
    import torch

    B, T, H, K = (int(s) for s in q.shape)
    HV, V = int(v.shape[2]), int(v.shape[3])
    dev = q.device
    rows = 1 if packed else B
    n_p = len(pieces)
    dfin = torch.zeros(n_p, HV, V, K, dtype=torch.float32, device=dev)
    for i, (n, _, _, _, cout) in enumerate(pieces):
        if not cout and d_final is not None:
            dfin[i] = d_final[n]

    # The states entering the pieces and their transitions again, from float32 maps (precise_maps)
    # instead of the forward's engine summaries, whose bf16-level error would reach the reduced
    # gradients (dA_log): the same exchange as the forward's.
    spans = [(0 if packed else n, lo, hi) for n, lo, hi, _, _ in pieces]
    h0s = [initial_state[n] if initial_state is not None and not cin else None for n, _, _, cin, _ in pieces]
    A_p, M_p = precise_maps(family, q, k, v, g, beta, decay, spans, dict(opts, A_log=A_log, dt_bias=dt_bias), h0=h0s)
    M_p = torch.stack([M_p[i] if p[3] else torch.zeros_like(M_p[i]) for i, p in enumerate(pieces)]) if pieces else M_p
    X = _incoming_states(dist, group, rank, pieces, rows, A_p, M_p, exchange)
    init = saved["init"].clone()
    for i, (n, _, _, cin, _) in enumerate(pieces):
        if cin:
            init[i] = X[0] if packed else X[n]

    def local_backward(d_final_state):
        if not pieces:
            return {}
        return ops.chunk_bwd(family, q, k, v, g, beta, d_out, decay=decay, d_final_state=d_final_state,
                             initial_state=init, A_log=A_log, dt_bias=dt_bias, cu_seqlens=saved["local_cu"],
                             state_layout="k_last", **opts)

    crossing_out = [i for i, p in enumerate(pieces) if p[4]]
    first = local_backward(dfin)
    # exchange: the first piece's R and M where it crosses in (dense: every row)
    send_R = torch.zeros(rows, HV, V, K, dtype=torch.float32, device=dev)
    send_M = torch.zeros(rows, HV, K, K, dtype=torch.float32, device=dev)
    flags = torch.zeros(rows, 2, dtype=torch.int64, device=dev)  # (crosses in, also crosses out)
    for i, (n, _, _, cin, cout) in enumerate(pieces):
        if cin:
            row = 0 if packed else n
            send_R[row] = first["d_initial_state"][i].float()
            send_M[row] = M_p[i]
            flags[row, 0], flags[row, 1] = 1, int(cout)
    # the gradient arriving from the ranks after, their maps Y -> Y M^T + R (Y passed through where the
    # row also crosses out there, nothing where it does not cross in) composed from the last rank
    cin, through = (flags[:, c].view(rows, 1, 1, 1) > 0 for c in (0, 1))
    zero_M = torch.zeros_like(send_M)
    Y = _cp_exchange.incoming(dist, group, rank, size,
                              torch.where(cin & through, send_M.transpose(-1, -2), zero_M),
                              torch.where(cin, send_R, torch.zeros_like(send_R)), exchange, reverse=True)
    if not crossing_out:
        return first
    for i in crossing_out:
        dfin[i] = Y[0] if packed else Y[pieces[i][0]]
    return local_backward(dfin)


def _make_chunk_cp_fn():
    import torch

    class ChunkCP(torch.autograd.Function):
        """chunk_cp with autograd: the forward of _cp_pieces, the backward of _cp_backward. The final
        states are returned on every rank (an all-reduce): their gradients are summed over the ranks,
        as torch.distributed.nn's all_reduce does. The gradients of inputs every rank holds whole
        (A_log, dt_bias, the global initial states) are this rank's part: sum them over the group as
        for any weight under sequence parallelism."""

        @staticmethod
        def forward(ctx, family, decay, dist, group, rank, size, pieces, packed, N, opts, exchange,
                    q, k, v, g, beta, A_log, dt_bias, initial_state):
            o, final, saved = _cp_pieces(family, q, k, v, g, beta, decay, dist, group, rank, pieces, packed,
                                         initial_state, dict(opts, A_log=A_log, dt_bias=dt_bias), exchange,
                                         for_backward=True)
            HV, V, K = int(v.shape[2]), int(v.shape[3]), int(q.shape[3])
            # (N None: FLA's cp_context, which has no final states; an empty tensor stands for them)
            out = q.new_zeros(0, dtype=torch.float32) if N is None else _gather_finals(dist, group, final, N, HV, V, K,
                                                                                      q.device)
            ctx.meta = (family, decay, dist, group, rank, size, pieces, packed, N, opts, exchange, saved)
            ctx.save_for_backward(q, k, v, g, beta, A_log, dt_bias, initial_state)
            return o, out

        @staticmethod
        def backward(ctx, d_out, d_final):
            family, decay, dist, group, rank, size, pieces, packed, N, opts, exchange, saved = ctx.meta
            q, k, v, g, beta, A_log, dt_bias, initial_state = ctx.saved_tensors
            HV, V, K = int(v.shape[2]), int(v.shape[3]), int(q.shape[3])
            # (every rank takes part in the all-reduce, also where its final states were unused)
            if N is None:
                d_final = None
            else:
                d_final = (torch.zeros(N, HV, V, K, dtype=torch.float32, device=q.device) if d_final is None
                           else d_final.float().contiguous())
                dist.all_reduce(d_final, group=group)
            grads = _cp_backward(family, q, k, v, g, beta, decay, A_log, dt_bias, dist, group, rank, size, pieces,
                                 packed, saved, d_out.contiguous(), d_final, opts, exchange, initial_state)
            out = []
            for name, x in (("dq", q), ("dk", k), ("dv", v), ("dg", g), ("dbeta", beta), ("dA_log", A_log),
                            ("ddt_bias", dt_bias)):
                gr = grads.get(name)
                out.append(None if x is None or gr is None else gr.to(x.dtype))
            d_h0 = None
            if initial_state is not None and "d_initial_state" in grads:
                d_h0 = torch.zeros_like(initial_state, dtype=torch.float32)
                for i, (n, _, _, cin, _) in enumerate(pieces):
                    if not cin:
                        d_h0[n] = grads["d_initial_state"][i]
                d_h0 = d_h0.to(initial_state.dtype)
            return (None,) * 11 + (*out, d_h0)

    return ChunkCP


_ChunkCP = LazyFunction(_make_chunk_cp_fn)


def _make_segments_cp_fn():
    import torch

    class SegmentsCP(torch.autograd.Function):
        """chunk_cp(deterministic=True) with autograd (_cp_segments.forward / backward). Every rank
        computes every final state; their gradients are summed over the ranks, as in ChunkCP."""

        @staticmethod
        def forward(ctx, family, decay, dist, group, rank, plan, N, opts,
                    q, k, v, g, beta, A_log, dt_bias, initial_state):
            o, out = _cp_segments.forward(family, q, k, v, g, beta, decay, dist, group, plan, N, initial_state,
                                          dict(opts, A_log=A_log, dt_bias=dt_bias))
            ctx.meta = (family, decay, dist, group, rank, plan, N, opts)
            ctx.save_for_backward(q, k, v, g, beta, A_log, dt_bias, initial_state)
            return o, out

        @staticmethod
        def backward(ctx, d_out, d_final):
            family, decay, dist, group, rank, plan, N, opts = ctx.meta
            q, k, v, g, beta, A_log, dt_bias, initial_state = ctx.saved_tensors
            HV, V, K = int(v.shape[2]), int(v.shape[3]), int(q.shape[3])
            d_final = (torch.zeros(N, HV, V, K, dtype=torch.float32, device=q.device) if d_final is None
                       else d_final.float().contiguous())
            dist.all_reduce(d_final, group=group)
            grads = _cp_segments.backward(family, q, k, v, g, beta, decay, A_log, dt_bias, dist, group, rank, plan,
                                          initial_state, d_out.contiguous(), d_final, opts)
            out = []
            for name, x in (("dq", q), ("dk", k), ("dv", v), ("dg", g), ("dbeta", beta), ("dA_log", A_log),
                            ("ddt_bias", dt_bias), ("d_initial_state", initial_state)):
                gr = grads.get(name)
                out.append(None if x is None or gr is None else gr.to(x.dtype))
            return (None,) * 8 + tuple(out)

    return SegmentsCP


_SegmentsCP = LazyFunction(_make_segments_cp_fn)


def _incoming_states(dist, group, rank, pieces, rows, A, M, exchange):
    """The state entering this rank per row [rows, HV, V, K]: the maps X -> X M + A of the pieces
    leaving the ranks before (dense: every row; packed: the last piece), composed in rank order (a
    row that does not leave a rank passes nothing on: its map is zero). A, M: per piece, M None or
    zero where the piece does not cross in."""
    import torch

    HV, V, K = (int(s) for s in A.shape[1:])  # (A has these even with no piece: [0, HV, V, K])
    dev = A.device
    send_A = torch.zeros(rows, HV, V, K, dtype=torch.float32, device=dev)
    send_M = torch.zeros(rows, HV, K, K, dtype=torch.float32, device=dev)
    for row, i in enumerate(i for i, p in enumerate(pieces) if p[4]):  # (dense: the rows in order)
        send_A[row] = A[i]
        if M is not None:
            send_M[row] = M[i]
    return _cp_exchange.incoming(dist, group, rank, dist.get_world_size(group), send_M, send_A, exchange)


def _cp_pieces(family, q, k, v, g, beta, decay, dist, group, rank, pieces, packed, initial_state, opts, exchange,
               for_backward=False):
    """The context-parallel pass over this rank's pieces [(sequence n, local begin, local end,
    crosses in, crosses out)] (packed: one row of packed sequences, else one piece per batch row).
    Returns (o, {n: final state [HV, V, K] of each sequence ending here})."""
    import torch

    B, T, H, K = (int(s) for s in q.shape)
    HV, V = int(v.shape[2]), int(v.shape[3])
    dev = q.device
    crossing_in = any(p[3] for p in pieces)
    if crossing_in and family in _DIAGONAL:
        return _cp_pieces_diagonal(family, q, k, v, g, decay, dist, group, rank, pieces, packed, initial_state,
                                   opts, exchange, for_backward)
    # One pass. Delta rule: values extended by K zero columns (value_dim: read as zeros by the engine,
    # no copy), the crossing-in pieces' initial state by the identity (the extension carries M and Q~),
    # and a correction of o by Q~ and the incoming state.
    W = V + K if crossing_in else V
    own = _own_initial_states(pieces, initial_state, HV, V, K, dev)
    init = torch.zeros(len(pieces), HV, W, K, dtype=torch.float32, device=dev)
    init[:, :, :V, :] = own
    for i, p in enumerate(pieces):
        if p[3]:
            init[i, :, V:, :] = torch.eye(K, dtype=torch.float32, device=dev)
    local_cu = _local_offsets(pieces, packed, dev)
    # Where a correction is added, the pass writes float32 (the engines' accumulators unrounded, Q~
    # included) and o is rounded once, after the correction.
    out = torch.empty(B, T, HV, W, dtype=torch.float32, device=dev) if crossing_in else None
    if packed and not pieces:  # no tokens and no sequence here
        ow, fw = v.new_empty(B, T, HV, W), init
    else:
        ow, fw = ops.chunk_fwd(family, q, k, v, g, beta, decay, initial_state=init, output_final_state=True,
                               cu_seqlens=local_cu, state_layout="k_last", state_dtype="float32", out=out,
                               value_dim=W if crossing_in else None, **opts)
    A, M = fw[:, :, :V, :], (fw[:, :, V:, :] if crossing_in else None)
    X = _incoming_states(dist, group, rank, pieces, 1 if packed else B, A, M, exchange)

    one_pass = dev.type == "cuda" and K in (64, 128) and V in (64, 128) and v.dtype in (torch.bfloat16, torch.float16)
    if crossing_in and one_pass:
        o = _corrected_in_one_pass(ow, X, pieces, packed, B, T, V, v.dtype)
    else:
        o = _corrected_by_torch(ow, X, pieces, packed, V, v.dtype, crossing_in)
    final = {}
    for i, (n, _, _, cin, cout) in enumerate(pieces):
        if not cout:
            final[n] = A[i] + torch.matmul(X[0] if packed else X[n], M[i]) if cin else A[i]
    if not for_backward:
        return o, final, None
    # for the backward: the pieces' own initial states (where they start a sequence) and the local
    # offsets; it folds the incoming states again from float32 maps
    return o, final, dict(init=own, local_cu=local_cu)


def _corrected_by_torch(ow, X, pieces, packed, V, dtype, crossing_in):
    """o with the carried-state correction by torch: one product per crossing-in piece accumulated into
    o's float32 view, then one rounding copy (the host, and head sizes the CUDA correction does not take)."""
    import torch

    o = ow[..., :V] if crossing_in else ow  # (a view: the correction adds in place, the rounding copies once)
    with _tf32_products(dtype != torch.float32):
        for i, (n, lo, hi, _, _) in ((i, p) for i, p in enumerate(pieces) if p[3]):
            b, x = (0, X[0]) if packed else (n, X[n])  # x: [HV, V, K]
            # Q~: q^ through this piece's transitions [L, HV, K]; per head o += Q~ x^T [L, V], one
            # product accumulated into o's strided view (baddbmm_: the GEMM reads and writes o, no
            # temporary and no separate add). Not bmm_f32: its output is as large as o, and the bf16
            # split's three passes over it took longer than the float32 product.
            o[b, lo:hi].transpose(0, 1).baddbmm_(ow[b, lo:hi, :, V:].transpose(0, 1), x.transpose(1, 2))
    return o.to(dtype)


def _corrected_in_one_pass(ow, X, pieces, packed, B, T, V, dtype):
    """o with the carried-state correction on CUDA for a 16-bit o: ops.cp_correct over each crossing-in
    piece (ow read once, o written once, rounded; 0.59 ms at 65536 tokens and 16 heads on an H200
    against 0.41 + 0.33 for torch's TF32 product and rounding copy), a rounding copy of the tokens no
    piece corrects."""
    import torch

    o = torch.empty(B, T, ow.shape[2], V, dtype=dtype, device=ow.device)
    done = {}
    for n, lo, hi, cin, _ in pieces:
        if cin and hi > lo:
            b, x = (0, X[0]) if packed else (n, X[n])
            ops.cp_correct(ow[b, lo:hi], x.float().contiguous(), o[b, lo:hi])
            done.setdefault(b, []).append((lo, hi))
    for b in range(B):
        at = 0
        for lo, hi in sorted(done.get(b, [])) + [(T, T)]:
            if lo > at:
                o[b, at:lo].copy_(ow[b, at:lo, :, :V])
            at = max(at, hi)
    return o


class _tf32_products:
    """TF32 float32 matmuls inside the block when `on` (torch's flag, restored on exit). For the
    carried-state correction of a 16-bit o: a TF32 product's error (about 2^-11 of the term) stays
    under the bf16 rounding that follows (2^-9), and on an H100 the product takes 0.58 ms instead of
    1.00 at 65536 tokens and 16 heads (a CP rank's step 4.67 -> 4.22 ms). float32 outputs keep the
    float32 product. The flag is process state: a thread running float32 matmuls beside a CP call
    may see it set."""

    def __init__(self, on):
        self.on = on

    def __enter__(self):
        import torch

        if self.on:
            self.was = torch.backends.cuda.matmul.allow_tf32
            torch.backends.cuda.matmul.allow_tf32 = True

    def __exit__(self, *exc):
        import torch

        if self.on:
            torch.backends.cuda.matmul.allow_tf32 = self.was


def _own_initial_states(pieces, initial_state, HV, V, K, dev):
    """Each piece's own initial state [pieces, HV, V, K] in float32: its sequence's initial state
    where the piece starts the sequence, zero where it crosses in."""
    import torch

    init = torch.zeros(len(pieces), HV, V, K, dtype=torch.float32, device=dev)
    for i, (n, _, _, cin, _) in enumerate(pieces):
        if initial_state is not None and not cin:
            init[i] = initial_state[n].to(device=dev, dtype=torch.float32)
    return init


def _local_offsets(pieces, packed, dev):
    """The local cu_seqlens of a packed row's pieces (None for a dense batch or no piece)."""
    import torch

    if not (packed and pieces):
        return None
    return torch.tensor([pieces[0][1]] + [p[2] for p in pieces], dtype=torch.int32, device=dev)


def _cp_pieces_diagonal(family, q, k, v, g, decay, dist, group, rank, pieces, packed, initial_state, opts, exchange,
                        for_backward):
    """_cp_pieces for the families without the delta rule, where a piece's map (A, M) comes from its
    keys, values and gates alone (diagonal_end_state: one product per head, no pass over q and no
    outputs): the maps of the pieces that leave the rank first, the exchange, then one engine pass
    from the right initial states (the incoming ones where a piece crosses in), which gives o
    rounded once and the final states, with no correction."""
    import torch

    B, T, H, K = (int(s) for s in q.shape)
    HV, V = int(v.shape[2]), int(v.shape[3])
    dev = q.device
    init = _own_initial_states(pieces, initial_state, HV, V, K, dev)
    A = torch.zeros(len(pieces), HV, V, K, dtype=torch.float32, device=dev)
    M = torch.zeros(len(pieces), HV, K, K, dtype=torch.float32, device=dev)
    for i, (n, lo, hi, cin, cout) in enumerate(pieces):
        if cout:  # (only the maps of pieces that leave the rank travel)
            b = 0 if packed else n
            A[i], m = _diagonal_end_state(family, k[b, lo:hi], v[b, lo:hi], None if g is None else g[b, lo:hi],
                                          decay, HV, opts, None if cin else init[i])
            if cin:
                M[i] = m
    X = _incoming_states(dist, group, rank, pieces, 1 if packed else B, A, M, exchange)
    start = init.clone()
    for i, (n, _, _, cin, _) in enumerate(pieces):
        if cin:
            start[i] = X[0] if packed else X[n]
    local_cu = _local_offsets(pieces, packed, dev)
    if packed and not pieces:  # no tokens and no sequence here
        o, fw = v.new_empty(B, T, HV, V), start
    else:
        o, fw = ops.chunk_fwd(family, q, k, v, g, None, decay, initial_state=start, output_final_state=True,
                              cu_seqlens=local_cu, state_layout="k_last", state_dtype="float32", **opts)
    final = {n: fw[i] for i, (n, _, _, _, cout) in enumerate(pieces) if not cout}
    if not for_backward:
        return o, final, None
    return o, final, dict(init=init, local_cu=local_cu)


def chunk_fla_cp(family, q, k, v, g=None, beta=None, decay=None, *, cp_context, initial_state=None,
                 output_final_state=False, **opts):
    """Context parallelism driven by FLA's context object (``fla.ops.cp.FLACPContext``, contiguous
    layout, or any object with its fields ``group``, ``cu_seqlens`` - this rank's local offsets -,
    ``is_first_rank`` and ``is_last_rank``): the FLA drop-ins' ``cp_context``. As in FLA, no
    initial or final states. With autograd (chunk_cp's backward): the gradients of A_log and
    dt_bias are this rank's part, summed over the group as for any weight."""
    layout = getattr(cp_context, "layout", "contiguous")
    if layout != "contiguous":
        raise NotImplementedError(f"cula.dist: cp_context with layout {layout!r}: only the contiguous layout is "
                                  "supported")
    if initial_state is not None or output_final_state:
        raise CulaError("cula.dist: argument 'cp_context': initial and final states are not supported with FLA's "
                        "context parallelism (as in FLA); use cula.dist.chunk_cp for them")
    cu = getattr(cp_context, "cu_seqlens", None)
    if cu is None:
        raise CulaError("argument 'cp_context': expected a context with this rank's cu_seqlens, got None")
    dist, size, rank = _group_info(cp_context.group, None, None, "cp_context.group", "cp_context.group")
    _refuse_cp_options(opts, q, k, v, g, beta, None)
    offsets = [int(x) for x in cu.tolist()]
    last = len(offsets) - 2
    pieces = [(i, offsets[i], offsets[i + 1], i == 0 and not cp_context.is_first_rank,
               i == last and not cp_context.is_last_rank) for i in range(len(offsets) - 1)]
    how = _cp_exchange.choose(size, "auto")[0]
    A_log, dt_bias = opts.pop("A_log", None), opts.pop("dt_bias", None)
    opts.pop("chunk_size", None)  # (checked by the drop-in; the chunk size does not change the function)
    if _needs_grad(q, k, v, g, beta, A_log, dt_bias):  # chunk_cp's backward; A_log's and dt_bias's are this rank's part
        o, _ = _ChunkCP.apply(family, decay, dist, cp_context.group, rank, size, pieces, True, None, opts, how,
                              q, k, v, g, beta, A_log, dt_bias, None)
        return o, None
    o, _, _ = _cp_pieces(family, q, k, v, g, beta, decay, dist, cp_context.group, rank, pieces, True, None,
                         dict(opts, A_log=A_log, dt_bias=dt_bias), how)
    return o, None


# ---------------------------------------------------------------- head parallelism over a token split


def _heads_to_tokens(x, group, lengths, rank, size):
    """[B, T_rank, h, D] -> this rank's h / size heads over every rank's tokens [B, sum T, h / size, D]
    (an all-to-all; differentiable)."""
    import torch
    import torch.distributed.nn.functional as dfn

    B, T, h, D = x.shape
    per = h // size
    send = x.reshape(B, T, size, per, D).permute(2, 0, 1, 3, 4).contiguous().reshape(-1)
    recv = send.new_empty(B * sum(lengths) * per * D)
    recv = dfn.all_to_all_single(recv, send, [B * t * per * D for t in lengths], [B * T * per * D] * size, group=group)
    parts = torch.split(recv, [B * t * per * D for t in lengths])
    return torch.cat([p.reshape(B, t, per, D) for p, t in zip(parts, lengths)], dim=1)


def _tokens_to_heads(x, group, lengths, rank, size):
    """The inverse of _heads_to_tokens: [B, sum T, h / size, D] -> [B, T_rank, h, D]."""
    import torch
    import torch.distributed.nn.functional as dfn

    B, _, per, D = x.shape
    T = lengths[rank]
    send = torch.cat([p.reshape(-1) for p in torch.split(x, lengths, dim=1)])
    recv = send.new_empty(size * B * T * per * D)
    recv = dfn.all_to_all_single(recv, send, [B * T * per * D] * size, [B * t * per * D for t in lengths], group=group)
    return recv.reshape(size, B, T, per, D).permute(1, 2, 0, 3, 4).reshape(B, T, size * per, D)


def chunk_heads(family, q, k, v, g=None, beta=None, decay=None, *, sp_group=None, sp_size=None, sp_rank=None,
                initial_state=None, output_final_state=True, cu_seqlens=None, A_log=None, dt_bias=None, _split=None,
                **opts):
    """The same contract as chunk_cp (this rank's tokens in, this rank's outputs and every final state
    out) by head parallelism (Ulysses): an all-to-all gives each rank all the tokens of H / size of
    the heads, Level 1 runs whole sequences there, and an all-to-all brings the outputs back. Exact:
    each head is computed as on one GPU, for any number of ranks. Needs H and HV divisible by the
    group size; moves the activations twice instead of folding state summaries. Differentiable.
    (_split: as chunk_cp's.)"""
    import torch

    dist, size, rank = _group_info(sp_group, sp_size, sp_rank, "sp_size", "sp_rank")
    B, T, H, K = (int(s) for s in q.shape)
    HV = int(v.shape[2])
    if H % size or HV % size:
        raise CulaError(f"argument 'q': head parallelism needs H = {H} and HV = {HV} divisible by the group size "
                        f"{size}; use chunk_cp")
    lengths, _ = _split or _token_split(dist, sp_group, q, v, cu_seqlens)
    hv_per = HV // size
    mine = [_heads_to_tokens(x, sp_group, lengths, rank, size) for x in (q, k, v)]
    gates = []
    for x in (g, beta):
        if x is None:
            gates.append(None)
        elif x.dim() == 3:  # [B, T, HV]
            gates.append(_heads_to_tokens(x.unsqueeze(-1), sp_group, lengths, rank, size).squeeze(-1))
        else:
            gates.append(_heads_to_tokens(x, sp_group, lengths, rank, size))
    A_log = _slice_param(A_log, HV, hv_per, rank, "A_log") if A_log is not None and A_log.numel() == HV else A_log
    if dt_bias is not None and dt_bias.numel() in (HV, HV * K):
        per_channel = dt_bias.numel() == HV * K
        dt_bias = _slice_param(dt_bias, HV * (K if per_channel else 1), hv_per * (K if per_channel else 1), rank,
                               "dt_bias")
    if decay is not None:
        heads = H if decay.numel() == H else HV
        decay = _slice_param(decay, heads, heads // size, rank, "decay")
    # (the CUDA kernels read states dense: this rank's heads of the initial states as one block)
    h0 = None if initial_state is None else initial_state[:, rank * hv_per:(rank + 1) * hv_per].contiguous()
    o, final = chunk(family, *mine, *gates, decay, A_log=A_log, dt_bias=dt_bias, initial_state=h0,
                     output_final_state=output_final_state, cu_seqlens=cu_seqlens, state_layout="k_last",
                     state_dtype="float32", **opts)
    o = _tokens_to_heads(o, sp_group, lengths, rank, size)
    if not output_final_state:
        return o, None
    import torch.distributed.nn.functional as dfn

    return o, torch.cat(dfn.all_gather(final.contiguous(), group=sp_group), dim=1)


_LAST_PLAN = {}


def chunk_sp(family, q, k, v, g=None, beta=None, decay=None, *, sp_group=None, mode="auto", **kwargs):
    """Sequence parallelism with the mode chosen: "cp" when a packed batch is split on sequence
    boundaries (split_sequences_for_sp: chunk_cp then runs Level 1 per rank, nothing exchanged), else
    "heads" (chunk_heads: exact, differentiable, moves the activations) when the heads divide over
    the group, else "cp" (chunk_cp: a constant-size state exchange, differentiable); or the mode
    named. last_plan() says which ran. With ``deterministic=True`` it is context parallelism on
    chunk_cp's segment grid."""
    dist = _dist()
    size = dist.get_world_size(sp_group)
    if mode not in ("auto", "heads", "cp"):
        raise CulaError(f"argument 'mode': expected 'auto', 'heads' or 'cp', got {mode!r}")
    H, HV = int(q.shape[2]), int(v.shape[2])
    deterministic = kwargs.get("deterministic", False)
    if mode == "heads" and deterministic:
        raise CulaError("argument 'deterministic': head parallelism has no deterministic mode (the kernels may "
                        "differ with the number of heads per rank); use mode='cp' or 'auto'")
    # a packed batch in auto mode: the check of the ranks' shapes and offsets that chunk_cp and
    # chunk_heads make, once, tells whether every sequence lies whole on one rank (and the mode
    # chosen takes its answer)
    cu_seqlens = kwargs.get("cu_seqlens")
    split = None
    if mode == "auto" and not deterministic and cu_seqlens is not None:
        split = _token_split(dist, sp_group, q, v, cu_seqlens)
    if mode == "auto" and deterministic:
        mode, why = "cp", "deterministic=True: chunk_cp's segment grid"
    elif mode == "auto" and split is not None and _sequences_whole(split[1], split[0]):
        mode, why = "cp", "every sequence whole on one rank: chunk_cp runs Level 1 per rank with no exchange"
    elif mode == "auto":
        mode = "heads" if H % size == 0 and HV % size == 0 else "cp"
        why = (f"H = {H} and HV = {HV} divide over {size} ranks" if mode == "heads" else
               f"H = {H} or HV = {HV} does not divide over {size} ranks")
    else:
        why = "named by the caller"
    _LAST_PLAN.clear()
    _LAST_PLAN.update(mode=mode, reason=why)
    fn = chunk_heads if mode == "heads" else chunk_cp
    return fn(family, q, k, v, g, beta, decay, sp_group=sp_group, _split=split, **kwargs)


def last_plan():
    """{"mode": "heads" | "cp", "reason": ...} of the last chunk_sp call of this process."""
    return dict(_LAST_PLAN)


def chunk_tp_cp(family, q, k, v, g=None, beta=None, decay=None, *, tp_group=None, sp_group=None, tp_size=None,
                sp_size=None, tp_rank=None, sp_rank=None, A_log=None, dt_bias=None, **opts):
    """Heads sharded over tp_group and tokens over sp_group (a 2-D grid of ranks): context
    parallelism over this rank's heads, per-head parameters sliced as chunk_tp does."""
    dist, size, rank = _group_info(tp_group, tp_size, tp_rank, "tp_size", "tp_rank")
    A_log, dt_bias, decay = _rank_head_params(A_log, dt_bias, decay, int(q.shape[2]), int(v.shape[2]),
                                              int(q.shape[3]), size, rank)
    return chunk_cp(family, q, k, v, g, beta, decay, sp_group=sp_group, sp_size=sp_size, sp_rank=sp_rank,
                    A_log=A_log, dt_bias=dt_bias, **opts)


# ---------------------------------------------------------------- the RFC's entry points


def _kda_family(g):
    return "gdn" if g.dim() == 3 else "kda"


def cula_kda_tp(q, k, v, g, beta, *, tp_group=None, tp_size=None, tp_rank=None, **kwargs):
    """KDA (g [B, T, H, K]) or GDN (g [B, T, H]) over this rank's heads."""
    return chunk_tp(_kda_family(g), q, k, v, g, beta, tp_group=tp_group, tp_size=tp_size, tp_rank=tp_rank, **kwargs)


def cula_kda_cp(q, k, v, g, beta, *, sp_group=None, sp_size=None, sp_rank=None, initial_state=None,
                output_final_state=True, **kwargs):
    """KDA or GDN over this rank's tokens, the state carried over from the ranks before."""
    return chunk_cp(_kda_family(g), q, k, v, g, beta, sp_group=sp_group, sp_size=sp_size, sp_rank=sp_rank,
                    initial_state=initial_state, output_final_state=output_final_state, **kwargs)


def cula_kda_tp_cp(q, k, v, g, beta, *, tp_group=None, sp_group=None, tp_size=None, sp_size=None, tp_rank=None,
                   sp_rank=None, **kwargs):
    return chunk_tp_cp(_kda_family(g), q, k, v, g, beta, tp_group=tp_group, sp_group=sp_group, tp_size=tp_size,
                       sp_size=sp_size, tp_rank=tp_rank, sp_rank=sp_rank, **kwargs)


def cula_gdn_tp(q, k, v, g, beta, **kwargs):
    return chunk_tp("gdn", q, k, v, g, beta, **kwargs)


def cula_gdn_cp(q, k, v, g, beta, **kwargs):
    return chunk_cp("gdn", q, k, v, g, beta, **kwargs)


def cula_gdn_tp_cp(q, k, v, g, beta, **kwargs):
    return chunk_tp_cp("gdn", q, k, v, g, beta, **kwargs)


def cula_lightning_tp(Q, K, V, decay, *, tp_group=None, tp_size=None, tp_rank=None, **kwargs):
    return chunk_tp("lightning", Q, K, V, decay=decay, tp_group=tp_group, tp_size=tp_size, tp_rank=tp_rank, **kwargs)


def cula_lightning_cp(Q, K, V, decay, *, sp_group=None, sp_size=None, sp_rank=None, initial_state=None,
                      output_final_state=True, **kwargs):
    return chunk_cp("lightning", Q, K, V, decay=decay, sp_group=sp_group, sp_size=sp_size, sp_rank=sp_rank,
                    initial_state=initial_state, output_final_state=output_final_state, **kwargs)


# ---------------------------------------------------------------- utilities


def _heads_per_rank(num_heads, tp_size):
    if tp_size < 1 or num_heads % tp_size:
        raise CulaError(f"argument 'tp_size': expected a divisor of num_heads = {num_heads}, got {tp_size}")
    return num_heads // tp_size


def alloc_state_buffer(batch_size, num_heads, head_dim_k, head_dim_v, *, tp_size=1, dtype=None, device="cuda"):
    """Zeroed K-last states [batch_size, num_heads / tp_size, head_dim_v, head_dim_k] (float32 default)."""
    import torch

    return torch.zeros(batch_size, _heads_per_rank(num_heads, tp_size), head_dim_v, head_dim_k,
                       dtype=dtype or torch.float32, device=device)


def alloc_decode_state_pool(pool_size, num_heads, head_dim_k, head_dim_v, *, tp_size=1, dtype=None, device="cuda"):
    """A zeroed decode state pool [pool_size, num_heads / tp_size, head_dim_v, head_dim_k] (K-last)."""
    return alloc_state_buffer(pool_size, num_heads, head_dim_k, head_dim_v, tp_size=tp_size, dtype=dtype,
                              device=device)


def shard_heads(x, tp_size, tp_rank, dim=2):
    """This rank's slice of the heads of a whole tensor (dimension dim, default BSHD's H)."""
    n = int(x.shape[dim])
    per = _heads_per_rank(n, tp_size)
    return x.narrow(dim, tp_rank * per, per)


def _check_rank(sp_size, sp_rank):
    if not 0 <= sp_rank < sp_size:
        raise CulaError(f"argument 'sp_rank': expected a rank in [0, {sp_size}), got {sp_rank}")


def _token_range(total, sp_size, sp_rank, shares=None):
    """Rank sp_rank's global tokens [start, end) of total: an even split (the first total % sp_size
    ranks one token more), or with shares (one positive weight per rank) tokens in proportion to the
    weights, the remainder by largest fraction (ties to the lower rank)."""
    _check_rank(sp_size, sp_rank)
    if shares is None:
        per, extra = divmod(total, sp_size)
        start = sp_rank * per + min(sp_rank, extra)
        return start, start + per + (1 if sp_rank < extra else 0)
    w = [float(x) for x in shares]
    if len(w) != sp_size or not all(x > 0 and x != float("inf") for x in w):
        raise CulaError(f"argument 'shares': expected {sp_size} positive finite weights (one per rank), got {list(shares)}")
    sum_w = sum(w)
    exact = [total * x / sum_w for x in w]
    counts = [int(e) for e in exact]
    for r in sorted(range(sp_size), key=lambda r: (counts[r] - exact[r], r))[:total - sum(counts)]:
        counts[r] += 1
    start = sum(counts[:sp_rank])
    return start, start + counts[sp_rank]


def split_tokens_for_sp(x, sp_size, sp_rank, dim=1, shares=None):
    """This rank's contiguous slice of the tokens (dimension dim): the first total % sp_size ranks
    get one token more; shares (one positive weight per rank, e.g. ``cp_shares(...)``) splits the
    tokens in proportion instead."""
    start, end = _token_range(int(x.shape[dim]), sp_size, sp_rank, shares)
    return x.narrow(dim, start, end - start)


def cp_shares(family, K, V, sp_size):
    """Token shares for context parallelism that balance the ranks' passes under the cost model of
    docs/DIST.md: with the delta rule (KDA, GDN, DeltaNet) every rank but the first runs its pass
    over V + K value columns (the summary's) and the first over V, so the first takes (V + K) / V
    times the others' tokens (2x at K = V: a 4-rank bound of (w + 1) / 2 = 2.5x one GPU, against
    w / 2 = 2x for the even split). The families without the delta rule run one pass of V columns
    on every rank: even shares. A model, not a measurement: ``cula bench cp`` times both splits."""
    if sp_size < 1:
        raise CulaError(f"argument 'sp_size': expected a positive group size, got {sp_size}")
    first = (V + K) / V if family not in _DIAGONAL else 1.0
    return [first] + [1.0] * (sp_size - 1)


def split_sequences_for_sp(cu_seqlens, sp_size, sp_rank):
    """Sequence-complete partitioning of a packed batch, the other mode beside the token split: each
    rank takes a run of whole sequences, the rank boundaries put at the sequence boundaries nearest
    to the even token split (ranks may end up empty when sequences are few or long). Returns (the
    rank's local offsets [sequences + 1] int32, its global token range [start, end] int64): slice
    the rank's tensors as x[:, start:end] and pass chunk_cp the *global* cu_seqlens, which then runs
    Level 1 on each rank with no state exchange (``last_exchange()`` says "none")."""
    cu = [int(x) for x in cu_seqlens.tolist()]
    if len(cu) < 2 or cu[0] != 0 or any(b < a for a, b in zip(cu, cu[1:])):
        raise CulaError(f"argument 'cu_seqlens': expected non-decreasing offsets from 0, got {cu}")
    _check_rank(sp_size, sp_rank)
    total, bounds = cu[-1], [0]
    for r in range(1, sp_size):
        target = r * total / sp_size
        best = min((x for x in cu if x >= bounds[-1]), key=lambda x: (abs(x - target), x))
        bounds.append(best)
    bounds.append(total)
    return _rank_offsets(cu, bounds[sp_rank], bounds[sp_rank + 1], sp_rank, sp_size, cu_seqlens.device)


def split_cu_seqlens_for_sp(cu_seqlens, sp_rank, sp_size, max_seqlen=None, shares=None):
    """The token split split_tokens_for_sp makes of a packed batch (with the same shares): (local
    offsets of the pieces of the sequences on this rank [pieces + 1] int32, the rank's global token
    range [start, end] int64). chunk_cp takes the global cu_seqlens; this is for callers that index
    their own tensors. max_seqlen is accepted for the RFC's signature and not needed."""
    del max_seqlen
    cu = [int(x) for x in cu_seqlens.tolist()]
    return _rank_offsets(cu, *_token_range(cu[-1], sp_size, sp_rank, shares), sp_rank, sp_size, cu_seqlens.device)


def _rank_offsets(cu, start, end, rank, size, device):
    """What the split helpers return for the rank holding global tokens [start, end) of the packed
    offsets cu: (the local offsets of its pieces [pieces + 1] int32, [start, end] int64)."""
    import torch

    pieces = _pieces(cu, start, end, rank, size)
    local = [pieces[0][1] if pieces else 0] + [p[2] for p in pieces]
    return (torch.tensor(local, dtype=torch.int32, device=device),
            torch.tensor([start, end], dtype=torch.int64, device=device))
