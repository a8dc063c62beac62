"""Mamba1 selective-scan CP jobs the gloo pool runs on every rank, and the inputs the unit tests share
(tests/test_mamba1.py). The token dim of a selective scan is the last one (``[b, d, l]``)."""

from __future__ import annotations

from typing import Callable

import torch

import ringmaster as rm

F64 = torch.float64
SEQ_KEYS = ("u", "delta", "B", "C", "z")
NEEDED = ("A_log", "dt_proj.bias", "conv1d.weight")   # gradients that must be among the checked ones


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def mamba1_inputs(b=2, d=6, l=24, n=4, dtype=F64, seed=0, gate=True):
    """Selective-scan inputs with a spread of decays per (channel, state entry): the slowest keep ~all
    their state over the whole sequence (state crosses several shards), the fastest forget within a few
    tokens. ``dt = softplus(delta + delta_bias)``."""
    gen = _gen(seed)
    A = -torch.logspace(-4, 0.3, d * n, dtype=dtype).reshape(d, n)
    out = dict(
        u=torch.randn(b, d, l, generator=gen, dtype=dtype),
        delta=torch.randn(b, d, l, generator=gen, dtype=dtype) * 0.5,
        A=A,
        B=torch.randn(b, n, l, generator=gen, dtype=dtype),
        C=torch.randn(b, n, l, generator=gen, dtype=dtype),
        D=torch.randn(d, generator=gen, dtype=dtype),
        delta_bias=torch.randn(d, generator=gen, dtype=dtype) * 0.3,
    )
    if gate:
        out["z"] = torch.randn(b, d, l, generator=gen, dtype=dtype)
    return out


def kernel(name: str) -> Callable:
    """``ref``: the float64 token-by-token reference; ``hf``: transformers' Mamba torch fallback (fp32 inside)."""
    if name == "ref":
        from standins import naive

        return naive.mamba1_selective_scan_ref
    from transformers.models.mamba import modeling_mamba

    return modeling_mamba.mamba_selective_scan


def segment(kernel_name: str, inputs: dict, sl):
    from ringmaster.recurrent.mamba1 import Mamba1Segment

    t = {k: (v[..., sl] if k in SEQ_KEYS else v) for k, v in inputs.items()}
    return Mamba1Segment(kernel(kernel_name), t["u"], t["delta"], t["A"], t["B"], t["C"], D=t["D"], z=t.get("z"),
                         delta_bias=t["delta_bias"], delta_softplus=True)


def full_output(kernel_name: str, inputs: dict) -> torch.Tensor:
    l = inputs["u"].shape[-1]
    return segment(kernel_name, inputs, slice(0, l)).run(None)[0]


def leaves(inputs: dict) -> dict:
    return {k: v.detach().clone().requires_grad_(True) for k, v in inputs.items()}


def rel(a, b) -> float:
    a, b = a.detach().double(), b.detach().double()
    return (a - b).abs().max().item() / max(b.abs().max().item(), 1e-30)


def doc_ids(rows) -> torch.Tensor:
    return torch.stack([torch.repeat_interleave(torch.arange(len(r)), torch.tensor(r)) for r in rows])


def per_document_reference(kernel_name, inputs, docs):
    """Every document of every row run alone from a zero state."""
    rows = []
    for r in range(docs.shape[0]):
        row = {k: (v[r:r + 1] if k in SEQ_KEYS else v) for k, v in inputs.items()}
        outs = []
        for d in docs[r].unique().tolist():
            idx = (docs[r] == d).nonzero().flatten()
            outs.append(segment(kernel_name, row, slice(int(idx[0]), int(idx[-1]) + 1)).run(None)[0])
        rows.append(torch.cat(outs, dim=-1))
    return torch.cat(rows, dim=0)


# --------------------------------------------------------------------------- pool jobs (function level)


def state_passing(ctx, P, layout, strategy, kernel_name="ref", l=24, rows=None):
    """Real collectives: ``pass_state`` over this rank's Mamba1 segments vs the full single-process run
    (``rows``: packed document lengths per row, then vs every document alone), outputs and every input
    gradient (shared parameters summed over the group)."""
    import torch.distributed as dist

    from ringmaster.recurrent.documents import local_documents, with_documents
    from ringmaster.recurrent.scan import chunk_ids, pass_state
    from ringmaster.sharding import balancers
    from ringmaster.sharding.documents import CPBatch

    group = ctx.mesh(P)["cp"].get_group()
    rank = dist.get_rank(group)
    dtype = F64 if kernel_name == "ref" else torch.float32
    docs = doc_ids(rows) if rows is not None else None
    base = mamba1_inputs(b=2 if docs is None else docs.shape[0], l=l, dtype=dtype)
    ref_in = leaves(base)
    y_ref = full_output(kernel_name, ref_in) if docs is None else per_document_reference(kernel_name, ref_in, docs)
    W = torch.randn(y_ref.shape, generator=_gen(5), dtype=y_ref.dtype)
    (y_ref * W).sum().backward()

    pos = balancers.shard_positions(l, P, rank, layout)
    local = {k: (v[..., pos] if k in SEQ_KEYS else v).detach().clone().requires_grad_(True) for k, v in base.items()}
    n = len(chunk_ids(layout, P, rank))
    m = len(pos) // n
    segs = [segment(kernel_name, local, slice(j * m, (j + 1) * m)) for j in range(n)]
    if docs is not None:
        batch = CPBatch(rank, P, layout, l, docs)
        segs = with_documents(segs, local_documents(batch, "mamba1", P, rank, layout, (docs.shape[0], len(pos)), n))
    y = torch.cat([o[0] if isinstance(o, tuple) else o for o in pass_state(segs, strategy, group, layout)], dim=-1)
    (y * W[..., pos]).sum().backward()
    errs = {"out": rel(y, y_ref[..., pos])}
    for k, v in local.items():
        g = v.grad.detach().clone()
        if k not in SEQ_KEYS:
            dist.all_reduce(g, group=group)
            errs[f"grad_{k}"] = rel(g, ref_in[k].grad)
        else:
            errs[f"grad_{k}"] = rel(g, ref_in[k].grad[..., pos])
    return errs


# --------------------------------------------------------------------------- model level


def slow_decay(model) -> None:
    """Push some decays towards 1 (A_log very negative) so state survives across shards; for every
    A_log of any shape (Mamba1 ``[d, n]``, Mamba2 ``[h]``)."""
    with torch.no_grad():
        for module in model.modules():
            a_log = module._parameters.get("A_log") if hasattr(module, "_parameters") else None
            if a_log is not None:
                a_log.copy_(torch.linspace(-9.0, 0.5, a_log.numel()).reshape(a_log.shape))


def family_parity(ctx, model_type, P, strategy, backend="ulysses", seq_len=64, fp64=False, cfg_kwargs=None,
                  checkpointing=False):
    """``compare`` with slow decays; ``fp64``: model in float64, reference and CP under ``keep_fp64``.
    ``checkpointing``: gradient checkpointing on (blocks replayed in backward without the batch kwarg)."""
    from ringmaster_tools.parity import compare

    def prepare(model):
        slow_decay(model)
        if checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})

    cfg = rm.RingmasterConfig(size=P, backend=backend, recurrent=strategy, **(cfg_kwargs or {}))
    return compare(model_type, cfg, seq_len=seq_len, device_mesh=ctx.mesh(P), prepare=prepare, fp64=fp64)


def packed_parity(ctx, model_type, P, strategy, backend="ulysses", cfg_kwargs=None, doc_lens=(5, 67, 10, 14),
                  fp64=False):
    """A packed row through the model under CP vs every document run alone (token-weighted)."""
    from ringmaster_tools.parity import compare, packed_batch, per_document_forward

    cfg = rm.RingmasterConfig(size=P, backend=backend, recurrent=strategy, **(cfg_kwargs or {}))
    return compare(model_type, cfg, device_mesh=ctx.mesh(P), prepare=slow_decay, fp64=fp64,
                   batch=lambda m: packed_batch(m.config.vocab_size, list(doc_lens)),
                   reference_forward=per_document_forward)


def padded_parity(ctx, model_type, P, strategy, backend="ulysses"):
    from jobs import padded_parity as padded

    return padded(ctx, P, backend, {"recurrent": strategy}, model_type=model_type, prepare=slow_decay, S=64, left=7,
                  real=41)


def wire_report(ctx, model_type):
    """What ``wire`` did to the tiny model: the recurrent layers and their kinds, the attention layers."""
    from ringmaster_tools.parity import tiny_model

    model = tiny_model(model_type)
    runtime = rm.wire(model, rm.RingmasterConfig(size=2, backend="ulysses"), device_mesh=ctx.mesh(2))
    try:
        return {"recurrent": list(runtime.report.recurrent), "attention": list(runtime.report.attention)}
    finally:
        rm.unwire(model)
        rm.teardown()


# --------------------------------------------------------------------------- mutations


def _patch(owner, name: str, new) -> Callable[[], None]:
    old = vars(owner)[name]
    setattr(owner, name, new)
    return lambda: setattr(owner, name, old)


def drop_mamba1_state() -> Callable[[], None]:
    """``ringmaster.recurrent.mamba1.Mamba1Segment.finish`` (scan) and ``.run`` (sequential): the carried
    SSM state ignored (zeroed), as if every shard started from a zero state."""
    from ringmaster.recurrent.mamba1 import Mamba1Segment as cls

    finish, run = cls.finish, cls.run

    def zero(state_in):
        return None if state_in is None else state_in * 0

    undo_finish = _patch(cls, "finish", lambda self, aux, state_in: finish(self, aux, zero(state_in)))
    undo_run = _patch(cls, "run", lambda self, state_in: run(self, zero(state_in)))

    def undo():
        undo_run()
        undo_finish()
    return undo


def skip_mamba1_state_passing() -> Callable[[], None]:
    """``ringmaster.recurrent.mamba1.pass_state`` (the engine call of ``cp_selective_scan``): every shard's
    chunks run from a zero state, nothing is passed between ranks. ``wire``'s probe calls the segment
    directly, so only the model-level check can see this one."""
    from ringmaster.recurrent import mamba1

    def mutated(segments, strategy, group, layout, *name):
        return [seg.run(None) for seg in segments]

    return _patch(mamba1, "pass_state", mutated)


def drop_conv_halo() -> Callable[[], None]:
    from jobs_mutations import drop_conv_halo as drop

    return drop()


MUTATIONS = {"mamba1_state_zeroed": drop_mamba1_state, "mamba1_state_not_passed": skip_mamba1_state_passing,
             "conv_halo_dropped": drop_conv_halo}


def mutated_parity(ctx, mutation, model_type, P, strategy, seq_len=64) -> dict:
    """The fp64 parity run with ``mutation`` applied, then the same run clean: ``{"mutated", "clean"}``."""
    keep = ("cp_size", "loss_err", "logits_err", "grad_err", "worst_param", "grad_errs", "grad_err_total",
            "missing_grads", "n_grads", "n_params", "recurrent_layers")
    out: dict = {}
    undo = MUTATIONS[mutation]()
    try:
        r = family_parity(ctx, model_type, P, strategy, seq_len=seq_len, fp64=True)
        out["mutated"] = {k: r[k] for k in keep}
    except Exception as exc:  # noqa: BLE001 - a mutation that raises is detected too
        out["raised"] = f"{type(exc).__name__}: {exc}"
    finally:
        undo()
    r = family_parity(ctx, model_type, P, strategy, seq_len=seq_len, fp64=True)
    out["clean"] = {k: r[k] for k in keep}
    return out
