"""Every bad input gets a clear error, raised on every rank before any collective (no hang)."""

import jobs
import pytest
import torch

import ringmaster as rm
from ringmaster.shard import shard_collated_batch

SCENARIOS = {
    "seq_not_divisible": ("ValueError", ["sequence length 63 is not divisible by 2", "pad the batch to 64"]),
    "heads_not_divisible": ("ValueError", ["query heads (6) divisible by the CP size (4)", "backend='ring'"]),
    "kv_heads_unsplittable": ("ValueError", ["cannot split 6 KV heads over 4 ranks"]),
    "mesh_without_cp_dim": ("ValueError", ["device_mesh has no 'sequence' dim", "('dp', 'cp')"]),
    "size_mismatch": ("ValueError", ["RingmasterConfig.size=4 but device_mesh['cp'] has 2 ranks"]),
    "wire_twice": ("RuntimeError", ["already wired", "rm.unwire(model)"]),
    "unknown_model": ("ValueError", ["does not know model_type 'phi3'", "llama", "gpt_oss", "register_architecture"]),
    "unknown_stateful_layer": ("UnsupportedLayerError", ["'model.layers.1.mlp' (FakeMamba2Mixer)",
                                                         "recurrent_classes", "register_architecture"]),
}


@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_bad_input_raises_clearly_on_every_rank(pool, scenario):
    kind, fragments = SCENARIOS[scenario]
    results = pool.run(jobs.bad_input, scenario)
    for rank, result in enumerate(results):
        assert result is not None, f"rank {rank}: {scenario} did not raise"
        name, message = result
        assert name == kind, (rank, name, message)
        for fragment in fragments:
            assert fragment in message, (rank, fragment, message)


def test_head_tail_needs_2p():
    batch = {"input_ids": torch.zeros(1, 12, dtype=torch.long)}
    with pytest.raises(ValueError, match=r"not divisible by 8 \(2 x cp size 4, layout 'head_tail'\)"):
        shard_collated_batch(batch, cp_rank=0, cp_size=4, load_balance="head_tail")


def test_setup_without_process_group():
    with pytest.raises(RuntimeError, match="init_process_group"):
        rm.setup(rm.RingmasterConfig(size=2))


def test_attention_without_runtime_says_what_to_do():
    from ringmaster.runtime import active

    rm.teardown()
    with pytest.raises(RuntimeError, match=r"rm.setup\(cfg, ...\) or rm.wire"):
        active()
