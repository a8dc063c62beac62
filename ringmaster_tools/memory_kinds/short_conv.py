"""Short causal depthwise convolutions: ``short_conv`` (LFM2 / LFM2-MoE / LFM3's gated ``Lfm*ShortConv``;
Inkling's / Inkling2's static ``*ShortConvolution``) and ``dynamic_short_conv`` (Inkling2's
``*DynamicShortConvolution``: per-token taps computed inline).

Notation: ``h`` the layer input width, ``c`` the conv's channels, ``K`` its taps, ``w = K - 1`` the halo,
``b`` the activation bytes, ``wb`` the conv weight's bytes (the model dtype; Inkling's convs are fp32 by
design, ``_keep_in_fp32_modules_strict``), ``n`` the chunks a rank stores (1; 2 under Ring's ``head_tail``
layout), ``L = S/P`` the local tokens. Fixed terms are per sequence of the micro-batch (batch 1).

Gated (LFM: ``y = out_proj(C * conv(B * x))``, ``B, C, x = in_proj(h).chunk(3)``), kernel "torch"
(transformers' ``causal_conv1d_fn`` fallback: ``F.conv1d`` with ``padding = w``, then ``[..., :L]``):

====================  =====================  ==========================================================
tensor                bytes                  saved by
====================  =====================  ==========================================================
layer input           b h / token            ``in_proj`` (the norm's output)
``in_proj`` output    3 b h / token          ``B * x`` (B and x), ``C * conv`` (C): one storage
``B * x``             b h / token            ``F.conv1d`` (its input)
conv output           b h / token + w b h    ``C * conv``: the padded output, ``L + w`` columns
``C * conv`` (T)      b h / token            ``out_proj`` (``transpose().contiguous()``)
====================  =====================  ==========================================================

= ``7 b h`` per token, ``w b h`` fixed. Under CP (ringmaster's ``conv.cp_causal_conv1d``): each stored
chunk runs the kernel on ``[halo | chunk]``: the conv saves ``L + n w`` input columns; with one chunk the
output it hands to ``C * conv`` is a slice of the ``L + 2w`` column kernel output (fixed ``w + 2w``), with
two chunks the outputs are concatenated anew (fixed ``2w``: the inputs' halos only). The tails'
all-gather saves nothing.

Kernel "fast" (``causal_conv1d.causal_conv1d_interface.CausalConv1dFn.forward``, Dao-AILab/causal-conv1d:
``ctx.save_for_backward(x, weight, bias, seq_idx, initial_states)``; its output is exactly ``L`` columns):
the same terms with the conv output ``b h`` per token and no fixed term at P=1 (``x`` is ``B * x``, made
contiguous by the kernel when it is not: ``B * x`` of a transposed projection is channel-last, which the
kernel accepts as is); under CP the saved input is the ``[halo | chunk]`` cat (fixed ``n w b h``) and
the outputs are slices (one chunk) or a cat (two): the same ``w`` terms as torch minus the padding
``w`` of the kernel output. Not run here (no GPU): read from the source.

Residual (Inkling, Inkling2 static: ``(x.float() + conv(x.float())) [/ sqrt(K+1)]``): ``F.conv1d``
saves its input, ``x.float()`` cast to the conv weight's dtype: ``wb c`` per token (the add, the
scalar divide and the casts save nothing); under CP the ``[halo | chunk]`` cat instead (fixed
``n w wb c``). "fast": ``CausalConv1dFn`` saves the same input: the same count.

Dynamic (Inkling2 full layers: ``sum_lag windows * (static + weight_proj(dynamic_input))``), kernel
"torch" (the class forward: ``F.pad`` + ``unfold`` + ``flip``): the mul saves the flipped windows
(``4 K c`` per token, fp32) and the broadcast taps ``[L, H, c/H, K]`` (``4 K c``); ``weight_proj``'s
input is the attention's layer input, saved first by the k/v projection (counted there). Under CP
(ringmaster's ``dynamic_conv`` forward: the windows as a one-hot depthwise conv over ``K c`` channels
through the conv halo) the conv also saves its ``[halo | chunk]`` input (``4 K c`` per token and
``n w 4 K c`` fixed) and its one-hot lag taps (``[K c, K]`` fp32: ``4 c K^2`` fixed); with one chunk the
windows the mul saves are a view of the conv's ``L + 2w`` column output (``2 w 4 K c`` more fixed), with
two a new concatenation. There is no GPU kernel for it: "fast" = "torch".

``backward`` (torch, P=1, ``memory_probe.step_peak`` on one layer module, per token): gated ``2 b c`` (measured:
512 B/token at c = 64, fp32); residual ``8 c``, dynamic ``8 K c`` (estimates: not measured); "fast" the same.
"""

from __future__ import annotations

from . import Bytes, stored_chunks

NAME = "short_conv"
CASES = [("lfm2", dict(hidden_size=64, num_hidden_layers=2, full_attn_idxs=[1], layer_types=["conv", "full_attention"])),
         ("lfm3", dict(hidden_size=32, num_hidden_layers=2, layer_types=["conv", "full_attention"]))]

_SOURCE_TORCH = "transformers <Family>ShortConv.forward with causal_conv1d_fn's torch fallback (F.conv1d)"
_SOURCE_FAST = ("causal-conv1d causal_conv1d_interface.CausalConv1dFn.forward "
                "(save_for_backward(x, weight, bias, seq_idx, initial_states))")


def dims(module) -> dict:
    """``style``: "gated" (LFM: in_proj / conv / out_proj), "residual" (Inkling's static conv) or "dynamic"
    (Inkling2's per-token taps)."""
    if hasattr(module, "static_weight") and hasattr(module, "weight_proj"):
        K, c = module.static_weight.shape
        return {"style": "dynamic", "channels": int(c), "taps": int(K), "heads": int(module.num_heads),
                "input": int(module.weight_proj.in_features)}
    conv = getattr(module, "conv", None)
    if conv is None:
        conv = getattr(module, "conv1d")
    taps = int(conv.kernel_size[0])
    d = {"channels": int(conv.in_channels), "taps": taps, "weight_bytes": conv.weight.element_size()}
    if hasattr(module, "in_proj"):
        return {"style": "gated", "hidden": int(module.in_proj.in_features), **d}
    return {"style": "residual", **d}




def saved(d: dict, b: int, kernel: str = "torch", P: int = 1, backend: str = "ulysses") -> Bytes:
    n = stored_chunks(P, backend)
    K, c = d["taps"], d["channels"]
    w = K - 1
    fast = kernel == "fast"
    if d["style"] == "gated":
        h = d["hidden"]
        per = 7 * b * c if h == c else b * h + 6 * b * c
        if n == 0:
            fixed = 0 if fast else w * b * c
        elif n == 1:
            fixed = (w + (w if fast else 2 * w)) * b * c
        else:
            fixed = n * w * b * c
        return Bytes(per, fixed, _BACKWARD["gated"] * b * c, _SOURCE_FAST if fast else _SOURCE_TORCH)
    if d["style"] == "residual":
        wb = d.get("weight_bytes", 4)
        return Bytes(wb * c, n * w * wb * c, _BACKWARD["residual"] * c,
                     _SOURCE_FAST if fast else "transformers <Family>ShortConvolution.forward (F.conv1d)")
    # dynamic
    kc = 4 * K * c
    if n == 0:
        return Bytes(2 * kc, 0, _BACKWARD["dynamic"] * kc,
                     "transformers <Family>DynamicShortConvolution.forward (unfold windows * taps)")
    # the conv's [halo | chunk] inputs; one chunk: the windows are a view of its L + 2w column output; the
    # one-hot lag taps [K c, K] (fp32, made once per forward) saved by the conv
    fixed = n * w * kc + (2 * w * kc if n == 1 else 0) + 4 * c * K * K
    return Bytes(3 * kc, fixed, _BACKWARD["dynamic"] * kc,
                 "ringmaster.recurrent.dynamic_conv forward (one-hot depthwise conv over the halo, windows * taps)")


# per token at the backward peak beyond saved + output (memory_probe.step_peak, P=1, torch, fp32, S = 64 / 128):
# gated: measured 512 B/token on lfm2 (h = c = 64): 2 b c (the input gradient and the conv's). residual, dynamic:
# estimates, not measured (the conv's input gradient and the layer's, in the conv dtype / fp32 windows and taps).
# "fast" uses the same figures (causal-conv1d's backward allocates dx and dweight the same way).
_BACKWARD = {"gated": 2.0, "residual": 8.0, "dynamic": 2.0}
