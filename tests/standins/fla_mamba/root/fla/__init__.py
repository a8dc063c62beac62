"""CPU stand-in for flash-linear-attention (``fla``): only ``fla.layers.mamba.Mamba`` and
``fla.layers.mamba2.Mamba2``, the two classes axolotl 0.21's FLA Mamba backend builds on
(see standins.fla_mamba). Not the real package: nothing else is provided."""

STANDIN = True
