"""Cut a full batch into this rank's sequence shard, and put sharded outputs back together.

Labels are shifted *before* sharding (``shift_labels``) so the target of a shard's last
token, which lives on the next rank, is not lost.
"""

from __future__ import annotations

import warnings
from typing import Any, Mapping

import torch
import torch.distributed as dist

from ..comm import all_gather, all_reduce_sum
from ..runtime import Runtime, active, check_setup_path, runtime_of
from ..validation import validate_batch
from . import balancers
from .carrier import carrier_of
from .assignment import DOCUMENTS, Assignment, DocumentPolicy, plan_documents, policy_of
from .documents import BATCH_KWARG, CPBatch, Runs, batch_documents, pad_tokens, positions_from_doc_ids
from .positions import row_inputs

CP_SHARD_KEY = "_cp_shard"
IGNORE_INDEX = -100

# batch keys that describe the full batch only: the document structure they carry is captured
# before sharding (``doc_ids``) and the CP attention builds every mask from it
LOCAL_ONLY_KEYS = ("attention_mask", "cu_seq_lens_q", "cu_seq_lens_k", "cu_seqlens", "max_length_q", "max_length_k",
                   "seq_idx")

# batch keys that run along the sequence, and the dim they run along
SEQUENCE_KEYS: dict[str, int] = {
    "input_ids": 1,
    "labels": 1,
    "shift_labels": 1,
    "attention_mask": 1,
    "position_ids": -1,
    "inputs_embeds": 1,
    "token_type_ids": 1,
}


def shard_tensor(x: torch.Tensor, dim: int, rank: int, size: int, layout: str = "contiguous") -> torch.Tensor:
    """This rank's part of ``x`` along ``dim`` for the given layout."""
    seq_len = x.shape[dim]
    balancers.check_divisible(seq_len, size, layout)
    n = balancers.chunks_per_rank(layout)
    chunk = seq_len // (size * n)
    parts = [x.narrow(dim, c * chunk, chunk) for c in balancers.shard_chunks(layout, size, rank)]
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=dim)


def shift_labels(labels: torch.Tensor, ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """``labels[..., 1:]`` padded with ``ignore_index`` to the full length: the target of token t."""
    pad = torch.full_like(labels[..., :1], ignore_index)
    return torch.cat([labels[..., 1:], pad], dim=-1)


def sequence_length(batch: Mapping[str, Any]) -> int:
    for key in ("input_ids", "inputs_embeds", "labels", "shift_labels"):
        value = batch.get(key)
        if isinstance(value, torch.Tensor):
            return value.shape[1]
    raise ValueError(
        f"cannot find the sequence in the batch (keys: {sorted(batch)}); pass input_ids or inputs_embeds "
        "of shape [batch, seq, ...]"
    )


def refuse_bidirectional_spans(batch: Mapping[str, Any]) -> None:
    """Gemma-style VLMs (gemma3, paligemma) mark image tokens with ``token_type_ids == 1`` and let each
    image span attend to itself bidirectionally (HF's ``block_sequence_ids`` OR-ed onto the causal
    mask). The CP kernels mask with causal/window bands and documents (an AND), which cannot express
    that OR, so such a batch is refused here, before any collective. Text-only batches are exact."""
    tt = batch.get("token_type_ids")
    if not isinstance(tt, torch.Tensor) or not bool((tt == 1).any()):
        return
    row = int((tt == 1).any(-1).nonzero()[0])
    idx = (tt[row] == 1).nonzero().flatten()
    end = int(idx[0])
    while end + 1 < tt.shape[-1] and int(tt[row, end + 1]) == 1:
        end += 1
    raise NotImplementedError(
        f"this VLM batch has bidirectional image spans (token_type_ids == 1; row {row}, positions {int(idx[0])}..{end}): "
        "Gemma-style models let image tokens attend to their whole span, which ringmaster CP's causal/document masks "
        "do not express. Train text-only batches under CP, or run image batches without CP")


def shard_collated_batch(batch: Mapping[str, Any], cp_rank: int, cp_size: int,
                         load_balance: str = "contiguous", multimodal: bool = False,
                         documents: DocumentPolicy | None = None, keep_one: bool = False) -> dict[str, Any]:
    """Return this rank's shard of a full collated batch (no collective runs here).

    Sequence tensors are cut along the sequence; ``labels`` are shifted first and the shard
    carries both ``labels`` and ``shift_labels`` (HF's causal-LM loss uses the latter);
    ``position_ids`` are global (``arange``, or restarting per document of a packed row) so
    RoPE sees true positions. Packed rows (restarting position_ids, ``cu_seq_lens``, axolotl's
    packed ``attention_mask`` ids) and padding are captured as global ``doc_ids`` before the cut;
    ``attention_mask`` and ``cu_seq_lens`` themselves are dropped (they describe the full row).
    The result carries ``_cp_shard`` metadata so a later forward hook does not shard again; for
    a batch without position_ids it keeps references to the full rows' input_ids/attention_mask
    (``rows``), from which a model with absolute position tables gets its own numbering
    (:func:`apply_positions`, :mod:`.positions`).

    For a VLM wired with ``rm.wire`` (``multimodal=True``; ``context_parallel_region`` and
    ``ContextParallelContextManager`` pass it from the model's runtime) only the labels are cut here: input_ids, pixel values and the attention mask stay whole
    because the model builds the fused sequence (and its mrope positions) from them, and the
    language model's pre-hook cuts the fused sequence.

    ``load_balance="documents"`` (``documents``: the runtime's :class:`DocumentPolicy`) assigns short
    documents whole to single ranks and splits the long ones (:mod:`.assignment`): each rank's shard is its
    piece of the long documents followed by its whole documents, and ``_cp_shard`` carries the assignment.
    A batch whose documents all end up split (one long document) is cut as the policy's static layout cuts it.

    ``keep_one`` (a compiled runtime, ``Runtime.compiled``): rows with position_ids that hold one document each stay a
    packed batch of one document (:func:`~.documents.batch_documents`), the case a compiled block already has.
    """
    layout = balancers.check_layout(load_balance)
    if not (0 <= cp_rank < cp_size):
        raise ValueError(f"cp_rank={cp_rank} is outside [0, cp_size={cp_size})")
    if CP_SHARD_KEY in batch:
        raise ValueError("this batch is already a CP shard (it carries _cp_shard); shard the full batch once")
    seq_len = sequence_length(batch)
    policy = (documents or DocumentPolicy()) if layout == DOCUMENTS else None
    balancers.check_divisible(seq_len, cp_size, policy.split_layout if policy is not None else layout)
    doc_ids = batch_documents(batch, seq_len, keep_one=keep_one)
    if multimodal:
        refuse_bidirectional_spans(batch)
    runs = assignment = None
    if policy is not None:
        if multimodal:
            raise NotImplementedError("load_balance='documents' cuts text rows; a VLM's fused sequence is cut by its "
                                      "language model, so use load_balance='auto' for this model")
        runs = Runs.from_doc_ids(doc_ids) if doc_ids is not None else None   # the one host read of the documents
        assignment = plan_documents(runs, seq_len, cp_size, policy.split_layout, policy.threshold, policy.cost,
                                    policy.heads_split, policy.compiled)
    index = None if assignment is None else assignment.local_index(cp_rank)

    rows = None if multimodal else row_inputs(batch, seq_len)   # for absolute position rules (positions.py)
    keep_whole = ("attention_mask",) if multimodal else ()
    full = {k: v for k, v in batch.items() if k not in LOCAL_ONLY_KEYS or k in keep_whole}
    if isinstance(full.get("labels"), torch.Tensor) and full.get("shift_labels") is None:
        full["shift_labels"] = shift_labels(full["labels"])
    if full.get("position_ids") is None and not multimodal:
        ref = full.get("input_ids", full.get("inputs_embeds"))
        if doc_ids is not None and batch.get("attention_mask") is None:
            full["position_ids"] = positions_from_doc_ids(doc_ids)
        else:
            full["position_ids"] = torch.arange(seq_len, device=ref.device).unsqueeze(0).expand(ref.shape[0], -1)

    out: dict[str, Any] = {}
    for key, value in full.items():
        dim = SEQUENCE_KEYS.get(key) if (not multimodal or key in ("labels", "shift_labels")) else None
        if dim is not None and isinstance(value, torch.Tensor):
            if value.shape[dim] != seq_len:
                raise ValueError(
                    f"batch[{key!r}] has length {value.shape[dim]} along dim {dim} but the sequence is {seq_len}"
                )
            if index is not None:
                out[key] = value.index_select(dim % value.dim(), index.to(value.device)).contiguous()
            else:
                out[key] = shard_tensor(value, dim, cp_rank, cp_size, layout).contiguous()
        else:
            out[key] = value
    out[CP_SHARD_KEY] = {"rank": cp_rank, "size": cp_size, "layout": DOCUMENTS if assignment is not None else layout,
                         "seq_len": seq_len, "doc_ids": doc_ids, "rows": rows}
    mask = batch.get("attention_mask")
    if doc_ids is not None and assignment is None and isinstance(mask, torch.Tensor) and mask.dim() == 2:
        out[CP_SHARD_KEY]["recurrent_doc_ids"] = padding_merged(doc_ids, mask == 0)
    if not multimodal and isinstance(mask, torch.Tensor) and mask.dim() == 2 and mask.shape[1] == seq_len:
        # the shard of the batch's own padding mask (attention_mask itself is dropped): what a per-sequence statistic
        # over the tokens weights them by (the MoE router loss, sharding.router)
        out[CP_SHARD_KEY]["token_mask"] = (mask.index_select(1, index.to(mask.device)) if index is not None
                                           else shard_tensor(mask, 1, cp_rank, cp_size, layout)).contiguous()
    if assignment is not None:
        out[CP_SHARD_KEY].update(assignment=assignment, runs=runs)
    return out


def padding_merged(doc_ids: torch.Tensor, pad: torch.Tensor) -> torch.Tensor:
    """``doc_ids [B, S]`` with every run of consecutive padding tokens (``pad``) one document, for the recurrent
    layers (their outputs at padding are never used; a document after padding still starts from a zero state).
    Attention keeps each padding token a document of its own (no query without a key); the recurrent layers then run
    a run of padding as one piece, not one per token (which would pass the pieces' budget,
    :data:`~.documents.PIECES_BUDGET`, and cut the chunk in Python)."""
    pad = pad.to(doc_ids.device)
    both = pad[:, 1:] & pad[:, :-1]
    # always a tensor of its own (the same ids where no two padding tokens are neighbours): a compiled block guards on
    # whether two of its inputs are one tensor, so an alias of doc_ids would be a case of its own; and no host read
    new = (doc_ids[:, 1:] != doc_ids[:, :-1]) & ~both
    return torch.cat([torch.zeros_like(doc_ids[:, :1]), new.long().cumsum(-1)], dim=-1)


def gather_sequence(local: torch.Tensor, dim: int = 1, group=None, layout: str | None = None,
                    runtime: Runtime | None = None, assignment: Assignment | None = None) -> torch.Tensor:
    """Undo the shard: all-gather ``local`` along ``dim`` over the CP group and restore sequence order.

    Differentiable (backward reduce-scatters). ``group``/``layout`` default to ``runtime``'s (the
    one ``rm.wire`` returned), else to the current runtime's (the last ``rm.setup``/``rm.wire``).
    A batch cut with ``load_balance="documents"`` needs its ``assignment`` (``shard["ringmaster_batch"].assignment``,
    or ``ContextParallelContextManager.assignment_of(model)``): the shards differ in length and order.
    """
    if assignment is not None:
        layout = DOCUMENTS
    if group is None or layout is None:
        rt = runtime if runtime is not None else active()
        group = rt.cp_group if group is None else group
        layout = rt.shard_load_balance if layout is None else layout
    layout = balancers.check_layout(layout)
    dim = dim % local.dim()
    if layout == DOCUMENTS:
        if assignment is None:
            raise ValueError("this batch was cut with load_balance='documents': its shards differ in length and "
                             "order, so gather_sequence needs the batch's assignment; pass assignment="
                             "shard['ringmaster_batch'].assignment (the shard context_parallel_region gave you), or "
                             "manager.assignment_of(model) under ContextParallelContextManager")
        return _gather_documents(local, dim, group, assignment)
    stacked = all_gather(local, group, tag="gather_sequence")  # [P, ..., S/P, ...]
    P = stacked.shape[0]
    full = torch.cat(stacked.unbind(0), dim=dim)
    if layout == "contiguous":
        return full
    order = balancers.gathered_positions(full.shape[dim], P, layout, device=full.device)
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.numel(), device=order.device)
    return full.index_select(dim, inverse)


def _gather_documents(local: torch.Tensor, dim: int, group, a: Assignment) -> torch.Tensor:
    """:func:`gather_sequence` for a documents batch: shards padded to the longest, all-gathered, cut back
    to each rank's length (known on the host) and put in row order."""
    rank = dist.get_rank(group)
    if local.shape[dim] != a.local_len(rank):
        raise ValueError(f"gather_sequence: this rank's tensor has {local.shape[dim]} tokens along dim {dim}, but its "
                         f"shard of the documents batch has {a.local_len(rank)}")
    local = pad_tokens(local, dim, a.max_local_len - local.shape[dim])
    stacked = all_gather(local, group, tag="gather_sequence")
    full = torch.cat([stacked[r].narrow(dim, 0, a.local_len(r)) for r in range(a.size)], dim=dim)
    inverse = a.gathered_order.to(full.device)
    return full.index_select(dim, inverse)


def batch_kwarg(meta: Mapping[str, Any], runtime=None) -> CPBatch:
    """The ``ringmaster_batch`` kwarg for a shard's metadata: the only way the per-step layout and
    document structure reach the CP layers (nothing reads them from a process global). The step's dropout
    seed is drawn from it by the first forward that trains (:mod:`.rng`), not here: a step that draws nothing
    leaves the random stream alone. ``runtime``: the one the batch is for (its ``recurrent="heads"`` asks for the
    whole rows' pieces, ``CPBatch.row_pieces``; with ``"auto"``, the row lengths up to which its layers run heads:
    the batch makes the pieces when its rows are that short; and whether every wired layer pads its pieces neutrally,
    so a documents shard's split part runs as pieces a power of two long: ``RecurrentWiring.pow2_pieces``)."""
    config = getattr(runtime, "config", None)
    wiring = getattr(runtime, "recurrent_wiring", None)
    cpb = CPBatch.from_meta(meta, row_pieces=getattr(config, "recurrent", None) == "heads",
                            heads_upto=getattr(wiring, "heads_upto", ()),
                            pow2_pieces=getattr(wiring, "pow2_pieces", False),
                            piece_groups=getattr(wiring, "piece_groups", 1))
    if getattr(runtime, "compiled", False) and wiring is not None and cpb.past_the_budget():
        warnings.warn(BUDGET_WARNING, stacklevel=2)   # one message: Python shows it once per place
    return cpb


# what a compiled runtime's shard step says when a batch's recurrent pieces pass their budget (CPBatch.past_the_budget)
BUDGET_WARNING = (
    "ringmaster: this batch's documents would pad the recurrent layers' pieces past PIECES_BUDGET (4) times a chunk "
    "(many short documents beside a long one), in groups by length too where the kernels allow them (a kernel that "
    "loops over the tokens in Python keeps one group), so the compiled blocks cut that chunk in Python and recompile "
    "for this packing; packings like it recompile until dynamo's recompile_limit (benchmarks/pieces_budget.py). Pack "
    "fewer documents per row, or leave those recurrent blocks uncompiled (docs/api.md, 'What recompiles')")


def apply_positions(runtime: Runtime | None, kwargs: dict[str, Any]) -> None:
    """Give a model with absolute position tables (``runtime.positions``, found by ``rm.wire``'s
    probe) this shard's ``position_ids`` in its own convention, computed on the full row
    (:mod:`.positions`); a no-op for every other model, and for a batch with its own position_ids."""
    convention = getattr(runtime, "positions", None)
    if convention is not None:
        convention.apply(kwargs)


def global_num_items(batch: Mapping[str, Any], ignore_index: int = IGNORE_INDEX) -> torch.Tensor | None:
    """Supervised tokens in a *full* batch (labels shifted first), or None without labels."""
    labels = batch.get("shift_labels")
    if labels is None and isinstance(batch.get("labels"), torch.Tensor):
        labels = shift_labels(batch["labels"], ignore_index)
    return None if labels is None else labels.ne(ignore_index).sum()


def _model_name(model) -> str:
    return type(model).__name__


def check_shard_target(model, runtime: Runtime | None, layout: str | None, cp_size: int | None) -> Runtime:
    """Refuse, before any collective, to shard batches for a model whose attention is not CP
    attention (an unwired model, e.g. a separate reference model) or whose attention cannot use
    the shard layout (None: not checked). Returns the model's runtime."""
    if runtime is None:
        raise RuntimeError(
            f"{_model_name(model)} receives sequence shards but is not wired for context parallelism: its "
            "attention would see only this rank's tokens and train (or score) silently wrong. Wire every model "
            "that gets sharded batches (rm.wire(model, cfg), or rm.setup + model.set_attn_implementation("
            "runtime.attn_implementation)), e.g. a trainer's ref_model too"
        )
    check_setup_path(model, runtime)   # rm.setup + set_attn_implementation: the model must need nothing more
    if cp_size is not None and runtime.cp_size != cp_size:
        raise ValueError(f"{_model_name(model)} is wired for a CP group of {runtime.cp_size} ranks but its batches "
                         f"are sharded over {cp_size}; pass the model's runtime.cp_group to the manager")
    binding = runtime.binding
    if binding is not None and layout is not None and layout not in binding.layouts():
        raise ValueError(
            f"{_model_name(model)} uses {binding.backend} attention, which needs {' or '.join(binding.layouts())} "
            f"shards, but the batch is cut {layout!r}; use load_balance=None (the model's own layout, "
            f"{runtime.shard_load_balance!r}) or 'contiguous'"
        )
    return runtime


class ContextParallelContextManager:
    """Shard every forward of ``models`` over ``cp_group`` with forward pre-hooks.

    The hook takes the full batch the trainer passes, cuts this rank's shard, and sets
    ``num_items_in_batch`` to (global supervised tokens) / P, so the mean over the CP group
    of each rank's loss, and of its gradients, equals the single-device value. Batches that
    were already cut in the collator (they carry ``_cp_shard``) are not cut again; their
    token count is summed over the group. ``gather_outputs`` all-gathers the logits back to
    the full sequence after the forward (for losses that need every position). The pre-hook also sets
    the hooked model's step carrier (:mod:`.carrier`) and the post-hook clears it.

    ``load_balance=None`` (the default, or ``"auto"``) cuts each model's batches in the layout its own runtime
    was set up with; an explicit layout is used as given (Ring attention plans with whatever
    layout the batch carries; Ulysses/USP refuse a non-contiguous one before any collective).
    Every hooked model must be wired for CP (its runtime is found from ``rm.wire`` or from its
    attention implementation); a model that is not raises at its first forward.
    """

    def __init__(self, models, cp_group, gradient_accumulation_steps: int = 1, gather_outputs: bool = False,
                 load_balance: str | None = None):
        self.models = list(models) if isinstance(models, (list, tuple)) else [models]
        self.cp_group = cp_group
        self.cp_size = dist.get_world_size(cp_group)
        self.cp_rank = dist.get_rank(cp_group)
        self.gradient_accumulation_steps = int(gradient_accumulation_steps or 1)
        self.gather_outputs = gather_outputs
        self.load_balance = None if load_balance in (None, "auto") else balancers.check_layout(load_balance)
        self._local_valid: torch.Tensor | None = None
        self._layouts: dict[int, str] = {}
        self._assignments: dict[int, Assignment | None] = {}   # load_balance="documents": each model's last batch

    def _layout(self, runtime: Runtime | None) -> str:
        """The layout a full batch is cut in: the manager's, else the model's own runtime's."""
        if self.load_balance is not None:
            return self.load_balance
        return runtime.shard_load_balance if runtime is not None else "contiguous"

    def _make_pre_hook(self, forward_params):
        params = list(forward_params)

        def pre_hook(module, args, kwargs):
            kwargs = dict(kwargs)
            for name, value in zip(params, args):
                kwargs.setdefault(name, value)
            runtime = runtime_of(module)
            meta = kwargs.pop(CP_SHARD_KEY, None)   # a batch the collator already cut
            layout = meta["layout"] if meta is not None else self._layout(runtime)
            runtime = check_shard_target(module, runtime, layout, self.cp_size)   # before any collective
            full_batch = None
            if meta is None:
                full_batch = dict(kwargs)
                tensors = {k: v for k, v in kwargs.items()
                           if (k in SEQUENCE_KEYS or k in LOCAL_ONLY_KEYS) and v is not None}
                shard = shard_collated_batch(tensors, self.cp_rank, self.cp_size, layout,
                                             multimodal=runtime.multimodal is not None, documents=policy_of(runtime),
                                             keep_one=runtime.compiled)
                meta = shard.pop(CP_SHARD_KEY)
                for key in tensors:
                    kwargs.pop(key)
                kwargs.update(shard)
            # the ranks agree on the batch before the first collective (the token count below)
            validate_batch(runtime, meta, full_batch=full_batch, local=kwargs if full_batch is None else None)
            if full_batch is not None:
                full_count = global_num_items(full_batch)
            else:
                full_count = None
                local = kwargs.get("shift_labels")
                if local is not None:   # summed on the group's device (an NCCL group has no CPU backend)
                    full_count = all_reduce_sum(local.ne(IGNORE_INDEX).sum(), self.cp_group, tag="token count")
            local = kwargs.get("shift_labels")
            self._local_valid = None if local is None else local.ne(IGNORE_INDEX).sum()
            if kwargs.get("num_items_in_batch") is None and full_count is not None:
                kwargs["num_items_in_batch"] = full_count.float() / self.cp_size
            kwargs[BATCH_KWARG] = batch_kwarg(meta, runtime)
            self._layouts[id(module)] = meta["layout"]
            self._assignments[id(module)] = meta.get("assignment")
            apply_positions(runtime, kwargs)
            kwargs["use_cache"] = False
            carrier = carrier_of(module)
            if carrier is not None:   # the layers transformers calls without kwargs read it; cleared in _post_hook
                carrier.set(kwargs[BATCH_KWARG])
            return (), kwargs

        return pre_hook

    def _post_hook(self, module, args, kwargs, output):
        carrier = carrier_of(module)
        if carrier is not None:   # the step ends with the forward (a checkpoint's recomputation replays it)
            carrier.clear()
        logits = getattr(output, "logits", None)
        if self.gather_outputs and isinstance(logits, torch.Tensor):
            layout = self._layouts.get(id(module), self.load_balance or "contiguous")
            output.logits = gather_sequence(logits, dim=1, group=self.cp_group, layout=layout,
                                            assignment=self._assignments.get(id(module)))
        return output

    def assignment_of(self, model):
        """The documents assignment of ``model``'s last batch (``load_balance="documents"``; else None): what
        :func:`gather_sequence` needs to put its outputs back in row order."""
        return self._assignments.get(id(model))

    def install(self) -> list:
        """Register the hooks on every model; returns the handles (``handle.remove()`` undoes)."""
        import inspect

        handles = []
        for model in self.models:
            params = [p for p in inspect.signature(model.forward).parameters if p not in ("self", "args", "kwargs")]
            # first: every other pre-hook (the accounting, a VLM's) sees the shard's kwargs
            handles.append(model.register_forward_pre_hook(self._make_pre_hook(params), with_kwargs=True,
                                                           prepend=True))
            # last, and also when the forward raises: the step carrier is cleared after every other hook
            handles.append(model.register_forward_hook(self._post_hook, with_kwargs=True, always_call=True))
        return handles
