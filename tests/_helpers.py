"""Shared test helpers: a thin re-export of :mod:`arrayattn.testing.helpers` (their home
since the kit became public), kept so ``from _helpers import ...`` works."""

from arrayattn.testing.helpers import *  # noqa: F403
from arrayattn.testing.helpers import __all__  # noqa: F401
