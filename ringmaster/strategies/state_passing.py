"""Import path kept for axolotl 0.21 (``ringmaster.strategies.state_passing.recurrent_plan``):
the code lives in :mod:`ringmaster.recurrent`."""

from ..errors import UnsupportedLayerError  # noqa: F401
from ..recurrent.scan import STRATEGIES, pass_state  # noqa: F401
from ..recurrent.wiring import (RecurrentWiring, check_recurrent_layers, recurrent_plan,  # noqa: F401
                                wire_recurrent_layers)
