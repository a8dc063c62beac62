"""Mutations of the recurrent CP mechanisms, for tests/test_mutations_recurrent.py.

Each mutation is one small function that monkeypatches one module attribute of ringmaster (a
method of a segment class, or a module-level helper the wired layers look up per call) and
returns the undo. The docstring names the patch target (in ``ringmaster/recurrent/``).

Mutations keep every collective's autograd graph connected (they zero a tensor with ``* 0``
rather than dropping it), so a mutated run fails its parity check instead of hanging a rank.
"""

from __future__ import annotations

from typing import Callable

import jobs_recurrent as jr


def _patch(owner, name: str, new) -> Callable[[], None]:
    """Set ``owner.name = new``; the undo puts back exactly what was there (class dict or module global)."""
    old = vars(owner)[name]
    setattr(owner, name, new)
    return lambda: setattr(owner, name, old)


def detach_mamba2_decay() -> Callable[[], None]:
    """``ringmaster.recurrent.mamba2.Mamba2Segment.finish``: the scan correction
    ``C_t · S_in · exp(Σ A·dt)`` with the decay detached (``log_decay.detach().exp()``), so no
    gradient reaches A_log / dt_bias / dt through the incoming state's decay."""
    from ringmaster.recurrent import mamba2 as mamba

    finish = mamba.Mamba2Segment.finish

    def mutated(self, aux, state_in):
        y0, log_decay = aux
        return finish(self, (y0, log_decay.detach()), state_in)

    return _patch(mamba.Mamba2Segment, "finish", mutated)


def drop_conv_halo() -> Callable[[], None]:
    """``ringmaster.recurrent.conv.exchange_halos`` (called by ``cp_causal_conv1d``): the halos from
    the previous shard replaced by zeros, as if every shard's conv started the sequence."""
    from ringmaster.recurrent import conv

    exchange = conv.exchange_halos

    def mutated(*args, **kwargs):
        return [h * 0 for h in exchange(*args, **kwargs)]

    return _patch(conv, "exchange_halos", mutated)


def drop_gated_delta_state() -> Callable[[], None]:
    """``ringmaster.recurrent.gated_deltanet.GatedDeltaSegment.finish`` (scan) and ``.run`` (sequential):
    the incoming recurrent state ignored (zeroed), as if every shard started from a zero state."""
    from ringmaster.recurrent import gated_deltanet as linear_attn

    cls = linear_attn.GatedDeltaSegment
    finish, run = cls.finish, cls.run

    def zero(state_in):
        return None if state_in is None else state_in * 0

    undo_finish = _patch(cls, "finish", lambda self, aux, state_in: finish(self, aux, zero(state_in)))
    undo_run = _patch(cls, "run", lambda self, state_in: run(self, zero(state_in)))

    def undo():
        undo_run()
        undo_finish()
    return undo


MUTATIONS: dict[str, Callable[[], Callable[[], None]]] = {
    "mamba2_decay_detached": detach_mamba2_decay,
    "conv_halo_dropped": drop_conv_halo,
    "gated_delta_state_dropped": drop_gated_delta_state,
}


def _summary(r: dict) -> dict:
    keep = ("cp_size", "loss_err", "logits_err", "grad_err", "worst_param", "grad_errs", "grad_err_total",
            "missing_grads", "n_grads", "n_params", "recurrent_layers")
    return {k: r[k] for k in keep}


def mutated_parity(ctx, mutation: str, model_type: str, P: int, strategy: str, seq_len: int = 64) -> dict:
    """The fp64 model-level parity run (``jobs_recurrent.hybrid_parity``) with ``mutation`` applied on
    this rank, then the same run after the undo: ``{"mutated": ..., "clean": ...}`` (or ``"raised"``:
    the mutated run's exception, when the mutation makes CP fail loudly instead)."""
    out: dict = {}
    undo = MUTATIONS[mutation]()
    try:
        out["mutated"] = _summary(jr.hybrid_parity(ctx, model_type, P, strategy, seq_len=seq_len, fp64=True))
    except Exception as exc:  # a mutation that raises is detected too
        out["raised"] = f"{type(exc).__name__}: {exc}"
    finally:
        undo()
    out["clean"] = _summary(jr.hybrid_parity(ctx, model_type, P, strategy, seq_len=seq_len, fp64=True))
    return out


# --------------------------------------------------------------------------- controls of the metric itself


def structural_zero_metric(ctx, P: int = 2) -> dict:
    """A key bias under softmax with no positions has dL/db = 0 in exact arithmetic. The same toy
    attention run twice (the second on the tokens permuted: the same math, another rounding) gives
    that gradient as rounding noise: its own-norm error says nothing, the explicit structural-zero
    check (``zeros=``) measures it against the k weight's gradient."""
    import copy

    import torch

    from ringmaster_tools.parity import group_mean_grad_errors

    class Toy(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.q, self.k, self.v = (torch.nn.Linear(8, 8) for _ in range(3))

        def forward(self, x):
            a = torch.softmax(self.q(x) @ self.k(x).T, dim=-1)
            return (a @ self.v(x)).square().sum()

    torch.manual_seed(0)
    ref = Toy()
    cp = copy.deepcopy(ref)
    x = torch.randn(24, 8)
    ref(x).backward()
    cp(x[torch.randperm(24)]).backward()
    group = ctx.mesh(P)["cp"].get_group()
    plain, _, _ = group_mean_grad_errors(cp, ref, group, P, zeros=())
    listed, _, _ = group_mean_grad_errors(cp, ref, group, P, zeros=("k.bias",))
    return {"plain": plain, "listed": listed, "k_bias_max": ref.k.bias.grad.abs().max().item(),
            "k_weight_max": ref.k.weight.grad.abs().max().item()}
