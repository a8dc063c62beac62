"""Rank-side jobs of tests/test_compile.py: decoder blocks compiled with ``fullgraph=True`` after ``rm.wire``."""

from __future__ import annotations

from ringmaster.attention.ring import loop
from ringmaster_tools import step_shape

# two decoder blocks (one attention, one recurrent for the hybrid): the same code paths, half the compiles
SMALL = {
    "llama": dict(num_hidden_layers=2),
    "gdn-hybrid": dict(num_hidden_layers=2, layer_types=["linear_attention", "full_attention"]),
    "mamba2-hybrid": dict(num_hidden_layers=2, attn_layer_indices=[1]),
}


def compile_parity(ctx, model, backend, P=2, compiler="aot_eager_decomp_partition"):
    """Every block ``compile(fullgraph=True)`` (AOTAutograd with the min-cut partitioner, as inductor uses it,
    without inductor's slow CPU code generation), CP step vs the model without CP."""
    return step_shape.compile_parity(ctx, model, backend, "dense", P, fullgraph=True, compiler=compiler,
                                     overrides=SMALL[model])


def compile_with_host_read_in_ring(ctx, P=2):
    """Mutation: the ring loop reads a tensor value on the host (``.item()``) before each block; the fullgraph
    compile must refuse it (a graph break), not run it."""
    original = loop._forward_block

    def reads_host(kernel, plan, q, *args, **kwargs):
        if q.abs().sum().item() < 0:   # never true: only the host read matters
            raise AssertionError("unreachable")
        return original(kernel, plan, q, *args, **kwargs)

    loop._forward_block = reads_host
    try:
        return compile_parity(ctx, "llama", "ring-alltoall", P)
    finally:
        loop._forward_block = original
