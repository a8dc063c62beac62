"""The CPU flash-attention 2 stand-in that ``ringmaster bench``'s peers run on.

ring-flash-attn and yunchang import ``flash_attn`` at import time and have no CPU path; the bench
measures them on CPU by importing them inside :func:`.package.as_flash_attn`, which makes :mod:`.fa2`
(FA2's Python interface over the tiled math of :mod:`.core`) importable as ``flash_attn`` for that one
block. That is why this part of the stand-in ships with the tooling: the wheel's ``ringmaster bench``
needs it. It is never on ``sys.path`` as a package and nothing in ``ringmaster`` imports it.

The hub-shaped local repositories that ``kernels`` loads through ``LOCAL_KERNELS`` (FA2, FA3, vllm's FA3
with sinks, FA4) are test doubles and live in ``tests/standins/flash_repos``.
"""
