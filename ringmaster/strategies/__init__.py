"""Parallel strategies: how each kind of layer is made exact when the sequence is sharded."""
