"""Import paths kept for axolotl 0.21 (``strategies.state_passing``, ``strategies.ring``); the code
lives in :mod:`ringmaster.attention` and :mod:`ringmaster.recurrent`."""
