"""Pool jobs for the linear-recurrence kinds (lightning attention, KDA, RG-LRU, RWKV): model-level parity
dense / packed / padded, fp32 and fp64, and mutations that drop the carried state or the halo."""

from __future__ import annotations

from typing import Callable

import torch

import ringmaster as rm


def wide_decays(model) -> None:
    """MiniMax's lightning layers keep decay factors as buffers computed in float32 at init; recompute them
    in the model's dtype from the same ``slope_rate`` so a float64 reference is float64 throughout (else the
    reference itself is only ~1e-8 consistent between its intra- and inter-block decays)."""
    with torch.no_grad():
        for module in model.modules():
            if hasattr(module, "decay_factors") and hasattr(module, "slope_rate"):
                for name, value in zip(("query_decay", "key_decay", "diagonal_decay"),
                                       module.decay_factors(module.slope_rate)):
                    getattr(module, name).copy_(value)


PREPARE = {"minimax": wide_decays}
ATTN = {"rwkv": "eager"}   # attention-free: transformers refuses sdpa for it


def parity(ctx, model_type, P, strategy, backend="ulysses", seq_len=64, fp64=False, cfg_kwargs=None):
    from ringmaster_tools.parity import compare

    cfg = rm.RingmasterConfig(size=P, backend=backend, recurrent=strategy, **(cfg_kwargs or {}))
    return compare(model_type, cfg, seq_len=seq_len, device_mesh=ctx.mesh(P), fp64=fp64,
                   prepare=PREPARE.get(model_type), attn_implementation=ATTN.get(model_type, "sdpa"))


def packed_parity(ctx, model_type, P, strategy, backend="ulysses", cfg_kwargs=None, doc_lens=(5, 67, 10, 14),
                  fp64=False):
    """A packed row under CP vs every document run alone (token-weighted losses)."""
    from ringmaster_tools.parity import compare, packed_batch, per_document_forward

    cfg = rm.RingmasterConfig(size=P, backend=backend, recurrent=strategy, **(cfg_kwargs or {}))
    return compare(model_type, cfg, device_mesh=ctx.mesh(P), fp64=fp64, prepare=PREPARE.get(model_type),
                   attn_implementation=ATTN.get(model_type, "sdpa"),
                   batch=lambda m: packed_batch(m.config.vocab_size, list(doc_lens)),
                   reference_forward=per_document_forward)


def padded_parity(ctx, model_type, P, strategy, backend="ulysses"):
    from jobs import padded_parity as padded

    return padded(ctx, P, backend, {"recurrent": strategy}, model_type=model_type, S=64, left=7, real=41,
                  prepare=PREPARE.get(model_type), **({"attn_implementation": ATTN[model_type]} if model_type in ATTN else {}))


# --------------------------------------------------------------------------- mutations


def _patch(owner, name: str, new) -> Callable[[], None]:
    old = vars(owner)[name]
    setattr(owner, name, new)
    return lambda: setattr(owner, name, old)


def _zero(state_in):
    return None if state_in is None else state_in * 0


class _StateDropped:
    """A segment whose incoming state is zeroed (kept in the graph, so no collective's backward hangs)."""

    def __init__(self, seg):
        self._seg = seg

    def __getattr__(self, name):
        return getattr(self._seg, name)

    def finish(self, aux, state_in):
        return self._seg.finish(aux, _zero(state_in))

    def run(self, state_in):
        return self._seg.run(_zero(state_in))


def _drop_passed_state(module) -> Callable[[], None]:
    """``module.pass_state`` (the kind's call into the scan engine): every segment ignores the state the
    earlier shards pass in. Only the CP path changes (wire's probe runs the segments directly), so the
    model-level check, not the probe, must catch it."""
    pass_state = module.pass_state
    return _patch(module, "pass_state", lambda segments, *a: pass_state([_StateDropped(s) for s in segments], *a))


def drop_lightning_state():
    """``ringmaster.recurrent.lightning.pass_state``: the incoming state ignored."""
    from ringmaster.recurrent import lightning

    return _drop_passed_state(lightning)


def drop_kda_state():
    """``ringmaster.recurrent.gated_deltanet.pass_state`` (KDA runs gated DeltaNet's segment): the incoming
    state ignored."""
    from ringmaster.recurrent import gated_deltanet

    return _drop_passed_state(gated_deltanet)


def drop_conv_halo():
    """``ringmaster.recurrent.conv.exchange_halos``: the previous shard's conv inputs replaced by zeros."""
    from ringmaster.recurrent import conv

    exchange = conv.exchange_halos
    return _patch(conv, "exchange_halos", lambda *a, **k: [h * 0 for h in exchange(*a, **k)])


def drop_rglru_state():
    """``ringmaster.recurrent.rglru.pass_state``: the RG-LRU's incoming state ignored."""
    from ringmaster.recurrent import rglru

    return _drop_passed_state(rglru)


def drop_rwkv_state():
    """``ringmaster.recurrent.rwkv.pass_state``: the WKV's incoming (stabilised) state ignored."""
    from ringmaster.recurrent import rwkv

    return _drop_passed_state(rwkv)


MUTATIONS: dict[str, Callable[[], Callable[[], None]]] = {
    "lightning_state_dropped": drop_lightning_state,
    "kda_state_dropped": drop_kda_state,
    "kda_conv_halo_dropped": drop_conv_halo,
    "conv_halo_dropped": drop_conv_halo,
    "rglru_state_dropped": drop_rglru_state,
    "rwkv_state_dropped": drop_rwkv_state,
}


def _summary(r: dict) -> dict:
    keep = ("cp_size", "loss_err", "logits_err", "grad_err", "worst_param", "grad_errs", "grad_err_total",
            "missing_grads", "n_grads", "n_params", "recurrent_layers")
    return {k: r[k] for k in keep}


def mutated_parity(ctx, mutation: str, model_type: str, P: int, strategy: str, seq_len: int = 64) -> dict:
    """The fp64 parity run with ``mutation`` applied, then the same run after the undo."""
    out: dict = {}
    undo = MUTATIONS[mutation]()
    try:
        out["mutated"] = _summary(parity(ctx, model_type, P, strategy, seq_len=seq_len, fp64=True))
    except Exception as exc:  # a mutation that raises is detected too
        out["raised"] = f"{type(exc).__name__}: {exc}"
    finally:
        undo()
    out["clean"] = _summary(parity(ctx, model_type, P, strategy, seq_len=seq_len, fp64=True))
    return out
