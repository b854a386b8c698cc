"""``fsharded bench compile``: the step captured as one graph and compiled, against eager
steps, ``torch.compile`` of the plain loop, and the matmul floor.

    fsharded bench compile            # GPT "small" (0.84 M params), batch 16x128, fp32
    fsharded bench compile --quick    # tiny shapes, a smoke run

Section 1 times one optimizer step of the same functional GPT on the same batch, one
process: ``train_step(compile=True)`` (Inductor) against

- our eager step (``donate=True``: the fused in-place AdamW, our fastest eager form);
- the eager PyTorch loop a user would write (``loss.backward()``, ``clip_grad_norm_``,
  ``torch.optim.AdamW(foreach=True)``);
- the same loop with the model's loss under ``torch.compile`` (forward and backward
  compiled by AOTAutograd and Inductor; the optimizer eager, as most loops run it);
- the matmul floor: the model FLOPs of a step (``fsharded.tools.flops``) at the rate this
  machine's largest square fp32 ``torch.mm`` reaches, measured in the same run (the
  fastest GEMM shape: the floor is optimistic for the model's smaller products);
- and a floor at the model's own shapes: every matrix product of the traced forward and
  backward timed alone at its shapes, summed (``shape_floor``).

All are checked to give the same parameters after the warm-up steps before timing; the
rows alternate rounds. Beside the floor, the bare gradient compiled the same way (``make_fx``
of ``torch.func.grad_and_value(gpt.loss)``, then ``torch.compile``: no clipping, no update,
no fsharded step) says how far Inductor itself gets from the floor on this model.

Section 2 runs ZeRO-3 on 2 gloo ranks, compiled, against FSDP2 with each block under
``torch.compile`` (torchtitan's recipe) in the same two processes (``_compile_ranks``;
``--no-ranks`` skips it). Section 3 runs the default ``fsharded train`` job (``data=2`` on
the virtual mesh) with and without ``--compile``, alternating, and sets their steady
tokens/s side by side; the compile time is in the notes.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import tempfile
import time
from collections.abc import Callable, Sequence

import optree
import torch

import fsharded as fs
from fsharded.bench import Report, Row, Section, add_output_args, alternate
from fsharded.bench.train import _Eager
from fsharded.models import gpt
from fsharded.tools import flops as FL


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


class _Compiled(_Eager):
    """The eager loop with the loss under ``torch.compile`` (the optimizer eager)."""

    def __init__(self, params, lr, wd, clip, foreach):
        super().__init__(params, lr, wd, clip, foreach)
        self.loss = torch.compile(gpt.loss)

    def __call__(self, batch) -> torch.Tensor:
        loss = self.loss(self.params, batch)
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.leaves, self.clip)
        self.opt.step()
        return loss.detach()


def _bare_gradient(params: dict, batches: list) -> Callable[[], float]:
    """Seconds per call of ``grad_and_value(gpt.loss)`` traced with ``make_fx`` and
    compiled with Inductor: the model's forward and backward alone, as the compiler makes
    them (a timed block over ``batches``; compiled here, before it is timed)."""
    from torch.fx.experimental.proxy_tensor import make_fx

    leaves, tdef = optree.tree_flatten(params)

    def grads(leaves: list, batch: dict):
        return torch.func.grad_and_value(gpt.loss)(optree.tree_unflatten(tdef, leaves), batch)

    fn = torch.compile(make_fx(grads, tracing_mode="fake")(leaves, batches[0]), fullgraph=True, dynamic=False)
    fn(leaves, batches[0])

    def run() -> float:
        t0 = time.perf_counter()
        for b in batches:
            _, loss = fn(leaves, b)
        float(loss)
        return (time.perf_counter() - t0) / len(batches)
    return run


_MATMULS = ("aten.mm.default", "aten.bmm.default", "aten.addmm.default", "aten.baddbmm.default")


def shape_floor(params: dict, batch: dict, reps: int = 5) -> tuple[float, float, int]:
    """The matmul floor at the model's own shapes: every matrix product of the traced
    forward and backward (``grad_and_value(gpt.loss)`` under ``make_fx``: einsums lowered
    to ``mm``/``bmm``), each timed alone at its shapes on fresh contiguous operands (the best
    of ``reps``), summed. Returns (seconds, FLOPs, products)."""
    from torch.fx.experimental.proxy_tensor import make_fx

    leaves, tdef = optree.tree_flatten(params)

    def grads(leaves: list, batch: dict):
        return torch.func.grad_and_value(gpt.loss)(optree.tree_unflatten(tdef, leaves), batch)

    gm = make_fx(grads, tracing_mode="fake")(leaves, batch)
    shapes: dict[tuple, int] = {}
    for n in gm.graph.nodes:
        if n.op == "call_function" and str(n.target) in _MATMULS:
            args = [a.meta["val"] for a in n.args if isinstance(a, torch.fx.Node)]
            key = (str(n.target), *(tuple(a.shape) for a in args[-2:]))  # (addmm's bias left out)
            shapes[key] = shapes.get(key, 0) + 1
    total_s, flops = 0.0, 0.0
    for (op, a_shape, b_shape), count in shapes.items():
        a, b = torch.randn(a_shape), torch.randn(b_shape)
        fn = torch.bmm if "bmm" in op else torch.mm
        fn(a, b)
        best = float("inf")
        for _ in range(reps):
            t0 = time.perf_counter()
            fn(a, b)
            best = min(best, time.perf_counter() - t0)
        total_s += best * count
        flops += 2 * a.numel() * b_shape[-1] * count
    return total_s, flops, sum(shapes.values())


def gemm_rate(n: int = 1024, reps: int = 10) -> float:
    """FLOP/s of this machine's fp32 ``torch.mm`` of two ``n x n`` matrices (the best of
    ``reps``)."""
    a, b = torch.randn(n, n), torch.randn(n, n)
    torch.mm(a, b)
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        torch.mm(a, b)
        best = min(best, time.perf_counter() - t0)
    return 2 * n**3 / best


def _agree(a: list, b: list, what: str) -> None:
    err = max(float((x - y.detach()).abs().max()) for x, y in zip(a, b))
    if err > 1e-4:
        raise RuntimeError(f"{what}: parameters differ from the compiled step's by {err:.3g}")


def step_sections(cfg: gpt.GPTConfig, batch: int, *, rounds: int, iters: int) -> tuple[list[Section], float]:
    lr, wd, clip = 1e-3, 0.01, 1.0
    params = gpt.init(cfg, 0)
    data = fs.data.Batches(fs.data.load_tokens("stdlib"), batch, cfg.seq_len, seed=0)
    batches = [data.batch_at(i) for i in range(iters)]
    compiled = fs.train_step(gpt.loss, fs.optim.adamw(lr, weight_decay=wd), clip=clip, compile=True)
    eager = fs.train_step(gpt.loss, fs.optim.adamw(lr, weight_decay=wd), clip=clip, donate=True)
    boxes = {"compiled": compiled.init(params), "eager": eager.init(params)}
    loop, tloop = _Eager(params, lr, wd, clip, True), _Compiled(params, lr, wd, clip, True)
    t0 = time.perf_counter()
    boxes["compiled"], m = compiled(boxes["compiled"], batches[0])
    compile_s = float(m["compile_s"])
    _log(f"  compiled in {compile_s:.1f} s (first call {time.perf_counter() - t0:.1f} s)")
    t0 = time.perf_counter()
    tloop(batches[0])
    torch_compile_s = time.perf_counter() - t0
    boxes["eager"], _ = eager(boxes["eager"], batches[0])
    loop(batches[0])
    for b in batches[1:3]:
        boxes["compiled"], _ = compiled(boxes["compiled"], b)
        boxes["eager"], _ = eager(boxes["eager"], b)
        loop(b)
        tloop(b)
    mine = optree.tree_leaves(compiled.params(boxes["compiled"]))
    _agree(mine, optree.tree_leaves(eager.params(boxes["eager"])), "train_step (eager)")
    _agree(mine, loop.leaves, "the eager loop")
    _agree(mine, tloop.leaves, "the torch.compile loop")

    def ours(name: str):
        step = compiled if name == "compiled" else eager

        def run() -> float:
            t0 = time.perf_counter()
            for b in batches:
                boxes[name], m = step(boxes[name], b)
            float(m["loss"])
            return (time.perf_counter() - t0) / len(batches)
        return run

    def plain(fn):
        def run() -> float:
            t0 = time.perf_counter()
            for b in batches:
                loss = fn(b)
            float(loss)
            return (time.perf_counter() - t0) / len(batches)
        return run

    size = f"{batch}x{cfg.seq_len}"
    rows = []
    for label, peer in (("our eager step (donate=True)", ours("eager")), ("the eager PyTorch loop", plain(loop)),
                        ("the loop with torch.compile(loss)", plain(tloop))):
        a, p = alternate(ours("compiled"), peer, rounds)
        rows.append(Row.from_samples(f"train_step(compile=True) vs {label}", size, a, p))
        _log(f"  {rows[-1].case}: ratio {rows[-1].ratio:.2f}")
    bare = _bare_gradient(params, batches)
    step_flops = FL.gpt_step_flops(params, batch=batch, seq_len=cfg.seq_len)
    rate = gemm_rate()
    floor = step_flops / rate
    floors = []
    for label, name in (("train_step(compile=True)", "compiled"), ("our eager step (donate=True)", "eager")):
        a, _ = alternate(ours(name), lambda: floor, rounds)
        floors.append(Row.from_samples(f"{label} vs the matmul floor", size, a, [floor] * len(a)))
    a, _ = alternate(bare, lambda: floor, rounds)
    floors.append(Row.from_samples("the bare gradient, make_fx + torch.compile (no update) vs the matmul floor",
                                   size, a, [floor] * len(a)))
    own_s, own_flops, products = shape_floor(params, batches[0])
    own = []
    for label, run in (("train_step(compile=True)", ours("compiled")), ("the bare gradient (no update)", bare)):
        a, _ = alternate(run, lambda: own_s, rounds)
        own.append(Row.from_samples(f"{label} vs its products at their own shapes", size, a, [own_s] * len(a)))
    notes = (f"{rounds} alternating rounds of {iters} steps; every form checked to give the compiled step's "
             f"parameters after 3 steps",
             f"capture and Inductor compile of train_step: {compile_s:.1f} s; torch.compile of the loss (its first "
             f"step): {torch_compile_s:.1f} s")
    return [
        Section(title=f"one optimizer step of the GPT ({gpt.param_count(params):,} params, fp32), one process: "
                      f"compiled against eager forms",
                peer="as each row names it, on the same model, batch and weights", rows=tuple(rows), notes=notes),
        Section(title="the same step against the matmul floor", peer="the step's model FLOPs at the machine's GEMM rate",
                rows=tuple(floors), target=1.3,
                notes=(f"the matmul floor: {step_flops / 1e9:.2f} GFLOP per step at {rate / 1e9:.1f} GFLOP/s (fp32 "
                       f"torch.mm 1024^3, best of 10) = {floor * 1e3:.2f} ms; the target is the compiled row's",
                       "the bare gradient: forward and backward alone (no clipping, no update), compiled as the "
                       "step is: what Inductor makes of this model's products and element-wise work on this "
                       "machine")),
        Section(title="the same step against its matrix products at their own shapes",
                peer="the time of every product of the traced forward and backward, each alone at its shapes",
                rows=tuple(own),
                notes=(f"{products} products (mm and bmm, the einsums lowered), {own_flops / 1e9:.2f} GFLOP, "
                       f"{own_s * 1e3:.2f} ms when each runs alone at its shapes (best of 5; "
                       f"{own_flops / own_s / 1e9:.1f} GFLOP/s, against {rate / 1e9:.1f} GFLOP/s of the 1024^3 "
                       f"product): a floor for this model's shapes on this machine, where the one above "
                       f"takes every FLOP at the square product's rate",)),
    ], compile_s


def job_section(steps: int, *, quick: bool, rounds: int) -> Section:
    """The default ``fsharded train`` job with ``--compile`` and ``--no-compile``,
    alternating rounds of ``steps // rounds`` steps (each job's steady tokens/s: its first
    step, where the compiled job compiles, excluded); then the whole default job as it
    runs by default (``compile=auto``: compiled, from the cache the rounds filled) and
    with ``--no-compile``, end to end."""
    from fsharded.tools import train

    per_round = max(3, steps // rounds)
    small = ["--preset", "tiny", "--set", "model.vocab_size=256"] if quick else []
    base = ["--steps", str(per_round), "--progress", "off", *small]
    summaries: dict[bool, list] = {True: [], False: []}

    def job(compiled: bool):
        cfg = train.make_config(train.build_parser().parse_args(base + ["--compile" if compiled else "--no-compile"]))

        def run() -> float:
            with contextlib.redirect_stdout(sys.stderr):  # the job's log lines are not the report
                summaries[compiled].append(train.run(cfg, progress="off"))
            return 1.0 / summaries[compiled][-1]["tokens_per_s"]
        return run

    a, p = alternate(job(True), job(False), rounds)
    # The whole default job as it runs by default, twice (its own graph: the learning-rate
    # schedule's length is in it, so the rounds' shorter jobs do not fill the cache for it),
    # and with --no-compile.
    whole = []
    for flags in ([], [], ["--no-compile"]):  # (the default job's own step count unless quick)
        cfg = train.make_config(train.build_parser().parse_args(["--progress", "off", *small, *flags]
                                                                + (["--steps", str(steps)] if quick else [])))
        with contextlib.redirect_stdout(sys.stderr):
            whole.append(train.run(cfg, progress="off"))
    first = summaries[True][0]
    times = ", ".join(f"{x['compile_s']:.1f} s" for x in summaries[True])
    row = Row.from_samples(f"fsharded train --compile vs --no-compile ({first['backend']} mesh {first['mesh']}), "
                           f"per token", "default job", a, p)
    return Section(
        title="the default `fsharded train` job, compiled and eager",
        peer="the same job with --no-compile",
        rows=(row,), target=1 / 1.4,
        notes=(f"{rounds} alternating rounds of a {per_round}-step job each; steady tokens/s (the first step "
               f"excluded): compiled {1 / row.ours_s:,.0f}, eager {1 / row.peer_s:,.0f}: "
               f"{row.peer_s / row.ours_s:.2f} times the eager rate (target: at least 1.4)",
               f"compile time per job (capture and Inductor, the first step): "
               f"{times}; the later jobs hit Inductor's "
               f"cache of the first one's kernels",
               f"final losses: compiled {summaries[True][-1]['final_loss']:.5f}, eager "
               f"{summaries[False][-1]['final_loss']:.5f}",
               f"the whole default job ({whole[0]['steps']} steps, end to end, the model built and the "
               f"validation included), as it runs by default (compile=auto: "
               f"{'compiled' if whole[0]['compile_s'] > 0 else 'eager'}): {whole[0]['elapsed_s']:.1f} s the first "
               f"time ({whole[0]['compile_s']:.1f} s of it compiling), {whole[1]['elapsed_s']:.1f} s again "
               f"({whole[1]['compile_s']:.1f} s compiling{', from Inductor cache' if whole[1]['compile_s'] else ''}); "
               f"with --no-compile "
               f"{whole[2]['elapsed_s']:.1f} s"),
    )


def build_parser(prog: str | None = None) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog or "fsharded bench compile", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="tiny model, few steps (smoke run)")
    add_output_args(p)
    p.add_argument("--rounds", type=int, default=None)
    p.add_argument("--no-ranks", action="store_true", help="skip the 2-rank section (ZeRO-3 against FSDP2)")
    p.add_argument("--warm-cache", action="store_true",
                   help="use Inductor's usual cache (compile times then depend on earlier runs); by default the "
                        "run starts from an empty cache of its own")
    p.add_argument("--job-steps", type=int, default=None, help="steps of the default job per round (default 60)")
    return p


def main(argv: Sequence[str] | None = None, *, prog: str | None = None) -> int:
    args = build_parser(prog).parse_args(argv)
    with contextlib.ExitStack() as stack:
        if not args.warm_cache:  # compile times from nothing: Inductor's kernels cached in this run only
            cache = stack.enter_context(tempfile.TemporaryDirectory(prefix="fsharded-inductor-"))
            stack.enter_context(_environ(TORCHINDUCTOR_CACHE_DIR=cache))
        return _main(args)


@contextlib.contextmanager
def _environ(**env: str):
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _main(args: argparse.Namespace) -> int:
    report = Report("compile", params={"torch": torch.__version__, "threads": torch.get_num_threads(),
                                       "inductor_cache": "warm" if args.warm_cache else "empty at the start"})
    if args.quick:
        cfg, batch, rounds, iters, job_steps = gpt.GPTConfig.tiny(vocab_size=256), 4, args.rounds or 3, 3, 9
    else:
        cfg, batch, rounds, iters, job_steps = gpt.GPTConfig.small(), 16, args.rounds or 5, 10, 300
    job_steps = args.job_steps * rounds if args.job_steps else job_steps
    _log("one optimizer step ...")
    sections, _ = step_sections(cfg, batch, rounds=rounds, iters=iters)
    report.sections += sections
    if not args.no_ranks:
        from fsharded.bench import _compile_ranks

        _log("ZeRO-3 on 2 gloo ranks, against FSDP2 + compile ...")
        report.sections.append(_compile_ranks.section(quick=args.quick, batch=2 if args.quick else 8,
                                                      rounds=rounds, iters=iters))
    _log("the default fsharded train job ...")
    report.sections.append(job_section(job_steps, quick=args.quick, rounds=rounds))
    report.finish()
    report.emit(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
