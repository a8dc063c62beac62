"""Architecture registry: which layers of a model family get which CP treatment.

A family module is data: an :class:`ArchitectureSpec` naming the attention classes, where the
head counts live in the config, which recurrent layers exist (and the kernels they call), and,
for a VLM, where the fused sequence starts. ``rm.wire`` looks the spec up by
``config.model_type``, classifies every layer once (:mod:`.classify`) and fails closed on
anything stateful it does not know. Importing this package registers the built-in families.
"""

from . import llama, nemotron_h, qwen3_5, softcap_mla, vlm  # noqa: F401  (the built-in families register on import)
from .classify import Classification, STATEFUL_PATTERN, classify_layers, stateful_layers, unsupported_message
from .spec import (ArchitectureSpec, get_architecture, known_model_types, register_architecture,  # noqa: F401
                   text_config)

__all__ = ["ArchitectureSpec", "Classification", "STATEFUL_PATTERN", "classify_layers", "get_architecture",
           "known_model_types", "register_architecture", "stateful_layers", "text_config", "unsupported_message"]
