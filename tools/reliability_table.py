"""Write docs/reliability.md: every bad input in tests/bad_inputs.py and the error it gets.

    python tools/reliability_table.py

Runs each scenario (on 4 local CPU gloo ranks where it needs ranks), records the exception
type, the message rank 0 (or, for a missing rank, rank 1) printed and how long it took.
"""

from __future__ import annotations

import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests"))


# a fixed section after the table (the rule behind several errors, not one bad input)
WIRE_FORMAT = """
## One wire format per passed tensor

A tensor that crosses ranks has one wire format (shape and dtype), derived once from facts both ends
share, and both ends use it: the sender casts what it sends to it, the receiver allocates it and hands it
on. Neither end derives the format from its own computation alone, so a kernel that computes in another
dtype than the model (transformers' pure-torch Mamba2 and gated-delta kernels compute their state in
float32 inside a float64 model) cannot make the two ends disagree: before, the receiver allocated
float64 while the sender sent float32, and gloo aborted the whole process ("Received data size doesn't
match expected size"; NCCL would have read a buffer of the wrong dtype).

- Recurrent state, sequential pass (`recurrent/scan.py`): the wire format is `wire_format(segment)`,
  from the segment's `state_meta()` (batch and head sizes, the inputs' dtypes; never the shard length
  or the kernel's output). `to_wire` casts the kernel's final state to it (differentiable), the same
  for a state handed to a chunk on the same rank; `_Recv` allocates it; both backward messages use it.
  A state that cannot take it (another shape) raises `WireFormatError` naming the layer and the fix
  before any collective; wire's probe runs the same check on every rank (`scan.probe_run`), and the
  sender checks again right before `dist.send` (a one-sided error there: its peer waits in `recv`).
- Ring and distflash hops (`comm.start_exchange`): every message is cast to the caller's `like` dtype,
  and the receive shapes come from the same global plan on both ends.
- Symmetric collectives (the scan's map all-gather, the conv halo all-gather): every rank is sender
  and receiver with the same derivation (its own tensor, the same kernel on the same dtypes), so there is
  no separate receiver-side format to disagree with.

Tests: `tests/test_wire_format.py` (fp64 Nemotron-H and Qwen3.5 with float32 kernel state under the
sequential pass match the model without CP; a sender that skips the cast fails at wire on every rank,
and, patched in after wire, before the send)."""


TOKEN_MIXING = """

## Modules no registry knows: the token-mixing probe

`rm.wire` lists every module it does not route (the largest subtrees of the model that hold no attention
module, recurrent layer, declared self-attention site, position table or vision tower; the blocks of a
layer list are looked into, and torch's own per-token layers are skipped). On the first CP forward each one
is re-run inside its own forward on the first 16 tokens of its real input and on two pieces of them
(`ringmaster/per_token.py`, the probe `rm.tiled_mlp` uses too); the verdicts are agreed over the CP group
(one all-reduce, once) and a module whose pieces disagree is refused on every rank before any backward
(`UnsupportedLayerError`, naming the path, the class and the fix: make it per-token, route it with
`rm.register_architecture(spec, override=True)`, or refuse the family). `runtime.report.token_probe` says
how many modules it showed per-token and how long it took. `tests/test_token_mixing.py`, on a tiny Llama,
P=2 (before the probe every one of these trained silently wrong):

| edit (as user code or a `trust_remote_code` repository writes it) | refused, naming |
|---|---|
| an MLP wrapped by a running mean over the sequence (`x.cumsum(1) / arange`) | `model.layers.0.mlp` |
| the final norm after subtracting the sequence mean | `model.norm` |
| token embeddings plus sinusoidal positions numbered from the local length | `model.embed_tokens` |
| one layer's attention: fused `wqkv`, rotary from the local length, `F.scaled_dot_product_attention(is_causal=True)` | `model.layers.1.self_attn` |
| one layer's attention: `softmax(QK^T + ALiBi)` computed in the module | `model.layers.1.self_attn` |
| the same remote attention in every layer | refused at `rm.wire` (no attention layer of the family) |

Code in a decoder layer's own `forward` (not in a child module) is not probed. The probe needs the first CP
forward to run eagerly (it does, under torch.compile too).

## One order of collectives

A collective pairs with whatever its peers issue next on the same group: a rank that issues its backward
collectives in another order hangs, or, when the shapes agree, exchanges one collective's data for another's.
The backward's collectives (the conv halo's and the scan's reduce-scatters, the ring's hops, Ulysses'
all-to-alls, state passing's sends) are issued by autograd's engine, and packed rows give each rank a different
local graph. On CPU autograd runs the ready node with the highest sequence number first and every backward edge
goes from a later-created node to an earlier one, so a backward runs in reverse creation order, the forward's
program order, on every rank, as long as every rank creates the same collective nodes in the same order and
every one is reachable (the scan's and the halo's `tie`; state passing's token chain). `tests/test_collective_order.py`
shows it: each rank records its collectives at the c10d op level (`ringmaster_tools.profiling.record_collectives`:
op, phase, group, shapes, dtype, peer, all-to-all splits, ringmaster's tag), forward and backward, over hypothesis'
packings (1-token documents, documents across shard boundaries, padding; 8 packed rows a step), for Ulysses,
Ring (alltoall, allgather), distflash and USP 2x2 on a tiny Llama and every recurrent kind (mamba1, mamba2,
gated DeltaNet, KDA, lightning, RG-LRU, RWKV, mLSTM, short convs; P=2 sequential, P=4 scan), plus the zoo's
fp32 Mamba2 under HF non-reentrant checkpointing; `profiling.check_order` replays the group's logs with every
collective blocking until its partners reach it, and none has ever been stuck. A mutation (rank 1's Ulysses
backward all-to-alls recorded in swapped order) is caught. The suite runs 24 packings at P=2 and 16 at P=4
(`RINGMASTER_ORDER_EXAMPLES=8` runs 8 times as many)."""


def main() -> None:
    import bad_inputs

    from ringmaster_tools.pool import LocalPool

    rows = []
    with LocalPool(4, timeout=120) as pool:
        pool.run(bad_inputs.warm_up)
        for s in bad_inputs.SCENARIOS:
            start = time.monotonic()
            if s.rank:
                results = pool.run(bad_inputs.run_on_rank, s.name)
                result = results[1] if s.name == "collective_timeout" else results[0]
            else:
                result = bad_inputs.run_locally(s.name)
            elapsed = time.monotonic() - start
            kind, message = result if result is not None else ("(none)", "did not raise")
            rows.append((s.name, s.what, kind, message.replace("|", "\\|").replace("\n", " "), elapsed))
            print(f"{s.name:<32} {kind:<24} {elapsed:5.1f}s", flush=True)
    lines = [
        "# Reliability: bad inputs and the errors they get",
        "",
        "Generated by `python tools/reliability_table.py` (4 CPU gloo ranks); each row is also a test in",
        "`tests/test_reliability.py` that asserts the error type and message on every rank and that it",
        "arrives within seconds (no hang). Errors are raised before any collective can hang, except the",
        "last row, which shows what a rank waiting on a missing peer reports.",
        "",
        "| # | bad input | error | message (rank 0; rank 1 for the missing-rank case) | time |",
        "|---|---|---|---|---|",
    ]
    for i, (name, what, kind, message, elapsed) in enumerate(rows, 1):
        lines.append(f"| {i} | {what} (`{name}`) | `{kind}` | {message} | {elapsed:.1f}s |")
    lines += WIRE_FORMAT.splitlines() + TOKEN_MIXING.splitlines()
    path = os.path.join(ROOT, "docs", "reliability.md")
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")
    print(f"wrote {path} ({len(rows)} kinds)")


if __name__ == "__main__":
    main()
