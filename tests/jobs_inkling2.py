"""Pool jobs for tests/test_inkling2.py: Inkling2 / Inkling2-loop under Ulysses and Ring, fp64 per parameter, and
the mutations of the three mechanisms they add (per-token sinks, local attention over layer depth, the dynamic
short conv's halo)."""

from __future__ import annotations

import jobs_mutations as jm
import jobs_relbias as jr
import torch

from ringmaster.sharding.documents import BATCH_KWARG


def parity(ctx, P, backend, load_balance="auto", packed=False, model_type="inkling2_text", seq_len=32):
    """fp64 parity of the zoo's tiny model (packed rows against every document run alone)."""
    from ringmaster_tools.parity import compare, packed_batch, per_document_forward
    import ringmaster as rm

    cfg = rm.RingmasterConfig(size=P, backend=backend, load_balance=load_balance)
    extra = {}
    if packed:
        extra = dict(batch=lambda m: packed_batch(m.config.vocab_size, [5, 13, 2, 12]),
                     reference_forward=per_document_forward)
    return jr._errs(compare(model_type, cfg, seq_len=seq_len, device_mesh=ctx.mesh(P), fp64=True, build=jr.build,
                            **extra))


def drop_token_sinks():
    """``token_sinks.take``: the per-token sinks are dropped (neither backend adds them)."""
    from ringmaster.attention import token_sinks

    def drop(query, kwargs, where):
        if isinstance(kwargs.get("sinks"), torch.Tensor) and kwargs["sinks"].dim() == 4:
            kwargs.pop("sinks")
    return jm._patch(token_sinks, "take", drop)


def drop_sink_gradient():
    """The Ring's sink gradient returned as zeros (``sink_proj`` gets none through the ring)."""
    from ringmaster.attention.ring import loop

    return jm._patch(loop, "sink_grad", lambda sink, lse, dout, out: torch.zeros_like(sink))


def local_attention_off():
    """``local.is_local``: False, so the attention over layer depth goes to the CP function (which refuses it)."""
    from ringmaster.attention import local

    return jm._patch(local, "is_local", lambda module: False)


def drop_dynamic_halo():
    """The dynamic short conv's windows taken from the shard alone (zeros before its first token; the wire probe
    still reaches the real CP conv so wiring succeeds)."""
    from ringmaster.recurrent import dynamic_conv

    orig = dynamic_conv.cp_conv_kernel

    def make(ctx, namespace, name):
        real = orig(ctx, namespace, name)

        def conv(x, weight, bias=None, activation=None, **kwargs):
            if ctx.probe is not None:
                return real(x, weight, bias, activation, **kwargs)
            kwargs.pop(BATCH_KWARG, None)
            return namespace[name](x, weight, bias)
        return conv
    return jm._patch(dynamic_conv, "cp_conv_kernel", make)


MUTATIONS = {"drop_token_sinks": (drop_token_sinks, "ulysses"), "drop_sink_gradient": (drop_sink_gradient, "ring"),
             "local_attention_off": (local_attention_off, "ring"), "drop_dynamic_halo": (drop_dynamic_halo, "ulysses")}


def mutated(ctx, names, P=2, seq_len=16):
    """Each mutation in turn: the model-level errors with it applied (inf when the mutated run raises); 16 tokens
    (8 a shard: every mechanism still crosses the shard edge) to keep the test short."""
    out = {}
    for name in names:
        make, backend = MUTATIONS[name]
        undo = make()
        try:
            r = parity(ctx, P, backend, seq_len=seq_len)
            out[name] = {k: r[k] for k in ("loss_err", "logits_err", "grad_err", "worst_param")}
        except Exception as e:  # a refusal is a failed model-level check too
            out[name] = {"loss_err": float("inf"), "logits_err": float("inf"), "grad_err": float("inf"),
                         "worst_param": f"raised {type(e).__name__}: {str(e)[:120]}"}
        finally:
            undo()
    return out
