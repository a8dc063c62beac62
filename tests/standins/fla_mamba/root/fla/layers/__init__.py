"""Stand-in ``fla.layers`` (only mamba, mamba2)."""
