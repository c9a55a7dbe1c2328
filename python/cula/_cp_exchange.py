"""The exchange of context parallelism (cula.dist), forward and backward: every rank holds an affine
map Z -> Z P + Q over its slice (the forward: the state it passes on, P = M, Q = A; the backward:
the state gradient it passes back, P = M^T, Q = R; P = Q = 0 where nothing passes), and each rank
needs the composition of the maps of the ranks before it (reverse: after it, the last one first),
evaluated at zero. Z and Q are [rows, HV, V, K], P [rows, HV, K, K], float32.

Two ways, the same function (in exact arithmetic; the products associate differently):
- "all_gather": one collective of every rank's map, then the w - 1 compositions on every rank.
- "scan": a log-depth exclusive scan over point-to-point messages of one map each (Hillis and
  Steele): one round shifts each map to the next rank, then ceil(log2 w) rounds in which each rank
  composes the map received from the rank 2^d before it. Moves one map per round instead of w.

The planner ("auto") takes the all-gather up to ALL_GATHER_UP_TO ranks (one collective's latency
against log2 w + 1 rounds'), the scan beyond."""

from __future__ import annotations

from ._lib import CulaError

ALL_GATHER_UP_TO = 8
EXCHANGES = ("auto", "all_gather", "scan")


def choose(size, exchange):
    """(the exchange to run, why) for a group of `size` ranks and the caller's choice."""
    if exchange not in EXCHANGES:
        raise CulaError(f"argument 'exchange': expected one of {list(EXCHANGES)}, got {exchange!r}")
    if exchange != "auto":
        return exchange, "exchange=" + repr(exchange)
    if size <= ALL_GATHER_UP_TO:
        return "all_gather", f"{size} ranks <= {ALL_GATHER_UP_TO}: one collective"
    return "scan", f"{size} ranks > {ALL_GATHER_UP_TO}: log-depth rounds"


def incoming(dist, group, rank, size, P, Q, how, reverse=False):
    """The composition of the other ranks' maps before this one (reverse: after it), at zero."""
    if how == "all_gather":
        return _by_all_gather(dist, group, rank, size, P, Q, reverse)
    return _by_scan(dist, group, rank, size, P, Q, reverse)


def all_gather(dist, group, x):
    """[every rank's x] (x of the same shape on every rank)."""
    import torch

    out = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
    dist.all_gather(out, x.contiguous(), group=group)
    return out


def _by_all_gather(dist, group, rank, size, P, Q, reverse):
    import torch

    all_P, all_Q = all_gather(dist, group, P), all_gather(dist, group, Q)
    order = range(size - 1, rank, -1) if reverse else range(rank)
    Z = torch.zeros_like(Q)
    for j in order:
        Z = torch.matmul(Z, all_P[j]) + all_Q[j]
    return Z


def _by_scan(dist, group, rank, size, P, Q, reverse):
    import torch

    K = P.shape[-1]
    pos = size - 1 - rank if reverse else rank  # this rank's place in the order of application
    peer = lambda p: _global(dist, group, size - 1 - p if reverse else p)  # noqa: E731

    def exchange(send_to, recv_from, mine):
        """mine (P and Q stacked on dim -2) to position send_to, the map of recv_from back (or None)."""
        got = torch.empty_like(mine) if recv_from is not None else None
        p2p = []
        if send_to is not None:
            p2p.append(dist.P2POp(dist.isend, mine, peer(send_to), group))
        if got is not None:
            p2p.append(dist.P2POp(dist.irecv, got, peer(recv_from), group))
        if p2p:
            for req in dist.batch_isend_irecv(p2p):
                req.wait()
        return got

    # the shift: each position starts from the map of the one before it (the first: the identity)
    mine = torch.cat([P, Q], dim=-2).contiguous()
    got = exchange(pos + 1 if pos + 1 < size else None, pos - 1 if pos > 0 else None, mine)
    if got is None:
        eye = torch.eye(K, dtype=P.dtype, device=P.device).expand_as(P)
        cur_P, cur_Q = eye.clone(), torch.zeros_like(Q)
    else:
        cur_P, cur_Q = got[..., :K, :], got[..., K:, :]
    d = 1
    while d < size:  # Hillis-Steele: compose the map received from d positions before (applied first)
        mine = torch.cat([cur_P, cur_Q], dim=-2).contiguous()
        got = exchange(pos + d if pos + d < size else None, pos - d if pos - d >= 0 else None, mine)
        if got is not None:
            rP, rQ = got[..., :K, :], got[..., K:, :]
            cur_P, cur_Q = torch.matmul(rP, cur_P), torch.matmul(rQ, cur_P) + cur_Q
        d *= 2
    return cur_Q


def _global(dist, group, r):
    """The global rank of group rank r (point-to-point ops name global ranks)."""
    return r if group is None else dist.get_global_rank(group, r)
