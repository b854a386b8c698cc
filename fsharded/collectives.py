"""The collectives, under their long-standing module name (they live in ``fsharded.spmd``)."""

from fsharded.spmd.collectives import *  # noqa: F403
from fsharded.spmd.collectives import __all__  # noqa: F401
