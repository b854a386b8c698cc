"""Building fsharded's C++ / CUDA extensions once per install, and loading them.

Below everything that loads an extension (the shared-memory transport in ``fsharded.comm``,
the CPU optimizer in ``fsharded.kernels``): it imports nothing of fsharded. The sources are
under ``CSRC`` (the checkout's ``csrc/``).

torch's JIT builder (``torch.utils.cpp_extension.load``) keeps one build directory per
extension *name*, but what it compiles holds absolute paths: the sources, the include
folders, the venv's torch and Python, and ninja's own logs. Two installs on one machine
(two checkouts, two venvs, a venv's ninja and the system's) sharing a name rewrite each
other's ``build.ninja`` and rebuild on every switch (48-66 s for the shared-memory
transport, silently, inside a training step).

Here an extension's name carries a short hash of everything its binary depends on: the
contents of its sources and of every header beside them, the compile and link flags, the
include path, torch's version and location, the Python interpreter and environment
(``sys.prefix``), the compiler (``CXX``) and, for CUDA, the architectures. Each install
therefore has a build directory of its own. A finished build is marked there
(``fsharded-build.json``) and later loaded straight from its shared library, without
running ninja at all (so neither the ninja nor the compiler on ``PATH`` matters then).

Processes that need the same build at once (the ranks of one host) take a file lock in
its directory: the first compiles, printing one line to stderr ("building the
shared-memory transport, once for this install, ~15 s ..."), the others wait on the lock
— an untimed wait, not a collective — and then load what it built (or get its error,
without compiling again). The lock is ``flock``: the kernel releases it when a process
dies, so a killed build never leaves the others waiting. Callers that go on to a timed
collective build on every rank first (``fsharded.comm._shm``), so no rank sits in a
timed wait while another compiles.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import json
import os
import platform
import shutil
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from types import ModuleType

import torch

__all__ = ["build", "keyed_name", "build_directory", "CSRC"]

CSRC = Path(__file__).resolve().parents[1] / "csrc"

MARKER = "fsharded-build.json"
FAILED = "fsharded-build-failed.json"
_HEADERS = (".h", ".hpp", ".cuh", ".inl")


def _flags(extra_cflags: Sequence[str], extra_ldflags: Sequence[str],
           extra_cuda_cflags: Sequence[str] | None) -> dict:
    return {"cflags": list(extra_cflags), "ldflags": list(extra_ldflags),
            "cuda_cflags": None if extra_cuda_cflags is None else list(extra_cuda_cflags)}


def keyed_name(name: str, sources: Sequence[str], *, root: Path, extra_cflags: Sequence[str] = (),
               extra_ldflags: Sequence[str] = (), extra_cuda_cflags: Sequence[str] | None = None,
               python: str | None = None, prefix: str | None = None) -> str:
    """``name`` plus 12 hex digits of a hash of what the build depends on (see the module
    doc). ``python`` / ``prefix`` stand in for this interpreter's (tests).

    >>> keyed_name("ext", ["a.cpp"], root=Path("/nonexistent")) # doctest: +SKIP
    'ext_3f0c9d1a2b4e'
    """
    root = Path(root).resolve()
    h = hashlib.sha256()

    def add(label: str, value: object) -> None:
        h.update(f"{label}={value}\n".encode())

    for s in sources:
        add("source", s)
        h.update((root / s).read_bytes())
    for hdr in sorted(p for p in root.rglob("*") if p.suffix in _HEADERS and p.is_file()):
        add("header", hdr.relative_to(root).as_posix())
        h.update(hdr.read_bytes())
    add("flags", json.dumps(_flags(extra_cflags, extra_ldflags, extra_cuda_cflags), sort_keys=True))
    add("include", root)
    add("torch", (torch.__version__, torch.version.cuda, torch.version.hip, os.path.dirname(torch.__file__)))
    add("python", (python or os.path.realpath(sys.executable), prefix or sys.prefix, sys.version))
    add("cxx", os.environ.get("CXX", "c++"))
    add("machine", (platform.system(), platform.machine()))
    if extra_cuda_cflags is not None or any(s.endswith(".cu") for s in sources):
        from torch.utils import cpp_extension

        add("cuda", (os.environ.get("TORCH_CUDA_ARCH_LIST", ""), getattr(cpp_extension, "CUDA_HOME", None)))
    return f"{name}_{h.hexdigest()[:12]}"


def build_directory(keyed: str) -> str:
    """Where the build named ``keyed`` lives (created): torch's choice, under
    ``TORCH_EXTENSIONS_DIR`` or ``~/.cache/torch_extensions/<python>_<accelerator>``."""
    from torch.utils import cpp_extension

    try:
        return cpp_extension._get_build_directory(keyed, verbose=False)
    except AttributeError:  # a torch without the private helper: the same layout
        root = os.environ.get("TORCH_EXTENSIONS_DIR") or cpp_extension.get_default_build_root()
        path = os.path.join(root, keyed)
        os.makedirs(path, exist_ok=True)
        return path


@contextlib.contextmanager
def _locked(path: str) -> Iterator[None]:
    """An exclusive ``flock`` on ``path`` (released by the kernel if this process dies)."""
    try:
        import fcntl
    except ImportError:  # not POSIX: torch's own lock file still serialises the builds
        yield
        return
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)


def _import(name: str, path: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {path}")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _load(name: str, path: str, ops_namespace: str | None) -> ModuleType:
    if ops_namespace is None:
        return _import(name, path)
    torch.ops.load_library(path)
    return getattr(torch.ops, ops_namespace)


def _write_json(path: str, data: dict) -> None:
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        json.dump(data, f)
    os.replace(tmp, path)


def _missing_tools() -> str:
    """Why nothing can be compiled here, or ``""``."""
    cxx = os.environ.get("CXX", "c++")
    if shutil.which(cxx) is None:
        return (f"no C++ compiler: {cxx!r} is not on PATH (install one, e.g. `apt-get install g++`, "
                "or point CXX at it)")
    from torch.utils import cpp_extension

    try:
        cpp_extension.verify_ninja_availability()
    except RuntimeError:
        return "ninja is not installed (`pip install ninja`); torch builds extensions with it"
    return ""


def _forget_empty(bdir: str) -> None:
    """Remove a build directory that holds nothing but the lock (nothing could be built)."""
    with contextlib.suppress(OSError):
        if os.listdir(bdir) == ["fsharded.lock"]:
            os.remove(os.path.join(bdir, "fsharded.lock"))
            os.rmdir(bdir)


def build(name: str, sources: Sequence[str], *, root: Path, what: str = "", took: str = "",
          extra_cflags: Sequence[str] = (), extra_ldflags: Sequence[str] = (),
          extra_cuda_cflags: Sequence[str] | None = None,
          ops_namespace: str | None = None) -> tuple[ModuleType | None, str]:
    """The extension ``name`` built from ``sources`` (paths under ``root``, which is also
    the include path): ``(module, "")``, or ``(None, why)`` when it cannot be built.
    ``ops_namespace``: the sources register dispatcher ops in it (``TORCH_LIBRARY``, no
    Python module): the library is loaded with ``torch.ops.load_library`` and
    ``torch.ops.<ops_namespace>`` is returned in place of a module.

    Loaded from this install's cached build when there is one; otherwise built once, under
    a file lock, by the first process to get there, which prints one line naming ``what``
    is built and how long it ``took`` last time it was measured.
    """
    root = Path(root)
    missing = [s for s in sources if not (root / s).is_file()]
    if missing:
        return None, (f"the C++ sources {missing} are not under {root} (fsharded was installed without its "
                      "csrc/ folder; use a source checkout)")
    keyed = keyed_name(name, sources, root=root, extra_cflags=extra_cflags, extra_ldflags=extra_ldflags,
                       extra_cuda_cflags=extra_cuda_cflags)
    bdir = build_directory(keyed)
    from torch.utils.cpp_extension import LIB_EXT

    lib = os.path.join(bdir, keyed + LIB_EXT)
    marker, failed = os.path.join(bdir, MARKER), os.path.join(bdir, FAILED)
    asked = time.time()
    with _locked(os.path.join(bdir, "fsharded.lock")):
        if os.path.exists(marker) and os.path.exists(lib):
            try:
                return _load(keyed, lib, ops_namespace), ""
            except Exception:  # noqa: BLE001 - a damaged library: build it again below
                os.remove(marker)
        if os.path.exists(failed) and os.path.getmtime(failed) >= asked:
            # Another process built it while this one waited for the lock, and failed:
            # the same sources and flags would fail here too.
            with open(failed) as f:
                return None, json.load(f).get("error", "the build failed")
        why = _missing_tools()
        if why:
            _forget_empty(bdir)
            return None, why
        with contextlib.suppress(FileNotFoundError):
            # torch's own lock in the same folder, left by a build that was killed: this
            # process holds the folder's flock, so no build of this key is running.
            os.remove(os.path.join(bdir, "lock"))
        print(f"fsharded: building {what or name}, once for this install{', ' + took if took else ''} "
              f"(cached in {bdir})", file=sys.stderr, flush=True)
        from torch.utils import cpp_extension

        t0 = time.monotonic()
        kwargs = {} if extra_cuda_cflags is None else {"extra_cuda_cflags": list(extra_cuda_cflags)}
        try:
            mod = cpp_extension.load(name=keyed, sources=[str(root / s) for s in sources],
                                     extra_cflags=list(extra_cflags), extra_ldflags=list(extra_ldflags),
                                     extra_include_paths=[str(root)], build_directory=bdir, verbose=False,
                                     is_python_module=ops_namespace is None, **kwargs)
            if ops_namespace is not None:
                mod = getattr(torch.ops, ops_namespace)
        except Exception as e:  # noqa: BLE001 - any build failure means "not available"
            error = f"building {name} failed: {type(e).__name__}: {e}"
            _write_json(failed, {"error": error})
            return None, error
        _write_json(marker, {"name": keyed, "sources": list(sources), "root": str(root.resolve()),
                             "seconds": round(time.monotonic() - t0, 1), "torch": torch.__version__,
                             "python": sys.executable})
        with contextlib.suppress(FileNotFoundError):
            os.remove(failed)
        return mod, ""
