"""Errors shared across the package (a leaf module)."""


class UnsupportedLayerError(RuntimeError):
    """A layer ringmaster cannot make exact under CP (fail closed, never silently wrong).
    ``ringmaster.UnsupportedLayerError`` / ``ringmaster.wiring.UnsupportedLayerError`` are this class."""


class WireFormatError(RuntimeError):
    """A tensor about to cross ranks does not have the wire format both ends agreed on (its shape, or its
    dtype when the sender skipped the cast); raised before the collective is issued, naming the layer."""
