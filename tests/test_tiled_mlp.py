"""rm.tiled_mlp: per-token modules over sequence tiles, recomputed in backward (ringmaster/tiling.py).

Single process (its composition with CP and checkpointing runs in tests/test_checkpointing.py): exact
against the untiled model (loss, logits, every gradient; fp64, a tile that does not divide the
sequence, batch 2), the MLP intermediates are no longer saved for backward, modules that mix tokens
are refused, restore() puts everything back; and mutations (tiles out of order, no recomputation)
are caught by these checks.
"""

import copy

import pytest
import torch

import ringmaster as rm
from ringmaster import per_token, tiling as tm
from ringmaster_tools.parity import rel_err, tiny_batch, tiny_model

MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)


def errors(model_type, tile, **extra):
    base = tiny_model(model_type, dtype=torch.float64, **extra)
    model = copy.deepcopy(base)
    handle = rm.tiled_mlp(model, tile_size=tile)
    batch = tiny_batch(base.config.vocab_size, 40, batch_size=2)
    ref, out = base(**batch), model(**batch)
    ref.loss.backward()
    out.loss.backward()
    grads = {n: rel_err(p.grad, q.grad) for (n, p), q in zip(model.named_parameters(), base.parameters())}
    handle.restore()
    return abs(out.loss.item() - ref.loss.item()), rel_err(out.logits, ref.logits), max(grads.values()), handle


@pytest.mark.parametrize("model_type,extra", [("llama", {}), ("qwen3_moe", MOE)])
def test_exact_against_untiled(model_type, extra):
    loss, logits, grad, handle = errors(model_type, 7, **extra)
    assert handle.paths == ["model.layers.0.mlp", "model.layers.1.mlp"]
    assert loss <= 1e-12 and logits <= 1e-12 and grad <= 1e-12, (loss, logits, grad)


def saved_bytes(model, batch):
    with rm.profile_memory() as mem:
        out = model(**batch)
    out.loss.backward()
    return mem.peak_saved_bytes


def test_intermediates_not_saved():
    """Two layers' SwiGLU intermediates (gate, up, act, product: ~4 x S x I fp32 each) leave the saved set."""
    base = tiny_model("llama", intermediate_size=256)
    batch = tiny_batch(base.config.vocab_size, 256)
    plain = saved_bytes(copy.deepcopy(base), batch)
    model = copy.deepcopy(base)
    rm.tiled_mlp(model, tile_size=32)
    tiled = saved_bytes(model, batch)
    mlp = 2 * 4 * 256 * 256 * 4
    assert plain - tiled >= 0.9 * mlp, (plain, tiled, mlp)


def test_mutation_tiles_out_of_order_is_caught(monkeypatch):
    stock = tm._cat

    def reversed_cat(pieces, length):
        return stock(pieces[::-1], length) if len(pieces) > 1 else stock(pieces, length)

    monkeypatch.setattr(tm, "_cat", reversed_cat)
    monkeypatch.setattr(per_token, "TOL", float("inf"))   # let the probe pass: the parity check must catch it
    _, logits, grad, _ = errors("llama", 7)
    assert logits > 1e-3 and grad > 1e-3, (logits, grad)


def test_mutation_without_recomputation_is_caught(monkeypatch):
    """Tiles run plainly under grad (no checkpoint): exact, but the intermediates stay saved."""
    monkeypatch.setattr(tm, "checkpoint", lambda fn, *args, use_reentrant: fn(*args))
    base = tiny_model("llama", intermediate_size=256)
    batch = tiny_batch(base.config.vocab_size, 256)
    plain = saved_bytes(copy.deepcopy(base), batch)
    model = copy.deepcopy(base)
    rm.tiled_mlp(model, tile_size=32)
    assert plain - saved_bytes(model, batch) < 0.1 * (2 * 4 * 256 * 256 * 4)


@pytest.mark.parametrize("path,why", [
    ("model.layers.0.self_attn", "did not run"),              # needs position embeddings: not per-token input
    ("model.layers.0", "did not run"),
    ("model.layers.0.linear_attn", "not per-token"),          # gated DeltaNet: conv + scan mix tokens
])
def test_refuses_modules_that_are_not_per_token(path, why):
    model = tiny_model("qwen3_5_text" if "linear_attn" in path else "llama")
    before = dict(model.model.layers[0].__dict__)
    with pytest.raises(rm.UnsupportedLayerError, match=why) as info:
        rm.tiled_mlp(model, modules=["model.layers.0.mlp", path])
    assert repr(path) in str(info.value)
    assert "forward" not in model.model.layers[0].mlp.__dict__      # nothing changed
    assert model.model.layers[0].__dict__.keys() == before.keys()


def test_refuses_an_output_without_a_sequence_dim():
    class Flat(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = torch.nn.Linear(8, 8)

        def forward(self, x):
            return self.proj(x).flatten(0, 1)     # [B*S, H]: no sequence dim to put tiles back on

    holder = torch.nn.Module()
    holder.mlp = Flat()
    with pytest.raises(rm.UnsupportedLayerError, match="batch, seq"):
        rm.tiled_mlp(holder, hidden_size=8)


def test_restore_and_no_tiling_for_short_inputs():
    model = tiny_model("llama")
    mlp = model.model.layers[0].mlp
    handle = rm.tiled_mlp(model, tile_size=64)     # default names: both layers' mlp
    x = torch.randn(1, 16, 64)
    assert torch.equal(mlp(x), type(mlp).forward(mlp, x))   # one tile: the plain forward
    with pytest.raises(RuntimeError, match="already tiled"):
        rm.tiled_mlp(model)
    handle.restore()
    assert "forward" not in mlp.__dict__ and not hasattr(mlp, tm._TAG)
