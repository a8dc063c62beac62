"""Families refused under CP, each with the reason (found by running them through the generic path).

The generic path would accept these models (their attention dispatches through transformers'
interface), but they are wrong under CP or cannot be made exact by ringmaster as they are
written in transformers 5.24. ``rm.wire`` raises the reason before anything changes; a user who
fixes the cause registers a spec with ``override=True``.
"""

from .generic import refuse

PHIMOE = refuse(("phimoe",), (
    "PhimoeSparseMoeBlock's sparsemixer router samples experts at random in training (torch.rand per token): "
    "every CP rank draws the same random stream for different tokens, so routing is not the single-device run "
    "(measured: logits 0.14, whole gradient 0.13 off at P=2). Use a CP size of 1 for PhiMoE training"))
HY_V4 = refuse(("hy_v4",), (
    "HYV4Attention's DSA indexer (HYV4Indexer) picks each query's top-k keys from the layer's own attention "
    "mask and hidden states, outside the attention interface: under CP it would see only the shard (and gets "
    "no mask at all), so the selection cannot be the single-device one. Use a CP size of 1 for HY-V4"))
DOGE = refuse(("doge",), (
    "DogeAttention (dynamic mask attention) builds its attention mask from its own value states (dt_proj: an "
    "additive bias per key, and a top-k over the keys once they exceed keep_window_size) and passes it to the "
    "kernel: under CP that mask covers only the rank's shard of keys while the CP kernels mask from global "
    "positions, so the layer cannot be the single-device one. Use a CP size of 1 for Doge"))
ZAYA = refuse(("zaya",), (
    "ZayaAttention's CCA projection (ZayaCCAProjection, inside the attention module, before the attention "
    "interface) mixes tokens along the sequence: a causal depthwise and a grouped Conv1d over the q/k "
    "projections (conv_qk_depthwise, conv_qk_grouped: kernel - 1 earlier tokens each) and a value delayed by one "
    "token (v_proj_delayed). Under CP each rank would miss the previous shard's tokens there; ringmaster has no "
    "halo for a conv inside an attention module. Use a CP size of 1 for ZAYA"))
