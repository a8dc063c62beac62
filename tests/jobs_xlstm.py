"""Pool jobs for xLSTM's mLSTM (kind ``mlstm``): model-level parity dense / packed / padded, fp32 and fp64,
and the mutation that drops the carried state."""

from __future__ import annotations

from typing import Callable

import torch

import ringmaster as rm

MODEL = "xlstm"


def random_gates(model) -> None:
    """transformers initialises the gate projections to zero weights (input gate bias -10, forget gate
    biases 3..6): every token's gates are the same constants. Give them input-dependent weights and an
    input-gate bias around 0, so the stabiliser switches between its two branches (``m + log f`` vs the
    input gate) along the sequence and the gate gradients are not all alike."""
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "igate_preact" in name or "fgate_preact" in name:
                noise = torch.randn(p.shape, generator=g, dtype=torch.float64).to(p.dtype)
                if name.endswith("weight"):
                    p.copy_(0.5 * noise)
                elif "igate" in name:
                    p.copy_(2.0 * noise)


def parity(ctx, P, strategy, backend="ulysses", seq_len=64, fp64=False, cfg_kwargs=None, overrides=None):
    """``overrides``: config keys over :data:`parity.TINY` (``mode="train"``: the reference runs the chunkwise
    kernel alone, CP the backend's inference path per chunk)."""
    from ringmaster_tools.parity import compare

    cfg = rm.RingmasterConfig(size=P, backend=backend, recurrent=strategy, **(cfg_kwargs or {}))
    return compare(MODEL, cfg, seq_len=seq_len, device_mesh=ctx.mesh(P), fp64=fp64, prepare=random_gates,
                   attn_implementation="eager", **(overrides or {}))


def packed_parity(ctx, P, strategy, backend="ulysses", cfg_kwargs=None, doc_lens=(5, 67, 10, 14), fp64=True):
    """A packed row under CP vs every document run alone (token-weighted losses)."""
    from ringmaster_tools.parity import compare, packed_batch, per_document_forward

    cfg = rm.RingmasterConfig(size=P, backend=backend, recurrent=strategy, **(cfg_kwargs or {}))
    return compare(MODEL, cfg, device_mesh=ctx.mesh(P), fp64=fp64, prepare=random_gates,
                   attn_implementation="eager", batch=lambda m: packed_batch(m.config.vocab_size, list(doc_lens)),
                   reference_forward=per_document_forward)


def padded_parity(ctx, P, strategy, backend="ulysses"):
    from jobs import padded_parity as padded

    return padded(ctx, P, backend, {"recurrent": strategy}, model_type=MODEL, S=64, left=7, real=41,
                  prepare=random_gates, attn_implementation="eager")


# --------------------------------------------------------------------------- mutation


class _StateDropped:
    """A segment whose incoming state is zeroed (kept in the graph, so no collective's backward hangs);
    a zero packed state is transformers' own zero state (``m = 0``)."""

    def __init__(self, seg):
        self._seg = seg

    def __getattr__(self, name):
        return getattr(self._seg, name)

    def finish(self, aux, state_in):
        return self._seg.finish(aux, None if state_in is None else state_in * 0)

    def run(self, state_in):
        return self._seg.run(None if state_in is None else state_in * 0)


def drop_mlstm_state() -> Callable[[], None]:
    """``ringmaster.recurrent.mlstm.pass_state``: every segment ignores the state the earlier shards pass
    in. Only the CP path changes (wire's probe runs the segment directly), so the model-level check, not
    the probe, must catch it."""
    from ringmaster.recurrent import mlstm

    old = mlstm.pass_state
    mlstm.pass_state = lambda segments, *a: old([_StateDropped(s) for s in segments], *a)

    def undo():
        mlstm.pass_state = old
    return undo


def _summary(r: dict) -> dict:
    keep = ("cp_size", "loss_err", "logits_err", "grad_err", "worst_param", "grad_errs", "grad_err_total",
            "missing_grads", "n_grads", "n_params", "recurrent_layers")
    return {k: r[k] for k in keep}


def mutated_parity(ctx, P: int, strategy: str, seq_len: int = 64) -> dict:
    """The fp64 parity run with the carried state dropped, then the same run after the undo."""
    out: dict = {}
    undo = drop_mlstm_state()
    try:
        out["mutated"] = _summary(parity(ctx, P, strategy, seq_len=seq_len, fp64=True))
    except Exception as exc:  # a mutation that raises (wire's probe included) is reported, and fails the test
        out["raised"] = f"{type(exc).__name__}: {exc}"
    finally:
        undo()
    out["clean"] = _summary(parity(ctx, P, strategy, seq_len=seq_len, fp64=True))
    return out
