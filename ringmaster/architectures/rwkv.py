"""RWKV (v4): no softmax attention at all. Each block mixes time (token shift + WKV, a linear
recurrence with a normaliser) and channels (token shift + MLP); both get a halo of one token and
the WKV state passes exactly across ranks (:mod:`ringmaster.recurrent.rwkv`)."""

from .spec import ArchitectureSpec, register_architecture

RWKV = register_architecture(ArchitectureSpec(
    name="rwkv",
    model_types=("rwkv",),
    attention_classes=(),
    recurrent_classes={"RwkvSelfAttention": "rwkv", "RwkvFeedForward": "rwkv_channel_mix"},
    notes="attention-free: the CP backend only shards the sequence; every layer is recurrent or token-local",
))
