"""Import path kept for axolotl 0.21 (``from ringmaster import shard; shard.shard_collated_batch``):
the code lives in :mod:`ringmaster.sharding.batch`."""

from .sharding.batch import (CP_SHARD_KEY, IGNORE_INDEX, LOCAL_ONLY_KEYS, SEQUENCE_KEYS,  # noqa: F401
                             ContextParallelContextManager, batch_kwarg, gather_sequence, global_num_items,
                             sequence_length, shard_collated_batch, shard_tensor, shift_labels)
