"""Tooling for tests, ``ringmaster demo`` and ``ringmaster check``: the parity harness (``parity``:
tiny random models, CP vs single-device comparison, fp64 mode) and the local worker pool
(``pool``: CPU gloo ranks started once and reused). Never imported by the training path."""
