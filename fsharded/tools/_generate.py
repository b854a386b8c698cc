"""``fsharded generate``: continue a prompt with a GPT trained by ``fsharded train``.

    fsharded generate --checkpoint checkpoints --prompt "def main(" --max-new-tokens 64
    fsharded generate --checkpoint checkpoints/step-00000300 --prompt "import " \\
        --temperature 0.8 --top-p 0.95 --seed 1
    fsharded generate --checkpoint checkpoints --prompt-tokens 100,101,102 --greedy --json
    fsharded generate --checkpoint checkpoints --prompt "class " --int8 --dtype bf16
    fsharded generate --checkpoint ./my-llama --prompt "Once upon a time" --mesh tensor=2

``--checkpoint`` is a checkpoint directory (``step-N``), a save directory (its newest
intact checkpoint), a ``.safetensors`` file written by ``fsharded export`` (whose
metadata holds the model's config), or a Hugging Face causal LM's directory (written by
its ``save_pretrained``: ``config.json`` and the weights, and a tokenizer for text
prompts), which decodes with fsharded's cache in place of its own and, without
``--stop``, ends a continuation at the model's end-of-sequence tokens as its
``generate`` does. The model is rebuilt from the settings the run recorded beside its
checkpoints (``job.json``); a checkpoint without them (``step.save``, or an fsharded that
did not record the model) takes ``--preset`` and ``--set model.KEY=VALUE`` as the run was
given them. The parameters are the run's master weights (``params`` of the train state),
cast to ``--dtype``, or with ``--int8`` the projections and head quantized to int8 from
them (``fs.inference.quantize``). Text prompts are encoded as the run's data was: bytes for text (the
stdlib corpus and text files); a run on a ``.bin`` token file takes ``--prompt-tokens``.

It prints each prompt with its continuation (or the token ids), then the prefill and
decode rates in tokens per second; ``--json`` prints one JSON object instead.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import optree
import torch

from fsharded import checkpoint, distributed, inference
from fsharded import random as R
from fsharded.inference._hf import HFDecoder
from fsharded.inference._sharded import check_divides
from fsharded.mesh import Mesh
from fsharded.mesh._spec import shard_shape
from fsharded.models import gpt
from fsharded.tools import _train_resume
from fsharded.tools.train import parse_mesh

__all__ = ["Loaded", "load_model", "build_parser", "main"]

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass
class Loaded:
    """A model as ``fsharded generate`` runs it: a trained GPT's ``params`` (full tensors)
    and ``config``, or a Hugging Face causal LM (``params`` the module, ``config`` None, its
    ``tokenizer`` where the directory holds one); ``model_state`` (MoE routing biases, or
    None), the data's ``encoding`` ("bytes", "tokenizer" or None), the step and directory
    it was saved at, and the tokens that end a continuation by default (``eos``)."""

    params: Any
    config: gpt.GPTConfig | None
    model_state: Any
    encoding: str | None
    step: int | None
    directory: str
    mesh: Mesh | None = None
    tokenizer: Any = None
    eos: tuple[int, ...] = ()

    @property
    def moe(self) -> Any:
        return self.config.moe if self.config is not None else None

    def encode(self, text: str) -> list[int]:
        if self.tokenizer is not None:
            return list(self.tokenizer(text)["input_ids"])
        if self.config is None:
            raise ValueError(f"generate: {self.directory} holds no tokenizer (tokenizer.json, tokenizer_config.json, "
                             f"tokenizer.model or vocab.json): give the prompt as token ids (--prompt-tokens; "
                             f"serve: \"tokens\")")
        if self.encoding != "bytes":
            raise ValueError(f"generate: {self.directory} was trained on token ids of another tokenizer, which "
                             f"fsharded cannot encode: give --prompt-tokens")
        return list(text.encode("utf-8"))

    def decode(self, tokens: Sequence[int]) -> str | None:
        if self.tokenizer is not None:
            return self.tokenizer.decode(list(tokens), skip_special_tokens=True)
        return bytes(tokens).decode("utf-8", errors="replace") if self.encoding == "bytes" else None


def resolve(path: str) -> str:
    """A checkpoint directory: ``path`` itself, or the newest intact one under it."""
    if not os.path.isdir(path):
        raise ValueError(f"generate: --checkpoint {path}: no such directory")
    if os.path.exists(os.path.join(path, "manifest.json")):
        return path
    latest = checkpoint.Manager(path, keep=None).latest()
    if latest is None:
        raise ValueError(f"generate: --checkpoint {path} is neither a checkpoint (no manifest.json) nor a save "
                         f"directory holding one (no intact step-N under it)")
    return latest


def _config(directory: str, record: dict | None, preset: str | None, sets: Sequence[str]) -> gpt.GPTConfig:
    if preset is None and not sets and record is not None and "model" in record:
        return gpt.GPTConfig.from_dict(record["model"])
    if preset is None and not sets:
        raise ValueError(f"generate: {directory} does not record its model's settings (saved by step.save, or "
                         f"by an fsharded train that did not record them): give the --preset and --set "
                         f"model.KEY=VALUE options the run was trained with (the vocabulary and learned "
                         f"positions are read from the checkpoint)")
    fields: dict[str, Any] = {}
    for s in sets:
        key, eq, value = s.partition("=")
        if not eq or not key.startswith("model."):
            raise ValueError(f"generate: --set {s!r}: write model.KEY=VALUE (a GPT setting)")
        try:
            fields[key[6:]] = json.loads(value)
        except json.JSONDecodeError:
            fields[key[6:]] = value
    make = getattr(gpt.GPTConfig, preset or "small", None)
    if make is None or (preset or "").startswith("_") or not callable(make):
        raise ValueError(f"generate: --preset {preset!r}: unknown; known: tiny, small, llama_style")
    # What fsharded train fixed beside the preset (the data's vocabulary, --seq-len), as saved.
    if directory.endswith(".safetensors"):
        from safetensors import safe_open

        with safe_open(directory, framework="pt") as f:
            shapes = {k: f.get_slice(k).get_shape() for k in ("emb", "pos") if k in f.keys()}
    else:
        shapes = {e["path"].removeprefix("params."): e.get("shape")
                  for e in checkpoint.read_manifest(directory)["leaves"]}
    if shapes.get("emb"):
        fields.setdefault("vocab_size", shapes["emb"][0])
    if shapes.get("pos"):
        fields.setdefault("seq_len", shapes["pos"][0])
    return make(**fields)


def load_model(path: str, *, dtype: torch.dtype = torch.float32, preset: str | None = None,
               sets: Sequence[str] = (), int8: bool = False, group_size: int | None = None,
               mesh: Mesh | None = None) -> Loaded:
    """The GPT saved at ``path`` (a checkpoint or a save directory; or a Hugging Face
    model's directory, loaded whole on every rank and split by its tensor-parallel plan
    when it runs): its config from the run's record (or ``preset`` and ``sets``, ``model.KEY=VALUE``), its parameters (the
    checkpoint's ``params``, whatever layout they were trained in, as full tensors) cast
    to ``dtype``; with ``int8`` its projections quantized from the fp32 master weights
    (``fs.inference.quantize``, a scale per output channel or per ``group_size`` input
    features; a Hugging Face model: every linear layer, from its stored weights read in
    fp32, the rest then cast to ``dtype``). With ``mesh`` the parameters are laid out for generation on it
    (``fs.inference.mesh_specs``): on real ranks each rank reads its own shards only. A
    checkpoint of another model is an error naming the leaves that differ."""
    if str(path).endswith(".safetensors"):
        return _from_safetensors(path, dtype, preset, sets, int8, group_size, mesh)
    if is_hf_directory(path):
        if preset is not None or sets:
            raise ValueError(f"generate: {path} is a Hugging Face model, whose config.json gives its settings: "
                             f"--preset and --set are for fsharded checkpoints")
        return _from_hf(path, dtype, int8, group_size, mesh)
    directory = resolve(path)
    record = _train_resume.read_job(directory)
    cfg = _config(directory, record, preset, sets)
    with torch.device("meta"):
        like = gpt.init(cfg, 0)
    specs = None
    if mesh is not None:
        check_divides(like, mesh)
        specs = inference.mesh_specs(like, mesh)
        if distributed.is_initialized() and mesh.size > 1:  # this rank's shards
            like = optree.tree_map(lambda x, s: torch.empty(shard_shape(s, x.shape, mesh), dtype=x.dtype,
                                                            device="meta"), like, specs)
    mesh = mesh if mesh is not None else Mesh({})
    params = checkpoint.load(directory, like, specs, mesh, select="params")
    params = _cast(params, dtype, int8, group_size, _quantized_over(mesh))
    ms = None
    if cfg.moe is not None and cfg.moe.bias_update_rate is not None:
        ms = checkpoint.load(directory, gpt.init_model_state(like), None, mesh, select="model_state")
    encoding = record.get("encoding", "bytes") if record is not None else ("bytes" if cfg.vocab_size == 256 else None)
    step = record.get("step") if record is not None else None
    return Loaded(params, cfg, ms, encoding, step, directory, mesh if mesh.size > 1 else None)


def _quantized_over(mesh: Mesh | None) -> int:
    """The tensor size int8 weights are quantized for: the mesh's on the virtual mesh (the
    whole weights), 1 on real ranks (each rank quantizes its own shards: the same numbers)."""
    if mesh is None or mesh.size == 1 or distributed.is_initialized():
        return 1
    return mesh.shape.get("tensor", 1)


def _cast(params: dict, dtype: torch.dtype, int8: bool, group_size: int | None, tensor: int = 1) -> dict:
    if int8:
        params = inference.quantize(params, group_size, dtype=dtype, tensor=tensor)
    elif group_size is not None:
        raise ValueError("generate: --group-size is the int8 weights' group: give --int8 with it")
    elif dtype != torch.float32:
        params = optree.tree_map(lambda x: x.to(dtype) if x.is_floating_point() else x, params)
    return params


def _from_safetensors(path: str, dtype: torch.dtype, preset: str | None, sets: Sequence[str], int8: bool,
                      group_size: int | None, mesh: Mesh | None) -> Loaded:
    """``load_model`` of a ``.safetensors`` file (``fsharded export``'s: its metadata gives
    the config; otherwise ``preset`` and ``sets``)."""
    if not os.path.isfile(path):
        raise ValueError(f"generate: --checkpoint {path}: no such file")
    cfg, encoding = inference.safetensors_config(path)
    if preset is not None or sets:
        cfg = _config(path, None, preset, sets)
    elif cfg is None:
        raise ValueError(f"generate: {path} does not record its model's settings (not written by fsharded export of "
                         f"a fsharded train checkpoint): give the --preset and --set model.KEY=VALUE options the "
                         f"model was trained with")
    if mesh is not None:
        with torch.device("meta"):
            check_divides(gpt.init(cfg, 0), mesh)
    params, cfg = inference.load_safetensors(path, cfg, mesh=mesh)
    if cfg.moe is not None and cfg.moe.bias_update_rate is not None:
        raise NotImplementedError("generate: a .safetensors file holds the parameters only, not the routing biases "
                                  "of a mixture of experts trained with bias_update_rate: give its checkpoint")
    encoding = encoding if encoding is not None or cfg.vocab_size != 256 else "bytes"
    return Loaded(_cast(params, dtype, int8, group_size, _quantized_over(mesh)), cfg, None, encoding, None, path,
                  mesh if mesh is not None and mesh.size > 1 else None)


def is_hf_directory(path: str) -> bool:
    """Whether ``path`` is a Hugging Face model's directory (``save_pretrained``'s
    ``config.json``) rather than an fsharded checkpoint."""
    return (os.path.isdir(path) and os.path.isfile(os.path.join(path, "config.json"))
            and not os.path.exists(os.path.join(path, "manifest.json")))


def _from_hf(path: str, dtype: torch.dtype, int8: bool, group_size: int | None, mesh: Mesh | None) -> Loaded:
    """``load_model`` of a Hugging Face causal LM's directory: the model in ``dtype``, its
    tokenizer where the directory holds one, its end-of-sequence ids."""
    try:
        import transformers
    except ImportError as e:
        raise ValueError(f"generate: {path} is a Hugging Face model: install transformers "
                         f"(pip install 'fsharded[hf]')") from e
    if group_size is not None and not int8:
        raise ValueError("generate: --group-size is the int8 weights' group: give --int8 with it")
    if int8 and mesh is not None and mesh.size > 1:
        raise NotImplementedError("generate: --int8 for a Hugging Face model decodes on one device; drop --mesh, or "
                                  "--int8 to decode it on a mesh in --dtype")
    # (transformers takes the dtype as dtype= from 4.56, as torch_dtype= before)
    new = tuple(int(x) for x in transformers.__version__.split(".")[:2]) >= (4, 56)
    try:
        model = transformers.AutoModelForCausalLM.from_pretrained(  # (int8: from the stored weights, then cast)
            path, **{"dtype" if new else "torch_dtype": torch.float32 if int8 else dtype}).eval()
    except (OSError, ValueError, KeyError, TypeError, ImportError) as e:
        raise ValueError(f"generate: {path}: transformers cannot load a causal LM from it ({e})") from e
    tokenizer = None
    if any(os.path.isfile(os.path.join(path, f)) for f in ("tokenizer.json", "tokenizer_config.json",
                                                             "tokenizer.model", "vocab.json")):
        try:
            tokenizer = transformers.AutoTokenizer.from_pretrained(path)
        except (OSError, ValueError, KeyError, TypeError, ImportError) as e:
            raise ValueError(f"generate: {path}: transformers cannot load its tokenizer ({e}); give the prompts as "
                             f"token ids, or install what it names") from e
    eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    eos = () if eos is None else tuple(int(t) for t in (eos if isinstance(eos, (list, tuple)) else [eos]))
    if mesh is not None and mesh.size > 1:
        HFDecoder(model)  # (refuses a model fsharded cannot decode before any rank lays it out)
    if int8:  # every linear layer (the head included) as int8 with fp32 scales, in place
        model = inference.quantize(model, group_size=group_size, dtype=dtype, inplace=True)
    return Loaded(model, None, None, "tokenizer" if tokenizer is not None else None, None, path,
                  mesh if mesh is not None and mesh.size > 1 else None, tokenizer, eos)


def add_model_args(p: argparse.ArgumentParser) -> None:
    """The flags that name a model and how its weights are held (``generate`` and ``serve``)."""
    p.add_argument("--checkpoint", "--model", required=True, metavar="DIR", dest="checkpoint",
                   help="a checkpoint (step-N), a save directory (its newest checkpoint), a .safetensors file "
                        "(fsharded export's), or a Hugging Face causal LM's directory (save_pretrained's)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="fp32",
                   help="weights and cache (default fp32; the checkpoint's master weights are cast)")
    p.add_argument("--int8", action="store_true", help="int8 weight-only projections and head (a scale per "
                   "output channel; the activations and cache in --dtype)")
    p.add_argument("--group-size", type=int, default=None, metavar="G",
                   help="with --int8: a scale per G input features instead of per output channel")


def build_parser(prog: str = "fsharded generate") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0].split(": ", 1)[1],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="\n\n".join(__doc__.split("\n\n")[1:]))
    add_model_args(p)
    p.add_argument("--prompt", action="append", default=[], metavar="TEXT",
                   help="a prompt (repeat for a batch of prompts)")
    p.add_argument("--prompt-tokens", action="append", default=[], metavar="IDS",
                   help="a prompt as comma-separated token ids (repeat for a batch)")
    p.add_argument("--max-new-tokens", type=int, default=64, metavar="N")
    p.add_argument("--greedy", action="store_true", help="the most likely token each step (the default "
                   "without --temperature, --top-k or --top-p)")
    p.add_argument("--temperature", type=float, default=None, metavar="T")
    p.add_argument("--top-k", type=int, default=None, metavar="K")
    p.add_argument("--top-p", type=float, default=None, metavar="P")
    p.add_argument("--seed", type=int, default=0, help="the sampling key's seed (default 0)")
    p.add_argument("--stop", action="append", default=[], metavar="TOKEN",
                   help="a token id that ends a continuation (kept); repeatable (default: none, or a Hugging Face "
                        "model's end-of-sequence ids; 'none': not those either)")
    p.add_argument("--mesh", default=None, metavar="AXIS=N,...",
                   help="decode on a mesh: tensor=N splits the heads and hidden units, expert=N the experts, "
                        "data=N the prompts (virtual in one process; under torchrun the world size)")
    p.add_argument("--timeout", type=float, default=300.0, metavar="SECONDS",
                   help="under torchrun: how long a collective may wait (default 300)")
    p.add_argument("--compile", action="store_true", help="decode through a torch.compile'd step (compiled on the "
                   "first use: seconds; worth it for long continuations)")
    p.add_argument("--preset", default=None, help="for a checkpoint without a recorded model: the GPT preset")
    p.add_argument("--set", action="append", default=[], metavar="model.KEY=VALUE", dest="sets",
                   help="for a checkpoint without a recorded model: a GPT setting the run had")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    return p


def _prompts(args: argparse.Namespace, model: Loaded) -> list[list[int]]:
    rows = [model.encode(t) for t in args.prompt]
    for ids in args.prompt_tokens:
        try:
            rows.append([int(t) for t in ids.split(",") if t.strip()])
        except ValueError as e:
            raise ValueError(f"generate: --prompt-tokens {ids!r}: write comma-separated integers") from e
    if not rows:
        raise ValueError("generate: give --prompt TEXT or --prompt-tokens IDS")
    if any(not r for r in rows):
        raise ValueError("generate: a prompt is empty; give at least one token")
    return rows


def _stops(given: Sequence[str], model: Loaded) -> list[int]:
    """``--stop``'s token ids: none given, the model's end-of-sequence ids; ``none``, no ids."""
    if not given:
        return list(model.eos)
    if list(given) == ["none"]:
        return []
    try:
        return [int(s) for s in given]
    except ValueError as e:
        raise ValueError(f"generate: --stop {' '.join(given)}: give token ids, or 'none' alone") from e


def run(args: argparse.Namespace) -> dict:
    """Load, generate, and return what ``main`` prints (as its JSON form)."""
    sampled = not args.greedy and any(v is not None for v in (args.temperature, args.top_k, args.top_p))
    if args.greedy and any(v is not None for v in (args.temperature, args.top_k, args.top_p)):
        raise ValueError("generate: --greedy takes no --temperature, --top-k or --top-p")
    mesh = Mesh(parse_mesh(args.mesh)) if args.mesh else None
    model = load_model(args.checkpoint, dtype=DTYPES[args.dtype], preset=args.preset, sets=args.sets,
                       int8=args.int8, group_size=args.group_size, mesh=mesh)
    rows = _prompts(args, model)
    out = inference.generate(model.params, rows, args.max_new_tokens,
                             key=R.key(args.seed) if sampled else None,
                             temperature=1.0 if args.temperature is None else args.temperature,
                             top_k=args.top_k, top_p=args.top_p,
                             stop_tokens=_stops(args.stop, model),
                             moe=model.moe, model_state=model.model_state, mesh=model.mesh,
                             compile=args.compile)
    return {"checkpoint": model.directory, "step": model.step,
            "samples": [{"prompt": model.decode(r), "prompt_tokens": r, "text": model.decode(t), "tokens": t,
                         "full_text": model.decode(r + t), "stopped": s}
                        for r, t, s in zip(rows, out.tokens, out.stopped)],
            "prefill": {"tokens": out.prefill_tokens, "seconds": out.prefill_s,
                        "tokens_per_s": out.prefill_tokens_per_s},
            "decode": {"tokens": out.decode_tokens, "seconds": out.decode_s,
                       "tokens_per_s": out.decode_tokens_per_s}}


def main(argv: Sequence[str] | None = None, *, prog: str = "fsharded generate") -> int:
    args = build_parser(prog).parse_args(argv)
    launched = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    if launched:
        distributed.initialize(timeout_s=args.timeout)
    try:
        res = run(args)
        first = not launched or distributed.rank() == 0  # every rank has the same tokens: one prints them
    except (ValueError, OSError, NotImplementedError) as e:
        print(f"{prog}: {str(e).removeprefix('generate: ')}", file=sys.stderr)
        return 2
    finally:
        if launched:
            distributed.shutdown()
    if not first:
        return 0
    if args.json:
        print(json.dumps(res))
        return 0
    for s in res["samples"]:
        if s["text"] is not None:  # (the whole decoded at once: a tokenizer joins the words at the seam)
            print(s["full_text"])
        else:
            print(f"{s['prompt_tokens']} -> {s['tokens']}")
        print("-" * 40)
    pf, dc = res["prefill"], res["decode"]
    where = res["checkpoint"] if res["step"] is None else f"{res['checkpoint']}, step {res['step']}"
    print(f"prefill: {pf['tokens']} tokens, {pf['tokens_per_s']:,.0f} tokens/s; "
          f"decode: {dc['tokens']} tokens, {dc['tokens_per_s']:,.0f} tokens/s ({where})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
