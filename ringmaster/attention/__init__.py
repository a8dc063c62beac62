"""CP attention around the kernel the model already uses.

``ulysses``: all-to-all sequence <-> heads, the model's own kernel on the whole sequence.
``ring``: a kernel-agnostic loop over K/V blocks (block kernels, LSE merge, p2p/allgather rotation).
``usp``: Ulysses inside a group of ranks, Ring across groups. ``flex``: BlockMasks from global
positions. ``register``: one function per runtime, bound at setup (``binding``), registered
with transformers' attention interface.
"""
