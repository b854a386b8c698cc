"""fsharded.kernels dispatch: which implementation runs, and the errors when a forced one
cannot."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
import train_cases as T

import fsharded.kernels as K
from fsharded.kernels import _dispatch
from fsharded.models import gpt


def test_auto_and_forced_choices(monkeypatch):
    x = torch.zeros(3)
    monkeypatch.delenv("FSHARDED_KERNELS", raising=False)
    assert _dispatch.choose("layer_norm", x) == "reference"  # CPU tensors: the reference
    assert _dispatch.choose("layer_norm", x, impl="reference") == "reference"
    monkeypatch.setenv("FSHARDED_KERNELS", "reference")
    assert _dispatch.choose("fused_adamw", x, cpp=True) == "reference"
    # cpp forces the kinds that have a C++ form; the others keep choosing automatically.
    monkeypatch.setenv("FSHARDED_KERNELS", "cpp")
    assert _dispatch.choose("layer_norm", x) == "reference"
    with pytest.raises(RuntimeError, match="no C\\+\\+ implementation"):
        _dispatch.choose("layer_norm", x, impl="cpp")
    monkeypatch.setenv("FSHARDED_KERNELS", "bogus")
    with pytest.raises(ValueError, match="FSHARDED_KERNELS='bogus'"):
        _dispatch.choose("layer_norm", x)
    monkeypatch.delenv("FSHARDED_KERNELS")
    with pytest.raises(ValueError, match="impl='fast'"):
        _dispatch.choose("layer_norm", x, impl="fast")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(RuntimeError, match="impl='triton' requested but tensors are on"):
        _dispatch.choose("layer_norm", x, impl="triton")


def test_gpt_trains_under_every_forced_setting(monkeypatch):
    params = gpt.init(T.CONFIG, 0)
    batch = {"tokens": T.batches(1)[0]["tokens"][:2]}
    monkeypatch.delenv("FSHARDED_KERNELS", raising=False)
    want = gpt.loss(params, batch)
    for value in ("reference", "cpp", "auto"):
        monkeypatch.setenv("FSHARDED_KERNELS", value)
        torch.testing.assert_close(gpt.loss(params, batch), want)


def test_package_exports_and_import_without_triton():
    assert K.layer_norm.__module__ == "fsharded.kernels.norm"
    assert K.cross_entropy.__module__ == "fsharded.kernels.losses"
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        K.nope  # noqa: B018
    code = ("import sys, fsharded, fsharded.kernels as K; K.fused_adamw_; K.flash_attention; "
            "print('triton' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
