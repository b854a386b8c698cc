"""What ``fsharded train`` keeps of a run across ``--resume``: the job record saved in each
checkpoint (the learning-rate schedule and the global batch), the check that a resumed
run keeps them, and the metrics file continued in place.

A checkpoint holds the training state; the schedule and the batch live in the flags, so
a resume with other flags would continue the state under another schedule (``--steps``
also sets the schedule's length) or another global batch (``--mesh`` sets the number of
batch shards) without a word. ``job.json`` beside the state records both; a resume whose
flags give others is refused, naming the flag that keeps them and ``--resume-changes``
that changes them deliberately.
"""

from __future__ import annotations

import contextlib
import inspect
import json
import os
import warnings
import zlib
from collections.abc import Collection
from typing import IO, Any

import torch

from fsharded import optim
from fsharded.tools.data import encoding

JOB_FILE = "job.json"
RESUME_CHANGES = ("schedule", "batch")
# The parameter that is a schedule's length (what --schedule-steps and --steps set).
LENGTH_PARAM = {"WarmupCosineLR": "total_num_steps", "WarmupDecayLR": "total_num_steps", "linear": "total_steps"}


# -- the schedule, as data --------------------------------------------------------------------


def schedule_record(cfg: Any) -> dict:
    """The learning-rate schedule ``cfg`` runs, every parameter resolved (the schedule's
    own defaults and ``optimizer.lr`` where the schedule reads it), so that two configs
    with the same record run the same schedule: ``{"name": ..., "params": {...}}``."""
    name, params, lr = cfg.scheduler.name, dict(cfg.scheduler.params), cfg.optimizer.lr
    if name == "constant":
        return {"name": name, "params": {"lr": lr}}
    if name == "linear":
        return {"name": name, "params": {"lr": lr, "final_lr": params.get("final_lr", 0.0),
                                         "total_steps": params.get("total_steps", cfg.steps)}}
    if name == "WarmupCosineLR":
        params["lr"] = lr
    elif name in ("WarmupLR", "WarmupDecayLR"):
        params.setdefault("warmup_max_lr", lr)
    for p in inspect.signature(getattr(optim, name)).parameters.values():
        if p.default is not inspect.Parameter.empty:
            params.setdefault(p.name, p.default)
    return {"name": name, "params": dict(sorted(params.items()))}


def lr_schedule(record: dict) -> Any:
    """The ``fsharded.optim`` schedule a ``schedule_record`` describes."""
    name, p = record["name"], dict(record["params"])
    if name == "constant":
        return optim.constant(p["lr"])
    if name == "linear":
        return optim.linear(p["lr"], p["final_lr"], p["total_steps"])
    return getattr(optim, name)(**p)


def _describe(record: dict) -> str:
    return f"{record['name']}({', '.join(f'{k}={v!r}' for k, v in record['params'].items())})"


def _length(old: dict, new: dict) -> int | None:
    """The ``--schedule-steps`` that turns ``new`` back into ``old`` when only the length
    differs (and the warmup derived from it, a tenth, as the job's schedules derive it)."""
    key = LENGTH_PARAM.get(old["name"])
    if key is None or old["name"] != new["name"]:
        return None
    n = old["params"][key]
    differ = {k for k in set(old["params"]) | set(new["params"]) if old["params"].get(k) != new["params"].get(k)}
    if differ == {key} or (differ == {key, "warmup_num_steps"} and old["params"].get("warmup_num_steps") == max(1, n // 10)):
        return n
    return None


# -- the record in a checkpoint ---------------------------------------------------------------


def job_record(cfg: Any, step: int, model: Any = None) -> dict:
    """What a checkpoint at ``step`` records of the run that saved it: the schedule and
    batch (for resuming), and the model's config and the data's encoding (``"bytes"`` for
    text, None for token files), from which ``fsharded generate`` rebuilds the model."""
    rec = {"step": int(step), "steps": cfg.steps, "schedule": schedule_record(cfg),
           "global_batch": cfg.train_batch_size, "micro_batch_size": cfg.micro_batch_size,
           "grad_accum_steps": cfg.grad_accum_steps, "data_parallel_size": cfg.data_parallel_size,
           "mesh": dict(cfg.mesh)}
    if model is not None:
        rec.update(model=model.to_dict(), data=str(cfg.data), encoding=encoding(cfg.data))
    return rec


def _crc(record: dict) -> int:
    """A checksum of a job record (of its canonical JSON), kept in the file beside it."""
    return zlib.crc32(json.dumps(record, sort_keys=True).encode())


def write_job(checkpoint: str, record: dict) -> None:
    """``checkpoint/job.json``, whole or not at all (a temporary file renamed over it). A
    checkpoint pruned meanwhile is skipped."""
    if not os.path.isdir(checkpoint):
        return
    path = os.path.join(checkpoint, JOB_FILE)
    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        with open(tmp, "w") as f:
            json.dump({**record, "crc32": _crc(record)}, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except FileNotFoundError:  # pruned between the check and the write
        with contextlib.suppress(OSError):
            os.remove(tmp)


def read_job(checkpoint: str) -> dict | None:
    """The job record of ``checkpoint``: its own, or (a save interrupted before its record
    was written) the newest one of an earlier checkpoint of the same directory, which the
    same run wrote; None for checkpoints without any (saved by ``step.save``, or before
    fsharded train recorded its job)."""
    def load(d: str) -> dict | None:
        try:
            with open(os.path.join(d, JOB_FILE)) as f:
                rec = json.load(f)
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as e:
            raise ValueError(f"--resume: {os.path.join(d, JOB_FILE)} cannot be read ({e}); it records "
                             f"the run's schedule and batch: remove it to resume without that check") from None
        if not isinstance(rec, dict):
            return None
        crc = rec.pop("crc32", None)
        if crc is not None and crc != _crc(rec):
            raise ValueError(f"--resume: {os.path.join(d, JOB_FILE)} does not match its checksum: it was "
                             f"edited or damaged. It records the run's schedule and global batch: restore "
                             f"it, or remove it to resume without that check (the flags given then decide)")
        return rec

    own = load(checkpoint)
    if own is not None:
        return own
    root, name = os.path.split(os.path.abspath(checkpoint))
    if not (name.startswith("step-") and name[5:].isdigit()) or not os.path.isdir(root):
        return None
    earlier = sorted((int(n[5:]), n) for n in os.listdir(root)
                     if n.startswith("step-") and n[5:].isdigit() and int(n[5:]) < int(name[5:]))
    for _, n in reversed(earlier):
        rec = load(os.path.join(root, n))
        if rec is not None:
            return rec
    return None


def _same_rates(old: dict, new: dict, start: int, steps: int) -> bool:
    """Whether two schedules give the same learning rate to every update the resumed run
    makes (updates ``start`` to ``steps - 1``): parameters that differ only where the run
    has passed (a warmup already over) change nothing."""
    if steps <= start:
        return True
    try:
        at = torch.arange(start, steps)
        a, b = (optim.get_lr(lr_schedule(r), at) for r in (old, new))
        return a.shape == b.shape and bool(torch.equal(a, b))
    except Exception:  # noqa: BLE001 - a schedule that cannot be compared counts as changed
        return False


def check_resume(cfg: Any, checkpoint: str, allow: Collection[str] = ()) -> int | None:
    """Refuse a resume from ``checkpoint`` whose flags change the schedule or the global
    batch the checkpoint's run trained with (``allow``: what may change, deliberately).
    Returns the checkpoint's step as its record gives it (None without a record)."""
    rec = read_job(checkpoint)
    if rec is None:
        warnings.warn(f"fsharded train: --resume: {checkpoint} carries no record of its run's schedule and "
                      f"global batch ({JOB_FILE}: saved by step.save, or by an older fsharded train), so "
                      f"they are not checked: the flags given now decide them", stacklevel=2)
        return None
    name = os.path.basename(os.path.abspath(checkpoint))  # an earlier checkpoint's record: this one's step
    start = int(name[5:]) if name.startswith("step-") and name[5:].isdigit() else int(rec.get("step", 0))
    errors = []
    old, new = rec.get("schedule"), schedule_record(cfg)
    if old is not None and old != new and "schedule" not in allow and not _same_rates(old, new, start, cfg.steps):
        changed = ", ".join(f"{k} {old['params'].get(k)!r} -> {new['params'].get(k)!r}"
                            for k in sorted(set(old["params"]) | set(new["params"]))
                            if old["params"].get(k) != new["params"].get(k)) if old["name"] == new["name"] \
            else f"{old['name']} -> {new['name']}"
        try:
            then, now = (float(optim.get_lr(lr_schedule(r), start)) for r in (old, new))
            jump = f"; the learning rate of step {start + 1} would be {now:.3g} instead of {then:.3g}"
        except Exception:  # noqa: BLE001 - only the message's illustration
            jump = ""
        keep = f"--schedule-steps {_length(old, new)}" if _length(old, new) is not None else \
            "the flags that give the checkpoint's schedule (--schedule, --lr, --schedule-steps, --set scheduler.params.*)"
        errors.append(
            f"the learning-rate schedule changes ({changed}; --steps {cfg.steps} also sets the schedule's "
            f"length unless --schedule-steps is given){jump}. The checkpoint's run: {_describe(old)}. "
            f"To continue it, pass {keep}; to change it from step {start + 1} on, pass --resume-changes schedule")
    g_old = rec.get("global_batch")
    if g_old is not None and g_old != cfg.train_batch_size and "batch" not in allow:
        accum, dp = cfg.grad_accum_steps, cfg.data_parallel_size
        keep = f"--batch {g_old // (accum * dp)} (rows a batch shard on this mesh)" if g_old % (accum * dp) == 0 \
            else f"a --batch and --accum whose product times the {dp} batch shard(s) is {g_old}"
        errors.append(
            f"the global batch changes from {g_old} rows ({rec.get('micro_batch_size')} a batch shard x "
            f"{rec.get('grad_accum_steps')} accumulated x {rec.get('data_parallel_size')} shards, mesh "
            f"{rec.get('mesh')}) to {cfg.train_batch_size} ({cfg.micro_batch_size} x {accum} x {dp}, mesh "
            f"{dict(cfg.mesh)}): the data order and the gradients' average would change. To keep it, pass "
            f"{keep}; to change it deliberately, pass --resume-changes batch")
    if errors:
        raise ValueError(f"--resume: {checkpoint} was saved by a run these flags would change:\n"
                         + "\n".join(f"  {e}" for e in errors))
    return start


# -- the metrics file -------------------------------------------------------------------------


def open_metrics(path: str, *, resumed_at: int | None) -> IO[str]:
    """The metrics file, line-buffered (a killed run keeps every record but the one being
    written). A new run (``resumed_at`` None) starts it afresh; a resumed one keeps the
    records up to the step it resumes at and appends after them: records past that step
    (the lost part of an interrupted run, trained again now) are dropped by writing the
    kept lines to a temporary file renamed over the old one, never by truncating it."""
    if resumed_at is None:
        return open(path, "w", buffering=1)  # noqa: SIM115 - closed by the train loop
    try:
        with open(path) as f:
            text = f.read()
    except FileNotFoundError:
        text = ""
    lines = text.split("\n")
    tail = lines.pop()  # "" after a final newline; else a record cut short by a kill
    kept = [line for line in lines if not _past(line, resumed_at)]
    if len(kept) != len(lines) or tail:
        tmp = f"{path}.tmp-{os.getpid()}"
        with open(tmp, "w") as f:
            f.writelines(line + "\n" for line in kept)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    return open(path, "a", buffering=1)  # noqa: SIM115 - closed by the train loop


def _past(line: str, step: int) -> bool:
    """A metrics record of a step after ``step`` (lines that are not records are kept)."""
    try:
        rec = json.loads(line)
    except ValueError:
        return False
    n = rec.get("step") if isinstance(rec, dict) else None
    return isinstance(n, int) and n > step
