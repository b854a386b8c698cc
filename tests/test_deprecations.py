"""Old spellings that still work, with a warning naming the replacement."""

from __future__ import annotations

import importlib
import sys

import pytest

import fsharded as fs


def test_fsharded_collectives_is_deprecated_for_fs_psum_and_fsharded_lax():
    sys.modules.pop("fsharded.collectives", None)
    with pytest.warns(DeprecationWarning, match=r"use fs\.psum and friends .*fsharded\.lax"):
        old = importlib.import_module("fsharded.collectives")
    assert old.psum is fs.psum and old.all_gather is fs.all_gather  # the same functions
