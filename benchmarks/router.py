"""The MoE router loss's communication under CP: bytes per step with output_router_logits on minus off.

    python benchmarks/router.py [--models qwen3_moe,mixtral]

Per model (tiny, P=2 Ulysses, S=64, CPU gloo ranks): ``rm.profile_comms()`` around one training step
(``ringmaster_tools.parity.compare``) with the router loss on and off; prints a markdown table.
"""

from __future__ import annotations

import argparse


def _bytes(ctx, model_type, flag):
    import ringmaster as rm
    from ringmaster_tools.parity import compare

    r = compare(model_type, rm.RingmasterConfig(size=2), seq_len=64, device_mesh=ctx.mesh(2),
                output_router_logits=flag)
    return r["bytes_fwd"], r["bytes_bwd"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="qwen3_moe,mixtral")
    args = parser.parse_args()
    from ringmaster_tools.parity import tiny_model
    from ringmaster_tools.pool import LocalPool, torch_kernels_only

    pool = LocalPool(2, timeout=900, init=torch_kernels_only)
    try:
        print("| model | experts | extra bytes per step (forward) | extra bytes (backward) |")
        print("|---|---|---|---|")
        for name in args.models.split(","):
            on, off = pool.run(_bytes, name, True)[0], pool.run(_bytes, name, False)[0]
            config = tiny_model(name).config
            experts = getattr(config, "num_experts", None) or getattr(config, "num_local_experts", None)
            print(f"| {name} | {experts} | {on[0] - off[0]} | {on[1] - off[1]} |", flush=True)
    finally:
        pool.close()


if __name__ == "__main__":
    main()
