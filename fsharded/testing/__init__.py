"""Helpers for testing fsharded programs: run a function on N real gloo ranks.

>>> from fsharded.testing import run_on_ranks
>>> results = run_on_ranks(my_module.case, world_size=2)   # list, one result per rank
"""

from fsharded.testing._launch import free_port, run_on_new_ranks, run_on_ranks

__all__ = ["run_on_ranks", "run_on_new_ranks", "free_port"]
