"""Steps skipped for non-finite numbers, counted in the state (run on gloo ranks by
test_step_guards)."""

from __future__ import annotations

import nonfinite_cases as N
import torch


def run_skips(mesh: dict, directory: str | None = None) -> dict:
    """good, bad (skipped), good, bad (skipped) on ``mesh``; then, with ``directory``, the
    state saved and loaded by a new step object."""
    step = N.make_step(mesh, donate=False, on_nonfinite="skip")
    good, bad = N.batches()
    state = step.init(N.params())
    skipped, steps = [], []
    for b in (good, bad, good, bad):
        state, m = step(state, b)
        skipped.append(int(m["skipped"]))
        steps.append(int(state.step))
    out = {"skipped": skipped, "steps": steps, "state_skipped": int(state.skipped),
           "w": step.params(state)["w"].clone()}
    if directory is not None:
        step.save(state, directory, overwrite=True)
        again = N.make_step(mesh, donate=False, on_nonfinite="skip")
        loaded = again.load(directory)
        out["loaded_skipped"] = int(loaded.skipped)
        loaded, m = again(loaded, bad)
        out["after_load"] = (int(loaded.skipped), int(m["skipped"]), int(loaded.step))
    return out


def gloo_skips(directory: str) -> dict:
    import torch.distributed as dist

    out = run_skips({"data": dist.get_world_size()}, directory)
    out["rank"] = dist.get_rank()
    out["w"] = out["w"].tolist()
    return out


def unchanged(a: dict, b: dict) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a.values(), b.values(), strict=True))
