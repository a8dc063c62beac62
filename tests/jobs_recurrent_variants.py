"""Pool jobs for tests/test_recurrent_variants.py: the short-conv families (LFM2, LFM2-MoE, LFM3)
and the other gated-DeltaNet hybrids (Lara-mini, OLMo-hybrid, Bailing-hybrid's Kimi delta
attention), dense, packed and padded, fp64 per parameter and fp32; plus the mutations of the
short-conv kind."""

from __future__ import annotations

import jobs_mutations as jm
import jobs_recurrent as jr
import torch

import ringmaster as rm


def parity(ctx, model_type, P, strategy="scan", backend="ulysses", seq_len=64, fp64=True, load_balance="auto",
           **overrides):
    """Dense rows: ``compare`` with slow decays (where the layer has A_log)."""
    from ringmaster_tools.parity import compare

    cfg = rm.RingmasterConfig(size=P, backend=backend, recurrent=strategy, load_balance=load_balance)
    return compare(model_type, cfg, seq_len=seq_len, device_mesh=ctx.mesh(P), prepare=jr.slow_decay, fp64=fp64,
                   **overrides)


def packed_parity(ctx, model_type, P, strategy="scan", backend="ulysses", doc_lens=(5, 27, 2, 30), fp64=True,
                  load_balance="auto", **overrides):
    """One packed row (documents start mid-shard and on shard edges) against every document run alone."""
    from ringmaster_tools.parity import compare, packed_batch, per_document_forward

    cfg = rm.RingmasterConfig(size=P, backend=backend, recurrent=strategy, load_balance=load_balance)
    return compare(model_type, cfg, device_mesh=ctx.mesh(P), prepare=jr.slow_decay, fp64=fp64,
                   batch=lambda m: packed_batch(m.config.vocab_size, list(doc_lens)),
                   reference_forward=per_document_forward, **overrides)


def padded_parity(ctx, model_type, P, strategy="scan", backend="ulysses", S=64, left=7, real=41):
    """B=2, row 1 left- and right-padded, in float64 (padding is a document of its own: no conv tap
    or state reaches the first real token)."""
    from jobs import padded_parity as run

    from ringmaster_tools.parity import keep_fp64

    with keep_fp64():
        return run(ctx, P, backend, {"recurrent": strategy}, model_type=model_type, prepare=jr.slow_decay, S=S,
                   left=left, real=real, dtype=torch.float64)


def drop_short_conv_documents():
    """``ringmaster.recurrent.conv.conv_documents``: the document ids never reach the short conv (whose
    kernel wrapper, ``conv.cp_conv_kernel``, looks them up there), so its taps (and the halo) reach across
    document starts in a packed row."""
    from ringmaster.recurrent import conv

    return jm._patch(conv, "conv_documents", lambda *args: None)


def drop_gated_delta_scan_state():
    """``ringmaster.recurrent.gated_deltanet.GatedDeltaSegment.finish`` only (the ``scan`` strategy's
    outputs): the prefix state ignored. ``run`` (what ``wire``'s probe calls) is untouched, so the
    wiring passes and the model-level check must catch it."""
    from ringmaster.recurrent import gated_deltanet

    cls = gated_deltanet.GatedDeltaSegment
    finish = cls.finish
    return jm._patch(cls, "finish", lambda self, aux, state_in: finish(self, aux,
                                                                        None if state_in is None else state_in * 0))


def drop_received_state():
    """``ringmaster.recurrent.scan._Recv`` (the ``sequential`` strategy's hand-over): the state received
    from the previous rank zeroed (kept in the graph, so the backward send still runs)."""
    from ringmaster.recurrent import scan

    recv = scan._Recv

    class Dropped:
        @staticmethod
        def apply(*args):
            state, token = recv.apply(*args)
            return state * 0, token

    return jm._patch(scan, "_Recv", Dropped)


def _summary(r: dict) -> dict:
    return {**jm._summary(r), "attention_layers": r["attention_layers"]}


MUTATIONS = {**jm.MUTATIONS, "short_conv_documents_dropped": drop_short_conv_documents,
             "gated_delta_scan_state_dropped": drop_gated_delta_scan_state, "received_state_dropped": drop_received_state}


def mutated(ctx, mutation, job, *args, **kwargs):
    """``job(ctx, *args, **kwargs)`` with ``mutation`` applied on this rank, then again after the undo."""
    out = {}
    undo = MUTATIONS[mutation]()
    try:
        out["mutated"] = _summary(globals()[job](ctx, *args, **kwargs))
    except Exception as exc:  # a mutation that raises is detected too
        out["raised"] = f"{type(exc).__name__}: {exc}"
    finally:
        undo()
    out["clean"] = _summary(globals()[job](ctx, *args, **kwargs))
    return out


def wired_kinds(ctx, model_type, P=2):
    """``[(path, kind)]`` of the recurrent layers ``wire`` routed (the runtime's report)."""
    from ringmaster_tools.parity import tiny_model

    model = tiny_model(model_type)
    runtime = rm.wire(model, rm.RingmasterConfig(size=P, backend="ulysses"), device_mesh=ctx.mesh(P))
    try:
        return [tuple(x) for x in runtime.report.recurrent]
    finally:
        rm.unwire(model)
        rm.teardown()


def short_conv_layers(ctx, model_type, P, layout="contiguous", doc_lens=None, S=32):
    """Every declared short-conv layer of ``model_type``'s tiny model (float64), on its own: wired through
    the ``short_conv`` kind (``wire``'s probe included), run on this rank's positions of a random input
    with the batch's global structure, against the unwired layer on the whole input (``doc_lens``: one
    packed row per batch row, each document run alone). ``{path: {out, grad_x, grad_<param>}}``: relative
    errors, gradients summed over the group (the input's covers the whole sequence, halos included).
    Used where the model as a whole is refused (Inkling2), so its convs are still checked."""
    import copy

    import torch.distributed as dist

    from ringmaster.architectures import get_architecture
    from ringmaster.recurrent.context import LayerContext
    from ringmaster.recurrent.short_conv import KERNELS, probe_width, wire_short_conv_layer
    from ringmaster.recurrent.wiring import probe_layer
    from ringmaster.sharding import balancers
    from ringmaster.sharding.documents import CPBatch
    from ringmaster_tools.parity import keep_fp64
    from ringmaster_tools.zoo import build_tiny

    group = ctx.mesh(P)["cp"].get_group()
    rank = dist.get_rank(group)
    pos = balancers.shard_positions(S, P, rank, layout)
    docs = None
    if doc_lens is not None:
        docs = torch.repeat_interleave(torch.arange(len(doc_lens)), torch.tensor(doc_lens))[None].expand(2, -1)
    out = {}
    with keep_fp64():
        model = build_tiny(model_type)
        classes = get_architecture(model).recurrent_classes
        hidden = model.config.get_text_config().hidden_size
        for path, module in model.named_modules():
            if classes.get(type(module).__name__) != "short_conv":
                continue
            ref, cp = copy.deepcopy(module).double(), copy.deepcopy(module).double()
            C = probe_width(module, hidden)
            g = torch.Generator().manual_seed(len(out))
            x = torch.randn(2, S, C, generator=g, dtype=torch.float64)
            W = torch.randn(2, S, C, generator=g, dtype=torch.float64)
            xr = x.clone().requires_grad_()
            if docs is None:
                y_ref = ref(xr)
            else:
                bounds = [0, *torch.tensor(doc_lens).cumsum(0).tolist()]
                y_ref = torch.cat([ref(xr[:, a:b]) for a, b in zip(bounds, bounds[1:])], dim=1)
            (y_ref * W).sum().backward()
            lctx = LayerContext(path, group, "auto")
            undo = wire_short_conv_layer(cp, lctx)
            try:
                probe_layer(cp, lctx, KERNELS, C)
                lctx.carrier.set(CPBatch(rank, P, layout, S, docs))   # what the shard step does
                xl = x[:, pos].clone().requires_grad_()
                y = cp(xl)
                (y * W[:, pos]).sum().backward()
            finally:
                undo()
            gx = torch.zeros_like(x)
            gx[:, pos] = xl.grad
            dist.all_reduce(gx, group=group)
            errs = {"out": jr.rel(y, y_ref[:, pos]), "grad_x": jr.rel(gx, xr.grad)}
            for (name, p), (_, q) in zip(cp.named_parameters(), ref.named_parameters()):
                gp = p.grad.clone()
                dist.all_reduce(gp, group=group)
                errs[f"grad_{name}"] = jr.rel(gp, q.grad)
            out[path] = errs
    return out


def short_conv_layers_mutated(ctx, mutation, *args, **kwargs):
    """:func:`short_conv_layers` with ``mutation`` applied on this rank."""
    undo = MUTATIONS[mutation]()
    try:
        return short_conv_layers(ctx, *args, **kwargs)
    finally:
        undo()
