"""``fsharded serve``: a GPT trained by ``fsharded train``, or a Hugging Face causal LM,
behind continuous batching (``fs.inference.Engine``), as line-delimited JSON on
stdin/stdout or a small HTTP endpoint.

    fsharded serve --checkpoint checkpoints                      # JSON lines on stdin/stdout
    fsharded serve --checkpoint checkpoints --http 8000          # POST /generate, GET /health
    fsharded serve --model ./my-llama --mesh tensor=2 --http 8000

``--checkpoint`` (or ``--model``) takes what ``fsharded generate`` takes: a checkpoint, a
save directory, an exported ``.safetensors`` file or a Hugging Face model's directory
(text prompts through its tokenizer; without ``"stop"`` a request ends at the model's
end-of-sequence tokens). ``--mesh tensor=N`` splits the heads and hidden units over a
virtual mesh of N devices in this process; under ``torchrun --nproc_per_node N`` with
``--mesh tensor=N`` over the N ranks, the first of which reads the requests (stdin or
HTTP) and answers while every rank runs the same steps.

A request is a JSON object: ``"prompt"`` (text, encoded as the run's data was) or
``"tokens"`` (ids), and optionally ``"id"`` (echoed back; default a counter),
``"max_new_tokens"`` (default ``--max-new-tokens``), ``"temperature"``, ``"top_k"``,
``"top_p"``, ``"seed"`` (sampled where any of those is given; else greedy), ``"stop"``
(token ids) and ``"stream"`` (also one line per token: ``{"id", "token", "text"}``). The
answer is one JSON object: ``id``, ``text`` (None for a token-file model), ``tokens``,
``stopped``, ``prompt_tokens``, ``time_to_first_token_s`` and ``latency_s``; a request it
cannot run gets ``{"id", "error"}`` and the server goes on. On stdin the requests are
taken as they arrive and answered as they finish (not in order); at the end of the input
the ones running finish and the command exits. Over HTTP each ``POST /generate`` waits for
its answer, while other requests run in the same batches.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import queue
import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch.distributed as dist

from fsharded import distributed, inference
from fsharded import random as R
from fsharded.mesh import Mesh
from fsharded.tools._generate import DTYPES, Loaded, add_model_args, load_model
from fsharded.tools.train import parse_mesh

__all__ = ["Server", "start_http", "build_parser", "main"]

Reply = Callable[[dict], None]


# Under torchrun, how long the first rank waits for a request before it tells the others
# that none came (they wait for its word in a collective, which must not time out).
HEARTBEAT_S = 5.0


def _quiet(ans: dict) -> None:
    """A follower rank's reply: the first rank answers."""


class Server:
    """Requests in (``submit``, from any thread), answers out (each request's ``reply``),
    the engine stepped by ``loop`` in one thread.

    Under torchrun (a model on a real tensor axis) every rank runs ``loop``; requests reach
    the first rank (its ``submit``), which passes each step's new requests (and the end of
    the input) to the others before the step, so every rank adds the same requests in the
    same order and steps the engine in lockstep; the first rank answers."""

    def __init__(self, model: Loaded, *, max_new_tokens: int, max_batch_tokens: int, max_seqs: int,
                 page_size: int, pages: int | None, reserve: float = 0.5) -> None:
        self.model, self.max_new_tokens = model, max_new_tokens
        self.ranks = distributed.world_size() if distributed.is_initialized() else 1
        self.leader = self.ranks == 1 or distributed.rank() == 0
        self.engine = inference.Engine(model.params, max_batch_tokens=max_batch_tokens, max_seqs=max_seqs,
                                       page_size=page_size, pages=pages, moe=model.moe,
                                       model_state=model.model_state, mesh=model.mesh, reserve=reserve)
        self.inbox: queue.Queue = queue.Queue()
        self.pending: dict[int, tuple[Any, Reply, bool]] = {}
        self._sent: dict[int, str] = {}  # each streamed request's text sent so far
        self._ids = itertools.count()

    def submit(self, obj: Any, reply: Reply) -> None:
        self.inbox.put((obj, reply))

    def close(self) -> None:
        self.inbox.put(None)

    def _add(self, obj: Any, reply: Reply) -> None:
        rid = obj.get("id", next(self._ids)) if isinstance(obj, dict) else None
        try:
            if not isinstance(obj, dict):
                raise ValueError("a request is a JSON object")
            unknown = set(obj) - {"id", "prompt", "tokens", "max_new_tokens", "temperature", "top_k", "top_p", "seed",
                                  "stop", "stream"}
            if unknown:
                raise ValueError(f"unknown fields {sorted(unknown)}")
            if ("prompt" in obj) == ("tokens" in obj):
                raise ValueError('give "prompt" (text) or "tokens" (ids), one of them')
            if "prompt" in obj and not isinstance(obj["prompt"], str):
                raise ValueError(f'"prompt" is text; got {type(obj["prompt"]).__name__} (token ids go in "tokens")')
            tokens = self.model.encode(obj["prompt"]) if "prompt" in obj else _ints(obj["tokens"], "tokens")
            sampled = any(obj.get(k) is not None for k in ("temperature", "top_k", "top_p", "seed"))
            t = obj.get("temperature")
            engine_id = self.engine.add_request(
                tokens, int(obj.get("max_new_tokens", self.max_new_tokens)),
                key=R.key(int(obj.get("seed", 0))) if sampled else None,
                temperature=1.0 if t is None else float(t), top_k=obj.get("top_k"), top_p=obj.get("top_p"),
                stop_tokens=_ints(obj["stop"], "stop") if "stop" in obj else self.model.eos)
        except Exception as e:  # noqa: BLE001 - any request it cannot run is answered, and the server goes on
            reply({"id": rid, "error": str(e).removeprefix("Engine.add_request: ")})
            return
        self.pending[engine_id] = (rid, reply, bool(obj.get("stream")))

    def _fail_all(self, err: Exception) -> None:
        """A step failed: every request in flight gets the error, the engine starts empty."""
        for rid, reply, _ in list(self.pending.values()):
            reply({"id": rid, "error": f"the batch this request ran in failed: {type(err).__name__}: {err}"})
        self.pending.clear()
        self._sent.clear()
        for r in list(self.engine.running):
            self.engine.cache.release(r.id)
        self.engine.running.clear()
        self.engine.waiting.clear()
        self.engine.requests.clear()

    def _piece(self, engine_id: int, finished: bool) -> str | None:
        """The text a streamed token adds: the continuation decoded whole, less what was
        sent (a token that ends inside a character or a word's bytes sends "" until the
        next completes it)."""
        text = self.model.decode(self.engine.requests[engine_id].tokens)
        if text is None:
            return None
        if text.endswith("\ufffd") and not finished:
            return ""
        sent = self._sent.get(engine_id, "")
        self._sent[engine_id] = text
        return text[len(sent):] if text.startswith(sent) else text

    def _answer(self, engine_id: int) -> None:
        r = self.engine.requests.pop(engine_id)
        self._sent.pop(engine_id, None)
        rid, reply, _ = self.pending.pop(engine_id)
        reply({"id": rid, "text": self.model.decode(r.tokens), "tokens": r.tokens, "stopped": r.stopped,
               "prompt_tokens": len(r.prompt), "time_to_first_token_s": r.first_token_s - r.added_s,
               "latency_s": r.finished_s - r.added_s})

    def _arrived(self, block: bool, open_: bool) -> tuple[list, bool]:
        """The requests that arrived since the last step (waiting for one where ``block``),
        and whether more may come; on real ranks the first rank's, passed to every rank."""
        items = []
        if self.leader:
            while True:
                try:  # (on real ranks a wait is cut short: the others hear that nothing came)
                    item = self.inbox.get(block=block, timeout=HEARTBEAT_S if block and self.ranks > 1 else None)
                except queue.Empty:
                    break
                block = False
                if item is None:
                    open_ = False
                    continue
                items.append(item)
        if self.ranks > 1:
            box = [([obj for obj, _ in items], open_)] if self.leader else [None]
            dist.broadcast_object_list(box, src=0)
            objs, open_ = box[0]
            if not self.leader:
                items = [(obj, _quiet) for obj in objs]
        return items, open_

    def loop(self) -> None:
        """Take requests and step until ``close`` and every request has its answer."""
        open_ = True
        while open_ or self.engine.busy:
            items, open_ = self._arrived(open_ and not self.engine.busy, open_)
            for item in items:
                self._add(*item)
            try:
                events = self.engine.step() if self.engine.busy else []
            except Exception as e:  # noqa: BLE001 - answered to every request it touched
                self._fail_all(e)
                continue
            for ev in events:
                rid, reply, stream = self.pending[ev.id]
                if stream:
                    reply({"id": rid, "token": ev.token, "text": self._piece(ev.id, ev.finished)})
                if ev.finished:
                    self._answer(ev.id)


def _ints(v: Any, field: str) -> list[int]:
    """A JSON list of token ids, checked (no strings split into characters, no floats cut)."""
    if not isinstance(v, list) or any(isinstance(t, bool) or not isinstance(t, int) for t in v):
        raise ValueError(f'"{field}" is a list of integer token ids; got {json.dumps(v)[:60]}')
    return list(v)


def _stdio(server: Server) -> None:
    lock = threading.Lock()

    def write(obj: dict) -> None:
        with lock:
            sys.stdout.write(json.dumps(obj) + "\n")
            sys.stdout.flush()

    def read() -> None:
        try:
            for line in sys.stdin:
                if not line.strip():
                    continue
                try:
                    obj = json.loads(line)
                except json.JSONDecodeError as e:
                    write({"id": None, "error": f"not JSON: {e}"})
                    continue
                server.submit(obj, write)
        except (OSError, ValueError) as e:  # (stdin unreadable: the requests in flight still finish)
            print(f"fsharded serve: reading stdin failed: {e}", file=sys.stderr)
        finally:
            server.close()

    threading.Thread(target=read, daemon=True).start()
    server.loop()


def start_http(server: Server, port: int, host: str = "127.0.0.1", timeout_s: float = 600.0) -> Any:
    """An HTTP server (not yet serving: ``serve_forever``) in front of ``server``, whose
    loop it starts in a thread."""
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    class Handler(BaseHTTPRequestHandler):
        def _send(self, code: int, obj: dict) -> None:
            body = json.dumps(obj).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self) -> None:  # noqa: N802 (http.server's name)
            if self.path == "/health":
                self._send(200, {"ok": True, "running": len(server.engine.running), "waiting": len(server.engine.waiting)})
            else:
                self._send(404, {"error": f"no such path {self.path}; POST /generate or GET /health"})

        def do_POST(self) -> None:  # noqa: N802
            if self.path != "/generate":
                self._send(404, {"error": f"no such path {self.path}; POST /generate"})
                return
            try:
                obj = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"null")
            except json.JSONDecodeError as e:
                self._send(400, {"error": f"not JSON: {e}"})
                return
            done, box = threading.Event(), []

            def reply(ans: dict) -> None:
                if "token" not in ans:  # (streamed tokens are not sent over this endpoint)
                    box.append(ans)
                    done.set()
            server.submit(obj, reply)
            if not done.wait(timeout=self.server.timeout_s):
                self._send(504, {"error": f"no answer within {self.server.timeout_s:.0f} s"})
                return
            self._send(400 if "error" in box[0] else 200, box[0])

        def log_message(self, *args: Any) -> None:
            pass

    httpd = ThreadingHTTPServer((host, port), Handler)
    httpd.timeout_s = timeout_s
    threading.Thread(target=server.loop, daemon=True).start()
    return httpd


def build_parser(prog: str = "fsharded serve") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0].split(": ", 1)[1],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="\n\n".join(__doc__.split("\n\n")[1:]))
    add_model_args(p)
    p.add_argument("--mesh", default=None, metavar="tensor=N",
                   help="tensor=N splits the heads and hidden units: over a virtual mesh in this process, or under "
                        "torchrun over N ranks (the first takes the requests and answers)")
    p.add_argument("--timeout", type=float, default=300.0, metavar="S",
                   help="under torchrun: how long a collective may wait (default 300)")
    p.add_argument("--http", type=int, default=None, metavar="PORT", help="serve HTTP on PORT (0: any free port) "
                   "instead of JSON lines on stdin/stdout")
    p.add_argument("--host", default="127.0.0.1", help="with --http: the address to listen on (default 127.0.0.1)")
    p.add_argument("--max-new-tokens", type=int, default=64, metavar="N", help="a request's default")
    p.add_argument("--max-batch-tokens", type=int, default=256, metavar="N", help="tokens per step (default 256)")
    p.add_argument("--max-seqs", type=int, default=32, metavar="N", help="requests running at once (default 32)")
    p.add_argument("--page-size", type=int, default=16, metavar="N", help="token slots per cache page (default 16)")
    p.add_argument("--pages", type=int, default=None, metavar="N",
                   help="cache pages (default: --max-seqs sequences of the model's context, or of 2,048 tokens "
                        "without learned positions, within half the free memory)")
    p.add_argument("--reserve", type=float, default=0.5, metavar="F",
                   help="admit a request where the free pages hold its prompt and this share of every request's "
                        "remaining new tokens (default 0.5; 1: never preempt; 0: admit as soon as a prompt chunk "
                        "fits)")
    return p


def main(argv: Sequence[str] | None = None, *, prog: str = "fsharded serve") -> int:
    args = build_parser(prog).parse_args(argv)
    launched = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    if launched:
        distributed.initialize(timeout_s=args.timeout)
    try:
        return _serve(args, prog, launched)
    finally:
        if launched:
            distributed.shutdown()


def _serve(args: argparse.Namespace, prog: str, launched: bool) -> int:
    leader = not launched or distributed.rank() == 0
    try:
        mesh = Mesh(parse_mesh(args.mesh)) if args.mesh else None
        if mesh is not None and set(mesh.shape) - {"tensor"}:
            raise ValueError(f"--mesh {args.mesh}: the engine splits the model over a tensor axis only")
        if launched and (mesh is None or mesh.size != distributed.world_size()):
            raise ValueError(f"under torchrun the model is split over the ranks: give --mesh "
                             f"tensor={distributed.world_size()} (one tensor shard per rank)")
        model = load_model(args.checkpoint, dtype=DTYPES[args.dtype], int8=args.int8, group_size=args.group_size,
                           mesh=mesh)
        server = Server(model, max_new_tokens=args.max_new_tokens, max_batch_tokens=args.max_batch_tokens,
                        max_seqs=args.max_seqs, page_size=args.page_size, pages=args.pages, reserve=args.reserve)
    except (ValueError, OSError, NotImplementedError) as e:
        if leader:
            print(f"{prog}: {str(e).removeprefix('generate: ')}", file=sys.stderr)
        return 2
    if server.engine.cache_note and leader:
        print(f"{prog}: {server.engine.cache_note}", file=sys.stderr, flush=True)
    t0 = time.perf_counter()
    if not leader:  # the first rank takes the requests and answers; this one steps with it
        server.loop()
        return 0
    if args.http is not None:
        httpd = start_http(server, args.http, args.host)
        print(f"{prog}: http://{args.host}:{httpd.server_address[1]}/generate", file=sys.stderr, flush=True)
        try:
            httpd.serve_forever()
        except KeyboardInterrupt:
            pass
        finally:
            httpd.server_close()
        return 0
    _stdio(server)
    print(f"{prog}: {server.engine.steps} steps, {server.engine.preemptions} preemptions, "
          f"{time.perf_counter() - t0:.1f} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
