"""``fsharded bench inference``: generation with fsharded's cache against Hugging Face's
``generate`` on the same weights, fp32 / bf16 / int8 decoding, and continuous against
static batching on a trace of requests of mixed lengths.

    fsharded bench inference                 # Llama-style GPTs of 0.8M, 22M and 140M parameters
    fsharded bench inference --quick         # a small one, few tokens (smoke run)

The models are the bundled GPT in its Llama form (``GPTConfig.llama_style``: rotary
positions, RMSNorm, SwiGLU, grouped-query heads, an untied head), exported with
``fs.inference.to_transformers`` to ``LlamaForCausalLM`` for transformers' side, so both
run the same weights; every measured pair is checked to give the same greedy tokens first.
All in one process on this machine's threads.

- **Against Hugging Face** (the 0.8M and the 22M model; ``model.generate``, greedy, with
  its dynamic cache, and with its static cache and ``torch.compile`` of the forward,
  transformers' recipe, unless ``--no-hf-compile``): the prompt's forward (prefill) and
  the time per decoded token at batch 1 and 16, ours eager and with
  ``generate(..., compile=True)``. A decoded token's time is
  ``(T(P, N) - T(P, 1)) / (N - 1)``: a run producing ``N`` tokens less a run producing
  one, on both sides.
- **Weights** (the 140M model, where reading the weights dominates a token): our compiled
  decode at batch 1 and 16 in bf16 (the peer), fp32 and int8 weight-only
  (``fs.inference.quantize``, a scale per channel, bf16 activations). Decoding one token
  at batch 1 reads every weight once: the int8 row is where half the bytes should show.
- **Continuous batching**: a trace of requests (prompts of 8-96 tokens, 4-96 new tokens,
  drawn with a fixed seed) served by ``fs.inference.Engine`` against static batching,
  ``generate`` on consecutive groups of ``--max-seqs`` requests (a group's prompts padded
  to its longest and decoded for its longest), with the same cache memory: the static
  groups' worst case, which the engine holds as pages and fills with up to four times as
  many requests. The measure is the trace's wall time; both produce the same tokens for
  every request.
- **ZeRO-Inference**: decoding with the blocks streamed per layer from files
  (``fs.inference.stream_weights(..., "nvme", --nvme-path)``) against the disk's floor
  (the bytes read per token at the read bandwidth the same I/O pool measures on that
  disk in the same run) and against the weights in memory; and streamed from host memory.
- DeepSpeed's ``init_inference`` where DeepSpeed imports (``DS_ACCELERATOR=cpu``): its
  module in fp32 without kernel injection (the CPU has no injected kernels) running
  transformers' ``generate``; a row says so where it does not run.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from typing import Any

import optree
import torch

import fsharded as fs
from fsharded.bench import Report, Row, Section, add_output_args, alternate
from fsharded.models import gpt

__all__ = ["main", "build_parser"]


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


SIZES = {  # the Llama-form GPT at three sizes (quick: all tiny)
    "small": dict(),  # GPTConfig.llama_style's own: 4 layers, d_model 128 (0.8M parameters)
    "medium": dict(d_model=512, n_layers=8, n_heads=8, mlp_ratio=1376 / 512),  # 22M
    "large": dict(d_model=1024, n_layers=12, n_heads=16, mlp_ratio=2752 / 1024),  # 140M
}


def _model(quick: bool, size: str = "medium") -> tuple[gpt.GPTConfig, dict]:
    if quick:
        cfg = gpt.GPTConfig.llama_style(d_model=64, n_layers=2, n_heads=4, vocab_size=256, seq_len=256)
    else:
        cfg = gpt.GPTConfig.llama_style(vocab_size=256, seq_len=1024, **SIZES[size])
    return cfg, gpt.init(cfg, 0)


def _prompts(batch: int, length: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(1, 256, (batch, length), generator=g).tolist()  # (0 is transformers' pad id here)


def _hf_generate(model: Any, prompts: list[list[int]], n: int, static: bool) -> list[list[int]]:
    kw = dict(cache_implementation="static") if static else {}
    ids = torch.tensor(prompts)
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                             do_sample=False, pad_token_id=0, eos_token_id=None, **kw)
    return out[:, len(prompts[0]):].tolist()


def _timed(fn: Callable[[], Any], reps: int, warm: int = 1) -> float:
    """The median of ``reps`` timed calls (after ``warm`` untimed)."""
    for _ in range(warm):
        fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _per_token(run: Callable[[int], Any], n: int, reps: int, warm: int = 1) -> tuple[float, float]:
    """(prefill seconds, seconds per decoded token) of ``run(new_tokens)``."""
    one = _timed(lambda: run(1), reps, warm)
    many = _timed(lambda: run(n), reps, warm)
    return one, (many - one) / (n - 1)


def hf_section(cfg, params, *, batches, prompt_len: int, new: int, reps: int, hf_compile: bool) -> Section:
    model = fs.inference.to_transformers(params, cfg)
    compiled = None
    if hf_compile:  # transformers' recipe: a static cache and torch.compile of the forward
        compiled = fs.inference.to_transformers(params, cfg)
        compiled.forward = torch.compile(compiled.forward, fullgraph=True)
        # Its static cache is sized by each call's prompt and new tokens, and the prefill and
        # the decode steps are graphs of their own: one compile per (batch, length) measured,
        # more than dynamo's default limit of 8 (the warm-up calls make them).
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
    rows, notes, measured = [], [], []
    for b in batches:
        prompts = _prompts(b, prompt_len)
        ours = fs.inference.generate(params, prompts, new).tokens
        if ours != _hf_generate(model, prompts, new, False) or ours != fs.inference.generate(
                params, prompts, new, compile=True).tokens:
            raise RuntimeError(f"bench inference: batch {b}: fsharded and transformers disagree on the greedy tokens")
        size = f"batch {b}, prompt {prompt_len}"
        mine = _per_token(lambda k, ps=prompts: fs.inference.generate(params, ps, k), new, reps)
        fast = _per_token(lambda k, ps=prompts: fs.inference.generate(params, ps, k, compile=True), new, reps)
        hf = _per_token(lambda k, ps=prompts: _hf_generate(model, ps, k, False), new, reps)
        rows += [Row("decode per token, ours eager vs transformers (dynamic cache)", size, mine[1], hf[1]),
                 Row("decode per token, ours compiled vs transformers (dynamic cache)", size, fast[1], hf[1]),
                 Row("prefill vs transformers (dynamic cache)", size, mine[0], hf[0])]
        _log(f"  batch {b}: decode ours {mine[1] * 1e3:.2f} / compiled {fast[1] * 1e3:.2f} ms, hf {hf[1] * 1e3:.2f}; "
             f"prefill {mine[0] * 1e3:.1f} vs {hf[0] * 1e3:.1f} ms")
        measured.append((b, size, prompts, ours, fast[1]))
    for b, size, prompts, ours, fast_s in measured if compiled is not None else ():
        # (after every other measure: its compiles leave worker threads that slow eager runs after them)
        if _hf_generate(compiled, prompts, new, True) != ours:
            raise RuntimeError(f"bench inference: batch {b}: transformers compiled gives other greedy tokens")
        hfc = _per_token(lambda k, ps=prompts: _hf_generate(compiled, ps, k, True), new, reps, warm=2)
        rows.append(Row("decode per token, ours compiled vs transformers (static cache, compiled)", size, fast_s,
                        hfc[1]))
        _log(f"  batch {b}: transformers compiled {hfc[1] * 1e3:.2f} ms per token")
    notes.append(f"{new} new tokens per run; a decoded token's time is (T(prompt, {new}) - T(prompt, 1)) / "
                 f"{new - 1}, the median of {reps} runs each after warm-up ones (which compile); the same greedy "
                 f"tokens on every side (checked)")
    notes.append("ours compiled: generate(..., compile=True), one torch.compile'd decode step of static shapes; "
                 "transformers compiled: cache_implementation='static' with torch.compile(model.forward, "
                 "fullgraph=True), compiled anew for each batch and length (its cache_position and cache sizes)")
    notes.append("the target (decode at least 1.5x transformers at batch 1) is the compiled rows' ratio <= 0.67")
    return Section(title=f"generation vs transformers' generate on the same weights ({_describe(cfg, params)})",
                   peer="LlamaForCausalLM.generate (greedy)", rows=tuple(rows), target=1 / 1.5, notes=tuple(notes))


def _describe(cfg, params) -> str:
    n = sum(x.numel() for x in optree.tree_leaves(params))
    return f"{n / 1e6:.1f}M parameters, {cfg.n_layers} layers, d_model {cfg.d_model}, fp32"


def dtype_sections(cfg, params, *, batches, prompt_len: int, new: int, reps: int) -> tuple[Section, Section]:
    """Our compiled decode, and the prefill, in fp32 and int8 against bf16 (``cfg``: a model
    large enough that reading the weights dominates a decoded token)."""
    bf16 = fs.inference.quantize(params, dtype=torch.bfloat16)  # (for the int8 row)
    forms = {
        "bf16": optree.tree_map(lambda x: x.to(torch.bfloat16), params),
        "fp32": params,
        "int8 weight-only (per channel), bf16 activations": bf16,
    }
    rows, pre_rows = [], []
    for b in batches:
        prompts = _prompts(b, prompt_len, seed=1)
        both = {name: _per_token(lambda k, p=p, ps=prompts: fs.inference.generate(p, ps, k, compile=True), new,
                                 reps) for name, p in forms.items()}
        pre, per = {k: v[0] for k, v in both.items()}, {k: v[1] for k, v in both.items()}
        for name in ("fp32", "int8 weight-only (per channel), bf16 activations"):
            rows.append(Row(f"decode per token: {name} vs bf16", f"batch {b}", per[name], per["bf16"]))
            pre_rows.append(Row(f"prefill: {name} vs bf16", f"batch {b}, prompt {prompt_len}", pre[name],
                                pre["bf16"]))
        _log(f"  batch {b}: " + ", ".join(f"{k} {v * 1e3:.2f} ms" for k, v in per.items()))
    weights = {name: sum(x.numel() * x.element_size() for x in optree.tree_leaves(forms[name]))
               for name in ("fp32", "bf16")}
    int8_bytes = sum(w.nbytes for blk in bf16["blocks"] for w in (*blk["attn"].values(), *blk["mlp"].values())
                     if isinstance(w, fs.inference.Int8Weight)) + bf16["head"].nbytes
    notes = (f"weights read per decoded token: fp32 {weights['fp32'] / 1e6:.1f} MB, bf16 {weights['bf16'] / 1e6:.1f} "
             f"MB; int8 projections and head {int8_bytes / 1e6:.1f} MB plus the bf16 embedding and norms",
             "each form decodes through generate(..., compile=True); the int8 product on CPU is fsharded's C++ "
             "one (csrc/int8_matmul.cpp) for decoding rows; the target is the int8 row at batch 1")
    prefill = Section(title=f"prefill in fp32 and int8 weight-only against bf16 ({_describe(cfg, params)})",
                      peer="our prefill in bf16", rows=tuple(pre_rows),
                      notes=(f"the prompt's forward filling the cache and giving the first token (T(prompt, 1), the "
                             f"median of {reps} runs; tokens/s = batch x {prompt_len} / time); eager in every form "
                             f"(the compiled step is the decode's); an int8 prefill runs the int8 product over "
                             f"every prompt row",))
    return Section(title=f"decoding in fp32 and int8 weight-only against bf16 ({_describe(cfg, params)})",
                   peer="our decode in bf16",
                   rows=tuple(rows), target=1 / 1.5, notes=notes), prefill


def _trace(n: int, seed: int, max_prompt: int, max_new: int) -> tuple[list[list[int]], list[int]]:
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(8, max_prompt + 1, (n,), generator=g).tolist()
    news = torch.randint(4, max_new + 1, (n,), generator=g).tolist()
    return [torch.randint(0, 256, (k,), generator=g).tolist() for k in lens], news


def batching_section(params, *, n: int, max_seqs: int, max_prompt: int, max_new: int, rounds: int) -> Section:
    prompts, news = _trace(n, 7, max_prompt, max_new)
    page = 16
    slots = max_seqs * (max_prompt + max_new)  # what static batching of max_seqs rows may need at once

    def static() -> list[list[int]]:
        out = []
        for i in range(0, n, max_seqs):
            group = prompts[i:i + max_seqs]
            toks = fs.inference.generate(params, group, max(news[i:i + max_seqs])).tokens
            out += [t[:k] for t, k in zip(toks, news[i:i + max_seqs])]
        return out

    stats: dict[str, int] = {}

    def continuous() -> list[list[int]]:
        e = fs.inference.Engine(params, max_batch_tokens=256, max_seqs=4 * max_seqs, page_size=page,
                                pages=slots // page)
        ids = [e.add_request(p, k) for p, k in zip(prompts, news)]
        e.run()
        stats.update(steps=e.steps, preemptions=e.preemptions)
        return [e.requests[i].tokens for i in ids]

    if static() != continuous():
        raise RuntimeError("bench inference: continuous and static batching disagree on the trace's tokens")

    def timed(fn):
        def run() -> float:
            t0 = time.perf_counter()
            fn()
            return time.perf_counter() - t0
        return run

    a, b = alternate(timed(continuous), timed(static), rounds)
    total = sum(news)
    row = Row.from_samples("the trace's wall time: Engine vs generate on groups", f"{n} requests", a, b)
    notes = (f"prompts of 8-{max_prompt} tokens, {sum(news)} new tokens in all (4-{max_new} each); throughput "
             f"{total / row.ours_s:,.0f} vs {total / row.peer_s:,.0f} new tokens/s; {rounds} alternating rounds, "
             f"medians; every request's tokens equal on both sides (checked)",
             f"the same cache memory: static batching runs groups of {max_seqs} (each row's slots sized for the "
             f"longest prompt and continuation the trace may hold, {max_prompt + max_new}); the engine holds the same "
             f"{slots} slots as {slots // page} pages of {page} and runs up to {4 * max_seqs} requests at once, "
             f"256 tokens per step, admitting a request where the free pages hold its prompt and half its remaining "
             f"new tokens beyond what the running requests still need, counted alike (reserve=0.5, the default); "
             f"{stats['steps']} steps, "
             f"{stats['preemptions']} preemptions",
             "the target (continuous at least 2x static's throughput) is this row's ratio <= 0.5")
    return Section(title="continuous batching vs static batching on a trace of mixed lengths",
                   peer="generate on consecutive groups (padded, each decoded for its longest)", rows=(row,),
                   target=0.5, notes=notes)


def stream_section(cfg, params, *, prompt_len: int, new: int, reps: int, path: str) -> Section:
    from fsharded.bench.offload import disk_bandwidth

    prompts = _prompts(1, prompt_len, seed=3)
    want = fs.inference.generate(params, prompts, new).tokens
    nvme = fs.inference.stream_weights(params, "nvme", path, prefetch=1)
    host = fs.inference.stream_weights(params, "cpu", prefetch=1)
    try:
        for s in (nvme, host):
            if fs.inference.generate(s, prompts, new).tokens != want:
                raise RuntimeError("bench inference: streamed weights give other tokens than in memory")
        mem = _per_token(lambda k: fs.inference.generate(params, prompts, k), new, reps)[1]
        disk = _per_token(lambda k: fs.inference.generate(nvme, prompts, k), new, reps)[1]
        hostt = _per_token(lambda k: fs.inference.generate(host, prompts, k), new, reps)[1]
        _, read_bw = disk_bandwidth(path)
        floor = nvme["blocks"].nbytes / read_bw
        _log(f"  in memory {mem * 1e3:.2f} ms, NVMe {disk * 1e3:.2f} ms (floor {floor * 1e3:.2f}), "
             f"host {hostt * 1e3:.2f} ms per token")
        rows = (Row("decode per token, blocks streamed from files vs the disk's floor", "batch 1", disk, floor),
                Row("decode per token, blocks streamed from files vs in memory", "batch 1", disk, mem),
                Row("decode per token, blocks streamed from host memory vs in memory", "batch 1", hostt, mem))
        notes = (f"{nvme['blocks'].nbytes / 1e6:.1f} MB of block weights read per token (every block once, "
                 f"prefetch 1: the next block read while one computes); the disk's floor is that at the "
                 f"{read_bw / 1e9:.2f} GB/s the same I/O pool reads {path!r} with O_DIRECT in the same run",
                 "on a CPU-only machine the host tier copies each block into a staging buffer (the copy a GPU "
                 "would make to its memory)")
    finally:
        nvme["blocks"].close()
    return Section(title="ZeRO-Inference: the blocks streamed per layer from files and from host memory",
                   peer="as each row names it", rows=rows, notes=notes)


def deepspeed_section(cfg, params, *, prompt_len: int, new: int, reps: int) -> Section:
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    try:
        import deepspeed
    except Exception as e:  # noqa: BLE001 - any failure to import is "not here"
        return Section(title="DeepSpeed init_inference", peer="deepspeed.init_inference", rows=(),
                       notes=(f"not run: DeepSpeed does not import here ({type(e).__name__}: {e})",))
    model = fs.inference.to_transformers(params, cfg)
    try:
        engine = deepspeed.init_inference(model, dtype=torch.float32, replace_with_kernel_inject=False)
        ds_model = engine.module
    except Exception as e:  # noqa: BLE001
        return Section(title="DeepSpeed init_inference", peer="deepspeed.init_inference", rows=(),
                       notes=(f"not run: init_inference failed on this CPU ({type(e).__name__}: {e})",))
    prompts = _prompts(1, prompt_len, seed=2)
    if fs.inference.generate(params, prompts, new).tokens != _hf_generate(ds_model, prompts, new, False):
        raise RuntimeError("bench inference: DeepSpeed's module gives other greedy tokens")
    mine = _per_token(lambda k: fs.inference.generate(params, prompts, k), new, reps)
    theirs = _per_token(lambda k: _hf_generate(ds_model, prompts, k, False), new, reps)
    rows = (Row("decode, per token", f"batch 1, prompt {prompt_len}", mine[1], theirs[1]),
            Row("prefill", f"batch 1, prompt {prompt_len}", mine[0], theirs[0]))
    return Section(title=f"DeepSpeed {deepspeed.__version__} init_inference (fp32, no kernel injection on CPU)",
                   peer="init_inference(...).module.generate", rows=rows,
                   notes=("DeepSpeed's injected inference kernels are CUDA kernels; on CPU init_inference wraps "
                          "the transformers module",))


def build_parser(prog: str | None = None) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="a small model and few tokens (smoke run)")
    p.add_argument("--reps", type=int, default=None, help="timed runs per measure (default 5, quick 2)")
    p.add_argument("--max-seqs", type=int, default=8, help="requests at once in the batching section (default 8)")
    p.add_argument("--hf-compile", action=argparse.BooleanOptionalAction, default=True,
                   help="also time transformers with its static cache and torch.compile (default on)")
    p.add_argument("--no-deepspeed", action="store_true", help="skip DeepSpeed's init_inference")
    p.add_argument("--nvme-path", default=None, help="where the streamed weights' files go (default: a temporary "
                   "directory)")
    add_output_args(p)
    return p


def main(argv: Sequence[str] | None = None, *, prog: str | None = None) -> int:
    args = build_parser(prog).parse_args(argv)
    reps = args.reps or (2 if args.quick else 5)
    cfg, params = _model(args.quick)
    report = Report("inference", params={"torch": torch.__version__, "threads": torch.get_num_threads(),
                                         "model": _describe(cfg, params)})
    new, prompt_len = (8, 16) if args.quick else (32, 128)
    batches = (1, 4) if args.quick else (1, 16)
    for size in ("medium",) if args.quick else ("small", "medium"):
        time.sleep(2)  # (let the threads of earlier compiles go idle)
        _log(f"against transformers' generate ({size}) ...")
        c, p = _model(args.quick, size)
        report.sections.append(hf_section(c, p, batches=batches, prompt_len=prompt_len, new=new, reps=reps,
                                          hf_compile=args.hf_compile))
    time.sleep(2)
    _log("fp32 / bf16 / int8 ...")
    c, p = _model(args.quick, "large")
    report.sections.extend(dtype_sections(c, p, batches=batches, prompt_len=prompt_len, new=new, reps=reps))
    del c, p
    _log("continuous vs static batching ...")
    report.sections.append(batching_section(params, n=8 if args.quick else 48, max_seqs=args.max_seqs,
                                            max_prompt=24 if args.quick else 96, max_new=12 if args.quick else 96,
                                            rounds=2 if args.quick else 3))
    _log("ZeRO-Inference ...")
    path = args.nvme_path or tempfile.mkdtemp(prefix="fsharded-bench-")
    report.sections.append(stream_section(cfg, params, prompt_len=prompt_len, new=new, reps=reps, path=path))
    if not args.no_deepspeed:
        _log("DeepSpeed init_inference ...")
        report.sections.append(deepspeed_section(cfg, params, prompt_len=prompt_len, new=new, reps=reps))
    report.finish()
    report.emit(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
