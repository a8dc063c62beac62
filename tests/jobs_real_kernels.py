"""Jobs for tests/test_real_kernels.py. They run only in the real-kernel pool: a LocalPool whose workers call
``realkernels.enable_all_in_worker`` before anything imports transformers, so transformers' modeling modules
resolve ``fla`` to the installed flash-linear-attention (its Triton kernels run under Triton's interpreter)."""

from __future__ import annotations

import importlib
from typing import Callable

import torch

import ringmaster as rm
from ringmaster.recurrent.fla_cp import kernel_implementation   # what transformers' kernel wrapper calls

# model_type -> (modeling module, the chunk kernel name it calls, the FLA function it must resolve to)
FAMILIES = {
    "qwen3_5_text": ("transformers.models.qwen3_5.modeling_qwen3_5", "torch_chunk_gated_delta_rule",
                     "fla.ops.gated_delta_rule.chunk_gated_delta_rule"),
    "qwen3_5_moe_text": ("transformers.models.qwen3_5_moe.modeling_qwen3_5_moe", "torch_chunk_gated_delta_rule",
                         "fla.ops.gated_delta_rule.chunk_gated_delta_rule"),
    "qwen3_next": ("transformers.models.qwen3_next.modeling_qwen3_next", "torch_chunk_gated_delta_rule",
                   "fla.ops.gated_delta_rule.chunk_gated_delta_rule"),
    "olmo_hybrid": ("transformers.models.olmo_hybrid.modeling_olmo_hybrid", "torch_chunk_gated_delta_rule",
                    "fla.ops.gated_delta_rule.chunk_gated_delta_rule"),
    "lara_mini": ("transformers.models.lara_mini.modeling_lara_mini", "torch_chunk_gated_delta_rule",
                  "fla.ops.gated_delta_rule.chunk_gated_delta_rule"),
    "qwen4_exp_text": ("transformers.models.qwen4_exp.modeling_qwen4_exp", "torch_chunk_gated_delta_rule",
                       "fla.ops.gated_delta_rule.chunk_gated_delta_rule"),
    "kimi_linear": ("transformers.models.kimi_linear.modeling_kimi_linear", "chunk_kimi_delta_attention",
                    "fla.ops.kda.chunk_kda"),
    "bailing_hybrid": ("transformers.models.bailing_hybrid.modeling_bailing_hybrid", "chunk_kimi_delta_attention",
                       "fla.ops.kda.chunk_kda"),
    "glm5_next_text": ("transformers.models.glm5_next.modeling_glm5_next", "chunk_kimi_delta_attention",
                       "fla.ops.kda.chunk_kda"),
}
# Smaller than ringmaster_tools.parity.TINY (the interpreter runs every program instance in Python): one recurrent
# layer before one attention layer; gated DeltaNet with 2 value heads over 1 key head, KDA with 2 heads
_GDN = dict(num_hidden_layers=2, layer_types=["linear_attention", "full_attention"], linear_num_key_heads=1,
            linear_num_value_heads=2)
_KDA = dict(num_hidden_layers=2, layer_types=["linear_attention", "full_attention"], mlp_layer_types=["dense", "sparse"],
            linear_num_heads=2)
SMALL = {"qwen3_5_text": _GDN, "qwen3_5_moe_text": _GDN, "qwen3_next": _GDN, "olmo_hybrid": _GDN,
         "lara_mini": {**_GDN, "layer_types": ["linear_attention", "sliding_attention"]},
         "kimi_linear": _KDA, "bailing_hybrid": _KDA}
DOC_LENS = (5, 67, 10, 14)                 # a packed row of 96 tokens: documents cross every shard boundary
DOCUMENTS_DOC_LENS = [7, 41, 9, 13, 4, 22]   # documents mode: two long documents split, the rest whole


def _qualname(fn) -> str:
    return f"{fn.__module__}.{fn.__name__}"


def resolution(ctx) -> dict:
    """Per family: the function transformers resolved for its chunk kernel and where its package lives
    (``fla``'s file must be the installed package's, not a stand-in or the hidden shadow)."""
    import fla

    ctx.mesh(2)   # the solo pool's other ranks leave
    out = {"fla_file": fla.__file__, "triton_interpret": __import__("os").environ.get("TRITON_INTERPRET")}
    for model_type, (module_name, name, _) in FAMILIES.items():
        try:
            module = importlib.import_module(module_name)
        except ImportError as exc:
            out[model_type] = f"ImportError: {exc}"
            continue
        impl = kernel_implementation(getattr(module, name))
        out[model_type] = _qualname(impl)
        out[f"{model_type}.conv"] = _qualname(kernel_implementation(module.causal_conv1d_fn))
    return out


def kernels_match_naive(ctx) -> dict:
    """FLA's chunked gated delta rule and KDA under the interpreter (as bridged: the autotuner's pick, the loop
    variables) against FLA's own token-by-token references (``fla.ops.*.naive``), fp32, with an initial state and
    two varlen documents: the relative max error of the outputs, final states and every input's gradient."""
    ctx.mesh(2)   # the solo pool's other ranks leave
    if ctx.rank != 0:
        return {}
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    from fla.ops.gated_delta_rule.naive import naive_recurrent_gated_delta_rule
    from fla.ops.kda import chunk_kda
    from fla.ops.kda.naive import naive_recurrent_kda

    gen = torch.Generator().manual_seed(0)
    T, H, D, cut = 24, 2, 8, 9
    out = {}
    for name, fast, naive, g_shape in (("gdn", chunk_gated_delta_rule, naive_recurrent_gated_delta_rule, (1, T, H)),
                                       ("kda", chunk_kda, naive_recurrent_kda, (1, T, H, D))):
        q, v = (torch.randn(1, T, H, D, generator=gen) for _ in range(2))
        k = torch.nn.functional.normalize(torch.randn(1, T, H, D, generator=gen), dim=-1)
        g = -torch.rand(*g_shape, generator=gen) * 0.3
        beta = torch.rand(1, T, H, generator=gen)
        h0 = torch.randn(2, H, D, D, generator=gen)
        do = torch.randn(1, T, H, D, generator=gen)
        leaves = [x.clone().requires_grad_() for x in (q, k, v, g, beta, h0)]
        o, ht = fast(*leaves[:3], g=leaves[3], beta=leaves[4], initial_state=leaves[5], output_final_state=True,
                     cu_seqlens=torch.tensor([0, cut, T]))
        ((o * do).sum() + ht.sum()).backward()
        ref_leaves = [x.clone().double().requires_grad_() for x in (q, k, v, g, beta, h0)]
        outs, finals = [], []
        for i, (a, b) in enumerate(((0, cut), (cut, T))):   # each document alone
            qq, kk, vv, gg, bb = (x[:, a:b] for x in ref_leaves[:5])
            kwargs = dict(initial_state=ref_leaves[5][i:i + 1], output_final_state=True)
            oo, hh = naive(qq, kk, vv, beta=bb, g=gg, **kwargs)
            outs.append(oo)
            finals.append(hh)
        ro, rht = torch.cat(outs, dim=1), torch.cat(finals, dim=0)
        ((ro * do.double()).sum() + rht.sum()).backward()

        def rel(a, b):
            return ((a.double() - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()

        out[name] = {"o": rel(o, ro), "ht": rel(ht, rht),
                     **{f"d{n}": rel(x.grad, y.grad) for n, x, y in zip("qkvgbh", leaves, ref_leaves)}}
    return out


def split_part_pieces(ctx, lens=(13, 11), chunk=12) -> dict:
    """A ``load_balance="documents"`` split part as a compiled block runs it (``PiecesSegment`` over
    ``ChunkPieces.of(neutral=True)``: the first chunk's lone piece of a 13-token document, which the state
    enters and leaves, padded with zeros to 16 after it, so ``g = beta = 0``) on FLA's chunked gated delta rule and
    KDA under the interpreter (fp32), scan strategy; against FLA's token-by-token references, each document alone
    (fp64): the output and every input's gradient. ``decaying``: the mutation, gated DeltaNet padded with ``g = -1``
    (the padding decays the state the lone piece hands on), still claiming neutral. Rank 0 only."""
    ctx.mesh(2)   # the solo pool's other ranks leave
    if ctx.rank != 0:
        return {}
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    from fla.ops.gated_delta_rule.naive import naive_recurrent_gated_delta_rule
    from fla.ops.kda import chunk_kda
    from fla.ops.kda.naive import naive_recurrent_kda
    from test_linear_recurrent import _run, pieces_segments

    from ringmaster.recurrent.gated_deltanet import GatedDeltaSegment

    class Decaying(GatedDeltaSegment):
        def with_tensors(self, fn):
            return Decaying(self.kernel, fn(self.q), fn(self.k), fn(self.v), fn(self.g, -1.0), fn(self.beta),
                            self.kwargs)

    def rel(a, b):
        return ((a.double() - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()

    gen = torch.Generator().manual_seed(3)
    T, H, D = sum(lens), 2, 8
    ends = torch.tensor(lens).cumsum(0).tolist()
    out = {}
    for name, fast, naive, g_shape, seg in (
            ("gdn", chunk_gated_delta_rule, naive_recurrent_gated_delta_rule, (1, T, H), GatedDeltaSegment),
            ("kda", chunk_kda, naive_recurrent_kda, (1, T, H, D), GatedDeltaSegment),
            ("gdn-decaying", chunk_gated_delta_rule, naive_recurrent_gated_delta_rule, (1, T, H), Decaying)):
        q, v = (torch.randn(1, T, H, D, generator=gen) for _ in range(2))
        k = torch.nn.functional.normalize(torch.randn(1, T, H, D, generator=gen), dim=-1)
        g = -torch.rand(*g_shape, generator=gen) * 0.3
        beta = torch.rand(1, T, H, generator=gen)
        do = torch.randn(1, T, H, D, generator=gen)
        leaves = [x.clone().requires_grad_() for x in (q, k, v, g, beta)]
        segs = pieces_segments(lambda *t: seg(fast, *t), leaves, 1, lens, chunk, neutral=True)
        mutated = seg is Decaying   # the forward misses: no backward (the interpreter's time)
        with torch.set_grad_enabled(not mutated):
            o = _run(segs, "scan")
            ref_leaves = [x.clone().double().requires_grad_() for x in (q, k, v, g, beta)]
            ro = torch.cat([naive(*(x[:, a:b] for x in ref_leaves[:3]), beta=ref_leaves[4][:, a:b],
                                  g=ref_leaves[3][:, a:b])[0] for a, b in zip([0, *ends], ends)], dim=1)
        out[name] = {"o": rel(o, ro), "L": segs[0].L}
        if not mutated:
            (o * do).sum().backward()
            (ro * do.double()).sum().backward()
            out[name].update({f"d{n}": rel(x.grad, y.grad) for n, x, y in zip("qkvgb", leaves, ref_leaves)})
    return out


def _slim(r: dict) -> dict:
    keep = ("cp_size", "backend", "layout", "split_fraction", "loss_err", "logits_err", "grad_err", "worst_param",
            "grad_err_total", "recurrent_layers", "attention_layers", "n_grads", "n_params", "missing_grads")
    out = {k: r[k] for k in keep if k in r}
    out["grad_errs"] = {k: v for k, v in r["grad_errs"].items()
                        if v > 1e-6 or any(s in k for s in ("A_log", "dt_bias", "conv1d"))}
    return out


def family_cases(ctx, model_type, P, mode, cases, seq_len=64, overrides=None, doc_lens=None) -> list[dict]:
    """fp32 parity of ``model_type`` at CP size ``P`` on FLA's kernels against the same model without CP (also on
    FLA's kernels), one reference run shared by every case. ``mode``: ``dense`` (``seq_len`` tokens), ``packed``
    (a row of documents against every document alone) or ``documents`` (the same under
    ``load_balance="documents"``). ``cases``: ``(backend, recurrent[, mutation])``; the mutation (one of
    :data:`MUTATIONS`) is applied for that case only. A case that ringmaster refuses comes back as
    ``{"raised": message}``."""
    import copy

    from jobs_mamba1 import slow_decay
    from ringmaster_tools.parity import (compare, packed_batch, per_document_forward, tiny_batch, tiny_model,
                                         _plain_forward)

    ctx.mesh(P)   # in the solo pool, ranks outside the first CP group leave now, before the reference run
    base = tiny_model(model_type, **{**SMALL.get(model_type, {}), **(overrides or {})})
    slow_decay(base)
    vocab = base.config.vocab_size
    if mode == "dense":
        batch, forward = tiny_batch(vocab, seq_len, seed=1), _plain_forward
    else:
        batch = packed_batch(vocab, list(doc_lens or (DOC_LENS if mode == "packed" else DOCUMENTS_DOC_LENS)))
        forward = per_document_forward
    reference = copy.deepcopy(base)
    out = forward(reference, batch)
    out.loss.backward()
    extra = dict(load_balance="documents", documents_threshold=16) if mode == "documents" else {}
    results = []
    for backend, strategy, *mutation in cases:
        undo = MUTATIONS[mutation[0]]() if mutation else (lambda: None)
        cfg = rm.RingmasterConfig(size=P, backend=backend, recurrent=strategy, **extra)
        try:
            r = compare(model_type, cfg, device_mesh=ctx.mesh(P), batch=batch, build=lambda *a, **k: copy.deepcopy(base),
                        reference=(reference, out))
            results.append(_slim(r))
        except (rm.UnsupportedLayerError, NotImplementedError) as exc:
            rm.teardown()
            results.append({"raised": f"{type(exc).__name__}: {exc}"})
        finally:
            undo()
    return results


def builds(ctx, model_type) -> str:
    """Whether the tiny model of ``model_type`` builds and runs a forward without CP: "ok" or the error."""
    from ringmaster_tools.parity import tiny_batch, tiny_model

    try:
        model = tiny_model(model_type)
        model(**tiny_batch(model.config.vocab_size, 32))
    except Exception as exc:  # noqa: BLE001 - the reason is the result
        return f"{type(exc).__name__}: {exc}"
    return "ok"


def wire_error(ctx, model_type, recurrent="auto", mutation=None, auto_classes=False) -> str:
    """``wire`` on the tiny model of ``model_type`` at P=2 (Ulysses): the error it raises, or "wired".
    ``mutation``: one of :data:`MUTATIONS`, applied while wiring; ``auto_classes``: the model built through
    transformers' Auto classes as a user's ``from_pretrained`` would (whatever a package registered there)."""
    from ringmaster_tools.parity import COMMON, tiny_model

    ctx.mesh(2)   # the solo pool's other ranks leave
    if auto_classes:
        from transformers import AutoConfig, AutoModelForCausalLM

        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **COMMON))
    else:
        model = tiny_model(model_type, **SMALL.get(model_type, {}))
    undo = MUTATIONS[mutation]() if mutation else (lambda: None)
    try:
        rm.wire(model, rm.RingmasterConfig(size=2, backend="ulysses", recurrent=recurrent), device_mesh=ctx.mesh(2))
    except Exception as exc:  # noqa: BLE001 - the refusal is the result
        return f"{type(exc).__name__}: {exc}"
    finally:
        undo()
        rm.unwire(model)
        rm.teardown()
    return "wired"


# --------------------------------------------------------------------------- mutations


def no_state_passing() -> Callable[[], None]:
    """ringmaster's state passing turned off: every chunk starts from a zero state (``scan`` and
    ``sequential`` both go through ``pass_state``)."""
    from ringmaster.recurrent import gated_deltanet

    original = gated_deltanet.pass_state

    def local_only(segments, strategy, group, layout, path):
        return [seg.run(None) for seg in segments]

    gated_deltanet.pass_state = local_only
    return lambda: setattr(gated_deltanet, "pass_state", original)


def no_fla_cp_context() -> Callable[[], None]:
    """FLA's CP context dropped: each rank's part runs alone through FLA's varlen kernel (its local document
    boundaries kept), so no state crosses a rank boundary."""
    from ringmaster.recurrent import gated_deltanet

    original = gated_deltanet.fla_cp_rule

    def mutated(kernel, path, group, layout, runs, query, key, value, g, beta, kwargs):
        outs = [kernel(query[r:r + 1], key[r:r + 1], value[r:r + 1], g=g[r:r + 1], beta=beta[r:r + 1], **kwargs)[0]
                for r in range(query.shape[0])]
        return torch.cat(outs, dim=0)

    gated_deltanet.fla_cp_rule = mutated
    return lambda: setattr(gated_deltanet, "fla_cp_rule", original)


def kernel_ignores_initial_state() -> Callable[[], None]:
    """Qwen3.5's chunk kernel (FLA's, as transformers resolved it) drops ``initial_state``, as a kernel that ignored
    it would: ringmaster's ``scan`` and ``sequential`` hand the incoming state to the kernel through it, so
    ``wire``'s probe (a random incoming state must change the output) has to refuse the layer."""
    from transformers.models.qwen3_5 import modeling_qwen3_5 as m

    original = m.torch_chunk_gated_delta_rule

    def mutated(*args, initial_state=None, **kwargs):
        return original(*args, initial_state=None, **kwargs)

    m.torch_chunk_gated_delta_rule = mutated
    return lambda: setattr(m, "torch_chunk_gated_delta_rule", original)


def heads_varlen_one_document() -> Callable[[], None]:
    """recurrent="heads" on a packed row: FLA's varlen call given one document spanning every row (the
    boundaries dropped), so the state runs across every document start."""
    import torch

    from ringmaster.sharding import documents

    original = documents.rows_cu_seqlens
    documents.rows_cu_seqlens = lambda runs, rows, seq_len: torch.tensor([0, rows * seq_len])

    def undo():
        documents.rows_cu_seqlens = original
    return undo


MUTATIONS = {"no_state_passing": no_state_passing, "no_fla_cp_context": no_fla_cp_context,
             "kernel_ignores_initial_state": kernel_ignores_initial_state,
             "heads_varlen_one_document": heads_varlen_one_document}
