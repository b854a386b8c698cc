"""A training run's state (``TrainState``) and how a step reads one back from a checkpoint
(``load_state``: whatever mesh and placement it was saved from; a checkpoint written before
the state counted skipped steps reads 0)."""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from fsharded import _tree, checkpoint
from fsharded.checkpoint import _structure as _ckpt_structure
from fsharded.step import _trainable as T
from fsharded.step._checks import _check_param_leaves

__all__ = ["TrainState", "counted", "load_state"]


class TrainState(NamedTuple):
    """Everything a training run carries from step to step."""

    step: torch.Tensor  # int64 0-d: optimizer steps taken (skipped fp16 steps included)
    params: Any  # master weights, laid out by the step's param_specs
    opt_state: Any
    loss_scale: Any  # precision.LossScaleState, or None without loss scaling
    rng: Any = None  # fs.random key (int64 (2,)) random ops in the loss draw from, or None
    model_state: Any = None  # state the model reads but does not differentiate (update_model_state)
    # None: every parameter leaf trains; else a bool tensor, one entry per leaf (flatten
    # order), False for the frozen ones (train_step's trainable=).
    trainable: Any = None
    # int64 0-d: steps not applied for a non-finite loss or gradients (on_nonfinite="skip");
    # fp16's overflows are counted by the loss scale (loss_scale.skipped). None reads as 0
    # (a state made without it: the step starts counting from 0).
    skipped: Any = None


def counted(state: TrainState) -> TrainState:
    """``state`` with its ``skipped`` counter (0 for a state made without one)."""
    return state if state.skipped is not None else state._replace(skipped=torch.zeros((), dtype=torch.int64))


def load_state(step: Any, directory: Any, like: Any = None) -> TrainState:
    """``TrainStep.load``: the state saved at ``directory`` laid out for ``step``."""
    ms = checkpoint.tree_like(directory, "model_state") \
        if step.update_model_state is not None and (like is None or not isinstance(like, TrainState)) else None
    was = T.saved(directory)  # the leaves it trained
    if like is None:  # without another say (trainable=), the checkpoint's own record
        mask = was if step.trainable is None and was is not None else None
        like = _ckpt_structure.template(checkpoint.read_manifest(directory), directory, "params",
                                        lambda p: step._init(p, ms, mask=mask),
                                        "step.load(directory, like=params)")
    elif not isinstance(like, TrainState):  # the parameters as a template: meta tensors will do
        _check_param_leaves(like, meta_ok=True)
        like = step._init(like, ms)
    bad = T.disagree(_tree.tree_flatten_with_paths(like.params)[0], step._mask(like), was)
    if bad:
        raise ValueError(
            f"train_step.load: {directory} was saved training other parameters than this step "
            f"trains:\n" + "\n".join(bad[:8]) + ("\n  ..." if len(bad) > 8 else "")
            + "\nGive the step the checkpoint's choice (train_step(..., trainable=...), or "
              "the module's requires_grad flags), or start the optimizer anew from its weights: "
              "state = train_step(...).load(directory) (its own record of what trained), then "
              "train_step(..., trainable=<what trains now>).init(that_step.params(state))")
    like = counted(like)
    if not any(e["path"] == "skipped" for e in checkpoint.read_manifest(directory)["leaves"]):
        # Saved before the state counted skipped steps: none were (the count starts here).
        old = like._replace(skipped=None)
        state = counted(checkpoint.load(directory, old, step.state_specs(old), step.mesh, owners=step._owners(old)))
    else:
        state = checkpoint.load(directory, like, step.state_specs(like), step.mesh, owners=step._owners(like))
    return step._tiered(state)

