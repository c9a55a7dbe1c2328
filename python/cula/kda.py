"""FLA drop-in for the KDA family: ``from cula.kda import chunk_kda, fused_recurrent_kda, fused_kda_gate``.

Same argument lists, defaults and return tuples as flash-linear-attention 0.6.0's functions of
the same names. Arguments cula cannot honour raise an error instead of being ignored."""

from __future__ import annotations

from ._fla_common import fla_chunk_size, gate_param, offsets_for, recurrent_dropin, resolve_state_layout, unsupported
from ._front import chunk, reject_unknown
from ._gate import gate

__all__ = ["chunk_kda", "fused_recurrent_kda", "fused_kda_gate"]


def chunk_kda(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
              use_qk_l2norm_in_kernel=False, use_gate_in_kernel=False, use_beta_sigmoid_in_kernel=False,
              allow_neg_eigval=False, safe_gate=False, lower_bound=None, disable_recompute=False,
              return_intermediate_states=False, state_v_first=False, cu_seqlens=None, cu_seqlens_cpu=None,
              cp_context=None, use_graph=False, max_num_seqs=None, **kwargs):
    """FLA ``chunk_kda``: states are K-first ``[N, HV, K, V]`` unless ``state_v_first=True``.
    ``A_log``, ``dt_bias`` and ``chunk_size`` come as keyword arguments, as in FLA."""
    state_v_first = resolve_state_layout("chunk_kda", state_v_first, kwargs)
    A_log, dt_bias = kwargs.pop("A_log", None), kwargs.pop("dt_bias", None)
    chunk_size = fla_chunk_size("chunk_kda", kwargs.pop("chunk_size", 64), return_intermediate_states)
    reject_unknown("chunk_kda", kwargs)
    unsupported("chunk_kda", use_graph=use_graph, max_num_seqs=max_num_seqs)
    del disable_recompute  # a memory/recompute trade-off of FLA's backward: no effect on results here
    if cp_context is not None:  # FLA's context parallelism: cula.dist (with autograd)
        from .dist import chunk_fla_cp

        return chunk_fla_cp("kda", q, k, v, g, beta, cp_context=cp_context, A_log=gate_param(A_log),
                            dt_bias=gate_param(dt_bias), initial_state=initial_state, scale=scale,
                            output_final_state=output_final_state, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
                            use_gate_in_kernel=use_gate_in_kernel, use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel,
                            allow_neg_eigval=allow_neg_eigval, safe_gate=safe_gate, lower_bound=lower_bound,
                            chunk_size=chunk_size)
    return chunk("kda", q, k, v, g, beta, A_log=gate_param(A_log), dt_bias=gate_param(dt_bias),
                 initial_state=initial_state, scale=scale, output_final_state=output_final_state,
                 use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, use_gate_in_kernel=use_gate_in_kernel,
                 use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel, allow_neg_eigval=allow_neg_eigval,
                 safe_gate=safe_gate, lower_bound=lower_bound, return_intermediate_states=return_intermediate_states,
                 chunk_size=chunk_size, cu_seqlens=offsets_for(q, cu_seqlens, cu_seqlens_cpu),
                 state_layout="k_last" if state_v_first else "k_first",
                 **({"cu_seqlens_host": cu_seqlens_cpu} if return_intermediate_states and cu_seqlens_cpu is not None
                    else {}))


def fused_recurrent_kda(q, k, v, g, beta, A_log=None, dt_bias=None, scale=None, initial_state=None,
                        output_final_state=False, use_qk_l2norm_in_kernel=False, use_gate_in_kernel=False,
                        use_beta_sigmoid_in_kernel=False, allow_neg_eigval=False, lower_bound=None,
                        state_v_first=False, cu_seqlens=None, **kwargs):
    """FLA ``fused_recurrent_kda``. Also honours the serving-engine keywords of FLA's
    ``fused_recurrent_kda_fwd``: ``ssm_state_indices`` ([N] or [N, T] int32), ``num_accepted_tokens``
    and ``inplace_final_state`` (the initial_state is then a pool updated in place)."""
    state_v_first = resolve_state_layout("fused_recurrent_kda", state_v_first, kwargs)
    return recurrent_dropin("fused_recurrent_kda", "kda", q, k, v, g, beta, A_log=A_log, dt_bias=dt_bias, scale=scale,
                            initial_state=initial_state, output_final_state=output_final_state,
                            use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, use_gate_in_kernel=use_gate_in_kernel,
                            use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel, allow_neg_eigval=allow_neg_eigval,
                            lower_bound=lower_bound, state_v_first=state_v_first, cu_seqlens=cu_seqlens, kwargs=kwargs)


def fused_kda_gate(g, A_log=None, dt_bias=None, lower_bound=None, output_dtype=None):
    """FLA ``fused_kda_gate``: the gate activation of g [..., H, K] with autograd (A_log: H values,
    dt_bias: H * K; ``lower_bound`` gives ``lb * sigmoid(exp(A_log) (g + dt_bias))``, and then
    A_log may be None). The forward runs cula's gate kernel."""
    import torch

    return gate("fused_kda_gate", g, A_log, dt_bias, lower_bound, output_dtype or torch.float32, per_head=False)
