"""ringmaster's Mamba2 on mamba-ssm's real Triton SSD scan, on CPU.

mamba-ssm ships as an sdist whose build compiles CUDA; its Triton kernels are plain Python inside it.
tests/realkernels/mamba.py downloads the sdist once (PyPI, sha256 pinned; ``$RINGMASTER_SDIST_CACHE``, default
``~/.cache/ringmaster/sdists``) and registers ``mamba_ssm`` as a bare package (its ``__init__``, which imports the
CUDA extension, not run). A pool of two ranks runs Triton's interpreter with realkernels' bridges and mamba-ssm's
(no CUDA device guard, one SM, a grid-aware autotune pick) before transformers imports ``modeling_mamba2``, which
then resolves ``mamba_chunk_scan_combined`` to mamba-ssm's own function. Skipped only when the sdist cannot be
downloaded.

Checked, fp32 on both sides, tolerances of tests/test_real_kernels.py:
- what transformers resolves: the SSD scan is mamba-ssm's; the fused block, causal-conv1d and Mamba1's selective
  scan keep transformers' torch fallbacks (they need the CUDA extensions: realkernels.mamba.CANNOT_RUN);
- the kernel against the stand-in's token-by-token fp64 reference, with ``initial_states`` and ``seq_idx``;
- Mamba2 under CP at P=2 (``scan``, ``sequential`` and ``heads``; Ulysses' contiguous and Ring's head_tail layout) against
  the same model without CP, a scan chunk of 12 that divides no shard; state passing off must miss;
- causal-conv1d's own ``causal_conv1d_ref`` equals the torch conv ringmaster's CP conv runs here.
"""

import jobs_real_mamba as jm
import pytest
from test_real_kernels import check   # the same fp32 bounds, mutation floor and per-case checks

KERNEL_TOL = 1e-5   # the kernel vs the fp64 reference (measured max 6e-7)
NEEDED = ("A_log", "dt_bias", "conv1d.weight")
# one Mamba2 layer, 32 tokens: shards of 16 (Ulysses) and chunks of 8 (Ring's head_tail) against a scan chunk of 12
SEQ_LEN = 32
OVERRIDES = dict(num_hidden_layers=1)


@pytest.fixture(scope="module")
def mamba_pool(real_pool):
    """The session's real-kernel pool (tests/conftest.py: FLA and mamba-ssm's Triton kernels, interpreted)."""
    import importlib.util

    missing = [m for m in ("triton", "einops", "packaging") if importlib.util.find_spec(m) is None]
    assert not missing, f"mamba-ssm's Triton kernels need {missing} installed (Triton runs them on CPU, interpreted)"
    if real_pool.mamba_unavailable:
        pytest.skip(f"mamba-ssm's sdist is not cached and cannot be downloaded (no network?): "
                    f"{real_pool.mamba_unavailable}")
    return real_pool


def test_transformers_resolves_mamba_ssms_scan(mamba_pool):
    got = mamba_pool.run(jm.resolution)[0]
    assert got["triton_interpret"] == "1" and got["mamba_ssm"].endswith("mamba_ssm"), got
    for module, names in jm.RESOLVED.items():
        for name, want in names.items():
            assert got[f"{module}.{name}"] == want, (name, got)


def test_kernel_matches_the_fp64_reference(mamba_pool):
    """``mamba_chunk_scan_combined`` as bridged (no device guard, one SM, the grid-aware pick): output, final state
    and every input's gradient, with and without initial states, with three documents in ``seq_idx``."""
    for case, r in mamba_pool.run(jm.kernel_matches_reference)[0].items():
        print(f"{case}: forward {r['fwd_s']:.2f} s, backward {r['bwd_s']:.2f} s, worst "
              f"{max(r['errs'].values()):.1e}")
        assert max(r["errs"].values()) <= KERNEL_TOL, (case, r)


# sequential hands the passed state to the kernel's initial_states; Ring cuts head_tail; heads runs the kernel over
# whole rows for half the heads (Ring's head_tail order restored inside its all-to-alls)
CASES = [("ulysses", "scan"), ("ring", "sequential"), ("ring", "heads"), ("ulysses", "scan", "mamba2_state_not_passed")]


def test_mamba2_exact_on_mamba_ssms_kernel(mamba_pool):
    results = mamba_pool.run(jm.mamba2_cases, CASES, seq_len=SEQ_LEN, overrides=OVERRIDES)
    check(results, 2, "dense", CASES, needed=NEEDED)
    for rank, per_case in enumerate(results):
        for (backend, strategy, *mutation), r in zip(CASES, per_case):
            assert r["layout"] == ("head_tail" if backend == "ring" else "contiguous"), r
            assert mutation or r["recurrent_layers"] == 1, r
        print(f"rank {rank}: {len(CASES)} cases in {per_case[-1]['job_s']:.1f} s")


# heads on a packed row: mamba-ssm's own seq_idx, every document in one call; the mutation drops its boundaries
PACKED_CASES = [("ulysses", "heads"), ("ulysses", "heads", "heads_varlen_one_document")]


def test_mamba2_heads_packed_rows_on_mamba_ssms_seq_idx(mamba_pool):
    # 32 tokens: documents start mid-shard and on the shard edge (16)
    results = mamba_pool.run(jm.mamba2_cases, PACKED_CASES, overrides=OVERRIDES, mode="packed", doc_lens=(5, 11, 3, 13))
    check(results, 2, "packed", PACKED_CASES, needed=NEEDED)


def test_causal_conv1d_reference_is_the_conv_run_here(mamba_pool):
    """causal-conv1d's compiled ``causal_conv1d_fn`` cannot run (no ``causal_conv1d_cuda``); its pure-torch
    ``causal_conv1d_ref`` (which transformers never resolves: it looks up ``causal_conv1d_fn``) equals transformers'
    torch conv, and its ``initial_states`` equals the halo ringmaster concatenates."""
    got = mamba_pool.run(jm.conv_reference)[0]
    assert got["fallback_module"] == "transformers.models.mamba2.modeling_mamba2", got
    assert max(got["err_None"], got["err_silu"], got["err_initial_states_vs_halo"]) <= 1e-6, got
    assert got["causal_conv1d_fn"].startswith("TypeError"), got


def test_documents_split_part_pieces_on_mamba_ssms_kernel(mamba_pool):
    """The padded pieces a compiled documents split part runs (the lone piece the state enters and leaves padded to a
    power of two with ``PAD_DT``: a step of exactly 0 in the kernel's own softplus) on mamba-ssm's Triton SSD scan:
    output and every gradient as each document alone (fp64 reference). Mutation: the padding ``dt = 0`` moves the
    state the piece hands on."""
    got = mamba_pool.run(jm.split_part_pieces)[0]
    print({k: {e: f"{v:.1e}" for e, v in r["errs"].items()} for k, r in got.items()})
    assert got["pad_dt"]["L"] == 16, got
    assert max(got["pad_dt"]["errs"].values()) <= KERNEL_TOL, got
    assert got["zero_dt"]["errs"]["y"] > 1e-3, got
