"""``fsharded bench train``: the cost of ``train_step`` against a plain PyTorch loop.

    fsharded bench train            # GPT "small" (0.84 M params), batch 16x128, fp32
    fsharded bench train --quick    # tiny shapes, a smoke run
    fsharded bench train --markdown

Section 1 times one optimizer step of the same functional GPT on the same batch:
``train_step`` (value_and_grad, shard_map, our AdamW, mesh-aware clipping) against the
eager PyTorch loop a user would write (``loss.backward()``, ``clip_grad_norm_``,
``torch.optim.AdamW``), alternating in one run: the pure step (a new state each step) and
the donated one (``donate=True``: the state updated in place, as the eager loop's). Both are checked to produce the same
loss and parameters before timing. Section 2 runs the default ``fsharded train`` job and
the eager loop at the same batch, alternating within each round, and reports their
tokens/s.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import time
from collections.abc import Sequence

import optree
import torch

import fsharded as fs
from fsharded.bench import Report, Row, Section, add_output_args, alternate
from fsharded.models import gpt


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


class _Eager:
    """The plain loop: autograd on leaf tensors, clip_grad_norm_, torch.optim.AdamW."""

    def __init__(self, params, lr, wd, clip, foreach):
        self.params = optree.tree_map(lambda x: x.detach().clone().requires_grad_(), params)
        self.leaves = optree.tree_leaves(self.params)
        self.opt = torch.optim.AdamW(self.leaves, lr=lr, weight_decay=wd, foreach=foreach)
        self.clip = clip

    def __call__(self, batch) -> float:
        loss = gpt.loss(self.params, batch)
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.leaves, self.clip)
        self.opt.step()
        return loss.detach()


def _check(ours_state, step, eager: _Eager, case: str) -> None:
    # fp32, a few steps: the two differ by summation order only (~1e-6 relative).
    for a, b in zip(optree.tree_leaves(step.params(ours_state)), eager.leaves):
        err = float((a - b.detach()).abs().max())
        if err > 1e-4:
            raise RuntimeError(f"{case}: parameters differ from the eager loop by {err:.3g}")


def step_section(cfg: gpt.GPTConfig, batch: int, meshes: Sequence[dict], *, rounds: int, iters: int) -> Section:
    lr, wd, clip = 1e-3, 0.01, 1.0
    params = gpt.init(cfg, 0)
    data = fs.data.Batches(fs.data.load_tokens("stdlib"), batch, cfg.seq_len, seed=0)
    batches = [data.batch_at(i) for i in range(iters)]
    rows = []
    # (donate, foreach): the pure step against torch's default CPU AdamW (a for-loop) and
    # its foreach form; the donated step (its state updated in place, as the eager loop's
    # parameters are) against the faster of the two.
    for donate, foreach in ((False, False), (False, True), (True, True)):
        for mesh_axes in meshes:
            mesh = fs.Mesh(mesh_axes)
            step = fs.train_step(gpt.loss, fs.optim.adamw(lr, weight_decay=wd), mesh=mesh, clip=clip,
                                 donate=donate)
            state = step.init(params)
            eager = _Eager(params, lr, wd, clip, foreach)
            for b in batches[:3]:  # warm up both, then check they agree
                state, _ = step(state, b)
                eager(b)
            _check(state, step, eager, str(mesh_axes))
            box = {"state": state}

            def ours(step=step, box=box) -> float:
                t0 = time.perf_counter()
                for b in batches:
                    box["state"], m = step(box["state"], b)
                float(m["loss"])
                return (time.perf_counter() - t0) / len(batches)

            def peer(eager=eager) -> float:
                t0 = time.perf_counter()
                for b in batches:
                    loss = eager(b)
                float(loss)
                return (time.perf_counter() - t0) / len(batches)

            a, p = alternate(ours, peer, rounds)
            label = "one process" if mesh.size == 1 else f"virtual {mesh!r}"
            peer_name = "AdamW(foreach)" if foreach else "AdamW(for-loop)"
            kind = "train_step(donate=True)" if donate else "train_step"
            rows.append(Row.from_samples(f"{kind}, {label} vs eager + {peer_name}",
                                         f"{batch}x{cfg.seq_len}", a, p))
            _log(f"  {rows[-1].case}: ratio {rows[-1].ratio:.2f}")
    return Section(
        title=f"one optimizer step of the GPT ({gpt.param_count(params):,} params, fp32): train_step vs eager PyTorch",
        peer="the same functional model with loss.backward(), clip_grad_norm_ and torch.optim.AdamW",
        rows=tuple(rows),
        target=1.05,
        notes=(f"{rounds} alternating rounds of {iters} steps; both checked to give the same parameters",
               "train_step returns a new state (the update runs on copies of the parameters and moments); "
               "train_step(donate=True) consumes its state and updates it in place, as the eager loop does"),
    )


def job_section(steps: int, *, quick: bool, rounds: int = 5) -> Section:
    """The default `fsharded train` job, and the eager loop on the same model and batch,
    alternating within each of ``rounds`` rounds (which goes first swapped every round, as
    ``alternate`` does): a round runs the job for ``steps // rounds`` steps (its steady
    tokens/s: the first, warm-up step excluded) and the eager loop for as many steps."""
    from fsharded.tools import train

    per_round = max(3, steps // rounds)
    args = train.build_parser().parse_args(
        ["--steps", str(per_round), "--progress", "off"]
        + (["--preset", "tiny", "--set", "model.vocab_size=256"] if quick else []))
    cfg = train.make_config(args)
    mcfg = train.build_model_config(cfg)
    global_batch = cfg.micro_batch_size * cfg.data_parallel_size
    tok = global_batch * mcfg.seq_len
    eager = _Eager(gpt.init(mcfg, cfg.seed), cfg.optimizer.lr, cfg.optimizer.weight_decay, cfg.grad_clip, True)
    data = fs.data.Batches(fs.data.load_tokens(cfg.data), global_batch, mcfg.seq_len, seed=cfg.seed)
    eager(data.batch_at(0))
    summaries: list[dict] = []
    at = [1]

    def ours() -> float:
        with contextlib.redirect_stdout(sys.stderr):  # the job's log lines are not the report
            summaries.append(train.run(cfg, progress="off"))
        return tok / summaries[-1]["tokens_per_s"]

    def peer() -> float:
        t0 = time.perf_counter()
        for _ in range(per_round):
            loss = eager(data.batch_at(at[0]))
            at[0] += 1
        float(loss)
        return (time.perf_counter() - t0) / per_round

    a, p = alternate(ours, peer, rounds)
    row = Row.from_samples(f"fsharded train ({summaries[0]['backend']} mesh {summaries[0]['mesh']}), per step",
                           f"{global_batch}x{mcfg.seq_len}", a, p)
    last = summaries[-1]
    return Section(
        title="the default `fsharded train` job",
        peer="eager PyTorch loop (AdamW foreach) on the same model and global batch, one process",
        rows=(row,),
        notes=(f"{rounds} alternating rounds: a {per_round}-step `fsharded train` job (its steady tokens/s, "
               f"the first step excluded) and {per_round} eager steps, medians; ours {tok / row.ours_s:,.0f} "
               f"tokens/s, eager {tok / row.peer_s:,.0f} tokens/s",
               f"each job: loss {last['first_loss']:.3f} -> {last['final_loss']:.3f} over {per_round} steps"),
    )


def build_parser(prog: str | None = None) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog or "fsharded bench train", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="tiny model, few steps (smoke run)")
    add_output_args(p)
    p.add_argument("--rounds", type=int, default=None)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--job-steps", type=int, default=None, help="steps of the default job (default 300)")
    return p


def main(argv: Sequence[str] | None = None, *, prog: str | None = None) -> int:
    args = build_parser(prog).parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    report = Report("train", params={"torch": torch.__version__, "threads": torch.get_num_threads()})
    if args.quick:
        cfg, batch, rounds, iters, job_steps = gpt.GPTConfig.tiny(vocab_size=256), 4, args.rounds or 3, 3, args.job_steps or 5
    else:
        cfg, batch, rounds, iters, job_steps = gpt.GPTConfig.small(), 16, args.rounds or 7, 10, args.job_steps or 300
    _log("train_step vs eager PyTorch ...")
    report.sections.append(step_section(cfg, batch, [{"data": 1}, {"data": 2}], rounds=rounds, iters=iters))
    _log("the default fsharded train job ...")
    report.sections.append(job_section(job_steps, quick=args.quick, rounds=3 if args.quick else 5))
    report.finish()
    report.emit(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
