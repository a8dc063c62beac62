"""Stand-in ``mamba_ssm.ops.triton.ssd_chunk_scan``: only what callers touch of the Triton autotuner
around ``_chunk_scan_fwd_kernel`` (its ``arg_names`` and the ``keys`` it caches tuning results by)."""


class _Autotuned:
    def __init__(self, arg_names):
        self.arg_names = list(arg_names)
        self.keys = [name for name in self.arg_names if not name.endswith("_ptr")]

    def __call__(self, *args, **kwargs):
        raise NotImplementedError("the stand-in has no Triton kernel; call mamba_chunk_scan_combined")


_chunk_scan_fwd_kernel = _Autotuned(["cb_ptr", "x_ptr", "z_ptr", "out_ptr", "chunk_size", "hdim", "dstate",
                                     "IS_CAUSAL", "HAS_D", "BLOCK_SIZE_M", "BLOCK_SIZE_N"])
