"""The architecture spec type and its registry (one registry for text families and VLMs).

A family module is data: an :class:`ArchitectureSpec` naming the attention classes, where the
head counts live in the config, and which recurrent layers exist. ``rm.wire`` looks the spec
up by ``config.model_type``, checks every layer of the model against it and fails closed on
anything stateful it does not know.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

_REGISTRY: dict[str, "ArchitectureSpec"] = {}


@dataclass(frozen=True)
class SelfAttentionSite:
    """Where ringmaster reaches the attention of a module that computes it itself (its forward never
    reads transformers' ``ALL_ATTENTION_FUNCTIONS``), and what that attention is, as data.

    ``kind``:

    * ``"method"``: the module calls an instance method ``method`` with q, k, v ``[B, H, S, D]`` (k
      ``[B, H, D, S]`` when ``key_layout="bhds"``) and the model's own mask, positional parameters
      ``args``; ringmaster gives *this instance* a replacement that runs the CP attention and returns
      ``[B, H, S, D]`` as ``returns`` says (``"pair"``: ``(out, None)``; ``"list"``: ``[out]``).
    * ``"sdpa"``: the forward calls ``torch.nn.functional.scaled_dot_product_attention`` by the
      module-global name ``torch`` (or ``F``); this instance's forward is re-bound
      (:mod:`ringmaster.intercept`) so that name reaches the CP attention.
    * ``"fused_qkv"``: the forward computes scores inline (no call holds q, k and v), from one fused
      projection: this instance's forward is replaced by the generic one the data describes, ``out(
      CP(split(qkv(x))))``: ``qkv`` / ``out`` (child Linear names), ``qkv_layout`` (``"per_head"``:
      ``[.., H, 3, D]``, bloom; ``"chunked"``: ``[.., 3, H, D]``, mpt; or three names: separate query, key
      and value projections, BERT-style, and ``out=""`` when the module returns the context unprojected),
      ``causal_attr`` (a module bool that says whether it attends causally, BERT's ``is_decoder``;
      default causal), ``cross_arg`` (the argument that makes it cross-attention: refused), ``heads_attr`` (the module's head
      count), ``clip_attr`` (clamp the fused q/k/v, mpt's ``clip_qkv``), ``residual_arg`` (a forward
      argument added to the output, bloom), ``args`` (the forward's positional parameters), and
      ``alibi_slopes`` (module -> ``[H]`` per-head slopes: the bias ``slope * (k_pos - q_pos)`` from global
      positions, which differs from bloom's ``slope * k_pos`` and mpt's ``slope * (k_pos - S + 1)`` by a
      constant per query row, so the softmax is the same). Rotary applied inside the module from a table
      the model looked up for the *local* length (roformer: ``rotary_arg`` = ``sinusoidal_pos``): the site
      looks the table (the module at path suffix ``rotary_table``) up at the shard's global positions
      instead and applies it with the module's own ``rotary_apply`` (to v too when the module attribute
      ``rotary_value_attr`` is set). ``causal_config``: a config bool that says whether the model attends
      causally (xlm's ``causal``), read at wire time; ``empty_cache_arg``: a forward argument the model
      always fills with a fresh cache (xlm): allowed while it holds nothing; ``batch_rule``: ``(batch,
      model kwargs, config) -> None``, raising for a batch the family cannot run exactly under CP
      (checked per forward before the CP attention); ``position_table``: a position embedding module
      (path suffix) whose forward takes ``position_ids`` but is called without them (trocr): a forward
      pre-hook passes it this shard's global positions; ``mean_loss``: a module (path suffix) called
      ``(x, labels)`` that returns ``(loss, ...)`` with the loss a mean over its *local* labels != -100
      (xlm's ``pred_layer``): under CP its loss is rescaled to ``sum * P / (global count)``, so the mean
      over the CP group is the single-device mean. ``cross_modules``: attribute names of the instances of
      this class that are cross-attention (trocr's ``encoder_attn``, idle in a causal LM): left out of
      the attention layers and refused if called under CP.

    The model's own mask is dropped: it was built for the local shard. What it encoded must be
    declared here and is rebuilt from global positions: causal (always), padding / packed documents
    (from the batch), a sliding window on the layers where ``window_when = (module attribute, value)``
    holds, of ``window_config`` tokens (``config`` attribute; key visible iff ``0 <= q - k < w``).
    Scale: ``scale`` (a number; ``None``: ``1/sqrt(head_dim)``), or, when ``scale_if`` names a module
    bool attribute, ``1/sqrt(head_dim)`` if it is true and 1 otherwise, or the module attribute
    ``scale_attr`` holds it. ``refuse_config``: ``(attribute, reason)`` pairs refused at wire time when
    the module's (else the config's) attribute is truthy; ``refuse_kwargs``:
    call kwargs that send the forward down a path that bypasses the site (refused per call).
    """

    kind: str
    method: str = ""
    args: tuple[str, ...] = ("query", "key", "value", "attention_mask")
    key_layout: str = "bhsd"
    returns: str = "pair"
    scale: float | None = None
    scale_if: str = ""
    scale_attr: str = ""
    window_when: tuple[str, str] | None = None
    window_config: str = ""
    refuse_config: tuple[tuple[str, str], ...] = ()
    refuse_kwargs: tuple[str, ...] = ()
    qkv: str | tuple[str, str, str] = ""
    qkv_layout: str = ""
    causal_attr: str = ""
    cross_arg: str = ""
    out: str = ""
    heads_attr: str = "num_heads"
    clip_attr: str = ""
    residual_arg: str = ""
    alibi_slopes: Any = None
    rotary_arg: str = ""
    rotary_table: str = ""
    rotary_apply: str = ""
    rotary_value_attr: str = ""
    causal_config: str = ""
    empty_cache_arg: str = ""
    batch_rule: Any = None
    position_table: str = ""
    mean_loss: str = ""
    cross_modules: tuple[str, ...] = ()


@dataclass(frozen=True)
class RelativeBiasSite:
    """An attention module that adds a per-query relative position bias to its scores (Inkling): the bias of
    query ``q`` on key ``k`` is ``(states[q] @ proj)[q - k]`` for ``0 <= q - k < extent`` (row distances), zero
    elsewhere, where ``states`` are per-token, per-head features of the query's hidden state.

    The module builds that bias itself as a dense ``[B, H, q, kv]`` tensor from distances of the *local*
    shard and passes it as ``position_bias``; under CP the bias module (the child at attribute ``module``)
    instead returns ``states(bias_module, *args, **kwargs)`` ``[B, S/P, H, d]`` (its own computation of the
    per-token features), and the CP attention builds the bias from global positions inside its kernel
    (:mod:`ringmaster.attention.relbias`). ``proj`` / ``extent``: the bias module's ``[d, E]`` profile bank and
    its extent. ``log_scale``: module -> ``(alpha, n_floor)`` when the module multiplies its queries and its
    bias by ``1 + alpha * log(max((t + 1) / n_floor, 1))`` of the *local* token index ``t`` (Inkling's full
    layers), else None: the CP call rescales both to the global index."""

    module: str
    states: Any
    proj: str = "proj"
    extent: str = "rel_extent"
    log_scale: Any = None


@dataclass(frozen=True)
class ArchitectureSpec:
    """What ringmaster needs to know about one model family.

    ``attention_classes``: class names of the self-attention modules whose kernel call goes
    through ``config._attn_implementation`` (these get Ulysses/Ring).
    ``recurrent_classes``: class name -> strategy for state-carrying layers ringmaster handles.
    ``ignore_classes``: class names that match the stateful pattern but carry no state.
    ``refuse``: non-empty for a family known to be wrong under CP; the reason ``rm.wire`` raises.
    ``recurrent_kernels``: kind -> {role: the module-level kernel name its layers call} (roles
    ``"conv"``, ``"scan"`` and the kind's optional ones; unset roles keep the kind's defaults,
    :mod:`ringmaster.recurrent.registry`); ``wire`` intercepts and probes exactly these.

    A vision-language model also names where its fused sequence starts (``language_model``:
    the first module whose forward sees only the fused sequence; its pre-hook cuts the shard),
    the modules that run unsharded on every rank (``vision_modules``), the per-token kwargs the
    pre-hook cuts (``sequence_kwargs``: name -> dim) and deepstack embeddings to re-select.
    """

    name: str
    model_types: tuple[str, ...]
    attention_classes: tuple[str, ...]
    num_heads_attr: str = "num_attention_heads"
    num_kv_heads_attr: str = "num_key_value_heads"
    recurrent_classes: dict = field(default_factory=dict)
    ignore_classes: tuple[str, ...] = ()
    supported_inner: tuple[str, ...] | None = None  # None: every kernel the model itself supports
    recurrent_kernels: dict = field(default_factory=dict)
    # attention class -> SelfAttentionSite, for attention modules that compute attention themselves
    # (attention.selfattn re-binds each instance; the model's attn_implementation is left as it is)
    self_attention: dict = field(default_factory=dict)
    # attention class -> RelativeBiasSite, for modules that pass a hidden-state-conditioned relative position
    # bias to their attention call (attention.relbias re-binds each instance's bias module)
    relative_bias: dict = field(default_factory=dict)
    # classes that call the attention interface for something that mixes nothing along the sequence
    # (Inkling2's attention residuals over layer depth): their calls run the wrapped kernel locally
    # (attention.local)
    local_attention: tuple[str, ...] = ()
    notes: str = ""
    # a family ringmaster knows to be wrong under CP: ``rm.wire`` raises this reason (naming the layer or
    # feature and the fix) instead of wiring it, even when the generic path would accept the model
    refuse: str = ""
    # vision-language models
    language_model: str | None = None
    vision_modules: tuple[str, ...] = ()
    sequence_kwargs: dict = field(default_factory=lambda: {"inputs_embeds": 1, "position_ids": -1,
                                                           "visual_pos_masks": 1})
    deepstack_kwarg: str | None = None         # list of [num_visual_tokens, hidden] per layer
    deepstack_mask_kwarg: str = "visual_pos_masks"

    @property
    def multimodal(self) -> bool:
        return self.language_model is not None

    def vlm(self, name: str, model_types: tuple[str, ...], language_model: str, vision_modules: tuple[str, ...],
            **fields) -> "ArchitectureSpec":
        """This (text) family inside a vision-language model of ``model_types``."""
        return replace(self, name=name, model_types=model_types, language_model=language_model,
                       vision_modules=vision_modules, **fields)


def register_architecture(spec: ArchitectureSpec, *, override: bool = False) -> ArchitectureSpec:
    """Add a model family. Raises if a model type is already claimed, unless ``override``."""
    if not isinstance(spec, ArchitectureSpec):
        raise TypeError(f"register_architecture needs an ArchitectureSpec, got {type(spec).__name__}")
    for model_type in spec.model_types:
        if model_type in _REGISTRY and not override and _REGISTRY[model_type] is not spec:
            raise ValueError(
                f"model_type {model_type!r} is already registered by family {_REGISTRY[model_type].name!r}; "
                "pass override=True to replace it"
            )
    for model_type in spec.model_types:
        _REGISTRY[model_type] = spec
    return spec


def known_model_types() -> list[str]:
    """Registered model types ringmaster wires (refused families are left out)."""
    return sorted(t for t, spec in _REGISTRY.items() if not spec.refuse)


def text_config(config):
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def registered_architecture(model_or_config) -> ArchitectureSpec | None:
    """The registered spec for a model (or its config), found by ``model_type`` (the text config's for
    VLMs); None when no family is registered for it."""
    config = getattr(model_or_config, "config", model_or_config)
    for cfg in (config, text_config(config)):
        model_type = getattr(cfg, "model_type", None)
        if model_type in _REGISTRY:
            return _REGISTRY[model_type]
    return None


def unknown_family(model_or_config) -> ValueError:
    config = getattr(model_or_config, "config", model_or_config)
    model_type = getattr(config, "model_type", None)
    return ValueError(
        f"ringmaster does not know model_type {model_type!r} from its config alone. Known families: "
        f"{', '.join(known_model_types())}. Pass the model itself (the generic path inspects its attention "
        "modules) or describe it with rm.register_architecture(rm.ArchitectureSpec(name=..., "
        "model_types=(...,), attention_classes=('MyAttention',))); see docs/models.md"
    )
