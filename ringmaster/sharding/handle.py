"""The step context as one object ``torch.compile`` does not look into.

A compiled decoder block receives the batch's :class:`~.documents.CPBatch` (the ``ringmaster_batch`` kwarg). Every
Python value the traced code reads from it becomes a guard: a document boundary, a tile plan or a cut point read
in the block would make each new packing recompile the block (and, past dynamo's recompile limit, fail). So the
block reads only what every packing shares (rank, size, layout, whether the row is packed) and hands
``CPBatch.handle`` to ringmaster's custom ops (``torch.ops.ringmaster.*``), which plan on the host inside the op,
from the batch's host runs, exactly as eager mode does. The handle is a *reference* opaque type
(``torch._library.opaque_object``): a graph input, never guarded on, never traced into (as flash varlen's
``cu_seqlens`` tensor or flex's ``BlockMask`` reach their kernels as data).

``AVAILABLE`` is False on a torch without opaque objects; the ops then are not registered and the blocks plan in
Python as eager mode does (``report.compile_notes`` says so).
"""

from __future__ import annotations

try:
    from torch._library.opaque_object import register_opaque_type
    from torch._opaque_base import OpaqueBase
except ImportError:   # an older torch: no opaque objects
    OpaqueBase, register_opaque_type = object, None


class StepHandle(OpaqueBase):
    """Points at one :class:`~.documents.CPBatch` (or a part of it). Created with the batch, in the shard step."""

    def __init__(self, batch):
        self.batch = batch


AVAILABLE = register_opaque_type is not None
if AVAILABLE:
    try:
        register_opaque_type(StepHandle, typ="reference")
    except (TypeError, ValueError, RuntimeError):   # an opaque-object API this code does not know
        AVAILABLE = False


def differentiable(op, backward_op) -> None:
    """Autograd for a custom attention op ``op(q, k, v, *args) -> (out, lse)`` whose backward is the custom op
    ``backward_op(dout, q, k, v, out, lse, *args) -> (dq, dk, dv)``: saves the inputs and outputs, and gives the other
    arguments (the step handle among them) no gradient. The lse's own gradient is never taken."""
    def setup(ctx, inputs, output):
        q, k, v, *args = inputs
        ctx.save_for_backward(q, k, v, *output)
        ctx.args = tuple(args)

    def grad(ctx, dout, _dlse):
        q, k, v, out, lse = ctx.saved_tensors
        return (*backward_op(dout.contiguous(), q, k, v, out, lse, *ctx.args), *([None] * len(ctx.args)))

    op.register_autograd(grad, setup_context=setup)
