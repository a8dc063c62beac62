"""Jobs for load_balance="documents" (length-aware CP): run on every rank by the gloo pool."""

from __future__ import annotations

import contextlib

import ringmaster as rm


def documents_parity(ctx, P, model_type, backend, doc_lens, threshold=None, cfg_kwargs=None, fp64=False,
                     via="region", mutation=None, overrides=None):
    """A packed row under ``load_balance="documents"`` against every document run alone (token-weighted):
    loss, gathered logits, every gradient. ``mutation``: a name from :data:`MUTATIONS`, applied while the CP
    model runs."""
    from ringmaster_tools.parity import compare, packed_batch, per_document_forward

    from jobs_recurrent import slow_decay

    cfg = rm.RingmasterConfig(size=P, backend=backend, load_balance="documents", documents_threshold=threshold,
                              **(cfg_kwargs or {}))
    with (MUTATIONS[mutation]() if mutation else contextlib.nullcontext()):
        return compare(model_type, cfg, device_mesh=ctx.mesh(P), prepare=slow_decay,
                       batch=lambda m: packed_batch(m.config.vocab_size, list(doc_lens)),
                       reference_forward=per_document_forward, fp64=fp64, via=via, **(overrides or {}))


@contextlib.contextmanager
def _twice():
    """A whole document assigned to two ranks: the first whole document of rank 0 is also rank 1's."""
    from unittest import mock

    from ringmaster.sharding import assignment

    real = assignment.assign

    def assign(*args, **kwargs):
        a = real(*args, **kwargs)
        whole = [list(w) for w in a.whole]
        if whole[0] and len(whole) > 1 and whole[1]:
            whole[1][0] = whole[0][0]
        import dataclasses
        return dataclasses.replace(a, whole=tuple(tuple(w) for w in whole))

    with mock.patch.object(assignment, "assign", assign):
        yield


@contextlib.contextmanager
def _state_not_passed():
    """A split document's recurrent state is not passed: the split part runs as if each rank were alone."""
    import importlib
    import pkgutil
    from unittest import mock

    import ringmaster.recurrent as recurrent
    from ringmaster.recurrent import scan

    def alone(segments, *args, **kwargs):
        return scan.simulate_sequential(segments)

    with contextlib.ExitStack() as stack:
        for info in pkgutil.iter_modules(recurrent.__path__):
            module = importlib.import_module(f"ringmaster.recurrent.{info.name}")
            if getattr(module, "pass_state", None) is scan.pass_state:
                stack.enter_context(mock.patch.object(module, "pass_state", alone))
        yield


@contextlib.contextmanager
def _local_sees_split():
    """The local attention is given the split document's keys too (its whole documents attend to them)."""
    from unittest import mock

    import torch

    from ringmaster.attention import ulysses

    real = ulysses.local_attention

    def local_attention(module, query, key, value, *, binding, cpb, **kwargs):
        # the whole documents' attention, but the batch's documents merged into one (all may attend)
        from ringmaster.sharding.documents import CPBatch, Runs
        merged = CPBatch(0, 1, "contiguous", cpb.seq_len, torch.zeros_like(cpb.doc_ids), runs=Runs.whole(cpb.seq_len),
                         origin=cpb.origin)
        return real(module, query, key, value, binding=binding, cpb=merged, **kwargs)

    with mock.patch.object(ulysses, "local_attention", local_attention):
        yield


MUTATIONS = {"whole_on_two_ranks": _twice, "split_state_not_passed": _state_not_passed,
             "local_attends_across_documents": _local_sees_split}
