"""What exact state passing costs next to attention, and what ``scan`` costs over ``sequential``.

1. Per-layer bytes one rank sends (analytic, real model shapes, bf16 activations, fp32 states):
   Ulysses all-to-all of one attention layer vs the state passing of one recurrent layer
   (scan: all-gather of the maps; sequential: one state per hop) and the conv halo.
2. Measured bytes per layer on tiny hybrid models (gloo pool, forward + backward); the short-conv
   layers (LFM2) send only their halo, for either strategy. MiniMax (lightning), Kimi Linear (KDA),
   Recurrent Gemma (RG-LRU), RWKV (WKV, attention-free: bytes are the state and the shift halos) and
   xLSTM (mLSTM, attention-free: the stabilised (C', n', m) state, no conv).
3. Extra compute of scan vs sequential: one rank's recurrent kernel work for its shard
   (transformers torch kernels, CPU, fwd+bwd), P = 2 and 4. Timings are printed, never asserted.
   RWKV's and xLSTM's ``scan`` rerun the kernel from the composed state (their output is a ratio of the
   state), so they cost about 2x ``sequential``; the others add one correction term.

    python benchmarks/state_passing.py [--seq 4096] [--skip-pool] [--only mlstm,rwkv,...]

``--quick``: ``--skip-pool --seq 1024`` (the analytic table in full, the compute of the kinds ``--only``
names, every kind without it).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))

BF16, F32 = 2, 4

# (name, kind, shapes); attention shapes are the model's full-attention layers
MODELS = {
    "Qwen3-Next-80B (GDN)": dict(kind="gdn", hk=16, hv=32, dk=128, dv=128, conv=4, hq=16, hkv=2, hd=256),
    "Qwen3.5-27B-ish (GDN)": dict(kind="gdn", hk=16, hv=48, dk=128, dv=128, conv=4, hq=24, hkv=4, hd=256),
    "Nemotron-H-8B (Mamba2)": dict(kind="mamba", h=128, p=64, n=128, g=8, conv=4, hq=32, hkv=8, hd=128),
    # short conv: no scan state, only the halo (conv_L_cache - 1 inputs of the hidden size)
    "LFM2-2.6B (short conv)": dict(kind="short_conv", hidden=2048, conv=3, hq=32, hkv=8, hd=64),
    # lightning attention: a d x d state per head, one decay per head in the map; no conv
    "MiniMax-Text-01 (lightning)": dict(kind="lightning", h=64, d=128, conv=1, hq=64, hkv=8, hd=128),
    # KDA: gated DeltaNet's d_k x (d_v + d_k) maps; MLA attention (q/k heads 192 wide, v 128: ~hd 160)
    "Kimi-Linear-48B (KDA)": dict(kind="gdn", hk=32, hv=32, dk=128, dv=128, conv=4, hq=32, hkv=32, hd=160),
    # RG-LRU: one value per channel (and its decay product in the map); local attention, one KV head
    "RecurrentGemma-9B (RG-LRU)": dict(kind="rglru", w=4096, conv=4, hq=16, hkv=1, hd=256),
    # RWKV-4: (num, den, max) per channel, + w·L in the map; two token shifts (halo of one token each)
    "RWKV-4-7B (WKV)": dict(kind="rwkv", c=4096, conv=2, hq=0, hkv=0, hd=0),
    # Mamba1: state [d_inner, d_state], one decay per entry (maps: 2x the state); Jamba's attention layers
    "Jamba-v0.1 (Mamba1)": dict(kind="mamba1", d=8192, n=16, conv=4, hq=32, hkv=8, hd=128),
    # xLSTM-7B (mLSTM): attention-free, 8 heads, q/k 256 wide, v 512; state (C', n', m) per head, the map adds
    # G; no conv. The attention column is a 4096-wide GQA layer (32 x 128, 8 KV heads), for scale only
    "xLSTM-7B (mLSTM)*": dict(kind="mlstm", h=8, dk=256, dv=512, conv=1, hq=32, hkv=8, hd=128),
}


def _state_bytes(m) -> tuple[int, int, int]:
    """``(state, maps, conv channels)`` of one recurrent layer, fp32 states."""
    if m["kind"] == "short_conv":
        return 0, 0, m["hidden"]
    if m["kind"] == "gdn":
        return (m["hv"] * m["dk"] * m["dv"] * F32, m["hv"] * m["dk"] * (m["dv"] + m["dk"]) * F32,
                2 * m["hk"] * m["dk"] + m["hv"] * m["dv"])
    if m["kind"] == "lightning":
        return m["h"] * m["d"] * m["d"] * F32, m["h"] * (m["d"] * m["d"] + 1) * F32, 0
    if m["kind"] == "rglru":
        return m["w"] * F32, 2 * m["w"] * F32, m["w"]
    if m["kind"] == "rwkv":
        return 3 * m["c"] * F32, 4 * m["c"] * F32, 2 * m["c"]
    if m["kind"] == "mamba1":
        return m["d"] * m["n"] * F32, m["d"] * 2 * m["n"] * F32, m["d"]
    if m["kind"] == "mlstm":
        state = m["h"] * (m["dk"] * m["dv"] + m["dk"] + 1)
        return state * F32, (state + m["h"]) * F32, 0
    return (m["h"] * m["p"] * m["n"] * F32, m["h"] * (m["p"] * m["n"] + 1) * F32,
            m["h"] * m["p"] + 2 * m["g"] * m["n"])


def analytic(seq: int) -> None:
    print(f"\n## 1. bytes one rank sends per layer, forward (backward is the same again), S={seq}, batch 1")
    print(f"{'model':<28} {'P':>2} {'ulysses attn':>13} {'scan maps':>11} {'seq state/hop':>14} {'conv halo':>10}"
          f" {'scan/attn':>10}")
    for name, m in MODELS.items():
        for P in (2, 4, 8):
            attn = seq // P * (2 * m["hq"] + 2 * m["hkv"]) * m["hd"] * BF16 * (P - 1) // P  # q,k,v out, o back
            state, maps, conv_dim = _state_bytes(m)
            scan = maps * (P - 1)
            halo = conv_dim * (m["conv"] - 1) * BF16 * (P - 1)
            ratio = f"{scan / attn:>10.3f}" if attn else f"{'no attn':>10}"
            print(f"{name:<28} {P:>2} {attn / 2**20:>10.1f}MiB {scan / 2**20:>8.2f}MiB {state / 2**20:>11.2f}MiB"
                  f" {halo / 2**10:>7.1f}KiB {ratio}")


def measured(pool) -> None:
    print("\n## 2. measured bytes per layer, tiny models (gloo, fwd+bwd, S=96, rank 0)")
    print(f"{'model':<14} {'P':>2} {'strategy':<10} {'a2a/attn layer':>15} {'state+halo/rec layer':>21}")
    for model_type in ("qwen3_5_text", "nemotron_h", "lfm2", "minimax", "kimi_linear", "recurrent_gemma", "rwkv",
                       "xlstm"):
        for P in (2, 4):
            for strategy in ("scan", "sequential"):
                r = pool.run(_bytes_job, model_type, P, strategy)[0]
                print(f"{model_type:<14} {P:>2} {strategy:<10} {r['a2a'] / max(r['attn'], 1):>14.0f}B"
                      f" {r['rec_bytes'] / max(r['rec'], 1):>20.0f}B")


def _bytes_job(ctx, model_type, P, strategy):
    import jobs_linear_recurrent as jl
    import jobs_recurrent as jr

    if model_type in ("minimax", "kimi_linear", "recurrent_gemma", "rwkv"):
        r = jl.parity(ctx, model_type, P, strategy, seq_len=96)
    elif model_type == "xlstm":
        import jobs_xlstm as jx

        r = jx.parity(ctx, P, strategy, seq_len=96)
    else:
        r = jr.hybrid_parity(ctx, model_type, P, strategy)
    return {"a2a": r["a2a_bytes"], "attn": r["attention_layers"], "rec": r["recurrent_layers"],
            "rec_bytes": r["bytes_sent"] - r["a2a_bytes"]}  # compare() gathers logits outside the profile


def _time(fn, reps=7) -> float:
    fn()
    out = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t)
    return min(out)  # least disturbed run (shared CPU)


def compute(seq: int, only: set | None = None) -> None:
    import jobs_recurrent as jr

    from ringmaster.recurrent.scan import compose_prefix

    torch.set_num_threads(1)
    print(f"\n## 3. one rank's recurrent compute for its shard (S={seq}, fwd+bwd, CPU torch kernels, 1 thread)")
    print(f"{'kernel':<16} {'P':>2} {'sequential':>11} {'scan':>9} {'scan/seq':>9}")
    shapes = {"mamba2": dict(b=1, h=8, p=16, g=2, n=32), "gated_deltanet": dict(b=1, hk=2, hv=4, dk=32, dv=32)}
    for kind, shape in shapes.items():
        if only and kind not in only:
            continue
        for P in (2, 4):
            L = seq // P
            make = jr.mamba_inputs if kind == "mamba2" else jr.gdn_inputs
            inputs = make(l=L, dtype=torch.float32, **shape)
            chunk = 64

            def sequential():
                x = jr.leaves(inputs)
                seg = jr.segment(kind, "hf", x, slice(0, L), chunk)
                state = torch.zeros(seg.state_meta()[0]).requires_grad_(True)
                y, final = seg.run(state)
                (y.sum() + final.sum()).backward()

            def scan():
                x = jr.leaves(inputs)
                seg = jr.segment(kind, "hf", x, slice(0, L), chunk)
                packed, aux = seg.local_map()
                maps = [packed.detach().requires_grad_(True) for _ in range(P)]  # what the all-gather returns
                states = compose_prefix(seg, maps)
                y = seg.finish(aux, states[-1])
                (y.sum() + packed.sum()).backward()

            t_seq, t_scan = _time(sequential), _time(scan)
            print(f"{kind:<16} {P:>2} {t_seq * 1e3:>9.1f}ms {t_scan * 1e3:>7.1f}ms {t_scan / t_seq:>9.2f}")
    for kind in ("lightning", "kda", "rglru", "rwkv", "mlstm"):
        if only and kind not in only:
            continue
        for P in (2, 4):
            make = _linear_segment(kind, seq // P)
            t_seq, t_scan = _time(lambda: _run_sequential(make), 3), _time(lambda: _run_scan(make, P), 3)
            print(f"{kind:<16} {P:>2} {t_seq * 1e3:>9.1f}ms {t_scan * 1e3:>7.1f}ms {t_scan / t_seq:>9.2f}")
    if not only or "mamba1" in only:
        _compute_mamba1(seq)


def _linear_segment(kind: str, L: int):
    """A callable returning ``(segment, leaves)`` of one shard of ``kind`` (transformers' torch kernels,
    fp32; lightning: ringmaster's block loop with MiniMax's block size 256)."""
    g = torch.Generator().manual_seed(0)

    def r(*shape):
        return torch.randn(*shape, generator=g)

    if kind == "lightning":
        from ringmaster.recurrent.lightning import LightningSegment

        base = [r(1, L, 8, 32) for _ in range(3)]
        slope = torch.logspace(-3, 0, 8)[:, None, None]
        return lambda: (lambda x: (LightningSegment(*x, slope, 256), x))([t.clone().requires_grad_(True) for t in base])
    if kind == "kda":
        from transformers.models.kimi_linear.modeling_kimi_linear import chunk_kimi_delta_attention

        from ringmaster.recurrent.gated_deltanet import GatedDeltaSegment

        base = [r(1, L, 4, 32), r(1, L, 4, 32), r(1, L, 4, 32), -torch.rand(1, L, 4, 32, generator=g) * 0.1,
                torch.rand(1, L, 4, generator=g)]
        return lambda: (lambda x: (GatedDeltaSegment(chunk_kimi_delta_attention, *x,
                                                     kwargs=dict(use_qk_l2norm_in_kernel=True)), x))(
            [t.clone().requires_grad_(True) for t in base])
    if kind == "rglru":
        from transformers.models.recurrent_gemma.modeling_recurrent_gemma import RecurrentGemmaRglru

        from ringmaster.recurrent.rglru import RglruSegment

        base = [r(1, L, 256), torch.rand(1, L, 256, generator=g)]
        reset = torch.zeros(1, L, 1, dtype=torch.bool)
        return lambda: (lambda x: (RglruSegment(lambda **kw: RecurrentGemmaRglru._rnn_scan(None, **kw), *x, reset),
                                   x))([t.clone().requires_grad_(True) for t in base])
    if kind == "mlstm":
        from transformers import xLSTMConfig
        from transformers.models.xlstm.modeling_xlstm import xLSTMBackend

        from ringmaster.recurrent.mlstm import MlstmSegment

        backend = xLSTMBackend(xLSTMConfig(hidden_size=256, num_heads=4, chunk_size=64, num_hidden_layers=1))

        def kernel(q, k, v, igate, fgate, c, n, m):   # what the wired layer runs per chunk
            return type(backend).forward(backend, query=q, key=k, value=v, igate=igate, fgate=fgate, c_initial=c,
                                         n_initial=n, m_initial=m, mode="inference")

        base = [r(1, 4, L, 32), r(1, 4, L, 32), r(1, 4, L, 64), r(1, 4, L), 2 + r(1, 4, L)]
        return lambda: (lambda x: (MlstmSegment(kernel, *x), x))([t.clone().requires_grad_(True) for t in base])
    from transformers.models.rwkv.modeling_rwkv import rwkv_linear_attention_cpu

    from ringmaster.recurrent.rwkv import WkvSegment

    base = [torch.linspace(-5, 1, 256), r(256), r(1, L, 256), r(1, L, 256)]
    return lambda: (lambda x: (WkvSegment(rwkv_linear_attention_cpu, *x), x))(
        [t.clone().requires_grad_(True) for t in base])


def _run_sequential(make) -> None:
    seg, leaves = make()
    state = torch.zeros(seg.state_meta()[0])
    if isinstance(seg, __import__("ringmaster.recurrent.rwkv", fromlist=["WkvSegment"]).WkvSegment):
        state[..., 2] = -1e38                      # the empty stabilised state
    y, final = seg.run(state.requires_grad_(True))
    (y.sum() + final[..., :2].sum()).backward()


def _run_scan(make, P: int) -> None:
    from ringmaster.recurrent.scan import compose_prefix

    seg, leaves = make()
    packed, aux = seg.local_map()
    maps = [packed.detach().requires_grad_(True) for _ in range(P)]   # what the all-gather returns
    states = compose_prefix(seg, maps)
    y = seg.finish(aux, states[-1])
    y = y[0] if isinstance(y, tuple) else y
    (y.sum() + packed.sum()).backward()



def _compute_mamba1(seq: int) -> None:
    """Mamba1: both strategies run the kernel once from a zero state plus the same closed-form correction
    (the kernels take no initial state); scan adds only the prefix over the P gathered maps."""
    import jobs_mamba1 as jm1

    from ringmaster.recurrent.scan import compose_prefix

    for P in (2, 4):
        L = seq // P
        inputs = jm1.mamba1_inputs(b=1, d=64, n=16, l=L, dtype=torch.float32)

        def sequential():
            x = jm1.leaves(inputs)
            seg = jm1.segment("hf", x, slice(0, L))
            state = torch.zeros(seg.state_meta()[0]).requires_grad_(True)
            y, final = seg.run(state)
            (y.sum() + final.sum()).backward()

        def scan():
            x = jm1.leaves(inputs)
            seg = jm1.segment("hf", x, slice(0, L))
            packed, aux = seg.local_map()
            maps = [packed.detach().requires_grad_(True) for _ in range(P)]
            y = seg.finish(aux, compose_prefix(seg, maps)[-1])
            (y.sum() + packed.sum()).backward()

        t_seq, t_scan = _time(sequential, reps=3), _time(scan, reps=3)
        print(f"{'mamba1':<16} {P:>2} {t_seq * 1e3:>9.1f}ms {t_scan * 1e3:>7.1f}ms {t_scan / t_seq:>9.2f}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--skip-pool", action="store_true")
    ap.add_argument("--quick", action="store_true", help="--skip-pool --seq 1024")
    ap.add_argument("--only", default="", help="comma-separated kinds for the compute table (default: all)")
    args = ap.parse_args()
    if args.quick:
        args.skip_pool, args.seq = True, 1024
    analytic(32768)
    if not args.skip_pool:
        from ringmaster_tools.pool import LocalPool, torch_kernels_only

        with LocalPool(4, timeout=300, init=torch_kernels_only) as pool:
            measured(pool)
    compute(args.seq, set(filter(None, args.only.split(","))) or None)


if __name__ == "__main__":
    main()
