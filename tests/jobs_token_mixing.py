"""Rank-side jobs of tests/test_token_mixing.py: a tiny Llama edited the way user code and ``trust_remote_code``
repositories do, under CP (issues 27 and 37)."""

from __future__ import annotations

import math

import torch
import torch._dynamo
import torch.nn as nn
import torch.nn.functional as F

import ringmaster as rm
from ringmaster_tools.parity import compare, packed_batch, tiny_batch, tiny_model


# ---- modules that mix tokens, each a sample of a class
class Wrap(nn.Module):
    """``inner`` (an MLP, a norm, the embedding) followed by ``fn(input, output)``."""

    def __init__(self, inner, fn):
        super().__init__()
        self.inner, self.fn = inner, fn

    def forward(self, x, *args, **kwargs):
        return self.fn(x, self.inner(x, *args, **kwargs))


def running_mean(x):
    n = torch.arange(1, x.shape[1] + 1, device=x.device, dtype=x.dtype)[None, :, None]
    return x.cumsum(1) / n


def fft_lowpass(x):
    f = torch.fft.rfft(x.float(), dim=1)
    keep = torch.linspace(1, 0, f.shape[1], device=x.device)[None, :, None]
    return torch.fft.irfft(f * keep, n=x.shape[1], dim=1).to(x.dtype)


def shift(x, lag):
    return torch.cat([torch.zeros_like(x[:, :lag]), x[:, :-lag]], dim=1)


class CumsumFn(torch.autograd.Function):
    """A custom autograd function mixing tokens (a running sum, its true backward)."""

    @staticmethod
    def forward(ctx, x):
        return x.cumsum(1)

    @staticmethod
    def backward(ctx, g):
        return g.flip(1).cumsum(1).flip(1)


class FlatRouted(nn.Module):
    """Per-token work that looks like mixing: tokens flattened through ``B * S`` (a reshape by the sequence
    size), a reduction over hidden, and routing by gather to one of two experts (the MoE pattern)."""

    def __init__(self, inner, hidden):
        super().__init__()
        self.inner, self.router = inner, nn.Linear(hidden, 2, bias=False)

    def forward(self, x):
        B, S, D = x.shape
        flat = x.reshape(B * S, D)
        pick = self.router(flat).argmax(-1)
        out = torch.zeros_like(flat)
        for e in range(2):
            idx = (pick == e).nonzero(as_tuple=True)[0]
            out.index_add_(0, idx, (e + 1) * self.inner(flat.index_select(0, idx)[None])[0])
        return (out * flat.pow(2).mean(-1, keepdim=True).rsqrt()).reshape(B, S, D)


class ChannelsFirstConv(nn.Module):
    """A causal depthwise ``nn.Conv1d`` called channels-first (``[B, hidden, S]``)."""

    def __init__(self, inner, hidden):
        super().__init__()
        self.inner = inner
        self.conv = nn.Conv1d(hidden, hidden, 3, groups=hidden, padding=2)

    def forward(self, x):
        y = self.conv(x.transpose(1, 2))[..., :x.shape[1]].transpose(1, 2)
        return self.inner(x) + 0.5 * y


class LocalSinusoid(nn.Module):
    """The token embedding plus a sinusoidal position numbered from the local input (``arange(S)``)."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, input_ids):
        x = self.inner(input_ids)
        pos = torch.arange(input_ids.shape[1], device=x.device, dtype=x.dtype)[:, None]
        freq = torch.arange(x.shape[-1], device=x.device, dtype=x.dtype)[None, :]
        return x + 0.1 * torch.sin(pos / (10000 ** (freq / x.shape[-1])))


class RemoteAttention(nn.Module):
    """Attention as hub repositories write it: fused ``wqkv``, rotary built from the local length, and either
    ``F.scaled_dot_product_attention(is_causal=True)`` called directly or ``softmax(QK^T + ALiBi)`` computed
    in the module."""

    def __init__(self, config, alibi: bool = False):
        super().__init__()
        self.heads = config.num_attention_heads
        self.dim = config.hidden_size // self.heads
        self.wqkv = nn.Linear(config.hidden_size, 3 * config.hidden_size, bias=False)
        self.out = nn.Linear(config.hidden_size, config.hidden_size, bias=False)
        self.alibi = alibi

    def forward(self, hidden_states, *args, **kwargs):
        B, S, _ = hidden_states.shape
        q, k, v = self.wqkv(hidden_states).view(B, S, 3, self.heads, self.dim).permute(2, 0, 3, 1, 4)
        if self.alibi:
            slopes = torch.tensor([2 ** (-8 * (h + 1) / self.heads) for h in range(self.heads)], dtype=q.dtype)
            pos = torch.arange(S, dtype=q.dtype)
            scores = q @ k.transpose(-1, -2) / math.sqrt(self.dim)
            scores = scores - slopes[:, None, None] * (pos[:, None] - pos[None, :]).abs()
            scores = scores.masked_fill(torch.ones(S, S, dtype=torch.bool).triu(1), float("-inf"))
            out = scores.softmax(-1) @ v
        else:
            pos = torch.arange(S, dtype=q.dtype)[:, None]   # rotary numbered from the local length
            inv = 1.0 / (10000 ** (torch.arange(0, self.dim, 2, dtype=q.dtype) / self.dim))
            cos, sin = torch.cos(pos * inv).repeat(1, 2), torch.sin(pos * inv).repeat(1, 2)

            def rot(x):
                a, b = x.chunk(2, dim=-1)
                return x * cos + torch.cat([-b, a], dim=-1) * sin
            out = F.scaled_dot_product_attention(rot(q), rot(k), v, is_causal=True)
        return self.out(out.transpose(1, 2).reshape(B, S, -1)), None


class LocalRotary(nn.Module):
    """The model's rotary table looked up at ``arange(S)`` of the local input, not at the position_ids it is
    given: every attention layer then rotates by local positions."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, x, position_ids=None, **kwargs):
        local = torch.arange(x.shape[1], device=x.device)[None].expand(x.shape[0], -1)
        return self.inner(x, local, **kwargs)


def _layer_forward(layer, fn):
    """The decoder layer's own forward, edited: ``fn`` applied to its output hidden states (code in the layer,
    no module of its own)."""
    cls = type(layer)

    class Edited(cls):
        def forward(self, hidden_states, *args, **kwargs):
            out = super().forward(hidden_states, *args, **kwargs)
            if isinstance(out, tuple):
                return (fn(self, out[0]),) + out[1:]
            return fn(self, out)
    Edited.__name__ = cls.__name__ + "Edited"
    layer.__class__ = Edited


def _mlp(fn):
    return lambda model: setattr(model.model.layers[0], "mlp", Wrap(model.model.layers[0].mlp, fn))


def _targets(kwargs):
    """The forward's targets: the ``shift_labels`` ringmaster passes under CP, else its ``labels`` shifted by one."""
    labels = kwargs.get("shift_labels")
    return F.pad(kwargs["labels"], (0, 1), value=-100)[:, 1:] if labels is None else labels


def _loss(kind):
    def edit(model):
        cls = type(model)

        class Edited(cls):
            def forward(self, *args, **kwargs):
                out = super().forward(*args, **kwargs)
                if out.loss is not None:
                    if kind == "statistic":      # a sequence statistic of the logits in the loss
                        out.loss = out.loss + 0.1 * out.logits.float().mean(dim=1).pow(2).mean()
                    elif kind == "local_mean":   # num_items_in_batch dropped: a mean over the shard
                        labels = _targets(kwargs)   # without CP: the whole row's mean, the model's own loss
                        logits = out.logits.float()
                        out.loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100)
                    elif kind == "mean_all_tokens":   # a mean over the shard's positions, ignored ones counted as 0
                        labels = kwargs.get("shift_labels")
                        out.loss = F.cross_entropy(out.logits.float().flatten(0, 1), labels.flatten(), ignore_index=-100,
                                                   reduction="none").mean()
                    elif kind == "custom_sum":   # honest: a sum over the shard's targets / the batch's target count
                        labels = _targets(kwargs)   # without CP: the model's own shift, its own count
                        n = kwargs.get("num_items_in_batch") or (labels != -100).sum()
                        out.loss = F.cross_entropy(out.logits.float().flatten(0, 1), labels.flatten(), ignore_index=-100,
                                                   reduction="sum") / n
                    elif kind == "shifts_labels":   # the labels it is given, shifted in the shard: a target lost at a cut
                        labels, n = kwargs["labels"], kwargs["num_items_in_batch"]
                        logits = out.logits.float()[:, :-1]
                        out.loss = F.cross_entropy(logits.flatten(0, 1), labels[:, 1:].flatten(), ignore_index=-100,
                                                   reduction="sum") / n
                return out
        Edited.__name__ = cls.__name__ + "Edited"
        # its attention is Llama's own (transformers guesses from this file's source, whose attention stand-ins
        # do not use the interface)
        Edited._can_set_attn_implementation_cached_value = True
        model.__class__ = Edited
    return edit


EDITS = {
    "plain": lambda model: None,
    # per-token, and must stay exact and unrefused (a false alarm is a bug too)
    "per_token_routing": lambda model: setattr(model.model.layers[0], "mlp", FlatRouted(
        model.model.layers[0].mlp, model.config.hidden_size)),
    # issue 27's table
    "running_mean_mlp": _mlp(lambda x, y: y + running_mean(x)),
    "sequence_centred_norm": lambda model: setattr(model.model, "norm", Wrap(model.model.norm, lambda x, y: y - y.mean(1, keepdim=True))),
    "local_positions": lambda model: setattr(model.model, "embed_tokens", LocalSinusoid(model.model.embed_tokens)),
    "remote_sdpa": lambda model: setattr(model.model.layers[1], "self_attn", RemoteAttention(model.config)),
    "remote_alibi": lambda model: setattr(model.model.layers[1], "self_attn", RemoteAttention(model.config, alibi=True)),
    # issue 37's table
    "layer_running_mean": lambda model: _layer_forward(model.model.layers[0], lambda self, h: h + running_mean(h)),
    "layer_shift": lambda model: _layer_forward(model.model.layers[1], lambda self, h: h + 0.5 * shift(h, 1)),
    "long_lag": _mlp(lambda x, y: y + 0.5 * shift(x, 20)),
    "longer_than_16": _mlp(lambda x, y: y + running_mean(x) if x.shape[1] > 16 else y),
    "channels_first_conv": lambda model: setattr(model.model.layers[0], "mlp", ChannelsFirstConv(
        model.model.layers[0].mlp, model.config.hidden_size)),
    # more of their classes
    "local_scale": _mlp(lambda x, y: y * math.log(x.shape[1])),
    "first_token_state": _mlp(lambda x, y: y + x[:, :1]),
    "fft_filter": _mlp(lambda x, y: y + fft_lowpass(x)),
    "unfold_window": _mlp(lambda x, y: y + F.pad(x, (0, 0, 2, 0)).unfold(1, 3, 1).mean(-1)),
    "custom_function": _mlp(lambda x, y: y + 0.1 * CumsumFn.apply(x)),
    # in an attention module that calls the attention interface, around the call: its query projection shifted
    "attention_q_shift": lambda model: setattr(model.model.layers[0].self_attn, "q_proj", Wrap(
        model.model.layers[0].self_attn.q_proj, lambda x, y: y + 0.5 * shift(y, 1))),
    "local_rotary": lambda model: setattr(model.model, "rotary_emb", LocalRotary(model.model.rotary_emb)),
    "loss_statistic": _loss("statistic"),
    "loss_local_mean": _loss("local_mean"),
    "loss_shifts_labels": _loss("shifts_labels"),
    "loss_mean_all_tokens": _loss("mean_all_tokens"),
    "loss_custom_sum": _loss("custom_sum"),
}


def _training_only(model):
    """``training_only``: the MLP mixes only in training mode (eval mode, as a probe that re-runs it there, sees
    a per-token MLP)."""
    mlp = model.model.layers[0].mlp
    model.model.layers[0].mlp = Wrap(mlp, lambda x, y: y + running_mean(x) if model.training else y)


EDITS["training_only"] = _training_only

LAYOUTS = {
    "ulysses": dict(backend="ulysses"),
    "ring": dict(backend="ring"),
    "usp": dict(backend="usp", ulysses_size=2),  # P=4
    "documents": dict(backend="ring", load_balance="documents"),
}


def _batch(layout, vocab, S=64):
    if layout == "documents":   # one long document split over the group and short ones kept whole
        return packed_batch(vocab, [S - 24, 8, 9, 7])
    return tiny_batch(vocab, S)


def refusals(ctx, cases: list[str], layout: str, P: int = 2, compiled: bool = False) -> dict:
    """Each edit of ``cases`` on a tiny Llama, one CP step under ``layout``: the error it was refused with (on
    this rank), and how many parameters had a gradient then (0: refused before backward); None when it ran.
    ``compiled``: every decoder block compiled (fullgraph) before that first CP step, which then runs compiled
    (its checks record an eager replay)."""
    from ringmaster.adapters.raw import context_parallel_region

    out = {}
    mesh = ctx.mesh(P)
    for case in cases:
        torch.manual_seed(0)
        model = tiny_model("llama", num_hidden_layers=2)
        EDITS[case](model)
        model.train()
        rm.wire(model, rm.RingmasterConfig(size=P, **LAYOUTS[layout]), device_mesh=mesh, compile=compiled)
        if compiled:
            torch._dynamo.reset()
            for layer in model.model.layers:
                layer.compile(fullgraph=True, backend="eager")
        try:
            with context_parallel_region(_batch(layout, model.config.vocab_size)) as shard:
                loss = model(**shard).loss
            loss.backward()
            out[case] = None
        except rm.UnsupportedLayerError as exc:
            out[case] = {"error": str(exc), "grads": sum(p.grad is not None for p in model.parameters())}
        finally:
            for layer in model.model.layers:
                layer._compiled_call_impl = None
            rm.unwire(model)
    return out


def exactness(ctx, case: str, layout: str = "ulysses", P: int = 2, mutation: str | None = None) -> dict:
    """The tiny Llama edited by ``case`` under CP against itself without CP: ``refused`` (the error) or the
    errors. ``mutation="skip"``: the check stands in for the MLP of layer 0 as if ringmaster routed it (it
    skips the module); ``mutation="off"``: no check at all; ``mutation="no_loss"``: the check without its loss test."""
    from ringmaster.architectures import mixing

    original = mixing.MixingCheck.__init__

    def init(self, model, decoder, routed, replayed, *args, **kwargs):
        if mutation == "skip":
            routed = dict(routed, **{"model.layers.0.mlp": model.model.layers[0].mlp})
        original(self, model, decoder, routed, replayed, *args, **kwargs)
        if mutation == "off":
            self.done = {True, False}
        if mutation == "no_loss":   # the loss test skipped
            self.loss = False
    mixing.MixingCheck.__init__ = init
    try:
        batch = _batch(layout, tiny_model("llama", num_hidden_layers=2).config.vocab_size)
        ref = None
        if layout == "documents":
            from ringmaster_tools.parity import per_document_forward
            ref = per_document_forward
        r = compare("llama", rm.RingmasterConfig(size=P, **LAYOUTS[layout]), device_mesh=ctx.mesh(P),
                    prepare=EDITS[case], num_hidden_layers=2, batch=batch,
                    reference_forward=ref if case == "plain" else None)
    except rm.UnsupportedLayerError as exc:
        return {"refused": str(exc)}
    finally:
        mixing.MixingCheck.__init__ = original
    return {"refused": None, "loss": r["loss_err"], "logits": r["logits_err"], "grad": r["grad_err_total"]}


def check_report(ctx, P: int = 2, layers: int = 2, seq_len: int = 64) -> dict:
    """The wiring report of a tiny Llama before and after its first CP forward in training and in eval mode."""
    from ringmaster.adapters.raw import context_parallel_region

    model = tiny_model("llama", num_hidden_layers=layers)
    runtime = rm.wire(model, rm.RingmasterConfig(size=P, backend="ulysses"), device_mesh=ctx.mesh(P))
    try:
        before = runtime.report.token_probe
        batch = tiny_batch(model.config.vocab_size, seq_len)
        model.train()
        with context_parallel_region(batch, runtime=runtime) as shard:
            model(**shard)
        train = runtime.report.token_probe
        model.eval()
        with context_parallel_region(batch, runtime=runtime) as shard:
            model(**shard)
        return {"before": before, "train": train, "after": runtime.report.token_probe, "text": str(runtime.report),
                "disarmed": not runtime.mixing.handles, "timed": sorted(runtime.mixing.seconds)}
    finally:
        rm.unwire(model)


def generate_while_wired(ctx, P: int = 2) -> dict:
    """``model.generate`` on a wired model (refused, naming rm.unwire) and after ``rm.unwire`` (runs)."""
    model = tiny_model("llama", num_hidden_layers=2)
    prompt = torch.tensor([[1, 2, 3, 4]])
    rm.wire(model, rm.RingmasterConfig(size=P, backend="ulysses"), device_mesh=ctx.mesh(P))
    try:
        model.generate(prompt, max_new_tokens=2, do_sample=False)
        wired = None
    except RuntimeError as exc:
        wired = str(exc)
    finally:
        rm.unwire(model)
    out = model.generate(prompt, max_new_tokens=2, do_sample=False)
    return {"wired": wired, "unwired_tokens": int(out.shape[1]), "restored": "generate" not in model.__dict__}


def targets_on_one_rank(ctx, layout: str = "ulysses", P: int = 2) -> list[dict]:
    """Every target on the first rank's shard (labels -100 on the rest of the row, then on its first half): a rank
    with no target returns 0 for its share (``num_items_in_batch`` is the group's count), never NaN, and the step is
    exact against the model without CP."""
    from ringmaster_tools.parity import tiny_batch

    out = []
    for half in (0, 1):
        batch = tiny_batch(tiny_model("llama", num_hidden_layers=2).config.vocab_size, 64, ignore_frac=0.0)
        if half == 0:
            batch["labels"][:, 32:] = -100   # the second rank's targets (labels 33..63, shifted) all ignored
        else:
            batch["labels"][:, :33] = -100   # the first rank's (labels 1..32)
        r = compare("llama", rm.RingmasterConfig(size=P, **LAYOUTS[layout]), device_mesh=ctx.mesh(P), batch=batch,
                    num_hidden_layers=2)
        out.append({"loss": r["loss_err"], "logits": r["logits_err"], "grad": r["grad_err_total"]})
    return out
