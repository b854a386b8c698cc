"""Expert parallelism on gloo ranks: fsharded's ``moe.moe_layer`` under ``shard_map`` against
DeepSpeed's ``deepspeed.moe.layer.MoE``, with the same weights and the same tokens.

One MoE layer (GELU MLP experts, top-1 and top-2, a fixed capacity per expert), forward and
backward, the experts split over 2 ranks (one thread each), each rank routing its own
tokens. Reported per rank: median step time (slowest rank), bytes sent (ours: the
manifest recorded over the step; DeepSpeed: its all-to-alls of the ``(E, C, d)`` buffer,
computed), peak bytes the layer allocates (the memory tracker, the same for both), and how
many assignments each drops; and how far the two outputs are apart. ``--model gpt``: an
MoE GPT's AdamW train step instead (4 blocks, 2 of them MoE), against the same GPT and
step with DeepSpeed's layer in place of ``moe_layer``, with its losses compared::

    fsharded bench moe --quick            # tiny sizes, a smoke run
    python -m fsharded bench moe --markdown
    python -m fsharded bench moe --model gpt --markdown
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import os
import statistics
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass

import torch

from fsharded.bench import Qty, Report, Row, Section, add_output_args


@dataclass(frozen=True)
class Config:
    """One benchmark run's sizes and routing options."""

    tokens: tuple[int, ...] = (1024, 4096)
    """tokens per rank, one measurement each"""
    top_k: tuple[int, ...] = (1, 2)
    """routings measured: 1 (Switch) and/or 2 (GShard)"""
    rounds: int = 15
    """timed steps per framework, alternating"""
    d_model: int = 256
    d_ff: int = 1024
    experts: int = 8
    capacity_factor: float = 1.25
    min_capacity: int = 4
    router_std: float = 0.1
    """std of the router weights (the MLP's 0.02 would route near uniformly)"""
    token_skew: float = 0.3
    """std of a direction ``m`` every token shares (``x = z + m``, ``z`` standard normal):
    it tilts the routing towards some experts, as a trained router is tilted, so that
    experts overflow at capacity factor 1.25 (6-12% of the assignments drop at the default sizes)"""
    gpt_rounds: int = 8
    """timed train steps per framework of the MoE GPT (``--model gpt``), alternating"""


QUICK = Config(tokens=(128,), rounds=2, d_model=32, d_ff=64, gpt_rounds=2)


def _params(cfg: Config) -> dict[str, torch.Tensor]:
    """The global parameters, identical on every rank (seeded)."""
    from fsharded.parallel import moe

    p = moe.init(cfg.d_model, cfg.d_ff, cfg.experts, seed=0)
    g = torch.Generator().manual_seed(1)
    p["router"] = torch.randn(cfg.d_model, cfg.experts, generator=g) * cfg.router_std
    return p


class _MLP(torch.nn.Module):
    """The expert DeepSpeed replicates: the GELU MLP of ``moe.expert_mlp`` (no biases)."""

    def __init__(self, d_model: int, d_ff: int):
        super().__init__()
        self.fc1 = torch.nn.Linear(d_model, d_ff, bias=False)
        self.fc2 = torch.nn.Linear(d_ff, d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.nn.functional.gelu(self.fc1(x)))


def _deepspeed_layer(cfg: Config, k: int, params: dict[str, torch.Tensor], n: int, rank: int):
    """DeepSpeed's MoE with ``params`` copied in; a forward hook keeps the gate's outputs.

    Layouts: DeepSpeed's gate computes ``x @ wg.weight.T`` (``wg.weight`` ``(E, d)``), so
    ``wg.weight = router.T``; local expert ``i`` on rank ``r`` is global expert ``r * E/n +
    i`` (the all-to-all's chunk ``r`` holds those experts), and ``nn.Linear`` weights are
    ``(out, in)``: ``fc1.weight = w1[e].T``, ``fc2.weight = w2[e].T``.
    """
    from deepspeed.moe.layer import MoE

    # use_rts=False and no 2nd-expert sampling: no randomness in the routing;
    # eval_capacity_factor too, so eval mode would route alike.
    layer = MoE(cfg.d_model, expert=_MLP(cfg.d_model, cfg.d_ff), num_experts=cfg.experts, ep_size=n, k=k,
                capacity_factor=cfg.capacity_factor, eval_capacity_factor=cfg.capacity_factor,
                min_capacity=cfg.min_capacity, drop_tokens=True, use_rts=False, top2_2nd_expert_sampling=False)
    layer.set_deepspeed_parallelism()  # what the engine would call: creates the ep_size_n groups
    local = cfg.experts // n
    with torch.no_grad():
        layer.deepspeed_moe.gate.wg.weight.copy_(params["router"].t())
        for i, mlp in enumerate(layer.deepspeed_moe.experts.deepspeed_experts):
            e = rank * local + i
            mlp.fc1.weight.copy_(params["w1"][e].t())
            mlp.fc2.weight.copy_(params["w2"][e].t())
    seen: dict = {}

    def keep(module, args, out):  # sparse routes: (l_aux, C, E, indices (k, T), locations, gates, exp_counts)
        seen.update(capacity=int(out[1]), indices=out[3].detach(), locations=out[4].detach(),
                    exp_counts=out[6].detach())

    layer.deepspeed_moe.gate.register_forward_hook(keep)
    return layer, seen


def _time(fns: dict, rounds: int) -> dict[str, list[float]]:
    """Alternate the frameworks round by round (the first one rotating), barrier between."""
    import torch.distributed as dist

    names = list(fns)
    out: dict[str, list[float]] = {name: [] for name in names}
    for r in range(rounds):
        for name in names[r % len(names):] + names[: r % len(names)]:
            dist.barrier()
            t0 = time.perf_counter()
            fns[name]()
            out[name].append(time.perf_counter() - t0)
    return out


def _peak(fn) -> int:
    import fsharded as fs

    with fs.memory.track() as mem:
        fn()
    return mem.peak_bytes


def _reenact(params: dict, x: torch.Tensor, r, seen: dict) -> torch.Tensor:
    """DeepSpeed's decisions run through our pieces on all the experts (the single-device
    layer on this shard's tokens, which each shard of ours equals): its kept routes and
    slots, and for top-2 its weights renormalised over the kept routes (top-1: the
    router probability, as ours)."""
    from fsharded.parallel import moe

    kept = (seen["indices"] >= 0).t()  # (T, k)
    slots = torch.where(kept, seen["locations"].t().long(), r.capacity)
    w = r.probs.gather(1, r.experts) * kept
    if kept.shape[1] > 1:
        w = w / w.sum(1, keepdim=True).clamp(min=torch.finfo(w.dtype).eps)
    ds_r = r._replace(kept=kept, slots=slots, weights=w)
    return moe.combine(moe.expert_mlp(params, moe.dispatch(x, ds_r)), ds_r)


def _compare(y: torch.Tensor, y_ds: torch.Tensor, y_re: torch.Tensor, kept: torch.Tensor,
             kept_ds: torch.Tensor) -> dict:
    """Where the routing semantics coincide (every choice of the token decided alike on
    both sides, and kept for all or none of its choices) the outputs must agree; the other
    tokens are those DeepSpeed treats differently (top-1: another token kept at a full
    expert; top-2: its weights renormalised after a drop). ``y_re`` (``_reenact``) must
    agree with DeepSpeed everywhere."""
    same = (kept == kept_ds).all(1) & (kept.all(1) | ~kept.any(1))  # (T,)
    diff = (y - y_ds).abs().amax(1)  # (T,)
    return {"tokens": int(y.shape[0]), "same": int(same.sum()),
            "decided_differently": int((kept != kept_ds).any(1).sum()),
            "partly_dropped": int((kept.any(1) & ~kept.all(1)).sum()),
            "max_diff_same": float(diff[same].max()) if same.any() else 0.0,
            "max_diff_other": float(diff[~same].max()) if (~same).any() else 0.0,
            "max_diff_reenacted": float((y_re - y_ds).abs().max())}


def _rank(cfg: Config, deepspeed: bool) -> dict:
    """On each rank: ours and DeepSpeed's layer at every top-k and token count."""
    import torch.distributed as dist

    import fsharded as fs
    from fsharded import P
    from fsharded.parallel import moe
    from fsharded.spmd import _manifest
    from fsharded.spmd._transfer import local_shards

    torch.set_num_threads(1)
    n, rank = dist.get_world_size(), dist.get_rank()
    mesh = fs.Mesh({"expert": n})
    params = _params(cfg)
    specs = moe.expert_parallel_specs(params, axis_size=n)
    if deepspeed:
        _init_deepspeed()
    local = {k: v.requires_grad_() for k, v in local_shards(params, specs, mesh).items()}
    skew = torch.randn(cfg.d_model, generator=torch.Generator().manual_seed(2)) * cfg.token_skew
    out: dict = {}
    for k in cfg.top_k:
        opts = dict(top_k=k, capacity_factor=cfg.capacity_factor, min_capacity=cfg.min_capacity)

        def body(p, x, opts=opts):
            y, aux = moe.moe_layer(p, x, axis="expert", **opts)
            return y, aux["drop_fraction"][None], aux["aux_loss"][None]

        ours = fs.shard_map(body, mesh=mesh, in_specs=(specs, P("expert")), out_specs=(P("expert"),) * 3)
        ds = seen = None
        if deepspeed:
            ds, seen = _deepspeed_layer(cfg, k, params, n, rank)
        for T in cfg.tokens:
            g = torch.Generator().manual_seed(100 + rank)
            x = (torch.randn(T, cfg.d_model, generator=g) + skew).requires_grad_()  # this rank's tokens
            dy = torch.randn(T, cfg.d_model, generator=g)

            def step_ours(x=x, dy=dy, ours=ours):
                ours.local(local, x)[0].backward(dy)
                x.grad = None
                for v in local.values():
                    v.grad = None

            fns = {"ours": step_ours}
            if ds is not None:
                def step_ds(x=x, dy=dy, ds=ds):
                    ds(x)[0].backward(dy)
                    x.grad = None
                    ds.zero_grad(set_to_none=True)

                fns["deepspeed"] = step_ds
            rec: dict = {name: {} for name in fns}
            with _manifest.recording() as entries:  # the collectives one real step runs, fwd + bwd
                step_ours()
            rec["ours"]["sent"] = sum(e.bytes_sent for e in entries)
            rec["ours"]["sent_a2a"] = sum(e.bytes_sent for e in entries if e.op == "all_to_all")
            rec["ours"]["collectives"] = [(e.phase, e.op, e.shape) for e in entries]
            for fn in fns.values():
                fn()  # warm
            for name, ts in _time(fns, cfg.rounds).items():
                rec[name]["t"] = ts
            for name, fn in fns.items():
                dist.barrier()
                rec[name]["peak"] = _peak(fn)
            with torch.no_grad():  # one forward each on the same tokens
                y, drop, aux_loss = ours.local(local, x)
                r = moe.route(x @ params["router"], **opts)  # the routing ours ran on this shard
            rec["ours"].update(drops=round(float(drop) * T * k), aux_loss=float(aux_loss),
                               capacity=r.capacity)
            if ds is not None:
                with torch.no_grad():
                    y_ds, l_aux, _ = ds(x)
                    y_re = _reenact(params, x, r, seen)
                kept_ds = (seen["indices"] >= 0).t()  # (T, k)
                C = seen["capacity"]
                sent = 2 * 2 * cfg.experts * C * cfg.d_model * x.element_size() * (n - 1) // n
                rec["deepspeed"].update(
                    drops=int((~kept_ds).sum()), aux_loss=float(l_aux), capacity=C, sent=sent,
                    drops_from_counts=int((seen["exp_counts"] - C).clamp(min=0).sum()))
                rec["cmp"] = _compare(y, y_ds, y_re, r.kept, kept_ds)
            dist.barrier()
            out[k, T] = rec
    return out


def run(cfg: Config, deepspeed: bool, *, world: int = 2) -> tuple[Report, dict]:
    """Measure on ``world`` gloo ranks; returns the report and the measured numbers,
    ``{(top_k, tokens): {"ours": ..., "deepspeed": ..., "cmp": ...}}`` (summed or worst
    over the ranks: times the slowest rank's median, peaks and bytes the largest, drops
    the sum, differences the largest)."""
    from fsharded.testing import (
        run_on_new_ranks as run_on_ranks,  # fresh processes: clean peaks and caches
    )

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    per_rank = run_on_ranks(_rank, world, cfg, deepspeed)
    nums: dict = {}
    names = ("ours", "deepspeed") if deepspeed else ("ours",)
    for key in per_rank[0]:
        rs = [r[key] for r in per_rank]
        entry = {}
        for name in names:
            entry[name] = {
                "t": max(statistics.median(r[name]["t"]) for r in rs),  # a step takes its slowest rank
                "peak": max(r[name]["peak"] for r in rs),
                "sent": max(r[name]["sent"] for r in rs),
                "sent_a2a": max(r[name].get("sent_a2a", r[name]["sent"]) for r in rs),
                "drops": sum(r[name]["drops"] for r in rs),
                "aux_loss": [r[name]["aux_loss"] for r in rs],
                "capacity": rs[0][name]["capacity"],
            }
        entry["ours"]["collectives"] = rs[0]["ours"]["collectives"]
        if deepspeed:
            entry["deepspeed"]["drops_from_counts"] = sum(r["deepspeed"]["drops_from_counts"] for r in rs)
            c = [r["cmp"] for r in rs]
            entry["cmp"] = {f: sum(x[f] for x in c) for f in ("tokens", "same", "decided_differently",
                                                             "partly_dropped")}
            entry["cmp"].update(max_diff_same=max(x["max_diff_same"] for x in c),
                                max_diff_other=max(x["max_diff_other"] for x in c),
                                max_diff_reenacted=max(x["max_diff_reenacted"] for x in c),
                                max_aux_loss_diff=max(abs(a - b) for a, b in zip(entry["ours"]["aux_loss"],
                                                                                  entry["deepspeed"]["aux_loss"])))
        nums[key] = entry
    return _report(cfg, nums, deepspeed, world), nums


# --------------------------------------------------------------------------- an MoE GPT

GPT_LAYERS, GPT_HEADS, GPT_EVERY = 4, 4, 2
"""The MoE GPT: 4 blocks, the MLPs of blocks 1 and 3 mixtures of experts."""


def _gpt_config(cfg: Config, k: int, capacity_factor: float, seq: int):
    from fsharded.models import gpt

    moe_cfg = gpt.MoEConfig(experts=cfg.experts, top_k=k, capacity_factor=capacity_factor,
                            eval_capacity_factor=capacity_factor, min_capacity=cfg.min_capacity,
                            every=GPT_EVERY, d_ff=cfg.d_ff, aux_loss_weight=0.01, z_loss_weight=0.0)
    return gpt.GPTConfig.small(vocab_size=256, d_model=cfg.d_model, n_layers=GPT_LAYERS, n_heads=GPT_HEADS,
                               mlp_ratio=cfg.d_ff / cfg.d_model, seq_len=seq, activation="gelu", bias=False, moe=moe_cfg)


def _gpt_seq(cfg: Config) -> int:
    return min(256, min(cfg.tokens))


def _gpt_params(cfg: Config, gcfg) -> dict:
    """``gpt.init`` with the routers drawn with ``router_std`` as in the layer (the
    normalised hidden states are unit RMS, so the logits' std is about ``router_std *
    sqrt(d_model)``): 4-9% of the assignments drop at capacity factor 1.25."""
    from fsharded.models import gpt

    params = gpt.init(gcfg, 0)
    g = torch.Generator().manual_seed(1)
    for b in params["blocks"]:
        if "router" in b["mlp"]:
            b["mlp"]["router"] = torch.randn(b["mlp"]["router"].shape, generator=g) * cfg.router_std
    return params


def _gpt_step(cfg: Config, k: int, capacity_factor: float, tokens: int, n: int):
    """(train step, initial state, global batch): the MoE GPT trained with AdamW, the
    experts over ``expert`` (``gpt_plans.expert_parallel_specs``), the rows over it too."""
    import functools

    import optree

    import fsharded as fs
    from fsharded import P
    from fsharded.models import gpt, gpt_plans

    seq = _gpt_seq(cfg)
    gcfg = _gpt_config(cfg, k, capacity_factor, seq)
    params = _gpt_params(cfg, gcfg)
    mesh = fs.Mesh({"expert": n})
    specs = gpt_plans.expert_parallel_specs(params, base=optree.tree_map(lambda _: P(), params))
    step = fs.train_step(functools.partial(gpt.loss, moe=gcfg.moe, metrics=True), fs.optim.adamw(1e-3), mesh=mesh,
                         param_specs=specs, batch_spec=P("expert"))
    g = torch.Generator().manual_seed(3)
    batch = gpt.shift({"tokens": torch.randint(0, gcfg.vocab_size, (tokens * n // seq, seq + 1), generator=g)})
    return step, step.init(params), batch


class _DeepSpeedInGPT:
    """DeepSpeed's ``MoE`` in place of ``moe.moe_layer`` inside the GPT's step: each call
    runs one ``deepspeed.moe.layer.MoE`` (gate, its all-to-alls, its experts) on the
    block's own parameters through ``torch.func.functional_call`` (the layouts of
    ``_deepspeed_layer``), and counts its drops as ours are counted."""

    def __init__(self, cfg: Config, k: int, capacity_factor: float, n: int):
        from deepspeed.moe.layer import MoE

        self.k, self.local = k, cfg.experts // n
        self.layer = MoE(cfg.d_model, expert=_MLP(cfg.d_model, cfg.d_ff), num_experts=cfg.experts, ep_size=n, k=k,
                         capacity_factor=capacity_factor, eval_capacity_factor=capacity_factor,
                         min_capacity=cfg.min_capacity, drop_tokens=True, use_rts=False,
                         top2_2nd_expert_sampling=False)
        self.layer.set_deepspeed_parallelism()
        self.seen: dict = {}
        self.capacity: list[int] = []  # one per call

        def keep(module, args, out):
            self.seen.update(capacity=int(out[1]), exp_counts=out[6].detach())
            self.capacity.append(int(out[1]))

        self.layer.deepspeed_moe.gate.register_forward_hook(keep)

    def __call__(self, p: dict, x: torch.Tensor, **_: object) -> tuple[torch.Tensor, dict]:
        w = {"deepspeed_moe.gate.wg.weight": p["router"].t()}
        for i in range(self.local):
            w[f"deepspeed_moe.experts.deepspeed_experts.{i}.fc1.weight"] = p["w1"][i].t()
            w[f"deepspeed_moe.experts.deepspeed_experts.{i}.fc2.weight"] = p["w2"][i].t()
        y, l_aux, _ = torch.func.functional_call(self.layer, w, (x,))
        counts = self.seen["exp_counts"].to(l_aux.dtype)
        dropped = (counts - self.seen["capacity"]).clamp(min=0).sum() / (x.numel() // x.shape[-1] * self.k)
        zero = l_aux.detach() * 0  # typed as l_aux is: this shard's
        return y, {"aux_loss": l_aux, "z_loss": zero, "drop_fraction": zero + dropped, "load": zero + counts}


def _rank_gpt(cfg: Config, deepspeed: bool) -> dict:
    """On each rank: a train step of the MoE GPT, ours against the same GPT with
    DeepSpeed's MoE in place of ``moe_layer``, timed alternately as in ``_rank``."""
    from unittest import mock

    import torch.distributed as dist

    import fsharded as fs
    from fsharded.parallel import moe

    torch.set_num_threads(1)
    n = dist.get_world_size()
    if deepspeed:
        _init_deepspeed()
    names = ("ours", "deepspeed") if deepspeed else ("ours",)
    out: dict = {}

    def variant(name, k, cf, T):
        step, state, batch = _gpt_step(cfg, k, cf, T, n)
        ds = _DeepSpeedInGPT(cfg, k, cf, n) if name == "deepspeed" else None
        return [step, state, batch, ds]

    def call(run):
        step, state, batch, ds = run
        with mock.patch.object(moe, "moe_layer", ds) if ds is not None else contextlib.nullcontext():
            run[1], m = step(state, batch)
        return {key: float(v) for key, v in m.items()}

    for k in cfg.top_k:
        if deepspeed:  # nothing dropped (capacity = all tokens): the two GPTs train alike
            runs = {name: variant(name, k, cfg.experts / k, cfg.tokens[0]) for name in names}
            out[k, "no drops"] = {name: [call(runs[name])["loss"] for _ in range(3)] for name in names}
        for T in cfg.tokens:
            runs = {name: variant(name, k, cfg.capacity_factor, T) for name in names}
            rec = {name: {"first": call(runs[name]), "t": []} for name in names}  # warm
            for r in range(cfg.gpt_rounds):
                for name in names[r % len(names):] + names[:r % len(names)]:
                    dist.barrier()
                    t0 = time.perf_counter()
                    call(runs[name])
                    rec[name]["t"].append(time.perf_counter() - t0)
            for name in names:
                dist.barrier()
                with fs.memory.track() as mem:
                    rec[name]["last"] = call(runs[name])
                rec[name]["peak"] = mem.peak_of(("activations", "comm buffers"))
            step, state, batch, _ = runs["ours"]
            manifest = step.collectives(state, batch)
            rec["ours"]["sent"] = manifest.total_bytes()
            rec["ours"]["sent_a2a"] = sum(e.bytes_sent for e in manifest if e.op == "all_to_all")
            if deepspeed:  # our step's other collectives + DeepSpeed's four (E, C, d) all-to-alls per layer
                caps = runs["deepspeed"][3].capacity[-(GPT_LAYERS // GPT_EVERY):]
                a2a = sum(4 * cfg.experts * C * cfg.d_model * 4 * (n - 1) // n for C in caps)
                rec["deepspeed"]["sent"] = rec["ours"]["sent"] - rec["ours"]["sent_a2a"] + a2a
                rec["deepspeed"]["sent_a2a"] = a2a
            runs.clear()
            out[k, T] = rec
    return out


def run_gpt(cfg: Config, deepspeed: bool, *, world: int = 2) -> tuple[Report, dict]:
    """The MoE GPT's train step on ``world`` gloo ranks, ours against the same GPT with
    DeepSpeed's MoE layers; returns the report and the numbers (as ``run``: the slowest
    rank's median, the largest peak and bytes)."""
    from fsharded.testing import run_on_new_ranks

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    per_rank = run_on_new_ranks(_rank_gpt, world, cfg, deepspeed)
    names = ("ours", "deepspeed") if deepspeed else ("ours",)
    nums: dict = {}
    layers = GPT_LAYERS // GPT_EVERY
    for key in per_rank[0]:
        rs = [r[key] for r in per_rank]
        if key[1] == "no drops":  # the losses are the step's mean over the ranks: equal on every rank
            nums[key] = rs[0]
            continue
        k, T = key
        nums[key] = {name: {
            "t": max(statistics.median(r[name]["t"]) for r in rs),
            "peak": max(r[name]["peak"] for r in rs),
            "sent": max(r[name]["sent"] for r in rs) if "sent" in rs[0][name] else float("nan"),
            "sent_a2a": max(r[name]["sent_a2a"] for r in rs) if "sent_a2a" in rs[0][name] else float("nan"),
            # the metrics are means over the MoE layers and the batch shards
            "drops": round(rs[0][name]["first"]["moe_drop_fraction"] * T * k * layers * world),
            "first": rs[0][name]["first"], "last": rs[0][name]["last"]} for name in names}
    return _report_gpt(cfg, nums, deepspeed, world), nums


def _report_gpt(cfg: Config, nums: dict, deepspeed: bool, world: int) -> Report:
    target = 1.0 if deepspeed else None
    seq = _gpt_seq(cfg)
    report = _Report("moe", params={
        "torch": torch.__version__, "ranks": world, "threads per rank": 1,
        "model": f"GPT, d_model {cfg.d_model}, {GPT_LAYERS} blocks, {GPT_HEADS} heads, GELU MLPs of {cfg.d_ff}; "
                 f"blocks {GPT_EVERY - 1} and {2 * GPT_EVERY - 1}: {cfg.experts} experts over {world} ranks, "
                 f"capacity factor {cfg.capacity_factor}, router std {cfg.router_std}; sequences of {seq}, "
                 "the rows over the expert axis; AdamW train step, fp32",
        "rounds": cfg.gpt_rounds})
    peer = ("the same GPT and step with deepspeed.moe.layer.MoE(ep_size=2, use_rts=False, "
            "top2_2nd_expert_sampling=False) in place of moe_layer, on the same parameters"
            if deepspeed else "DeepSpeed not run (n/a)")
    keys = [key for key in nums if key[1] != "no drops"]

    rows = functools.partial(_rows, nums, keys, deepspeed)

    report.sections.append(Section(
        f"MoE GPT train step on {world} ranks (slowest rank)", peer, rows("", "t", "s", Row), target=target,
        notes=("medians of alternating rounds (the first framework rotating); each rank one thread; "
               "everything but the MoE layers is the same program on both sides",)))
    report.sections.append(Section(
        "bytes sent per rank per train step", peer,
        rows(", all-to-alls", "sent_a2a", "B") + rows(", every collective", "sent", "B"), target=target,
        notes=("ours: the step's manifest (forward, backward, gradient sync); DeepSpeed: the same step's "
               "other collectives plus its four (E, C, d) fp32 all-to-alls per MoE layer, (n - 1)/n of each "
               "sent, C its own capacity",)))
    report.sections.append(Section(
        "peak activation bytes per rank of a train step", peer, rows("", "peak", "B"), target=target,
        notes=("the memory tracker's activation and comm-buffer categories (parameters, gradients and "
               "optimizer state are the same on both sides); they include the update's temporaries, about "
               "twice the rank's parameter bytes on both sides, which at small sizes (--quick) set both peaks",)))
    report.sections.append(Section(
        "assignments dropped over capacity, first step (all ranks, both MoE layers)", peer,
        rows("", "drops", "drops"), notes=(
            "both from the step's moe_drop_fraction metric (DeepSpeed's: sum(max(0, exp_counts - C)) of "
            "its gate); the second MoE layer's inputs differ a little where the first layer's dropped "
            "tokens are treated differently, so its counts may too",)))
    if deepspeed:
        loss_rows = tuple(Qty(f"top-{k}: first-step loss", f"{T} tokens/rank",
                              nums[k, T]["ours"]["first"]["loss"], nums[k, T]["deepspeed"]["first"]["loss"],
                              unit="")
                          for k, T in keys)
        loss_rows += tuple(Qty(f"top-{k}: loss of step {cfg.gpt_rounds + 2}, same batch", f"{T} tokens/rank",
                               nums[k, T]["ours"]["last"]["loss"], nums[k, T]["deepspeed"]["last"]["loss"],
                               unit="")
                           for k, T in keys)
        notes = []
        for k in cfg.top_k:
            a, b = nums[k, "no drops"]["ours"], nums[k, "no drops"]["deepspeed"]
            notes.append(f"top-{k}, capacity factor {cfg.experts / k:g} (capacity = every token, nothing "
                         f"dropped), {cfg.tokens[0]} tokens/rank: losses of 3 steps "
                         + ", ".join(f"{x:.6f}/{y:.6f}" for x, y in zip(a, b))
                         + f" (ours/DeepSpeed), at most {max(abs(x - y) for x, y in zip(a, b)):.1e} apart")
        notes.append(f"at capacity factor {cfg.capacity_factor} the losses differ where the routing semantics "
                     "do (see `fsharded bench moe` on one layer): at top-1 which tokens stay at a full expert, "
                     "at top-2 a token's weights after one of its choices is dropped; every step trains on the "
                     "same batch, so from there the two runs fit it along their own paths")
        report.sections.append(Section("losses (the step's loss: LM loss + 0.01 x the balancing losses)", peer,
                                       loss_rows, notes=tuple(notes)))
    report.finish()
    return report


def _init_deepspeed() -> None:
    import logging

    from fsharded.bench.zero import _quiet_stdout

    _quiet_stdout()  # DeepSpeed's logs and JIT builds: stdout is the report
    os.environ["DS_ACCELERATOR"] = "cpu"
    import deepspeed as ds_pkg

    ds_pkg.utils.logger.setLevel(logging.WARNING)
    ds_pkg.init_distributed(dist_backend="gloo")  # wraps the existing gloo group


class _Report(Report):
    """Counts of other units print "n/a" where the peer was not run."""

    def _cells(self, s: Section) -> list[tuple[str, ...]]:
        cells = super()._cells(s)
        return [c[:3] + ("n/a", "n/a") if r.peer_s != r.peer_s else c for r, c in zip(s.rows, cells)]


def _rows(nums: dict, keys: list, deepspeed: bool, label: str, field: str, unit: str, cls=Qty,
          ours_field: str | None = None) -> tuple:
    """One row per (top-k, tokens) of ``keys``: ours' ``ours_field or field`` against
    DeepSpeed's ``field`` (n/a when it was not run)."""
    return tuple(cls(f"top-{k}{label}", f"{T} tokens/rank", nums[k, T]["ours"][ours_field or field],
                     nums[k, T]["deepspeed"][field] if deepspeed else float("nan"),
                     **({} if cls is Row else {"unit": unit}))
                 for k, T in keys)


def _report(cfg: Config, nums: dict, deepspeed: bool, world: int) -> Report:
    target = 1.0 if deepspeed else None
    report = _Report("moe", params={
        "torch": torch.__version__, "ranks": world, "threads per rank": 1,
        "layer": f"MoE, d_model {cfg.d_model}, d_ff {cfg.d_ff} (GELU MLP, no biases), {cfg.experts} experts "
                 f"over {world} ranks, capacity factor {cfg.capacity_factor}, min capacity {cfg.min_capacity}, "
                 f"router std {cfg.router_std}, tokens N(m, 1) with m ~ N(0, {cfg.token_skew}^2) shared, "
                 "fp32, fwd + bwd",
        "rounds": cfg.rounds})
    peer = ("deepspeed.moe.layer.MoE(ep_size=2, use_rts=False, top2_2nd_expert_sampling=False, "
            "drop_tokens=True), same weights and tokens" if deepspeed else "DeepSpeed not run (n/a)")
    keys = list(nums)

    rows = functools.partial(_rows, nums, keys, deepspeed)

    report.sections.append(Section(
        f"step time on {world} ranks (fwd + bwd, slowest rank)", peer, rows("", "t", "s", Row), target=target,
        notes=("medians of alternating rounds (the first framework rotating); each rank one thread",)))
    psum = {f"{ph} {op}" for ph, op, _ in nums[keys[0]]["ours"]["collectives"]}
    report.sections.append(Section(
        "bytes sent per rank per step", peer,
        rows(", all-to-alls", "sent", "B", ours_field="sent_a2a") + rows(", every collective", "sent", "B"),
        target=target, notes=(
            "ours: the collectives recorded over one real step (the manifest, fwd + bwd): "
            + ", ".join(sorted(psum)) + "; the psum is the replicated router's gradient "
            f"({cfg.d_model} x {cfg.experts} fp32), which DeepSpeed leaves to its engine's data-parallel "
            "gradient all-reduce (no engine here): the every-collective rows count it for ours only",
            "DeepSpeed: computed from the same formula, not counted: its two all-to-alls of the (E, C, d) "
            "fp32 dispatch buffer forward and their two transposes backward, (n - 1)/n of each sent: "
            "4 x E x C x d x 4 B x (n - 1)/n with C its own capacity")))
    report.sections.append(Section(
        "peak bytes the layer allocates per rank (fwd + bwd)", peer, rows("", "peak", "B"), target=target,
        notes=("fs.memory.track() around one step of each: tensors allocated inside it (weights and tokens "
               "are allocated before)",)))
    notes = ["ours: aux['drop_fraction'] x T x k per rank; DeepSpeed: the routes its gate marks dropped "
             "(expert index -1), both summed over the ranks"]
    if deepspeed:
        equal = [key for key in keys if nums[key]["ours"]["drops"] == nums[key]["deepspeed"]["drops"]]
        notes.append("target: equal; " + ("equal at every size" if len(equal) == len(keys) else
                                           f"DIFFERENT at {[k for k in keys if k not in equal]}"))
        notes.append("capacity per expert (ours / DeepSpeed): " + ", ".join(
            f"top-{k} {T} tokens {nums[k, T]['ours']['capacity']}/{nums[k, T]['deepspeed']['capacity']}"
            for k, T in keys))
        agree = all(nums[key]["deepspeed"]["drops"] == nums[key]["deepspeed"]["drops_from_counts"]
                    for key in keys)
        notes.append("DeepSpeed's dropped routes " + ("equal" if agree else "DIFFER FROM")
                     + " sum(max(0, exp_counts - C)) at every size")
    report.sections.append(Section("assignments dropped over capacity (all ranks)", peer,
                                   rows("", "drops", "drops"), notes=tuple(notes)))
    if deepspeed:
        out_rows = tuple(Qty(f"top-{k}: tokens routed alike / all", f"{T} tokens/rank", nums[k, T]["cmp"]["same"],
                             nums[k, T]["cmp"]["tokens"], unit="tokens") for k, T in keys)
        notes = []
        for k, T in keys:
            c = nums[k, T]["cmp"]
            notes.append(
                f"top-{k}, {T} tokens/rank: max |ours - DeepSpeed| {c['max_diff_same']:.1e} over the "
                f"{c['same']} tokens routed alike, {c['max_diff_other']:.1e} over the other "
                f"{c['tokens'] - c['same']} ({c['decided_differently']} with a choice kept on one side "
                f"and dropped on the other, {c['partly_dropped']} with one of their choices dropped); "
                f"our pieces re-enacting DeepSpeed's decisions: {c['max_diff_reenacted']:.1e} over all "
                f"tokens; aux loss differs by {c['max_aux_loss_diff']:.1e}")
        notes += [
            "routed alike: every choice of the token kept (or dropped) on both sides, and kept for all or "
            "none of its choices; there the semantics coincide and the outputs agree to fp32 rounding",
            "top-1: both keep C = max(min_capacity, ceil(T/E x cf)) per expert, so the drop counts are equal; "
            "but with use_rts=False DeepSpeed picks which tokens stay at a full expert with torch.topk over "
            "its 0/1 mask, whose order among ties is not token order, so at an overflowing expert other "
            "tokens are kept than ours (the first C in token order, Switch/GShard)",
            "top-2: the same choices, capacity and slots (both serve every first choice before any second, "
            "in token order), so the same routes drop; DeepSpeed renormalises the two weights after the drops "
            "(a token left with one choice gets weight 1), we before (GShard): exactly the tokens with one "
            "choice dropped differ",
            "re-enacted: DeepSpeed's kept routes, slots and (top-2) renormalised weights put through our "
            "dispatch / expert_mlp / combine: matching DeepSpeed on every token shows the two differences "
            "above are the only ones",
        ]
        report.sections.append(Section("outputs against DeepSpeed (one forward, same tokens)",
                                       "all of the rank's tokens, summed over the ranks", out_rows,
                                       notes=tuple(notes)))
    report.finish()
    return report


def build_parser(prog: str | None = None) -> argparse.ArgumentParser:
    d = Config()
    p = argparse.ArgumentParser(prog=prog or "fsharded bench moe", description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="tiny sizes, 2 rounds (a smoke run)")
    p.add_argument("--tokens", default=",".join(map(str, d.tokens)), help="comma-separated tokens per rank")
    p.add_argument("--top-k", default=",".join(map(str, d.top_k)), help="comma-separated: 1, 2 or both")
    p.add_argument("--rounds", type=int, default=None,
                   help=f"timed rounds per framework (default {d.rounds}; {d.gpt_rounds} with --model gpt)")
    p.add_argument("--model", choices=("layer", "gpt"), default="layer",
                   help="one MoE layer (default) or an MoE GPT's train step (4 blocks, 2 of them MoE)")
    add_output_args(p)
    p.add_argument("--no-deepspeed", action="store_true", help="skip DeepSpeed (compared where installed)")
    return p


def _ints(text: str, flag: str, allowed: Sequence[int] | None = None) -> tuple[int, ...]:
    try:
        vals = tuple(int(v) for v in text.split(","))
    except ValueError:
        raise SystemExit(f"fsharded bench moe: {flag} {text!r}: give comma-separated integers") from None
    bad = [v for v in vals if v < 1 or (allowed is not None and v not in allowed)]
    if bad:
        raise SystemExit(f"fsharded bench moe: {flag}: {bad} not allowed"
                         + (f" (use {', '.join(map(str, allowed))})" if allowed else ""))
    return vals


def main(argv: Sequence[str] | None = None, *, prog: str | None = None) -> int:
    args = build_parser(prog).parse_args(argv)
    cfg = QUICK if args.quick else Config(tokens=_ints(args.tokens, "--tokens"))
    if args.rounds is not None:
        if args.rounds < 1:
            raise SystemExit(f"fsharded bench moe: --rounds {args.rounds}: give at least 1")
        cfg = Config(**{**asdict(cfg), "rounds": args.rounds, "gpt_rounds": args.rounds})
    if args.model == "gpt" and not args.quick:
        seq = _gpt_seq(cfg)
        bad = [T for T in cfg.tokens if T % seq]
        if bad:
            raise SystemExit(f"fsharded bench moe --model gpt: --tokens {bad} are not whole sequences of {seq}")
    cfg = Config(**{**asdict(cfg), "top_k": _ints(args.top_k, "--top-k", (1, 2))})
    with_ds = not args.no_deepspeed
    if with_ds:
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
        try:
            import deepspeed.moe.layer  # noqa: F401
        except Exception:  # noqa: BLE001 - not installed or not importable here
            with_ds = False
    report, _ = (run_gpt if args.model == "gpt" else run)(cfg, with_ds)
    report.emit(args)
    return 0
