"""Jobs for tests/test_memory.py: per-rank peak tensor memory of one CP step as S doubles."""

from __future__ import annotations

import contextlib
from unittest import mock

import torch

import ringmaster as rm

# mask kinds -> (model type, model overrides); the batch comes from ``batch_of``
MODELS = {
    "causal": ("llama", {}),
    "window": ("mistral", dict(sliding_window=128)),
    "packed": ("llama", {}),
    "padded": ("llama", {}),
    # sinks on full-attention layers only, so the row measures the sinks (windows have their own row)
    # (gpt-oss loads with eager only; the ring backends never call the inner kernel)
    "sinks": ("gpt_oss", dict(layer_types=["full_attention", "full_attention"])),
}


def batch_of(kind: str, vocab: int, S: int) -> dict[str, torch.Tensor]:
    """A batch whose structure scales with S (documents and padding as fractions of S)."""
    from ringmaster_tools.parity import packed_batch, tiny_batch

    if kind == "packed":  # one long document, mid-size ones, a run of short ones
        lens = [S // 2, S // 4, S // 8] + [S // 64] * 6
        lens.append(S - sum(lens))
        return packed_batch(vocab, lens)
    if kind == "padded":  # B=2: row 0 one document, row 1 left and right padding (each pad token its own doc)
        batch = tiny_batch(vocab, S, batch_size=2)
        mask = torch.ones(2, S, dtype=torch.long)
        mask[1, :S // 128] = 0
        mask[1, S - S // 128:] = 0
        batch["attention_mask"] = mask
        batch["labels"][mask == 0] = -100
        return batch
    return tiny_batch(vocab, S)


def _step(model, batch, backward: bool = True):
    from ringmaster.adapters.raw import context_parallel_region

    with torch.set_grad_enabled(backward), context_parallel_region(batch) as shard:
        out = model(**shard)
    if backward:
        out.loss.backward()


@contextlib.contextmanager
def _eager_flex(attn: str):
    """HF compiles flex_attention, and torch.compile refuses to run under a (non-infra) dispatch mode:
    while measured, run it eagerly and call flex's op directly (torch's own debug switch). The tracker
    counts the flex_attention op as one kernel (its outputs); what it allocates inside (eagerly: the
    dense scores of torch's reference implementation) is the kernel's own, as a fused kernel's tiles
    are. What ringmaster builds around it (the BlockMask) is counted."""
    if attn != "flex_attention":
        yield
        return
    import torch.nn.attention.flex_attention as fa

    try:
        with torch._dynamo.config.patch(disable=True), mock.patch.object(fa, "_FLEX_ATTENTION_DISABLE_COMPILE_DEBUG",
                                                                          True):
            yield
    finally:
        # frames first met while dynamo was disabled stay marked as skipped in this worker: a later test's compiled
        # flex_attention (fullgraph) would then find no compiled frame and fail, depending on the test order
        torch._dynamo.reset()


# Each S is measured REPEATS times and the smallest peak kept: a collective's input buffer is released when
# gloo's background thread drops its reference, so whether it is still alive at the peak op varies from run
# to run (measured: one extra [2, B, H, S/P, D] all-to-all input, +18% on a flex row, in 1 run of 3). A term
# quadratic in S is there in every run, so the minimum keeps it.
REPEATS = 2


def peak_growth(ctx, P: int, backend: str, kind: str, sizes, attn: str = "sdpa", cfg_kwargs=None,
                backward: bool = True):
    """Peak bytes of tensors alive at once during one CP forward+backward on this rank, per S.

    Gradients are allocated (zeroed) before the measured block, so the peak counts activations,
    temporaries and collectives' buffers, not the parameter/gradient baseline. Each S runs once
    unmeasured first (lazy caches, allocator warm-up outside the count). ``backward=False``: forward
    only, under no_grad (flex_attention has no CPU backward in torch 2.13).
    """
    from ringmaster_tools.profiling import track_tensor_memory
    from ringmaster_tools.parity import tiny_model

    model_type, overrides = MODELS[kind]
    flash = "/" in attn  # a hub flash kernel (the CPU stand-in): built with sdpa, then named as from_pretrained does
    model = tiny_model(model_type, "eager" if model_type == "gpt_oss" else "sdpa" if flash else attn, **overrides)
    if flash:
        from jobs_ring import as_flash_model

        as_flash_model(model, attn)
    cfg = rm.RingmasterConfig(size=P, backend=backend, **(cfg_kwargs or {}))
    rm.wire(model, cfg, device_mesh=ctx.mesh(P))
    vocab = model.config.vocab_size
    rows = []
    try:
        with _eager_flex(attn):
            _step(model, batch_of(kind, vocab, sizes[0]), backward)
        for S in sizes:
            batch = batch_of(kind, vocab, S)
            best = None
            for _ in range(REPEATS):
                for p in model.parameters():
                    p.grad = torch.zeros_like(p)
                with _eager_flex(attn), track_tensor_memory() as mem:
                    _step(model, batch, backward)
                row = {"S": S, "peak": mem.peak_bytes, "peak_op": mem.peak_op,
                       "largest": mem.largest_bytes, "largest_op": mem.largest_op,
                       "largest_wide": mem.largest_wide_bytes, "largest_wide_op": mem.largest_wide_op}
                best = row if best is None or row["peak"] < best["peak"] else best
            rows.append(best)
    finally:
        rm.unwire(model)
        rm.teardown()
    return rows
