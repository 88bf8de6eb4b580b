"""Plain float64 NumPy oracles: a thin re-export of :mod:`arrayattn.testing.oracles`
(their home since the kit became public), kept so ``import _reference as ref`` works."""

from arrayattn.testing.oracles import *  # noqa: F403
from arrayattn.testing.oracles import __all__  # noqa: F401
