"""Rank functions and a tiny extension for test_build_cache."""

from __future__ import annotations

import datetime
import os
import time

import torch

# A minimal extension: no torch headers, so it builds in a second or two.
PROBE_CPP = r"""
#include <Python.h>
#define FS_CAT(a, b) a##b
#define FS_XCAT(a, b) FS_CAT(a, b)
#define FS_STR(a) #a
#define FS_XSTR(a) FS_STR(a)
static PyObject* answer(PyObject*, PyObject*) { return PyLong_FromLong(42); }
static PyMethodDef methods[] = {{"answer", answer, METH_NOARGS, nullptr}, {nullptr, nullptr, 0, nullptr}};
static PyModuleDef def = {PyModuleDef_HEAD_INIT, FS_XSTR(TORCH_EXTENSION_NAME), nullptr, -1, methods};
PyMODINIT_FUNC FS_XCAT(PyInit_, TORCH_EXTENSION_NAME)(void) { return PyModule_Create(&def); }
"""

# One process loading the probe from the csrc folder argv[1] (a stand-in for one install's
# checkout), the way fsharded loads its extensions; prints the library it loaded.
LOAD_PROBE = r"""
import json, os, sys
from pathlib import Path
import fsharded.kernels.cpu_optim as c
c.CSRC = Path(sys.argv[1])
mod, why = c._compile("fsharded_probe", ("probe.cpp",))
assert mod is not None, why
assert mod.answer() == 42
print(json.dumps({"file": mod.__file__, "mtime": os.stat(mod.__file__).st_mtime_ns}))
"""


def slow_peer_build(tmp: str, sleep_s: float, timeout_s: float) -> dict:
    """The shared-memory transport set up over a group whose collectives time out after
    ``timeout_s``, while the first process to build it takes ``sleep_s`` (a fake builder
    standing in for the compiler: it sleeps, then hands over this install's real build)."""
    import torch.distributed as dist
    from torch.utils import cpp_extension

    from fsharded.comm import _groups, _shm

    real, why = _shm._module()  # this install's build (the test built it beforehand)
    assert real is not None, why
    _shm._module.cache_clear()
    os.environ["TORCH_EXTENSIONS_DIR"] = tmp  # no cached build there: every rank must "build"
    first = os.path.join(tmp, "first-builder")

    def fake_load(*args, **kwargs):
        try:
            os.close(os.open(first, os.O_CREAT | os.O_EXCL))
            time.sleep(sleep_s)  # this process compiles; the others find it built
        except FileExistsError:
            pass
        return real

    cpp_extension.load = fake_load
    rank = dist.get_rank()
    group = dist.new_group([0, 1], timeout=datetime.timedelta(seconds=timeout_s))
    g = _groups.AxisGroup(axes=("data",), group=group, group_name=group.group_name, size=2, index=rank,
                          ranks=(0, 1), to_group=(0, 1), identity_order=True)
    x = torch.full((4,), float(rank + 1))
    t0 = time.monotonic()
    _shm.all_reduce_(x, "sum", g)
    return {"sum": x.tolist(), "shm": _shm.in_use(), "seconds": time.monotonic() - t0}
