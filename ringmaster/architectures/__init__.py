"""Architecture registry: which layers of a model family get which CP treatment.

A family module is data: an :class:`ArchitectureSpec` naming the attention classes, where the
head counts live in the config, which recurrent layers exist (and the kernels they call), and,
for a VLM, where the fused sequence starts. ``rm.wire`` looks the spec up by
``config.model_type``, classifies every layer once (:mod:`.classify`) and fails closed on
anything stateful it does not know; an unregistered model goes through the generic path
(:mod:`.generic`), and a registered spec may refuse its family with a reason. Importing this package registers the built-in families.
"""

from . import kimi_linear, llama, mamba, minimax, nemotron_h, qwen3_5, recurrent_gemma, refused, rwkv, selfattn, short_conv, softcap_mla, vlm, xlstm  # noqa: F401  (built-in families register on import)
from .classify import Classification, STATEFUL_PATTERN, classify_layers, stateful_layers, unsupported_message
from .generic import cp_hazards, generic_spec, get_architecture, refuse_if_unsafe, unforked_dropout
from .positions import position_convention, position_tables
from .spec import (ArchitectureSpec, SelfAttentionSite, known_model_types, register_architecture,  # noqa: F401
                   registered_architecture, text_config)

__all__ = ["ArchitectureSpec", "Classification", "STATEFUL_PATTERN", "classify_layers", "cp_hazards",
           "generic_spec", "get_architecture", "refuse_if_unsafe", "unforked_dropout", "registered_architecture",
           "known_model_types", "position_convention", "position_tables", "register_architecture", "stateful_layers", "text_config", "unsupported_message"]
