"""Pool jobs for tests/test_relbias.py: Inkling (its hidden-state-conditioned relative position bias, the full
layers' log scaling) under Ulysses and Ring, fp64 per parameter, dense and packed, and the mutations of the
relative-bias mechanism."""

from __future__ import annotations

import jobs_mutations as jm
import torch

import ringmaster as rm

# log_scaling_n_floor below the sequence length: the full layers' log scaling of queries and bias is active
# (the zoo's tiny config leaves it None); the sliding window (16) is shorter than the sequence
OVERRIDES = dict(log_scaling_n_floor=4)


def build(model_type, attn_implementation="sdpa", seed=0, dtype=torch.float32, **overrides):
    """The zoo's tiny Inkling (``parity.tiny_model``'s generic shrink leaves its MoE at 300M parameters)."""
    from ringmaster_tools.zoo import build_tiny, tiny_config

    return build_tiny(model_type, tiny_config(model_type, **overrides), seed, dtype)


def _errs(r):
    return {k: r[k] for k in ("loss_err", "logits_err", "grad_err", "worst_param", "grad_errs", "missing_grads",
                              "cp_size", "attention_layers", "recurrent_layers")}


def parity(ctx, P, backend, load_balance="auto", packed=False, model_type="inkling_text", seq_len=32):
    """fp64 parity. Packed rows are compared with every document run alone, without the log scaling: the model
    scales by the *row* index (``torch.arange``), not the position in the document, so on a packed row it
    does not compute what each document alone computes, with or without CP."""
    from ringmaster_tools.parity import compare, packed_batch, per_document_forward

    cfg = rm.RingmasterConfig(size=P, backend=backend, load_balance=load_balance)
    extra = {}
    if packed:
        extra = dict(batch=lambda m: packed_batch(m.config.vocab_size, [5, 13, 2, 12]),
                     reference_forward=per_document_forward)
    return _errs(compare(model_type, cfg, seq_len=seq_len, device_mesh=ctx.mesh(P), fp64=True, build=build,
                         **extra, **({} if packed else OVERRIDES)))


def drop_ring_offset():
    """``BlockMask.rel_index``: the distance read from block-local coordinates only (``rel_offset`` ignored):
    the bias of every off-diagonal Ring block is that of the diagonal block."""
    import dataclasses

    from ringmaster.attention.ring import masks

    orig = masks.BlockMask.rel_index

    def local(self, r0, r1, k0, k1, device):
        return orig(dataclasses.replace(self, rel_offset=0), r0, r1, k0, k1, device)
    return jm._patch(masks.BlockMask, "rel_index", local)


def drop_bias_gradient():
    """``MathKernel.backward``: the relative bias's gradient returned as zeros (no gradient reaches ``proj`` or
    the bias states through the Ring)."""
    from ringmaster.attention.ring import math_kernel

    orig = math_kernel.MathKernel.backward

    def no_grad(self, *args, **kwargs):
        out = orig(self, *args, **kwargs)
        return out if len(out) == 3 else (*out[:3], torch.zeros_like(out[3]))
    return jm._patch(math_kernel.MathKernel, "backward", no_grad)


def local_log_scale():
    """``relbias._log_scales``: constant 1, so the full layers keep the model's *local*-index log scaling."""
    from ringmaster.attention import relbias

    return jm._patch(relbias, "_log_scales", lambda t, alpha, n_floor, dtype: torch.ones(t.shape, dtype=dtype,
                                                                                         device=t.device))


def drop_ulysses_bias():
    """``RelativeBias.dense``: zeros (Ulysses' eager kernel gets the mask without the bias)."""
    from ringmaster.attention import relbias

    return jm._patch(relbias.RelativeBias, "dense",
                     lambda self, pos: self.states.new_zeros(*self.states.shape[:3], pos.shape[0]))


MUTATIONS = {"drop_ring_offset": (drop_ring_offset, "ring"), "drop_bias_gradient": (drop_bias_gradient, "ring"),
             "local_log_scale": (local_log_scale, "ulysses"), "drop_ulysses_bias": (drop_ulysses_bias, "ulysses")}


def mutated(ctx, names, P=2):
    """Each mutation in turn: the model-level errors with it applied (rank 0's view is enough: every rank
    computes the same loss and group-mean gradients)."""
    out = {}
    for name in names:
        make, backend = MUTATIONS[name]
        undo = make()
        try:
            r = parity(ctx, P, backend)
        finally:
            undo()
        out[name] = {k: r[k] for k in ("loss_err", "logits_err", "grad_err", "worst_param")}
    return out
