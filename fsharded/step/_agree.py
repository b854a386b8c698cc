"""That every rank runs the same step, and what to say when a peer fails a step's save.

On real ranks each rank builds its own ``train_step`` and calls it with the global batch.
Ranks that differ there compute silently wrong numbers: another learning rate or
optimizer setting gives replicas that drift apart, another global batch (or one rank a
step behind, having skipped one) mixes other rows into the mean. So every call first
gathers four words from every rank (one small all-gather, over shared memory where the
ranks have it): a fingerprint of the step's settings (computed once per step: the
optimizer's hyper-parameters and its learning rate at a few steps, precision,
accumulation, clipping, specs, ...), the state's step count, and the global batch's
structure, shapes and dtypes, and a CRC of a sample of its values (at most 4096
elements per leaf, so the cost does not grow with the batch). Any difference is an error
on every rank naming the ranks and the values that differ. ``FSHARDED_CHECK_SITES=0``
turns it off with the call-site checks.
"""

from __future__ import annotations

import contextlib
import functools
import re
import types
import zlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

from fsharded import _tree, comm, optim
from fsharded.comm import _peers, _shm

__all__ = ["agree", "any_rank", "settings", "save_error"]

_SAMPLE = 4096  # elements of each batch leaf that go into its CRC
_LR_STEPS = (0, 1, 10, 100, 1000, 10_000, 100_000)  # where the learning rate is compared


_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")


def _crc(text: str) -> int:
    return zlib.crc32(text.encode())


def _hyper(obj: Any, path: str, out: dict[str, str], seen: set[int], depth: int = 0) -> None:
    """The numbers, strings and function names an optimizer is made of (its closures'
    cells, partials' arguments, dataclass fields, tuples), under readable paths."""
    if len(out) >= 256 or depth > 8:
        return
    if obj is None or isinstance(obj, (bool, int, float, str)):
        out[path] = repr(obj)
        return
    if isinstance(obj, torch.Tensor):
        out[path] = repr(obj.tolist()) if obj.numel() <= 8 else f"tensor {tuple(obj.shape)} {obj.dtype}"
        return
    if id(obj) in seen or isinstance(obj, (types.ModuleType, type)):
        return
    seen.add(id(obj))
    if isinstance(obj, (tuple, list)):
        for i, v in enumerate(obj):
            _hyper(v, f"{path}[{i}]", out, seen, depth + 1)
    elif isinstance(obj, dict):
        for k in sorted(obj, key=repr):
            _hyper(obj[k], f"{path}[{k!r}]", out, seen, depth + 1)
    elif isinstance(obj, functools.partial):
        _hyper(obj.func, f"{path}.func", out, seen, depth + 1)
        _hyper(obj.args, f"{path}.args", out, seen, depth + 1)
        _hyper(obj.keywords, f"{path}.keywords", out, seen, depth + 1)
    elif isinstance(obj, types.FunctionType):
        out[path] = f"{obj.__module__}.{obj.__qualname__}"
        for name, cell in zip(obj.__code__.co_freevars, obj.__closure__ or ()):
            try:
                value = cell.cell_contents
            except ValueError:  # an empty cell
                continue
            _hyper(value, f"{path}.{name}", out, seen, depth + 1)
        if obj.__defaults__:
            _hyper(obj.__defaults__, f"{path}.defaults", out, seen, depth + 1)
    elif hasattr(obj, "__dict__") and not callable(getattr(obj, "__self__", None)):
        out[path] = type(obj).__qualname__
        for k, v in sorted(vars(obj).items()):
            _hyper(v, f"{path}.{k}", out, seen, depth + 1)


def _name(fn: Any) -> str:
    """A function by its name (a partial with its plain arguments), not by what it closes
    over: a loss may read the rank, or a device, that differs between ranks on purpose."""
    if isinstance(fn, functools.partial):
        plain = (bool, int, float, str, type(None))
        args = [repr(a) for a in fn.args if isinstance(a, plain)]
        args += [f"{k}={v!r}" for k, v in sorted(fn.keywords.items()) if isinstance(v, plain)]
        return f"partial({_name(fn.func)}{''.join(', ' + a for a in args)})"
    return f"{getattr(fn, '__module__', '')}.{getattr(fn, '__qualname__', type(fn).__qualname__)}"


def settings(step: Any) -> dict[str, str]:
    """What must be the same on every rank of a step, by name."""
    opt = step.optimizer
    out: dict[str, str] = {
        "mesh": repr(step.mesh), "precision": repr(step.policy), "accumulation": repr(step.accumulation),
        "clip": repr(step.clip), "check_finite": repr(step.check_finite), "on_nonfinite": repr(step.on_nonfinite),
        "donate": repr(step.donate), "seed": repr(step.seed), "blocks": repr(step.blocks), "remat": repr(step.remat),
        "bucket_elems": repr(step.bucket_elems), "batch_spec": repr(step.batch_spec),
        "param_specs": repr(step.param_specs),
        "compile": repr(step.compile_backend if step.compiling else False),
    }
    if optim.get_lr_schedule(opt) is not None:
        lrs = [float(optim.get_lr(opt, s)) for s in _LR_STEPS]
        out["learning rate"] = repr(lrs[0]) if len(set(lrs)) == 1 else \
            ", ".join(f"{lr!r} at step {s}" for s, lr in zip(_LR_STEPS, lrs))
    hyper: dict[str, str] = {"loss_fn": _name(step.loss_fn)}
    _hyper(opt, "optimizer", hyper, set())
    out.update(hyper)
    # Addresses differ between processes: not part of what must agree.
    return {k: _ADDRESS.sub("", v) for k, v in out.items()}


def _leaf(x: Any) -> tuple[str, int]:
    """A leaf's shape and dtype, and a CRC of a sample of its values (evenly spaced)."""
    if not isinstance(x, torch.Tensor):
        return repr(x), _crc(repr(x))
    flat = x.detach().reshape(-1)
    n = flat.numel()
    if n > _SAMPLE:
        flat = flat[:: n // _SAMPLE][:_SAMPLE]
    data = flat.contiguous().cpu()
    return f"{tuple(x.shape)} {x.dtype}", zlib.crc32(data.view(torch.uint8).numpy().tobytes())


def _batch(batch: Any) -> tuple[dict[str, str], int, int]:
    """The batch's leaves by path (shape and dtype), a CRC of that, and a CRC of samples of
    the values."""
    paths, leaves, tdef = _tree.tree_flatten_with_paths(batch)
    shapes, content = {}, 0
    for p, x in zip(paths, leaves):
        shapes[f"batch.{p}" if p else "batch"], crc = _leaf(x)
        content = zlib.crc32(crc.to_bytes(4, "little"), content)
    return shapes, _crc(repr(tdef) + repr(sorted(shapes.items()))), content


def agree(step: Any, state: Any, batch: Any) -> None:
    """Raise on every rank unless every rank calls the same step (same settings) at the same
    step count with the same global batch (structure, shapes, dtypes and values)."""
    if _shm._checks() == "off" or not comm.is_initialized() or dist.get_world_size() == 1:
        return
    # The settings are fixed when the step is built (but for its bucket size): computed once.
    mine = step.__dict__.get("_agree_settings")
    if mine is None or mine[2] != step.bucket_elems:
        table = settings(step)
        mine = step.__dict__["_agree_settings"] = (table, _crc(repr(sorted(table.items()))), step.bucket_elems)
    count = int(state.step)
    shapes, structure, content = _batch(batch)
    words = torch.tensor([mine[1], count, structure, content], dtype=torch.int64,
                         device="cuda" if comm.default_device_type() == "cuda" else "cpu")
    g = comm.axis_group(step.mesh, step.mesh.axis_names)
    try:
        rows = _shm.gather_check(words, g).tolist()
    except RuntimeError as e:  # a rank that died, timed out or ran other collectives: say which step
        raise RuntimeError(f"train_step: step {count + 1} on rank {dist.get_rank()}: {e}") from e
    if all(r == rows[0] for r in rows):
        return
    # Every rank saw the same rows: all of them are here, to tell each other what differs.
    views: list = [None] * dist.get_world_size()
    dist.all_gather_object(views, (mine[0], count, shapes, content))
    raise RuntimeError(_differences(views, _shm._caller()))


def any_rank(mesh: Any, flag: bool) -> bool:
    """Whether ``flag`` holds on any rank of ``mesh``: one word from every rank, exchanged
    as ``agree``'s are (a check of the step's own over shared memory where the ranks have
    it, not one of the program's collectives: out of its manifest, timelines and byte
    counts)."""
    words = torch.tensor([int(flag)], dtype=torch.int64, device="cuda" if comm.default_device_type() == "cuda" else "cpu")
    return bool(_shm.gather_check(words, comm.axis_group(mesh, mesh.axis_names)).any())


def _differences(views: list, where: str) -> str:
    lines = []
    settings_of = [v[0] for v in views]
    for key in sorted(set().union(*settings_of), key=lambda k: (k != "learning rate", k)):
        vals = [s.get(key, "(none)") for s in settings_of]
        if len(set(vals)) > 1:
            lines.append(f"  {key}: " + ", ".join(f"rank {r} has {v}" for r, v in enumerate(vals)))
    counts = [v[1] for v in views]
    if len(set(counts)) > 1:
        lines.append("  steps taken (state.step): " + ", ".join(f"rank {r}: {c}" for r, c in enumerate(counts)))
    shape_of = [v[2] for v in views]
    for key in sorted(set().union(*shape_of)):
        vals = [s.get(key, "(absent)") for s in shape_of]
        if len(set(vals)) > 1:
            lines.append(f"  {key}: " + ", ".join(f"rank {r} has {v}" for r, v in enumerate(vals)))
    contents = [v[3] for v in views]
    if len(set(contents)) > 1 and len({repr(s) for s in shape_of}) == 1:
        groups: dict[int, list[int]] = {}
        for r, c in enumerate(contents):
            groups.setdefault(c, []).append(r)
        lines.append("  the global batch's values (same shapes): " + " / ".join(
            f"rank{'s' if len(rs) > 1 else ''} {', '.join(map(str, rs))}" for rs in groups.values())
            + " passed different batches")
    return (f"train_step: the ranks are not running the same step (called at {where}):\n" + "\n".join(lines)
            + "\nEvery rank must build the step alike (loss, optimizer and learning rate, precision, clipping, "
              "specs) and call it with the same global batch at the same step: look for settings or data that "
              "depend on the rank, or a rank that skipped or repeated a step")


@contextlib.contextmanager
def saving(what: str, step_count: int, directory: Any, distributed: bool) -> Iterator[None]:
    """Around ``step.save`` / ``step.save_async``: a failed collective of the save (on real
    ranks) raised as ``save_error`` says it, anything else as it is."""
    try:
        yield
    except (RuntimeError, ValueError) as e:  # ValueError: the checkpoint's CheckpointError
        err = save_error(what, step_count, directory, e) if distributed else None
        if err is None:
            raise
        raise err from e


def save_error(what: str, step_count: int, directory: Any, e: BaseException) -> RuntimeError | None:
    """A failure of torch.distributed inside ``step.save`` / ``step.save_async``: which save,
    which ranks exited (found from their processes), and what to do. None for an error
    that is not the process group's (raised as it is)."""
    if not isinstance(e, RuntimeError):  # the checkpoint's own account of a failed collective
        e = e.__cause__
        if e is None:
            return None
    why = _peers.why_failed(e, f"train_step.{what}")
    if why is None:
        return None
    me = dist.get_rank()
    return RuntimeError(
        f"train_step.{what}: saving the state after step {step_count} to {directory} failed on rank {me}: {why}. "
        f"This checkpoint was not written (an unfinished {directory}.tmp-* "
        "directory may remain; it is never loaded) and the earlier ones are untouched: restart every rank and "
        "resume from the last complete checkpoint")
