"""Recurrent layers under CP: exact cross-rank state passing.

``kind`` / ``registry``: the layer kinds (one module each: ``mamba2``, ``gated_deltanet``, ``mamba1``).
``scan``: the engine (segments, the all-gathered affine maps and their prefix, the sequential
p2p hand-over). ``documents``: state and halo resets at document starts. ``conv``: the causal
conv halo. ``intercept``: re-binding a layer instance's kernel names (in one place).
``context``: what a wired layer is bound to. ``wiring``: validate, wire, probe, restore.
``naive``: float64 reference recurrences for the tests. ``fla_mamba``: the Mamba/Mamba2 mixers axolotl
backs with flash-linear-attention (``mamba_backend: fla``), wired through their FLA view.
"""
