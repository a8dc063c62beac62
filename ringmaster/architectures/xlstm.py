"""xLSTM (transformers 5.24's ``xlstm``, the xLSTM-7B layout): attention-free, every block an mLSTM
layer (matrix memory + normaliser, stabilised) and a gated MLP. The mLSTM state passes exactly across
ranks (:mod:`ringmaster.recurrent.mlstm`). Every class of the family is named ``xLSTM*``, which the
stateful-layer pattern matches: the token-local ones are listed in ``ignore_classes``, and the backend
module holding the kernels (``xLSTMBackend``) is wired through its layer."""

from .spec import ArchitectureSpec, register_architecture

XLSTM = register_architecture(ArchitectureSpec(
    name="xlstm",
    model_types=("xlstm",),
    attention_classes=(),
    recurrent_classes={"xLSTMLayer": "mlstm"},
    ignore_classes=("xLSTMBackend", "xLSTMRMSNorm", "xLSTMMultiHeadLayerNorm", "xLSTMFeedForward"),
    notes="attention-free: the CP backend only shards the sequence; every mLSTM layer is recurrent",
))
