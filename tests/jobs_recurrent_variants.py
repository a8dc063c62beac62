"""Pool jobs for tests/test_recurrent_variants.py: the short-conv families (LFM2, LFM2-MoE, LFM3)
and the other gated-DeltaNet hybrids (Lara-mini, OLMo-hybrid, Bailing-hybrid's Kimi delta
attention), dense, packed and padded, fp64 per parameter and fp32; plus the mutations of the
short-conv kind."""

from __future__ import annotations

import jobs_mutations as jm
import jobs_recurrent as jr
import torch

import ringmaster as rm


def parity(ctx, model_type, P, strategy="scan", backend="ulysses", seq_len=64, fp64=True, **overrides):
    """Dense rows: ``compare`` with slow decays (where the layer has A_log)."""
    from ringmaster.testing.parity import compare

    cfg = rm.RingmasterConfig(size=P, backend=backend, recurrent=strategy)
    return compare(model_type, cfg, seq_len=seq_len, device_mesh=ctx.mesh(P), prepare=jr.slow_decay, fp64=fp64,
                   **overrides)


def packed_parity(ctx, model_type, P, strategy="scan", backend="ulysses", doc_lens=(5, 27, 2, 30), fp64=True,
                  **overrides):
    """One packed row (documents start mid-shard and on shard edges) against every document run alone."""
    from ringmaster.testing.parity import compare, packed_batch, per_document_forward

    cfg = rm.RingmasterConfig(size=P, backend=backend, recurrent=strategy)
    return compare(model_type, cfg, device_mesh=ctx.mesh(P), prepare=jr.slow_decay, fp64=fp64,
                   batch=lambda m: packed_batch(m.config.vocab_size, list(doc_lens)),
                   reference_forward=per_document_forward, **overrides)


def padded_parity(ctx, model_type, P, strategy="scan", backend="ulysses", S=64, left=7, real=41):
    """B=2, row 1 left- and right-padded, in float64 (padding is a document of its own: no conv tap
    or state reaches the first real token)."""
    from jobs import padded_parity as run

    from ringmaster.testing.parity import keep_fp64

    with keep_fp64():
        return run(ctx, P, backend, {"recurrent": strategy}, model_type=model_type, prepare=jr.slow_decay, S=S,
                   left=left, real=real, dtype=torch.float64)


def drop_short_conv_documents():
    """``ringmaster.recurrent.short_conv.conv_documents``: the document ids never reach the short conv,
    so its taps (and the halo) reach across document starts in a packed row."""
    from ringmaster.recurrent import short_conv

    return jm._patch(short_conv, "conv_documents", lambda *args: None)


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
    from ringmaster.testing.parity import tiny_model

    model = tiny_model(model_type)
    runtime = rm.wire(model, rm.RingmasterConfig(size=P, backend="ulysses"), device_mesh=ctx.mesh(P))
    try:
        return [tuple(x) for x in runtime.report.recurrent]
    finally:
        rm.unwire(model)
        rm.teardown()
