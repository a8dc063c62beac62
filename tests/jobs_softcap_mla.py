"""Pool jobs for tests/test_softcap_mla.py: the hub flash provider with softcap / MLA, and mutations."""

import ringmaster as rm


def hub_parity(ctx, P, model_type, overrides, ref_attn, flash_name="flash_attention_2", rotate="alltoall",
               layout="head_tail"):
    """The model as a flash model (``ring_impl='auto'`` picks the hub kernels: the CPU stand-in) against
    the same model running ``ref_attn`` without CP."""
    from jobs_ring import _sdpa_reference, as_flash_model

    from ringmaster_tools.parity import _plain_forward, compare

    cfg = rm.RingmasterConfig(size=P, backend="ring", rotate_method=rotate, load_balance=layout, ring_impl="auto")
    return compare(model_type, cfg, device_mesh=ctx.mesh(P), attn_implementation=ref_attn,
                   prepare=lambda m: as_flash_model(m, flash_name),
                   reference_forward=_sdpa_reference(_plain_forward, ref_attn), **overrides)


# -- mutations (registered with tests/jobs_mutations_attention.py's harness) -----------------------

def ring_kernels_drop_softcap():
    """Ring: the math kernel (and aten's CPU softcap tiles, which run it) ignores ``softcap``.

    Target: ``ringmaster.attention.ring.math_kernel.capped`` (bound there by ``from .common import``)."""
    return [("ringmaster.attention.ring.math_kernel", "capped", lambda scores, softcap: (scores, None))]


def aten_mla_keeps_the_wrong_columns():
    """Ring, aten: an MLA block's padded output is sliced from the wrong end (the last ``D_v`` columns).

    Target: ``ringmaster.attention.ring.aten.EqualHeadDims``."""
    from ringmaster.attention.ring.common import EqualHeadDims

    class Wrong(EqualHeadDims):
        def outputs(self, out):
            return out if self.equal else out[..., -self.dv:]

    return [("ringmaster.attention.ring.aten", "EqualHeadDims", Wrong)]


def register_mutations():
    from jobs_mutations_attention import MUTATIONS

    for fn in (ring_kernels_drop_softcap, aten_mla_keeps_the_wrong_columns):
        MUTATIONS.setdefault(fn.__name__, fn)


def mutated_parity(ctx, mutation, model_type, P, overrides, cfg_kwargs):
    from jobs_mutations_attention import mutated_parity as run

    register_mutations()
    return run(ctx, mutation, model_type, P, overrides, backend="ring", cfg_kwargs=cfg_kwargs)


def packed_parity(ctx, P, model_type, overrides, attn, impl, backend="ring", **split):
    """Packed rows (documents crossing shard edges) against each document run alone without CP; for
    ``impl='hf_kernels'`` the model is named a flash model (document blocks go through the varlen calls)."""
    from jobs_ring import DOC_LENS, _sdpa_reference, as_flash_model

    from ringmaster_tools.parity import compare, packed_batch, per_document_forward

    cfg = rm.RingmasterConfig(size=P, backend=backend, ring_impl="auto" if impl == "hf_kernels" else impl, **split)
    kwargs = dict(device_mesh=ctx.mesh(P), attn_implementation=attn, batch=packed_batch(128, DOC_LENS),
                  reference_forward=per_document_forward)
    if impl == "hf_kernels":
        kwargs["prepare"] = lambda m: as_flash_model(m)
        kwargs["reference_forward"] = _sdpa_reference(per_document_forward, attn)
    return compare(model_type, cfg, **kwargs, **overrides)
