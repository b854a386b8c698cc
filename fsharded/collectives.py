"""The collectives under their old module name. Deprecated: they are ``fs.psum`` and friends
(``fsharded.spmd.collectives``), with JAX's signatures in ``fsharded.lax``."""

import warnings

from fsharded.spmd.collectives import *  # noqa: F403
from fsharded.spmd.collectives import __all__  # noqa: F401

warnings.warn("fsharded.collectives is deprecated: use fs.psum and friends (fsharded.spmd.collectives), "
              "or fsharded.lax for JAX's signatures", DeprecationWarning, stacklevel=2)
