"""Pool jobs for ``recurrent="heads"`` (head-parallel recurrent layers): model-level parity against the same
model without CP, dense / packed / ``load_balance="documents"`` rows, and the mutations that break the head
split."""

from __future__ import annotations

import contextlib

import ringmaster as rm
from jobs_documents import ATTN, _prepare

DOC_LENS = (5, 27, 2, 30)   # 64 tokens: documents start mid-shard and on the P=2 / P=4 shard edges


def parity(ctx, model_type, P, backend="ulysses", rows="dense", load_balance="auto", fp64=True, mutation=None,
           seq_len=64, recurrent="heads", **overrides):
    """``rows``: ``dense`` (one random row), ``packed`` (one packed row against every document run alone),
    ``documents`` (the packed row under ``load_balance="documents"``). ``mutation``: a name of :data:`MUTATIONS`,
    applied while both models run."""
    from ringmaster_tools.parity import compare, packed_batch, per_document_forward

    if rows == "documents":
        load_balance = "documents"
    cfg = rm.RingmasterConfig(size=P, backend=backend, recurrent=recurrent, load_balance=load_balance)
    extra = {}
    if rows != "dense":
        extra = dict(batch=lambda m: packed_batch(m.config.vocab_size, list(DOC_LENS)),
                     reference_forward=per_document_forward)
    with (MUTATIONS[mutation]() if mutation else contextlib.nullcontext()):
        return compare(model_type, cfg, seq_len=seq_len, device_mesh=ctx.mesh(P), prepare=_prepare(model_type),
                       fp64=fp64, attn_implementation=ATTN.get(model_type, "sdpa"), **extra, **overrides)


@contextlib.contextmanager
def _patched(owners, name, new):
    owners = owners if isinstance(owners, (list, tuple)) else [owners]
    old = [getattr(o, name) for o in owners]
    for o in owners:
        setattr(o, name, new)
    try:
        yield
    finally:
        for o, fn in zip(owners, old):
            setattr(o, name, fn)


def _wrong_head_slice():
    """Per-head parameters sliced for the next rank's heads (Mamba2's A / D / dt_bias, lightning's slopes, RWKV's
    decays): the kernel runs this rank's heads with another rank's constants."""
    import torch.distributed as dist

    from ringmaster.recurrent import lightning, mamba1, mamba2, rwkv

    def local_heads(t, group, dim=0):
        if t is None or t.dim() == 0:
            return t
        P, rank = dist.get_world_size(group), dist.get_rank(group)
        n = t.shape[dim] // P
        return t.narrow(dim, ((rank + 1) % P) * n, n)
    return _patched([lightning, mamba1, mamba2, rwkv], "local_heads", local_heads)


def _groups_not_replicated():
    """Inputs shared by a group of heads (B/C with n_groups < P, q/k with fewer key heads) sliced like the heads
    instead of replicated: a rank's heads read another group's B/C (or q/k)."""
    from ringmaster.recurrent import heads

    def grouped(path, t, heads_, P, what):
        if t.shape[2] % P == 0:
            return t
        reps = -(-P // t.shape[2])
        return t.repeat(1, 1, reps, *[1] * (t.dim() - 3))   # tiled, not interleaved: the wrong groups
    return _patched(heads, "grouped", grouped)


def _order_ignored():
    """The whole row assembled in the order the ranks' chunks arrive, not in sequence order (head_tail)."""
    from ringmaster.recurrent import heads
    return _patched(heads, "_order", lambda layout, P: None)


def refused(ctx, model_type, P, **overrides):
    """``rm.wire`` with ``recurrent="heads"`` on a model whose head count P does not divide: the error, or None."""
    from ringmaster_tools.parity import tiny_model

    model = tiny_model(model_type, **overrides)
    try:
        rm.wire(model, rm.RingmasterConfig(size=P, backend="ulysses", recurrent="heads"), device_mesh=ctx.mesh(P))
    except Exception as exc:
        return type(exc).__name__, str(exc)
    finally:
        rm.teardown()
    return None


MUTATIONS = {"wrong_head_slice": _wrong_head_slice, "groups_not_replicated": _groups_not_replicated,
             "order_ignored": _order_ignored}


def auto_bytes(ctx, model_type, P, seqs, inverted=False, **overrides):
    """``recurrent="auto"`` against ``heads`` and the state passing it falls back to: the recurrent layers' bytes
    sent per forward (``rm.profile_comms``) on dense rows of each length in ``seqs``, and what ``auto`` reports per
    layer. ``inverted``: the mutation, ``auto`` picking the strategy that sends more."""
    from ringmaster.adapters.raw import context_parallel_region
    from ringmaster.sharding.documents import CPBatch
    from ringmaster_tools.parity import tiny_batch, tiny_model

    fallback = "sequential" if P <= 2 else "scan"
    out = {}
    rows = CPBatch.heads_rows
    with (_patched(CPBatch, "heads_rows", lambda self, up_to: not rows(self, up_to)) if inverted
          else contextlib.nullcontext()):
        for strategy in ("auto", "heads", fallback):
            model = tiny_model(model_type, **overrides)
            try:
                runtime = rm.wire(model, rm.RingmasterConfig(size=P, backend="ulysses", recurrent=strategy),
                                  device_mesh=ctx.mesh(P))
            except rm.UnsupportedLayerError as e:   # heads refused (a head count P does not divide)
                out[strategy] = str(e)
                continue
            try:
                if strategy == "auto":
                    out["choice"] = dict(runtime.report.recurrent_choice)
                for S in seqs:
                    with rm.profile_comms() as comms, context_parallel_region(
                            tiny_batch(model.config.vocab_size, S)) as shard:
                        model(**shard)
                    out[(strategy, S)] = comms.by_layer_kind()["recurrent"]["forward"]["bytes"]
            finally:
                rm.unwire(model)
    return out


def costs_checked(ctx, model_type, P, **overrides):
    """``layer_costs`` on a tiny model of ``model_type``, every segment's ``map_meta()`` checked against the map its
    ``local_map()`` computes (what the scan all-gathers), and what ``rm.wire(recurrent="auto")`` reports for the same
    model, wired for real at CP size ``P``, against what ``layer_costs`` says of it on the meta device."""
    import copy

    import torch

    from ringmaster.recurrent import context
    from ringmaster.recurrent.wiring import layer_costs
    from ringmaster_tools.parity import tiny_model

    seen = []
    original = context.Probe.observe

    def checked(self, segment, *args, **kwargs):
        seen.append((self.path, tuple(segment.map_meta()), tuple(segment.local_map()[0].shape)))
        return original(self, segment, *args, **kwargs)

    model = tiny_model(model_type, **overrides)
    with _patched(context.Probe, "observe", checked):
        real = layer_costs(model, P)
    meta = copy.deepcopy(model).to("meta")
    on_meta = layer_costs(meta, P)
    fallback = "sequential" if P <= 2 else "scan"
    runtime = rm.wire(model, rm.RingmasterConfig(size=P, backend="ulysses"), device_mesh=ctx.mesh(P))
    try:
        wired = dict(runtime.report.recurrent_choice)
    finally:
        rm.unwire(model)
    return {"maps": seen, "real": {p: c.describe(fallback) for p, c in real.items()},
            "meta": {p: c if isinstance(c, str) else c.describe(fallback) for p, c in on_meta.items()},
            "wired": wired, "dtype": str(next(model.parameters()).dtype).removeprefix("torch.")}


def setup_path_choices(ctx, P, recurrent="auto"):
    """The low-level path (``rm.setup``, then ``rm.wire_recurrent_layers`` with no strategy): what the layers pick
    under a runtime whose config asked ``recurrent``."""
    from ringmaster_tools.parity import tiny_model

    rm.setup(rm.RingmasterConfig(size=P, backend="ulysses", recurrent=recurrent), device_mesh=ctx.mesh(P))
    try:
        wiring = rm.wire_recurrent_layers(tiny_model("qwen3_5_text"))
        choices = dict(wiring.choices)
        wiring.restore()
    finally:
        rm.teardown()
    return choices


def auto_choice_graphs(ctx, mutated=False):
    """``recurrent="auto"``'s per-call choice inside a compiled function, over batches whose rows differ in length
    (as a documents shard's split part does per packing): graphs compiled. The choice reads the batch's host bool
    (``CPBatch.heads_rows``); ``mutated``: it compares the row length itself in the graph, a guard per length."""
    import torch
    import torch._dynamo

    from ringmaster.recurrent.context import LayerContext
    from ringmaster.recurrent.cost import LayerCost
    from ringmaster.sharding.documents import CPBatch

    group = ctx.mesh(2).get_group("cp")
    layer = LayerContext("layer", group, "sequential", auto=True, cost=LayerCost(2, 100.0, 1e6, 1e6))
    rank = torch.distributed.get_rank(group)

    class Carrier:   # as the model's step carrier hands the batch to a layer transformers calls without the kwarg
        current = None

    def step(x):
        return x * 2 if layer.resolve(Carrier.current)[3] == "heads" else x

    compiled = torch.compile(step, fullgraph=True, backend="eager")
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    picked = []
    with (_patched(CPBatch, "heads_rows", lambda self, up_to: 0 < self.seq_len <= up_to) if mutated
          else contextlib.nullcontext()):
        for S in (64, 96, 128, 160, 192, 2 * layer.heads_up_to, 4 * layer.heads_up_to):
            Carrier.current = CPBatch(rank, 2, "contiguous", S, heads_upto=(layer.heads_up_to,))
            picked.append(float(compiled(torch.ones(1))))
    return {"graphs": torch._dynamo.utils.counters["stats"]["unique_graphs"], "picked": picked,
            "up_to": layer.heads_up_to}
