"""Errors shared across the package (a leaf module)."""


class UnsupportedLayerError(RuntimeError):
    """A layer ringmaster cannot make exact under CP (fail closed, never silently wrong).
    ``ringmaster.UnsupportedLayerError`` / ``ringmaster.wiring.UnsupportedLayerError`` are this class."""
