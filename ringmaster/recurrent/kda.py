"""Kimi Delta Attention (KDA) under CP (``KimiLinearDeltaAttention``, ``kimi_linear``).

KDA is gated DeltaNet with a decay per key *channel* instead of per head::

    S_t = (I - β_t k_t k_tᵀ) · diag(exp(g_t)) · S_{t-1} + β_t k_t v_tᵀ       (g_t: [d_k])
    o_t = S_tᵀ q_t / sqrt(d_k)

still linear in (state, values) jointly, so the chunk map ``S_end = A · S_start + b`` (``A``:
``d_k × d_k``) and the output correction ``o_t = o⁰_t + S_startᵀ w_t`` come out of one call of the
unmodified kernel with values ``[v | 0]`` and initial state ``[0 | I]``, exactly as for gated DeltaNet.
The layers call ``causal_conv1d_fn`` and ``chunk_kimi_delta_attention`` (flash-linear-attention's
``chunk_kda`` when a hub kernel replaces it) by module-level name with the gated-DeltaNet signature
``(q, k, v, g=, beta=, initial_state=, output_final_state=, use_qk_l2norm_in_kernel=)``, so the
segment, the conv halo, the document resets and the wiring are gated DeltaNet's
(:mod:`ringmaster.recurrent.gated_deltanet`); this module names KDA's kernels. Cached decoding
(``causal_conv1d_update``, ``recurrent_kimi_delta_attention``) runs at CP size 1 only. With
flash-linear-attention installed, transformers resolves ``chunk_kimi_delta_attention`` to FLA's ``chunk_kda``
(which asserts an fp32 ``initial_state``: the maps' ``[0 | I]`` start and the passed state are fp32, fp64
for a float64 model); verified on CPU against the stand-in packages, not yet run on a GPU. ``recurrent=
"fla_cp"`` hands the state passing to FLA's own context parallelism (:mod:`ringmaster.recurrent.fla_cp`).
"""

from __future__ import annotations

from typing import Callable

from .context import LayerContext
from .fla_cp import STRATEGY as FLA_CP
from .gated_deltanet import wire_gated_deltanet_layer
from .heads import STRATEGY as HEADS
from .kind import RecurrentKind

# role -> the module-level name transformers' KDA layers call (a family spec may rename them)
KERNELS = {"conv": "causal_conv1d_fn", "scan": "chunk_kimi_delta_attention"}
OPTIONAL = {"conv_update": "causal_conv1d_update", "state_update": "recurrent_kimi_delta_attention"}


def wire_kda_layer(module, ctx: LayerContext, names: dict | None = None) -> Callable[[], None]:
    """Route one KDA layer instance through exact CP (gated DeltaNet's wiring with KDA's kernel names)."""
    return wire_gated_deltanet_layer(module, ctx, {**KERNELS, **OPTIONAL, **(names or {})})


KIND = RecurrentKind(name="kda", kernels=KERNELS, optional=OPTIONAL, wire=wire_kda_layer, strategies=(FLA_CP, HEADS),
                     description="Kimi Delta Attention: causal conv1d + chunked per-channel gated delta rule "
                                 "(d_k x d_k transition)")
