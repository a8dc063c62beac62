"""Rank-side jobs of tests/test_collective_order.py: each rank's collectives, in issue order, over many packings.

A job builds each case's tiny model once, wires it, and runs one CP step (forward and backward) per packing under
``profiling.record_collectives``; the logs of the CP group are gathered (``all_gather_object``) and replayed by
``profiling.check_order``: every rank must issue the same collectives in the same order (each send meeting its
receive). On the P=2 cases the pool's two CP groups ((dp, cp) = (2, 2)) take alternate packings.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

# the dp groups split the steps: every rank of the pool
# (ringmaster_tools.pool.RankContext: this module's jobs are never solo)
ALL_GROUPS = True

S = 32   # sequence length of every packing: 8 chunks of 4 under head_tail at P=4

# tiny llama: 2 layers of hidden 32 (4 heads of 8: Ulysses and USP 2x2 split them at P=4)
LLAMA = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=4, head_dim=8, vocab_size=64)

# attention backends (the tiny llama): name -> (RingmasterConfig kwargs, CP sizes)
BACKENDS = {
    "ulysses": (dict(backend="ulysses"), (2, 4)),
    "ring_alltoall": (dict(backend="ring", rotate_method="alltoall"), (2, 4)),
    "ring_allgather": (dict(backend="ring", rotate_method="allgather"), (2, 4)),
    "distflash": (dict(backend="ring", load_balance="distflash"), (2, 4)),
    "usp": (dict(backend="usp", ulysses_size=2, ring_size=2), (4,)),
}

# recurrent kinds: name -> (model type, config overrides (on parity.TINY), CP sizes). Each hybrid keeps one
# recurrent layer and (where it has one) one attention layer, so its backward has both kinds of collectives.
KINDS = {
    "mamba1": ("falcon_mamba", dict(num_hidden_layers=2), (2, 4)),
    "mamba2": ("mamba2", dict(num_hidden_layers=2), (2, 4)),
    "gated_deltanet": ("qwen3_5_text", dict(num_hidden_layers=2, layer_types=["linear_attention", "full_attention"]),
                       (2, 4)),
    "kda": ("kimi_linear", dict(num_hidden_layers=2, layer_types=["linear_attention", "full_attention"],
                                mlp_layer_types=["dense", "dense"]), (2,)),
    "lightning": ("minimax", dict(num_hidden_layers=2, layer_types=["linear_attention", "full_attention"]), (2,)),
    "rglru": ("recurrent_gemma", dict(num_hidden_layers=2), (2,)),
    "rwkv": ("rwkv", dict(num_hidden_layers=2), (2, 4)),
    "mlstm": ("xlstm", dict(num_blocks=1), (2,)),
    "short_conv": ("lfm2", dict(num_hidden_layers=2, layer_types=["conv", "full_attention"], full_attn_idxs=[1]),
                   (2, 4)),
}

# the state-passing strategy per CP size: P=2 passes states rank to rank (p2p, on the ring's head_tail layout:
# two chunks a rank), P=4 runs the scan (one all-gather; Ulysses' contiguous layout)
RECURRENT = {2: dict(recurrent="sequential", backend="ring"), 4: dict(recurrent="scan", backend="ulysses")}

# extra cases: the zoo's tiny Mamba2 (fp32) under HF non-reentrant gradient checkpointing (recomputation in backward)
EXTRA = {"mamba2_checkpointed": ("mamba2", dict(num_hidden_layers=2), (2,))}


def cases(P: int) -> list[str]:
    return ([n for n, (_, sizes) in BACKENDS.items() if P in sizes]
            + [n for n, (_, _, sizes) in KINDS.items() if P in sizes]
            + [n for n, (_, _, sizes) in EXTRA.items() if P in sizes])


def _build(name: str, P: int):
    import ringmaster as rm
    from ringmaster_tools import parity, zoo

    if name in BACKENDS:
        model = parity.tiny_model("llama", **LLAMA)
        return model, rm.RingmasterConfig(size=P, **BACKENDS[name][0])
    if name in EXTRA:
        model = zoo.build_tiny("mamba2", dtype=torch.float32)
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        return model, rm.RingmasterConfig(size=P, **RECURRENT[P])
    model_type, overrides, _ = KINDS[name]
    model = parity.tiny_model(model_type, **overrides)
    return model, rm.RingmasterConfig(size=P, **RECURRENT[P])


def packing_batch(vocab: int, packings: list[dict]) -> dict[str, torch.Tensor]:
    """One packed row per packing (``docs``: document lengths, ``pad``: padding at the end, ``seed``)."""
    from ringmaster_tools.parity import packed_batch

    rows = [packed_batch(vocab, p["docs"], seed=p["seed"], pad=p["pad"]) for p in packings]
    return {k: torch.cat([r[k] for r in rows]) for k in rows[0]}


def order_logs(ctx, names: list[str], packings: list[dict], P: int, mutate=None, rows: int = 1) -> dict:
    """For each case in ``names`` (built once, wired once): one CP step per ``rows`` packings of this rank's CP
    group (one packed row each), each rank's collectives recorded. Returns ``bad``: ``{case: [(packing index, problems)]}`` for the packings
    whose logs do not match (``check_order``), ``steps``: ``{case: steps run}`` and ``phases``: ``{case: {phase:
    collectives recorded}}`` on this rank. ``mutate(ctx, name)``: a context manager the
    mutation tests use to change what one rank does."""
    import ringmaster as rm
    from ringmaster.adapters.raw import context_parallel_region
    from ringmaster_tools.profiling import check_order, record_collectives

    mesh = ctx.mesh(P)
    group = mesh.get_group("cp")
    dp = mesh.get_local_rank("dp")
    ranks = dist.get_process_group_ranks(group)
    steps_of = [list(range(i, min(i + rows, len(packings)))) for i in range(0, len(packings), rows)]
    mine = [i for i in range(len(steps_of)) if i % mesh["dp"].size() == dp]
    bad: dict[str, list] = {}
    steps: dict[str, int] = {}
    phases: dict[str, dict[str, int]] = {}   # collectives this rank recorded per phase, over its packings
    for name in names:
        model, cfg = _build(name, P)
        vocab = model.config.get_text_config().vocab_size
        rm.wire(model, cfg, device_mesh=mesh)
        try:
            logs = []
            with (mutate(ctx, name) if mutate is not None else contextlib.nullcontext()):
                for i in mine:
                    batch = packing_batch(vocab, [packings[k] for k in steps_of[i]])
                    with record_collectives() as log:
                        with context_parallel_region(batch, model=model) as shard:
                            out = model(**shard)
                        out.loss.backward()
                    model.zero_grad(set_to_none=True)
                    logs.append(log.events)
        finally:
            rm.unwire(model)
            rm.teardown()
        gathered = [None] * len(ranks)
        dist.all_gather_object(gathered, logs, group=group)
        # check_order wants one log per global rank: ranks outside this CP group issue nothing here
        for j, i in enumerate(mine):
            per_rank = [[] for _ in range(ctx.world)]
            for r, rank_logs in zip(ranks, gathered):
                per_rank[r] = rank_logs[j]
            problems = check_order(per_rank)
            if problems:
                bad.setdefault(name, []).append((steps_of[i], problems[:4]))
        steps[name] = sum(len(steps_of[i]) for i in mine)
        phases[name] = {p: sum(e.phase == p for log in logs for e in log) for p in ("forward", "backward")}
    return {"bad": bad, "steps": steps, "phases": phases}


# ---- mutations: one rank issues its collectives in another order


@contextlib.contextmanager
def swap_ulysses_backward(ctx, name):
    """Mutation: on rank 1, the backward of Ulysses' output all-to-all and of its q/k/v all-to-all trade places
    in the recorded order, as if autograd ran two independent branches the other way round on this rank. The
    collectives themselves run unchanged (nothing hangs): the tag the recorder reads is swapped, the one thing
    that tells two same-shaped collectives apart when the wire cannot."""
    from ringmaster import comm

    if ctx.rank != 1:
        yield
        return
    original = comm._AllToAll.backward
    swap = {"ulysses_out": "ulysses_qkv", "ulysses_qkv": "ulysses_out"}

    def backward(c, grad):
        c.tag = swap.get(c.tag, c.tag)
        return original(c, grad)

    comm._AllToAll.backward = staticmethod(backward)
    try:
        yield
    finally:
        comm._AllToAll.backward = staticmethod(original)

