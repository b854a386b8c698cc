"""Pipeline executor cases run on gloo ranks (``fsharded.testing.run_on_ranks``)."""

from __future__ import annotations

import optree
import torch
import torch.distributed as dist

from fsharded.models import gpt, gpt_plans, gpt_stages
from fsharded.parallel import pipeline as pp


def setup(layers: int = 4, batch: int = 8, seed: int = 0, **cfg):
    """The tiny GPT, its parameters and a batch: the same on every rank and in the test."""
    config = gpt.GPTConfig.tiny(n_layers=layers, **cfg)
    params = gpt.init(config, seed)
    g = torch.Generator().manual_seed(seed + 1)
    tokens = torch.randint(0, config.vocab_size, (batch, config.seq_len + 1), generator=g)
    return params, tokens


def micro_batches(tokens: torch.Tensor, m: int) -> list[dict]:
    return [{"tokens": t} for t in tokens.chunk(m)]


def leaves_requiring_grad(tree):
    return optree.tree_map(lambda t: t.detach().clone().requires_grad_(), tree)


def run_rank(name: str, p: int, v: int, m: int, untied: bool = False) -> dict:
    """This rank's part of a pipelined gradient: its stages' gradients and, on the last
    stage's rank, the loss."""
    params, tokens = setup(tied_embeddings=False) if untied else setup()
    sched = pp.make(name, p, m, v)
    stages = gpt_stages.pipeline_stages(params, p * v, attention="einsum")
    me = dist.get_rank()
    mine = [s for s in range(stages.n) if sched.rank_of(s) == me]
    parts = {s: leaves_requiring_grad(stages.params_of(params, s)) for s in mine}
    res = pp.run(sched, stages, parts, micro_batches(tokens, m), ranks=[me],
                 transport=pp.PointToPoint(dist.group.WORLD, list(range(dist.get_world_size())), m))
    return {"grads": {s: optree.tree_map(torch.Tensor.detach, g) for s, g in res.grads.items()},
            "loss": None if res.loss is None else res.loss.detach(), "peak": res.peak_held[me]}


def tracked_rank(name: str, p: int, m: int, rows: int = 2, layers: int = 4) -> dict:
    """This rank's part of a pipelined gradient on ``m`` micro-batches of ``rows`` rows under
    the memory tracker: the peak bytes of live activations it saw, and the peak number of
    micro-batches the executor held."""
    import fsharded as fs
    params, tokens = setup(layers=layers, batch=rows * m)
    sched = pp.make(name, p, m)
    stages = gpt_stages.pipeline_stages(params, p, attention="einsum")
    me = dist.get_rank()
    parts = {me: leaves_requiring_grad(stages.params_of(params, me))}
    transport = pp.PointToPoint(dist.group.WORLD, list(range(p)), m)
    with fs.memory.track() as mem:
        res = pp.run(sched, stages, parts, micro_batches(tokens, m), ranks=[me], transport=transport)
        del res.grads
    return {"activations": mem.peak_of(["activations"]), "held": res.peak_held[me]}


def reference_step(clip: float | None = None):
    import fsharded as fs
    return fs.train_step(lambda p, b: gpt.loss(p, b, attention="einsum"), fs.optim.adamw(1e-2),
                         mesh=fs.Mesh({"data": 1}), clip=clip)


# Training compares parameters after Adam steps: without biases, whose key bias has a
# gradient of zero up to rounding, which Adam turns into steps of the learning rate.
TRAIN_CFG = {"bias": False}


def train(mesh_axes: dict, name: str, v: int, steps: int, m: int = 2, zero: int = 0, layers: int = 4,
          batch: int = 8, tensor: bool = False, manifest: bool = False, reshard: bool | None = None,
          remat=None, compile: bool | str = False, **cfg) -> dict:  # noqa: A002
    """``steps`` steps of the tiny GPT pipelined over ``pipe`` (on the virtual mesh, or on
    this process's rank under torch.distributed): the losses, and the parameters after;
    ``manifest``: also the step's collectives, as (op, axis) pairs in order; ``reshard``:
    ZeRO-3's ``reshard_after_forward``; ``remat``: the step's remat policy; ``compile``:
    the step's (a torch.compile backend's name, or True for Inductor)."""
    import fsharded as fs
    cfg = {**TRAIN_CFG, **cfg}
    params, tokens = setup(layers=layers, batch=batch, **cfg)
    mesh = fs.Mesh(mesh_axes)
    stages = gpt_stages.pipeline_stages(params, mesh.shape["pipe"] * v, attention="einsum")
    loss = pp.pipelined(stages, schedule=name, microbatches=m, virtual=v)
    specs = gpt_plans.tensor_parallel_specs(params) if tensor else None
    specs = fs.parallel.zero(zero, axis="data", min_size=8, reshard_after_forward=reshard)(specs, params) \
        if zero else specs
    kw = {"param_specs": specs} if specs is not None else {}
    step = fs.train_step(loss, fs.optim.adamw(1e-2), mesh=mesh, remat=remat, compile=compile, **kw)
    kept: list = []
    out = _steps(step, params, tokens, steps, state=kept)
    out["compiles"] = step.compiles
    if manifest:
        out["manifest"] = [(e.op, e.axis) for e in step.collectives(kept[0], {"tokens": tokens})]
    return out


def train_reference(steps: int, layers: int = 4, batch: int = 8, clip: float | None = None, **cfg) -> dict:
    params, tokens = setup(layers=layers, batch=batch, **{**TRAIN_CFG, **cfg})
    return _steps(reference_step(clip), params, tokens, steps)


def _steps(step, params, tokens: torch.Tensor, steps: int, state: list | None = None) -> dict:
    """``steps`` steps on the batch rolled by the step number: the losses, the gradient
    norms and the parameters after (and the state, appended to ``state`` where given)."""
    st = step.init(params)
    losses, norms = [], []
    for i in range(steps):
        st, metrics = step(st, {"tokens": tokens.roll(i, 0)})
        losses.append(float(metrics["loss"]))
        norms.append(float(metrics["grad_norm"]))
    if state is not None:
        state.append(st)
    return {"losses": losses, "norms": norms, "params": step.params(st)}


def train_mixed(mesh_axes: dict | None, name: str, steps: int, precision: str, *, power: int = 16,
                trainable=None, m: int = 2, v: int = 1, stored: bool = False, zero: int = 0,
                reshard: bool | None = None, compile: bool | str = False, **cfg) -> dict:  # noqa: A002
    """``steps`` steps in ``precision`` (fp16: dynamic loss scaling from ``2**power``),
    pipelined over ``pipe`` on ``mesh_axes`` (``zero``: that ZeRO stage over ``data``,
    ``reshard``: ZeRO-3's ``reshard_after_forward``); or,
    with ``mesh_axes`` None, the uncut GPT on one device accumulating over the same ``m``
    micro-batches (``compile``: the step's). The losses, loss scales and skipped steps, and
    the parameters after."""
    import fsharded as fs
    from fsharded.precision import DynamicLossScale, Policy
    params, tokens = setup(**{**TRAIN_CFG, **cfg})
    policy = Policy.fp16(loss_scale=DynamicLossScale(initial_scale_power=power, loss_scale_window=2)) \
        if precision == "fp16" else precision
    if mesh_axes is None:
        mesh, loss, acc = fs.Mesh({"data": 1}), lambda p, b: gpt.loss(p, b, attention="einsum"), m
    else:
        mesh, acc = fs.Mesh(mesh_axes), 1
        loss = pp.pipelined(gpt_stages.pipeline_stages(params, mesh.shape["pipe"] * v, attention="einsum"),
                            schedule=name, microbatches=m, virtual=v)
    specs = {"param_specs": fs.parallel.zero(zero, axis="data", min_size=8, reshard_after_forward=reshard)(
        None, params)} if zero else {}
    step = fs.train_step(loss, fs.optim.adamw(1e-2), mesh=mesh, precision=policy, accumulation=acc,
                         trainable=trainable, compile=compile, **specs)
    state = step.init(params)
    out = {"losses": [], "scales": [], "skipped": []}
    for i in range(steps):
        state, metrics = step(state, {"tokens": tokens.roll(i, 0)})
        out["losses"].append(float(metrics["loss"]))
        out["scales"].append(float(metrics["loss_scale"]))
        out["skipped"].append(int(metrics["skipped"]))
    if stored:  # what this rank stores, and the whole parameters' bytes
        out.update(param_bytes=stored_bytes(state.params), opt_bytes=stored_bytes(state.opt_state),
                   full_bytes=sum(x.numel() * x.element_size() for x in optree.tree_leaves(params)))
    out["params"] = step.params(state)
    return out


def train_saving(mesh_axes: dict, name: str, steps: int, directory: str, *, load: str | None = None,
                 start: int = 0, zero: int = 0, pipelined_run: bool = True, in_background: bool = False) -> list[float]:
    """Train ``steps`` steps from step ``start`` (from the checkpoint ``load`` if given) and
    save to ``directory`` (``in_background``: with ``save_async``): pipelined over ``pipe``
    or, without it, the plain GPT."""
    import fsharded as fs
    params, tokens = setup(**TRAIN_CFG)
    mesh = fs.Mesh(mesh_axes)
    if pipelined_run:
        loss = pp.pipelined(gpt_stages.pipeline_stages(params, mesh.shape["pipe"], attention="einsum"),
                            schedule=name, microbatches=2)
    else:
        loss = lambda p, b: gpt.loss(p, b, attention="einsum")  # noqa: E731
    specs = fs.parallel.zero(zero, axis="data", min_size=8)(None, params) if zero else None
    step = fs.train_step(loss, fs.optim.adamw(1e-2), mesh=mesh, **({"param_specs": specs} if specs else {}))
    state = step.load(load, params) if load else step.init(params)
    losses = []
    for i in range(start, start + steps):
        state, metrics = step(state, {"tokens": tokens.roll(i, 0)})
        losses.append(float(metrics["loss"]))
    if in_background:
        step.save_async(state, directory).wait()
    else:
        step.save(state, directory)
    return losses


# -- Hugging Face models through fs.nn ----------------------------------------------------------

def gloo_remat(world: int) -> dict:
    """On each rank: the pipelined GPT (and ZeRO-3 per block beside it) with remat policies."""
    out = {}
    for policy in (None, "blocks", "blocks:2,offload"):
        out[("pipe", policy)] = train({"pipe": world}, "1f1b", 1, 3, remat=policy)
    return out


def hf_loss(fm, p, b):
    return fm.apply(p, input_ids=b["input_ids"], labels=b["input_ids"]).loss


def hf_train(kind: str, mesh_axes: dict, name: str, steps: int, layers: int = 4, v: int = 1,
             dropout: float = 0.0, remat=None) -> dict:
    """``steps`` steps of a tiny Hugging Face model (``model_zoo.hf_llama`` / ``hf_gpt2``) cut
    by ``fs.nn.pipeline_stages`` over ``pipe`` (without a pipe axis: accumulated over the
    same 2 micro-batches); ``dropout``: GPT-2's three dropout rates."""
    import model_zoo

    import fsharded as fs
    drop = dict(resid_pdrop=dropout, embd_pdrop=dropout, attn_pdrop=dropout)
    model = model_zoo.hf_llama(num_hidden_layers=layers) if kind == "llama" else \
        model_zoo.hf_gpt2(n_layer=layers, **drop)
    fm = fs.nn.functional(model)
    ids = torch.randint(0, 256, (8, 16), generator=torch.Generator().manual_seed(1))
    mesh = fs.Mesh(mesh_axes)
    if "pipe" in mesh_axes:
        stages = fs.nn.pipeline_stages(fm, mesh.shape["pipe"] * v, hf_loss, {"input_ids": ids[:2]})
        loss, accumulation = pp.pipelined(stages, schedule=name, microbatches=2, virtual=v), 1
    else:
        loss, accumulation = (lambda p, b: hf_loss(fm, p, b)), 2
    # GPT-2's attention bias holds the key bias, whose gradient is zero up to rounding, which
    # Adam would turn into steps of the learning rate: SGD for it.
    opt = fs.optim.adamw(1e-2) if kind == "llama" else fs.optim.sgd(0.5)
    step = fs.train_step(loss, opt, mesh=mesh, accumulation=accumulation, remat=remat)
    state = step.init(fm.params)
    losses = []
    for i in range(steps):
        state, metrics = step(state, {"input_ids": ids.roll(i, 0)})
        losses.append(float(metrics["loss"]))
    return {"losses": losses, "params": step.params(state)}


def p2p_shapes() -> dict:
    """One PointToPoint kept over runs of micro-batches of two shapes: the numbers stay
    those of the one-process run, and a stage whose output shape changes for the same
    micro-batch shape is an error naming it."""
    params, tokens = setup()
    st = gpt_stages.pipeline_stages(params, 2, attention="einsum")
    me = dist.get_rank()
    sched = pp.one_f_one_b(2, 2)
    p2p = pp.PointToPoint(dist.group.WORLD, [0, 1], 2)
    out = {}
    for rows in (8, 4, 8):
        micro = micro_batches(tokens[:rows], 2)
        res = pp.run(sched, st, {me: st.params_of(params, me)}, micro, ranks=[me], transport=p2p)
        local = pp.run(sched, st, {s: st.params_of(params, s) for s in range(2)}, micro)
        out[rows] = max(float((a - b).abs().max()) for a, b in zip(optree.tree_leaves(res.grads[me]),
                                                                    optree.tree_leaves(local.grads[me])))
    # the same micro-batch shape, another activation shape: refused by the sender
    try:
        if me == 0:
            p2p.send(torch.zeros(3, 3), ("act", 0, 0), 0, 1)
        out["error"] = None
    except RuntimeError as e:
        out["error"] = str(e)
    return out


# -- a model of plain Stages that draws (dropout before, inside and after its blocks) ---------

def _drop_first(p, b):
    return torch.nn.functional.dropout(p["emb"][b["tokens"][:, :-1]], 0.2)


def _drop_block(p, x):
    return x + torch.nn.functional.dropout(torch.tanh(x @ p["w"]), 0.3)


def _drop_last(p, x, b):
    x = torch.nn.functional.dropout(x, 0.1)
    return torch.nn.functional.cross_entropy((x @ p["head"]).flatten(0, 1), b["tokens"][:, 1:].flatten())


def dropout_stages_train(mesh_axes: dict, name: str, steps: int, m: int = 2) -> dict:
    """``steps`` steps of a small model written as plain ``Stages`` whose ends and blocks
    draw dropout masks: pipelined over ``pipe`` on ``mesh_axes``, or (without a pipe axis)
    its uncut loss accumulated over the same ``m`` micro-batches."""
    import fsharded as fs
    from fsharded.parallel.blocks import run_block
    g = torch.Generator().manual_seed(0)
    params = {"emb": torch.randn(32, 16, generator=g) * 0.5, "head": torch.randn(16, 32, generator=g) * 0.5,
              "blocks": [{"w": torch.randn(16, 16, generator=g) * 0.3} for _ in range(4)]}
    tokens = torch.randint(0, 32, (8, 9), generator=g)
    mesh = fs.Mesh(mesh_axes)
    if "pipe" in mesh_axes:
        n = mesh.shape["pipe"]
        st = pp.Stages(_drop_first, _drop_block, _drop_last, ("emb",), ("head",), pp.cut([1] * 4, n))
        loss, acc = pp.pipelined(st, schedule=name, microbatches=m), 1
    else:
        def loss(p, b):
            x = _drop_first(p, b)
            for bp in p["blocks"]:
                x = run_block(_drop_block, bp, x)
            return _drop_last(p, x, b)
        acc = m
    return _steps(fs.train_step(loss, fs.optim.sgd(0.5), mesh=mesh, accumulation=acc, seed=3), params, tokens,
                  steps)


def dry_peaks(name: str = "gpipe", m: int = 4) -> dict:
    """The peak a train_step's dry run measures on this rank (what its memory check
    compares with the memory available) for the GPT pipelined over 2 ranks, and the same
    dry run with every pipe rank's actions counted."""
    import contextlib

    import fsharded as fs
    from fsharded import _memory_hooks
    from fsharded.spmd import _schedule
    from fsharded.step._batch import local_batch
    params, tokens = setup(batch=16)
    stages = gpt_stages.pipeline_stages(params, 2, attention="einsum")
    step = fs.train_step(pp.pipelined(stages, schedule=name, microbatches=m), fs.optim.adamw(1e-2),
                         mesh=fs.Mesh({"pipe": 2}))
    state = step.init(params)
    sm = step._shard_mapped(state)
    batch = local_batch(sm, {"tokens": tokens})
    with torch.no_grad():
        _, mine = _schedule.dry_run(sm.local, state, batch, peak=True)
        real = _memory_hooks.paused
        _memory_hooks.paused = contextlib.nullcontext
        try:
            _, every = _schedule.dry_run(sm.local, state, batch, peak=True)
        finally:
            _memory_hooks.paused = real
    return {"mine": mine, "every": every}


def train_seq(mesh_axes: dict | None, name: str, steps: int, seq_parallel: str = "ulysses", m: int = 2) -> dict:
    """``steps`` steps of the tiny GPT with its sequence sharded over ``seq`` (``tensor`` for
    Megatron-SP), pipelined over ``pipe`` on ``mesh_axes``; with ``mesh_axes`` None, the
    uncut GPT on one device accumulating over the same ``m`` micro-batches."""
    import fsharded as fs
    params, tokens = setup(**TRAIN_CFG)
    batch = gpt.shift({"tokens": tokens})
    if mesh_axes is None:
        mesh, loss, acc, spec = fs.Mesh({"data": 1}), (lambda p, b: gpt.loss(p, b, attention="einsum")), m, None
        specs = None
    else:
        mesh, acc = fs.Mesh(mesh_axes), 1
        megatron = seq_parallel == "megatron"
        axis = "tensor" if megatron else "seq"
        stages = gpt_stages.pipeline_stages(params, mesh.shape["pipe"], attention="einsum",
                                            seq_axis=None if megatron else axis, seq_parallel=seq_parallel)
        loss = pp.pipelined(stages, schedule=name, microbatches=m)
        spec = fs.P() if megatron else fs.P(None, axis)
        specs = gpt_plans.tensor_parallel_specs(params) if megatron else None
    step = fs.train_step(loss, fs.optim.adamw(1e-2), mesh=mesh, accumulation=acc,
                         **({"batch_spec": spec} if spec is not None else {}),
                         **({"param_specs": specs} if specs is not None else {}))
    state = step.init(params)
    losses = []
    for i in range(steps):
        state, metrics = step(state, {k: v.roll(i, 0) for k, v in batch.items()})
        losses.append(float(metrics["loss"]))
    return {"losses": losses, "params": step.params(state)}


def train_moe(mesh_axes: dict, name: str, steps: int, m: int = 2, v: int = 1, biased: bool = False) -> dict:
    """``steps`` steps of the tiny GPT with mixture-of-experts blocks (their balancing and
    z-losses in the loss; the experts over ``expert`` where the mesh has it, the rows
    too), pipelined over ``pipe`` where ``mesh_axes`` has it, else uncut accumulating
    over the same ``m`` micro-batches. ``biased``: aux-loss-free balancing too, routing
    biases in the model state (the biases after are returned)."""
    import fsharded as fs
    from fsharded.models.gpt import MoEConfig
    moe = MoEConfig(experts=4, top_k=2, every=1, capacity_factor=None, aux_loss_weight=0.1, z_loss_weight=0.01,
                    bias_update_rate=0.05 if biased else None)
    params, tokens = setup(moe=moe, **TRAIN_CFG)
    mesh = fs.Mesh(mesh_axes)
    if "pipe" not in mesh_axes:
        loss, acc = (lambda p, b, *ms: gpt.loss(p, b, *ms, attention="einsum", moe=moe, metrics=True)), m
    else:
        acc = 1
        stages = gpt_stages.pipeline_stages(params, mesh.shape["pipe"] * v, attention="einsum", moe=moe)
        loss = pp.pipelined(stages, schedule=name, microbatches=m, virtual=v)
    specs = gpt_plans.expert_parallel_specs(params) if "expert" in mesh_axes else None
    # The rows over the expert axis too (expert parallelism inside data parallelism).
    kw = {"param_specs": specs, "batch_spec": fs.P("expert")} if specs is not None else {}
    if biased:
        kw["update_model_state"] = gpt.model_state_updater(moe)
    step = fs.train_step(loss, fs.optim.adamw(1e-2), mesh=mesh, accumulation=acc, **kw)
    state = step.init(params, gpt.init_model_state(params) if biased else None)
    losses, reported = [], []
    for i in range(steps):
        state, metrics = step(state, {"tokens": tokens.roll(i, 0)})
        losses.append(float(metrics["loss"]))
        reported.append({k: float(v) for k, v in metrics.items() if k.startswith(("moe_", "lm_"))})
    out = {"losses": losses, "params": step.params(state), "metrics": reported}
    if biased:
        out["biases"] = step.model_state(state)["moe_bias"]
    return out


def timed_rank(name: str, p: int, m: int, layers: int = 8, rows: int = 4, runs: int = 3) -> list:
    """This rank's measured timeline of a pipelined gradient of a GPT big enough that an
    action takes milliseconds (the last of ``runs``, after warm-up): (start, end, action)
    per compute action, seconds from the run's start, the ranks started together."""
    config = gpt.GPTConfig.tiny(n_layers=layers, d_model=128, n_heads=4, seq_len=64)
    params = gpt.init(config, 0)
    tokens = torch.randint(0, config.vocab_size, (rows * m, config.seq_len + 1), generator=torch.Generator().manual_seed(1))
    stages = gpt_stages.pipeline_stages(params, p, attention="einsum")
    sched = pp.make(name, p, m)
    me = dist.get_rank()
    transport = pp.PointToPoint(dist.group.WORLD, list(range(p)), m)
    parts = {s: leaves_requiring_grad(stages.params_of(params, s)) for s in range(stages.n) if sched.rank_of(s) == me}
    for _ in range(runs):
        dist.barrier()
        res = pp.run(sched, stages, parts, micro_batches(tokens, m), ranks=[me], transport=transport)
    return [(b, e, a) for b, e, a in res.spans[me] if a.kind not in ("SEND", "RECV")]


def stored_bytes(tree) -> int:
    """Bytes of the distinct storages under ``tree``'s tensors (a placeholder: one element)."""
    seen = {}
    for x in optree.tree_leaves(tree):
        if isinstance(x, torch.Tensor):
            seen[x.untyped_storage().data_ptr()] = x.untyped_storage().nbytes()
    return sum(seen.values())


def train_stored(mesh_axes: dict, name: str, steps: int, zero: int = 0, m: int = 2, v: int = 1,
                 clip: float | None = None, observe: bool = False, **cfg) -> dict:
    """``train``, and what this rank stores: the bytes of its parameters and optimizer
    state, and which parameter paths it holds (not placeholders); ``observe``: also the
    all-reduces it ran over shared memory, as (elements, group size)."""
    from fsharded.comm import _shm
    seen: list = []
    if observe:
        _shm.set_observer(lambda op, t, n: seen.append((t.numel(), n)) if op == "all_reduce" else None)
    try:
        out = _train_stored(mesh_axes, name, steps, zero, m, v, clip, **cfg)
    finally:
        _shm.set_observer(None)
    return {**out, "all_reduces": seen} if observe else out


def _train_stored(mesh_axes: dict, name: str, steps: int, zero: int, m: int, v: int, clip: float | None,
                  **cfg) -> dict:
    import fsharded as fs
    cfg = {**TRAIN_CFG, **cfg}
    params, tokens = setup(**cfg)
    mesh = fs.Mesh(mesh_axes)
    stages = gpt_stages.pipeline_stages(params, mesh.shape["pipe"] * v, attention="einsum")
    loss = pp.pipelined(stages, schedule=name, microbatches=m, virtual=v)
    specs = fs.parallel.zero(zero, axis="data", min_size=8)(None, params) if zero else None
    kw = {"param_specs": specs} if specs is not None else {}
    kept: list = []
    out = _steps(fs.train_step(loss, fs.optim.adamw(1e-2), mesh=mesh, clip=clip, **kw), params, tokens, steps, kept)
    (state,) = kept
    paths, leaves, _ = fs.mesh._tree.tree_flatten_with_paths(state.params)
    held = [p for p, x in zip(paths, leaves) if x.numel() <= 1 or any(s != 0 for s in x.stride())]
    return {**out, "held": held, "param_bytes": stored_bytes(state.params), "opt_bytes": stored_bytes(state.opt_state)}


def nonfinite_stage(mesh_axes: dict, on_nonfinite: str) -> str:
    """One step with a NaN in ``blocks.2.mlp.w_in`` (the second stage's), on per-stage
    storage: what the step says (``raise``) or its skipped count (``skip``)."""
    import fsharded as fs
    params, tokens = setup(**TRAIN_CFG)
    params["blocks"][2]["mlp"]["w_in"] = params["blocks"][2]["mlp"]["w_in"].clone()
    params["blocks"][2]["mlp"]["w_in"][0, 0] = float("nan")
    mesh = fs.Mesh(mesh_axes)
    loss = pp.pipelined(gpt_stages.pipeline_stages(params, mesh.shape["pipe"], attention="einsum"), microbatches=2)
    step = fs.train_step(loss, fs.optim.adamw(1e-2), mesh=mesh, on_nonfinite=on_nonfinite)
    state = step.init(params)
    try:
        state, metrics = step(state, {"tokens": tokens})
    except FloatingPointError as e:
        return str(e)
    return f"skipped {int(metrics['skipped'])}"


def saved_elsewhere(directory: str) -> str:
    """A pipelined state saved by checkpoint.save without owners (its placeholders would be
    written as zeros): the error."""
    import fsharded as fs
    params, tokens = setup(**TRAIN_CFG)
    mesh = fs.Mesh({"pipe": 2})
    loss = pp.pipelined(gpt_stages.pipeline_stages(params, 2, attention="einsum"), microbatches=2)
    step = fs.train_step(loss, fs.optim.adamw(1e-2), mesh=mesh)
    state = step.init(params)
    out = []
    for save in (lambda: fs.checkpoint.save(directory, state, step.state_specs(state), mesh),
                 lambda: fs.checkpoint.dcp_state_dict(state, step.state_specs(state), mesh)):
        try:
            save()
            out.append("saved")
        except ValueError as e:
            out.append(str(e))
    return "\n".join(out)


def zero3_weights_peak(reshard: bool | None, name: str = "1f1b", m: int = 4, layers: int = 8) -> dict:
    """One step of the tiny GPT pipelined over ``pipe`` x ZeRO-3 over ``data`` on this gloo
    rank under the memory tracker: the peak bytes of parameters it saw (stored shards and
    gathered weights), the bytes of this rank's stored shards, the collectives of the step
    as (op, axis) pairs (its manifest)."""
    import fsharded as fs
    params, tokens = setup(layers=layers, batch=4 * m, **TRAIN_CFG)
    mesh = fs.Mesh({"pipe": 2, "data": 2})
    stages = gpt_stages.pipeline_stages(params, 2, attention="einsum")
    specs = fs.parallel.zero(3, axis="data", min_size=8, reshard_after_forward=reshard)(None, params)
    step = fs.train_step(pp.pipelined(stages, schedule=name, microbatches=m), fs.optim.adamw(1e-2), mesh=mesh,
                         param_specs=specs)
    state = step.init(params)
    state, _ = step(state, {"tokens": tokens})  # (the first step's dry run, outside the tracker)
    with fs.memory.track() as mem:
        state, metrics = step(state, {"tokens": tokens})
    # (a leaf of another pipe rank's stages is a broadcast zero: its one element)
    stored = sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                  for t in optree.tree_leaves(state.params)}.values())
    ops = [(e.op, e.axis) for e in step.collectives(state, {"tokens": tokens})]
    return {"peak": mem.peak_of(["parameters"]), "stored": stored, "ops": ops, "loss": float(metrics["loss"])}
