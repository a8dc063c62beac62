"""Ring block-kernel jobs (run on every rank of the gloo pool): model-level parity of each provider
(aten, hf_kernels on the CPU flash stand-in) for causal, sliding-window and packed rows."""

from __future__ import annotations

import ringmaster as rm

LLAMA_GQA = dict(num_attention_heads=8, num_key_value_heads=2)
# S=96 packed: documents cross shard edges at P=2 and P=4
DOC_LENS = [5, 67, 10, 14]
CASES = {
    "causal": ("llama", LLAMA_GQA),
    "window": ("mistral", dict(sliding_window=16)),
    "packed": ("llama", LLAMA_GQA),
    "sinks": ("gpt_oss", {}),  # per-head sink logits: the ring merges them after the last block
}
# the kernel a non-flash model (and every reference) runs: HF's sdpa has no sinks, eager has
REFERENCE_ATTN = {"sinks": "eager"}


def as_flash_model(model, name="flash_attention_2"):
    """Name the model's attention a flash kernel (the Ring never calls it; the name picks the hub
    kernel). Set on every config, as ``from_pretrained(attn_implementation=...)`` would."""
    for module in [model, *model.modules()]:
        config = getattr(module, "config", None)
        if config is not None and hasattr(config, "_attn_implementation"):
            config._attn_implementation = name


def _sdpa_reference(inner_forward, name="sdpa"):
    def forward(model, batch):
        model.set_attn_implementation(name)  # the deep-copied reference runs torch's own attention
        return inner_forward(model, batch)
    return forward


def kernel_parity(ctx, P, kernel, case, rotate, layout, flash_name="flash_attention_2", backend="ring", **split):
    """The model-level comparison for one (provider, mask case, rotation, layout).

    ``kernel="aten"``: an sdpa model with ``ring_impl='aten'``; ``kernel="hf_kernels"``: a model whose
    attention is ``flash_name`` under ``ring_impl='auto'`` (which must pick the hub kernels)."""
    from ringmaster_tools.parity import _plain_forward, compare, packed_batch, per_document_forward

    model_type, overrides = CASES[case]
    cfg = rm.RingmasterConfig(size=P, backend=backend, rotate_method=rotate, load_balance=layout,
                              ring_impl="aten" if kernel == "aten" else "auto", **split)
    kwargs = dict(device_mesh=ctx.mesh(P), attn_implementation=REFERENCE_ATTN.get(case, "sdpa"), **overrides)
    reference = per_document_forward if case == "packed" else _plain_forward
    if case == "packed":
        kwargs["batch"] = packed_batch(128, DOC_LENS)
    if kernel == "hf_kernels":
        kwargs["prepare"] = lambda m: as_flash_model(m, flash_name)
        reference = _sdpa_reference(reference, REFERENCE_ATTN.get(case, "sdpa"))
    return compare(model_type, cfg, reference_forward=reference, **kwargs)


def kernel_parity_variants(ctx, P, kernel, case, variants, flash_name="flash_attention_2", backend="ring",
                           **split):
    """:func:`kernel_parity` for each ``(rotate, layout)`` of ``variants``, in one job: the model is built, named
    and its reference (without CP) run once, shared by every variant (the same weights, batch and reference
    :func:`kernel_parity` builds for each)."""
    import copy

    from ringmaster_tools.parity import _plain_forward, compare, packed_batch, per_document_forward, tiny_batch, \
        tiny_model

    model_type, overrides = CASES[case]
    attn = REFERENCE_ATTN.get(case, "sdpa")
    base = tiny_model(model_type, attn, 0, **overrides)
    reference_forward = per_document_forward if case == "packed" else _plain_forward
    if kernel == "hf_kernels":
        as_flash_model(base, flash_name)
        reference_forward = _sdpa_reference(reference_forward, attn)
    batch = packed_batch(128, DOC_LENS) if case == "packed" else tiny_batch(base.config.vocab_size, 64, 1, seed=1)
    reference = copy.deepcopy(base)
    ref_out = reference_forward(reference, batch)
    ref_out.loss.backward()
    out = []
    for rotate, layout in variants:
        cfg = rm.RingmasterConfig(size=P, backend=backend, rotate_method=rotate, load_balance=layout,
                                  ring_impl="aten" if kernel == "aten" else "auto", **split)
        out.append(compare(model_type, cfg, device_mesh=ctx.mesh(P), attn_implementation=attn, batch=batch,
                           build=lambda *a, **k: copy.deepcopy(base), reference=(reference, ref_out)))
    return out


def hub_window_mutation(ctx, P, rotate="alltoall", layout="none"):
    """``{"clean", "mutated"}``: the windowed model through the hub provider, once as is and once with
    the provider dropping the window's left bound (``hub.flash_flags``)."""
    from jobs_mutations_attention import applied, MUTATIONS

    MUTATIONS.setdefault("hub_kernel_ignores_window", hub_kernel_ignores_window)
    clean = kernel_parity(ctx, P, "hf_kernels", "window", rotate, layout)
    with applied("hub_kernel_ignores_window"):
        try:
            mutated = kernel_parity(ctx, P, "hf_kernels", "window", rotate, layout)
        except Exception as exc:  # the test asserts on the type and message
            mutated = {"raised": (type(exc).__name__, str(exc))}
        finally:
            rm.teardown()
    return {"clean": clean, "mutated": mutated}


def hub_kernel_ignores_window():
    """hf_kernels: every flash call drops the window's left bound (keeps causal).

    Target: ``ringmaster.attention.ring.hub.flash_flags`` (read as a module global by each call)."""

    def flash_flags(left, right):
        return right == 0, (None, right)

    return [("ringmaster.attention.ring.hub", "flash_flags", flash_flags)]
