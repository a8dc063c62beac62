"""Rank-side jobs of tests/test_liger.py: Liger-Kernel's Triton kernels on a tiny Llama under
CP, in the real-kernel pool (Triton's interpreter, tests/realkernels' bridges), against the same model without
Liger and without CP."""

from __future__ import annotations

import contextlib
import copy

import torch

import ringmaster as rm
from ringmaster_tools.parity import (_plain_forward, compare, packed_batch, per_document_forward, tiny_batch,
                                     tiny_model)

KERNELS = ("rms_norm", "swiglu", "rope", "fused_linear_cross_entropy")
# family -> Liger's patch function and its GLU flag (Gemma's GeGLU, measured exact as a model once: geglu_matches_torch
# checks its kernel in the suite)
FAMILY = {"llama": ("apply_liger_kernel_to_llama", "swiglu"), "gemma": ("apply_liger_kernel_to_gemma", "geglu")}
LAYOUTS = {
    "ulysses": dict(backend="ulysses"),
    "ring": dict(backend="ring"),
    "documents": dict(backend="ring", load_balance="documents", documents_threshold=16),
}
# rows of 32 tokens (Liger's RoPE kernel runs a program per token under the interpreter): the parity runs and
# loss_refusals' refusals (refused at the first forward's check, before any backward); its mutation trains on 64,
# where a mean over the shard's labels differs from the mean over the batch's (on the 32-token row they coincide)
S = 32
MUTATION_S = 64
PACKED = {S: [S - 12, 5, 7]}   # the first document crosses the shard edge


def _batch(kind: str, vocab: int, seq_len: int = S) -> tuple[dict, object]:
    """The batch of ``kind`` and its reference forward: ``dense`` (a quarter of the labels ignored), ``sparse``
    (nine in ten ignored: shards with few or no targets), ``packed`` (documents, each its own reference)."""
    if kind == "dense":
        return tiny_batch(vocab, seq_len), _plain_forward
    if kind == "sparse":
        return tiny_batch(vocab, seq_len, ignore_frac=0.9, seed=3), _plain_forward
    if kind == "packed":
        return packed_batch(vocab, PACKED[seq_len]), per_document_forward
    raise ValueError(kind)


@contextlib.contextmanager
def liger(model_type: str, kernels: tuple[str, ...], model=None, drop_num_items: bool = False):
    """Liger patched as axolotl's plugin does (``model=None``: the modeling module's classes and the causal LM's
    forward, before the model is built) or on one ``model`` (Liger patches the modeling module's rotary function
    then too); the modeling module is restored on exit, so the worker's later jobs run transformers' own code.
    ``drop_num_items`` (with ``model``): the fused head and loss called without ``num_items_in_batch``, as a
    forward that drops it would (Liger then takes a mean over the shard)."""
    import importlib

    import liger_kernel.transformers as lt

    fn_name, glu = FAMILY[model_type]
    module = importlib.import_module(f"transformers.models.{model_type}.modeling_{model_type}")
    cls = next(v for k, v in vars(module).items() if k.endswith("ForCausalLM") and not k.startswith("_"))
    saved, forward = dict(vars(module)), cls.forward
    flags = {k: k in kernels for k in KERNELS if k != "swiglu"}
    flags[glu] = "swiglu" in kernels
    try:
        getattr(lt, fn_name)(model=model, cross_entropy=False, **flags)
        if drop_num_items:
            fused = model.forward

            def forward_without_count(*args, num_items_in_batch=None, **kwargs):
                return fused(*args, **kwargs)

            model.forward = forward_without_count
        yield module
    finally:
        for k, v in saved.items():
            if vars(module).get(k) is not v:
                setattr(module, k, v)
        cls.forward = forward


def _family_model(model_type: str):
    return tiny_model(model_type, num_hidden_layers=2)


def _what_liger_patched(model, module) -> dict:
    """The Liger module classes in ``model``, the module of the forward it runs and of the rotary function its
    attention calls."""
    forward = getattr(model.forward, "__func__", model.forward)
    return {"modules": sorted({type(m).__name__ for m in model.modules() if type(m).__name__.startswith("Liger")}),
            "forward": forward.__module__, "rope": module.apply_rotary_pos_emb.__module__}


def cases(ctx, model_type: str, batch_kind: str, runs: list[tuple], P: int = 2) -> list[dict]:
    """fp32 parity of Liger-patched ``model_type`` under CP against the same model without Liger and without CP
    (one reference shared by every run). ``runs``: ``(layout, kernels, on)`` with ``on`` ``"class"`` (axolotl's
    way: the modeling classes patched before the model is built) or ``"instance"``. Each result says what Liger
    patched (``liger``) and what the worker's modeling module holds after (``after``: transformers' own)."""
    ctx.mesh(P)
    base = _family_model(model_type)
    batch, forward = _batch(batch_kind, base.config.vocab_size)
    reference = copy.deepcopy(base)
    out = forward(reference, batch)
    out.loss.backward()
    results = []
    for layout, kernels, on in runs:
        built = []

        def build(*a, **k):
            if on == "class":
                model = _family_model(model_type)   # from the patched classes, with the reference's weights
                model.load_state_dict(base.state_dict())
            else:
                model = instance
            built.append(model)
            return model

        instance = copy.deepcopy(base) if on == "instance" else None
        with liger(model_type, tuple(kernels), model=instance) as module:
            r = compare(model_type, rm.RingmasterConfig(size=P, **LAYOUTS[layout]), device_mesh=ctx.mesh(P),
                        batch=batch, build=build, reference=(reference, out))
            patched = _what_liger_patched(built[0], module)
        keep = ("cp_size", "backend", "layout", "split_fraction", "loss_err", "logits_err", "grad_err", "worst_param",
                "grad_err_total", "n_grads", "n_params", "missing_grads")
        results.append({k: r[k] for k in keep} | {"liger": patched,
                                                   "after": _what_liger_patched(_family_model(model_type), module)})
    return results


def geglu_matches_torch(ctx) -> float:
    """Liger's GeGLU kernel (Gemma's ``liger_glu_activation``: its tanh is a libdevice function imported by bare
    name, the bridge's second gap) against torch's ``gelu(gate, approximate="tanh") * up``, forward and backward, in
    fp32: the largest error, each tensor against its own norm."""
    from liger_kernel.ops.geglu import LigerGELUMulFunction

    from ringmaster_tools.parity import rel_err

    g = torch.Generator().manual_seed(0)
    gate, up = (torch.randn(2, 16, 64, generator=g, requires_grad=True) for _ in range(2))
    grad = torch.randn(2, 16, 64, generator=g)
    ref_gate, ref_up = (t.detach().clone().requires_grad_() for t in (gate, up))   # Liger's backward reuses its inputs
    out = LigerGELUMulFunction.apply(gate, up)
    out.backward(grad)
    ref = torch.nn.functional.gelu(ref_gate, approximate="tanh") * ref_up
    ref.backward(grad)
    return max(rel_err(out, ref), rel_err(gate.grad, ref_gate.grad), rel_err(up.grad, ref_up.grad))


def loss_refusals(ctx, layouts: list[str], P: int = 2, mutation: str | None = None) -> dict:
    """Liger's fused linear cross entropy with ``num_items_in_batch`` dropped (a mean over the shard), one CP step
    per layout: the refusal this rank raised (None: it ran). ``mutation="no_loss"``: the token-mixing check
    without its loss test; the step then runs, and its loss and gradient are compared with the model without CP."""
    from ringmaster.adapters.raw import context_parallel_region
    from ringmaster.architectures import mixing

    original = mixing.MixingCheck.__init__

    def init(self, *args, **kwargs):
        original(self, *args, **kwargs)
        if mutation == "no_loss":
            self.loss = False

    mixing.MixingCheck.__init__ = init
    out = {}
    try:
        base = _family_model("llama")
        for layout in layouts:
            batch, forward = _batch("packed" if layout == "documents" else "dense", base.config.vocab_size,
                                    MUTATION_S if mutation else S)
            model = copy.deepcopy(base)
            cfg = rm.RingmasterConfig(size=P, **LAYOUTS[layout])
            with liger("llama", KERNELS, model=model, drop_num_items=True):
                if mutation is None:   # refused at the first forward: no reference needed
                    rm.wire(model, cfg, device_mesh=ctx.mesh(P))
                    try:
                        with context_parallel_region(batch) as shard:
                            model(**shard).loss.backward()
                        out[layout] = {"refused": None}
                    except rm.UnsupportedLayerError as exc:
                        out[layout] = {"refused": str(exc),
                                       "grads": sum(p.grad is not None for p in model.parameters())}
                    finally:
                        rm.unwire(model)
                        rm.teardown()
                    continue
                reference = copy.deepcopy(base)
                ref = forward(reference, batch)
                ref.loss.backward()
                r = compare("llama", cfg, device_mesh=ctx.mesh(P), batch=batch, build=lambda *a, **k: model,
                            reference=(reference, ref))
                out[layout] = {"refused": None, "loss_err": r["loss_err"], "grad_err_total": r["grad_err_total"]}
    finally:
        mixing.MixingCheck.__init__ = original
    return out
