"""The training step: ``train_step`` builds a ``TrainStep`` from small pieces chosen once
(``_gradients``: how gradients are computed and reduced, from the pieces beside it:
``_layout``'s spec-derived moves of each leaf, ``_differentiate``, ``_reduce``,
``_grad_plain``, ``_grad_accumulate``, ``_grad_blocks``; ``_scaling``: loss scaling;
``_transform``: unscale, the mesh-aware norm and the clipping factor; ``_update``: the
update; ``_guards``: what a non-finite step does; ``_batch``: what it reads of a batch;
``_model_state``: a model state beside the parameters), over the state it carries
(``_state``), with the checks that guard it (``_checks``, ``_memory_guard``, ``_agree``
across ranks) and the choice of which leaves train (``_trainable``).

>>> step = fs.train_step(gpt.loss, fs.optim.adamw(3e-4), mesh=fs.Mesh({"data": 2}),
...                      param_specs=P(), batch_spec=P("data"), precision="bf16", clip=1.0)
>>> state = step.init(params)
>>> state, metrics = step(state, batch)
"""

from fsharded.step._builder import TrainState, TrainStep, train_step

# The public path, which a checkpoint's structure record names (the module it is defined in
# may move).
TrainState.__module__ = __name__

__all__ = ["TrainState", "TrainStep", "train_step"]
