"""Cutting a batch into sequence shards and putting outputs back together.

``balancers``: which global positions each rank holds (contiguous, head_tail).
``documents``: the batch's global document structure (packing, padding) captured before the cut,
carried to every layer as the ``ringmaster_batch`` kwarg (:class:`~.documents.CPBatch`).
``carrier``: the one per-model :class:`~.carrier.StepCarrier` holding that step context for the layers
transformers calls without kwargs (set and cleared by the shard step, replayed by checkpoint recomputation).
``batch``: the shard step (``shard_collated_batch``, ``ContextParallelContextManager``,
``gather_sequence``) and the loss convention's token count. ``loss``: chunked NLL.
``positions``: absolute position ids in the model's own convention (GPT-2 / OPT / RoBERTa rules)
computed on the full row and cut for the shard.
"""
