"""Jobs for tests/test_flash_kernels.py: Ulysses with a flash inner kernel (the CPU stand-in loaded
through ``kernels`` + LOCAL_KERNELS, set by conftest before the pool started) against the same
weights without CP, run with sdpa or eager (loss, gathered logits, every gradient)."""

from __future__ import annotations

from contextlib import contextmanager

import torch

import ringmaster as rm


def _reference(attn, base=None):
    """The reference runs the model's own non-flash kernel: the flash name set for CP would make
    transformers look for a library it cannot load here."""
    from ringmaster_tools.parity import _plain_forward

    def forward(model, batch):
        model.config._attn_implementation = attn
        return (base or _plain_forward)(model, batch)

    return forward


def _batch(kind, vocab=128, seq_len=64):
    from ringmaster_tools.parity import packed_batch, padded_rows, per_document_forward, per_row_forward, tiny_batch

    if kind == "plain":
        return tiny_batch(vocab, seq_len), None
    if kind == "packed":  # documents crossing every shard edge at P=2 and P=4, one shorter than the window
        return packed_batch(vocab, [20, 30, 14]), per_document_forward
    if kind == "padded":  # B=2, row 1 padded on both sides: each padding token its own document
        return padded_rows(vocab, seq_len), per_row_forward
    raise ValueError(kind)


def flash_parity(ctx, P, inner, model_type="llama", overrides=None, kind="plain", reference_attn="sdpa",
                 mutation=None):
    """Ulysses with ``inner`` (a flash name) at CP size P vs ``reference_attn`` without CP."""
    from ringmaster_tools.parity import compare

    batch, base = _batch(kind)

    def prepare(model):
        model.config._attn_implementation = inner

    cfg = rm.RingmasterConfig(size=P, backend="ulysses")
    with applied(mutation):
        r = compare(model_type, cfg, device_mesh=ctx.mesh(P), attn_implementation=reference_attn, batch=batch,
                    reference_forward=_reference(reference_attn, base), prepare=prepare, **(overrides or {}))
    r["grad_errs"] = {k: v for k, v in r["grad_errs"].items() if v > 1e-5}  # keep the result small
    return r


def flash_padded_logits_ok(ctx, P, inner):
    """Padded rows: compare() measures logits over every position, padding included; here only the
    real tokens are compared (the loss and gradients never see padding)."""
    import copy

    import torch.distributed as dist

    from ringmaster.adapters.raw import context_parallel_region
    from ringmaster_tools.parity import group_mean_grad_errors, padded_rows, per_row_forward, rel_err, tiny_model

    model = tiny_model("llama", "sdpa", num_attention_heads=8, num_key_value_heads=2)
    reference = copy.deepcopy(model)
    batch = padded_rows(model.config.vocab_size, 64)
    ref = per_row_forward(reference, batch)
    ref.loss.backward()
    model.config._attn_implementation = inner
    runtime = rm.wire(model, rm.RingmasterConfig(size=P, backend="ulysses"), device_mesh=ctx.mesh(P))
    try:
        with context_parallel_region(batch) as shard:
            out = model(**shard)
        out.loss.backward()
        loss = out.loss.detach().clone()
        dist.all_reduce(loss, group=runtime.cp_group)
        logits = rm.gather_sequence(out.logits.detach(), dim=1)
        errs, missing, _ = group_mean_grad_errors(model, reference, runtime.cp_group, P)
    finally:
        rm.unwire(model)
        rm.teardown()
    keep = batch["attention_mask"].bool()
    return {"loss_err": rel_err(loss / P, ref.loss.detach()), "logits_err": rel_err(logits[keep], ref.logits[keep]),
            "grad_err": max(errs.values()), "missing": missing, "nan": bool(torch.isnan(logits).any())}


def flash_refusal(ctx, P, inner, model_type, overrides=None):
    """Wire and run one forward; return (exception type, message, collectives issued before it)."""
    from ringmaster.adapters.raw import context_parallel_region
    from ringmaster_tools.parity import tiny_batch, tiny_model

    model = tiny_model(model_type, "eager", **(overrides or {}))
    model.config._attn_implementation = inner
    try:
        rm.wire(model, rm.RingmasterConfig(size=P, backend="ulysses"), device_mesh=ctx.mesh(P))
        with rm.profile_comms() as comms:
            try:
                with context_parallel_region(tiny_batch(model.config.vocab_size, 64)) as shard:
                    model(**shard)
            except Exception as exc:  # the test asserts on the type and the message
                return type(exc).__name__, str(exc), comms.total_bytes("all_to_all")
        return None
    finally:
        rm.unwire(model)
        rm.teardown()


def setup_without_transformers_registration(ctx, inner):
    """setup() with a flash inner name that transformers has not registered (and could not load):
    the kernel resolves through ringmaster's loader."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    registered = inner in ALL_ATTENTION_FUNCTIONS
    rt = rm.setup(rm.RingmasterConfig(size=1, backend="ulysses"), num_kv_heads=2, inner_attn=inner,
                  device_mesh=ctx.mesh(1))
    try:
        k = rt.binding.inner_kernel
        return {"registered": registered, "source": k.source, "standin": getattr(k.module, "STANDIN", None),
                "name": rt.attn_implementation}
    finally:
        rm.teardown()


# -- mutations: break what Ulysses passes the kernel; the model-level check must see it -------

def _one_document(self, batch_size, device):
    """cu_seqlens ignore the documents: every row is one sequence."""
    S = self.seq_len
    return torch.arange(0, (batch_size + 1) * S, S, dtype=torch.int32, device=device), S


def _no_window(sliding_window, causal):
    """sliding windows are never passed to the kernel."""
    return None


class _NoSinkGrad(torch.autograd.Function):
    """the sink logits get no gradient (what vllm's FA3 backward alone gives)."""

    @staticmethod
    def forward(ctx, out, lse, sinks):
        return out.view_as(out)

    @staticmethod
    def backward(ctx, dout):
        return dout, None, None


def _no_softcap():
    from ringmaster.attention.flash_kernels import FlashKernel

    original = FlashKernel.varlen

    def varlen(self, *args, softcap=None, **kwargs):
        """logit softcapping is never passed to the kernel."""
        return original(self, *args, softcap=None, **kwargs)

    return varlen


def _first_heads(per_head, rank, count):
    """every rank takes the first heads' sinks."""
    return per_head[:count]


MUTATIONS = {
    "cu_seqlens_one_document": ("ringmaster.sharding.documents", "CPBatch", "varlen_bounds", _one_document),
    "window_dropped": ("ringmaster.attention.flash_kernels", None, "window_size", _no_window),
    "sink_grad_dropped": ("ringmaster.attention.flash_kernels", None, "SinkGrad", _NoSinkGrad),
    "sinks_not_sliced": ("ringmaster.attention.ulysses", None, "local_heads", _first_heads),
    "softcap_dropped": ("ringmaster.attention.flash_kernels", "FlashKernel", "varlen", _no_softcap),
}


@contextmanager
def applied(mutation):
    if mutation is None:
        yield
        return
    import importlib

    module_path, cls, attr, value = MUTATIONS[mutation]
    if mutation == "softcap_dropped":
        value = value()
    target = importlib.import_module(module_path)
    if cls is not None:
        target = getattr(target, cls)
    if not hasattr(target, attr):
        raise AttributeError(f"mutation {mutation}: {module_path}.{cls or ''}.{attr} does not exist (moved?)")
    saved = getattr(target, attr)
    setattr(target, attr, value)
    try:
        yield
    finally:
        setattr(target, attr, saved)
