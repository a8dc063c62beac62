"""Host-sync jobs (every rank of the gloo pool): ringmaster_tools.step_shape over a grid of models, backends
and batches, and the mutations that must make the count fail."""

from __future__ import annotations

import contextlib

from ringmaster_tools import step_shape


@contextlib.contextmanager
def _item_in_ring_loop():
    """One ``.item()`` per ring block in the forward: a host read the batch already told us."""
    from ringmaster.attention.ring import loop

    original = loop._forward_block

    def forward_block(kernel, plan, q, kv, src, scale, acc, lay, softcap, rel=None):
        q.sum().item()
        return original(kernel, plan, q, kv, src, scale, acc, lay, softcap, rel)

    loop._forward_block = forward_block
    try:
        yield
    finally:
        loop._forward_block = original


@contextlib.contextmanager
def _runs_dropped():
    """The step context without its host copy of the documents: every layer that asks for it reads the ids' values
    again (the layers no longer fall back to reading them themselves: they refuse a batch without runs)."""
    from ringmaster.sharding import documents

    def read_again(self):
        return None if self.doc_ids is None else documents.Runs.from_doc_ids(self.doc_ids)

    def read_recurrent_again(self):   # the recurrent layers' copy (a run of padding one document)
        docs = self.__dict__.get("recurrent_doc_ids")
        return None if docs is None else documents.Runs.from_doc_ids(docs)

    documents.CPBatch.runs = property(read_again, lambda self, value: None)
    documents.CPBatch.recurrent_runs = property(read_recurrent_again, lambda self, value: None)
    try:
        yield
    finally:
        del documents.CPBatch.runs
        del documents.CPBatch.recurrent_runs


MUTATIONS = {"item_in_ring_loop": _item_in_ring_loop, "runs_dropped": _runs_dropped}


def grid(ctx, cases, size: int = 2, mutation: str | None = None, overrides: dict | None = None) -> list[dict]:
    """``step_shape.host_syncs`` for every ``(model, backend, batch)`` of ``cases``; ``overrides``: model name ->
    config fields over it (``step_shape.TWO_BLOCKS``)."""
    overrides = overrides or {}
    patch = MUTATIONS[mutation]() if mutation else contextlib.nullcontext()
    out = []
    plain = {}   # the model without CP, warmed and counted once per (model, batch) and shared by the backends
    with patch:
        for model, backend, batch in cases:
            try:
                out.append({"case": (model, backend, batch),
                            **step_shape.host_syncs(ctx, model, backend, batch, size, overrides=overrides.get(model),
                                                    plain_cache=plain)})
            except Exception as exc:   # a mutation may break the step outright: report it as a failed row
                if mutation is None:
                    raise
                out.append({"case": (model, backend, batch), "error": repr(exc)})
    return out
