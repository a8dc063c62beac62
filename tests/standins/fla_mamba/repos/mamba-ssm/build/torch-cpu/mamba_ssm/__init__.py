"""CPU stand-in for ``kernels-community/mamba-ssm`` (see standins.fla_mamba): the
package layout axolotl imports from (``ops.selective_scan_interface``, ``ops.triton.*``)."""
from .ops.selective_scan_interface import mamba_inner_fn, selective_scan_fn  # noqa: F401
from .ops.triton.selective_state_update import selective_state_update  # noqa: F401
from .ops.triton.ssd_combined import mamba_chunk_scan_combined, mamba_split_conv1d_scan_combined  # noqa: F401

STANDIN = True
