"""Token sources and deterministic, resumable batches for language-model training.

A source is a ``Tokens``: a 1-D array of token ids (in memory or memory-mapped) with its
vocabulary size. ``Batches`` cuts random windows from it; batch ``i`` is a pure function of
``(seed, split, i)``, so a run resumed at step ``i`` sees exactly the batches it would have
seen. Every rank builds the same *global* batch; ``shard_map`` with ``batch_spec=P("data")``
hands each data shard its rows (``check_batch_size`` says early if they do not divide).

>>> tokens = Tokens(np.frombuffer(b"hello world, " * 20, dtype=np.uint8), 256, "demo")
>>> batches = Batches(tokens, batch_size=4, seq_len=8, seed=0)
>>> batches.batch_at(0)["tokens"].shape
torch.Size([4, 9])
>>> torch.equal(batches.batch_at(7)["tokens"], next(batches.iter_from(7))["tokens"])
True
"""

from __future__ import annotations

import dataclasses
import os
import sysconfig
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

__all__ = [
    "Tokens",
    "stdlib_corpus",
    "text_file",
    "token_file",
    "load_tokens",
    "encoding",
    "Batches",
    "check_batch_size",
]

DEFAULT_STDLIB_BYTES = 4 << 20  # 4 MiB: ~1000 steps of 16 x 128 before windows repeat much

# Directories of the stdlib tree that are not the standard library's own source, or differ
# between installs of the same Python version (so would break determinism across machines).
_SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__", "test", "tests", "idle_test"}


@dataclass(frozen=True, eq=False)
class Tokens:
    """A token stream: ``data`` is 1-D unsigned ints (``np.ndarray`` or ``np.memmap``), every
    id below ``vocab_size``; ``name`` says where it came from, for error messages."""

    data: np.ndarray
    vocab_size: int
    name: str

    def __post_init__(self) -> None:
        if self.data.ndim != 1:
            raise ValueError(f"Tokens {self.name!r}: data must be 1-D, got shape {self.data.shape}")
        if self.data.dtype.kind != "u":
            raise ValueError(
                f"Tokens {self.name!r}: data must be unsigned ints (uint8 / uint16 / uint32), "
                f"got {self.data.dtype}"
            )
        if not isinstance(self.vocab_size, int) or self.vocab_size < 1:
            raise ValueError(
                f"Tokens {self.name!r}: vocab_size must be a positive int, got {self.vocab_size!r}"
            )

    def __len__(self) -> int:
        return int(self.data.shape[0])

    def __repr__(self) -> str:
        return f"Tokens({self.name!r}, n={len(self):,}, vocab_size={self.vocab_size})"

    def split(self, val_fraction: float) -> tuple[Tokens, Tokens]:
        """``(train, val)``: the last ``val_fraction`` of the stream is validation.

        A contiguous cut (not interleaved windows) keeps validation text unseen in training.
        """
        if not 0.0 <= val_fraction < 1.0:
            raise ValueError(f"val_fraction must be in [0, 1), got {val_fraction!r}")
        n_val = int(len(self) * val_fraction)
        cut = len(self) - n_val
        return (Tokens(self.data[:cut], self.vocab_size, f"{self.name}[train]"),
                Tokens(self.data[cut:], self.vocab_size, f"{self.name}[val]"))


# ------------------------------------------------------------------------------------------
# Sources
# ------------------------------------------------------------------------------------------


def stdlib_corpus(max_bytes: int = DEFAULT_STDLIB_BYTES) -> Tokens:
    """Bytes of the Python standard library's ``.py`` sources: a corpus with no download.

    Files under ``sysconfig.get_paths()["stdlib"]`` in sorted path order, skipping
    installed packages, caches and test suites, concatenated and cut at ``max_bytes``.
    Deterministic for a given Python installation; nothing is cached or written.
    Vocabulary: the 256 byte values.

    >>> corpus = stdlib_corpus(max_bytes=10_000)
    >>> len(corpus), corpus.vocab_size, corpus.data.dtype
    (10000, 256, dtype('uint8'))
    """
    if not isinstance(max_bytes, int) or max_bytes < 1:
        raise ValueError(f"stdlib_corpus: max_bytes must be a positive int, got {max_bytes!r}")
    root = Path(sysconfig.get_paths()["stdlib"])
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in _SKIP_DIRS and not d.startswith("config-")]
        files += [Path(dirpath, f) for f in filenames
                  if f.endswith(".py") and not f.startswith("_sysconfigdata")]
    files.sort(key=lambda p: p.relative_to(root).as_posix())
    chunks, total = [], 0
    for f in files:
        if total >= max_bytes:
            break
        b = f.read_bytes()[: max_bytes - total]
        chunks.append(b)
        total += len(b)
    if total == 0:
        raise FileNotFoundError(
            f"stdlib_corpus: found no .py files under {root}; this Python has no source "
            f"standard library, so use text_file(path) or token_file(path) instead"
        )
    data = np.frombuffer(b"".join(chunks), dtype=np.uint8)
    return Tokens(data, 256, f"stdlib:{root}")


def _check_file(path: str | os.PathLike, what: str, hint: str) -> Path:
    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(f"{what}: {str(p)!r} does not exist; {hint}")
    if not p.is_file():
        raise ValueError(f"{what}: {str(p)!r} is not a regular file; {hint}")
    if p.stat().st_size == 0:
        raise ValueError(f"{what}: {str(p)!r} is empty; {hint}")
    return p


def text_file(path: str | os.PathLike) -> Tokens:
    """The bytes of a file as tokens (vocabulary 256), memory-mapped, any encoding.

    >>> import tempfile
    >>> with tempfile.NamedTemporaryFile(suffix=".txt") as f:
    ...     _ = f.write(b"to be or not to be"); f.flush()
    ...     len(text_file(f.name))
    18
    """
    p = _check_file(path, "text_file", "pass a non-empty text file (its bytes are the tokens)")
    return Tokens(np.memmap(p, dtype=np.uint8, mode="r"), 256, str(p))


def token_file(path: str | os.PathLike, *, vocab_size: int | None = None,
               dtype: Any = np.uint16) -> Tokens:
    """A nanoGPT-style ``.bin``: raw token ids, ``dtype`` each (uint16), memory-mapped.

    ``vocab_size`` is the tokenizer's (50257 for GPT-2); it defaults to the largest value
    ``dtype`` can hold. Ids at or above it are reported by ``Batches`` when a batch
    contains them (checking the whole file up front would read all of it).
    """
    hint = "write it with np.array(ids, dtype=np.uint16).tofile(path), as nanoGPT's prepare.py does"
    p = _check_file(path, "token_file", hint)
    dt = np.dtype(dtype)
    if dt.kind != "u":
        raise ValueError(f"token_file: dtype must be an unsigned int type, got {dt}")
    size = p.stat().st_size
    if size % dt.itemsize:
        raise ValueError(
            f"token_file: {str(p)!r} has {size} bytes, not a multiple of {dt.itemsize} "
            f"({dt} tokens), so it is truncated or not a token file; {hint}"
        )
    limit = int(np.iinfo(dt).max) + 1
    vocab = limit if vocab_size is None else vocab_size
    if not isinstance(vocab, int) or not 1 <= vocab <= limit:
        raise ValueError(
            f"token_file: vocab_size must be an int in [1, {limit}] for {dt} tokens, "
            f"got {vocab_size!r}"
        )
    return Tokens(np.memmap(p, dtype=dt, mode="r"), vocab, str(p))


def load_tokens(spec: str | os.PathLike, *, vocab_size: int | None = None) -> Tokens:
    """A source by name, as a config or command line gives it: ``"stdlib"`` (or
    ``"stdlib:<max_bytes>"``) for ``stdlib_corpus``, a path ending in ``.bin`` for
    ``token_file``, any other path for ``text_file``.

    >>> corpus = load_tokens("stdlib:1000")
    >>> len(corpus), corpus.vocab_size
    (1000, 256)
    """
    s = os.fspath(spec)
    if s == "stdlib" or s.startswith("stdlib:"):
        n = s.partition(":")[2]
        if n and not n.isdigit():
            raise ValueError(f"load_tokens: {s!r}: write 'stdlib' or 'stdlib:<max_bytes>'")
        return stdlib_corpus(int(n)) if n else stdlib_corpus()
    if s.endswith(".bin"):
        return token_file(s, vocab_size=vocab_size)
    if vocab_size not in (None, 256):
        raise ValueError(
            f"load_tokens: {s!r} is read as text (bytes, vocab_size 256), but vocab_size="
            f"{vocab_size} was asked for; give a .bin token file for other vocabularies"
        )
    return text_file(s)


def encoding(spec: str | os.PathLike) -> str | None:
    """How ``load_tokens(spec)`` turns text into tokens: ``"bytes"`` (the stdlib corpus
    and text files: a token is a byte) or None (a ``.bin`` file of another tokenizer's
    ids, which fsharded cannot decode)."""
    return None if os.fspath(spec).endswith(".bin") else "bytes"


# ------------------------------------------------------------------------------------------
# Batches
# ------------------------------------------------------------------------------------------

_SPLITS = {"train": 0, "val": 1}


@dataclass(frozen=True)
class Batches:
    """Random windows of ``seq_len + 1`` tokens, ``batch_size`` per batch, as
    ``{"tokens": LongTensor (batch_size, seq_len + 1)}`` (what ``gpt.loss`` takes).

    ``batch_at(step)`` depends only on ``(seed, split, step)`` and the source, so resuming
    from a step number reproduces the run; iterating yields ``batch_at(0), batch_at(1),
    ...`` forever. With ``val_fraction > 0`` the source is cut in two (the tail is
    validation), and ``split="val"`` draws from the tail with an independent stream.

    >>> tokens = Tokens(np.arange(100, dtype=np.uint8), 256, "ramp")
    >>> b = Batches(tokens, batch_size=2, seq_len=4, seed=1).batch_at(0)["tokens"]
    >>> bool((b[:, 1:] - b[:, :-1] == 1).all())  # windows are contiguous
    True
    """

    source: Tokens
    """Where the tokens come from (``stdlib_corpus()``, ``text_file``, ``token_file``)."""
    batch_size: int
    """Global rows per batch (all data shards together)."""
    seq_len: int
    """Model sequence length T; each row holds T + 1 tokens (inputs and shifted targets)."""
    seed: int = 0
    """Seed of the window positions."""
    split: str = "train"
    """``"train"`` or ``"val"``."""
    val_fraction: float = 0.0
    """Fraction of the source (its tail) held out for ``split="val"``; 0 for no split."""

    def __post_init__(self) -> None:
        if not isinstance(self.source, Tokens):
            raise TypeError(
                f"Batches: source must be a Tokens (from stdlib_corpus, text_file or "
                f"token_file), got {type(self.source).__name__}"
            )
        for name in ("batch_size", "seq_len"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"Batches: {name} must be a positive int, got {v!r}")
        if not isinstance(self.seed, int) or self.seed < 0:
            raise ValueError(f"Batches: seed must be a non-negative int, got {self.seed!r}")
        if self.split not in _SPLITS:
            raise ValueError(f"Batches: split must be 'train' or 'val', got {self.split!r}")
        if self.split == "val" and self.val_fraction == 0:
            raise ValueError("Batches: split='val' needs val_fraction > 0 (e.g. 0.1)")
        part = self.tokens  # validates val_fraction
        if len(part) < self.seq_len + 1:
            raise ValueError(
                f"Batches: {part.name!r} has {len(part):,} tokens, fewer than seq_len + 1 = "
                f"{self.seq_len + 1}; use a longer source, a smaller seq_len"
                + (" or a larger val_fraction" if self.split == "val" else "")
            )

    @property
    def tokens(self) -> Tokens:
        """The part of the source this split draws from."""
        if self.val_fraction == 0:
            return self.source
        train, val = self.source.split(self.val_fraction)
        return train if self.split == "train" else val

    def validation(self) -> Batches:
        """The same batching over the held-out tail (``split="val"``).

        >>> tokens = Tokens(np.arange(100, dtype=np.uint8), 256, "ramp")
        >>> val = Batches(tokens, batch_size=2, seq_len=4, val_fraction=0.2).validation()
        >>> bool((val.batch_at(0)["tokens"] >= 80).all())
        True
        """
        return dataclasses.replace(self, split="val")

    def batch_at(self, step: int) -> dict[str, torch.Tensor]:
        """Batch number ``step`` (``step >= 0``): ``{"tokens": int64 (B, seq_len + 1)}``."""
        if not isinstance(step, (int, np.integer)) or step < 0:
            raise ValueError(f"Batches.batch_at: step must be a non-negative int, got {step!r}")
        part = self.tokens
        T1 = self.seq_len + 1
        # A fresh generator keyed by (seed, split, step): no state carried between batches.
        rng = np.random.default_rng([self.seed, _SPLITS[self.split], int(step)])
        starts = rng.integers(0, len(part) - T1 + 1, size=self.batch_size)  # (B,)
        rows = np.asarray(part.data[starts[:, None] + np.arange(T1)])  # (B, T + 1)
        top = int(rows.max())
        if top >= part.vocab_size:
            raise ValueError(
                f"Batches: {part.name!r} holds token id {top} at batch {step}, but its "
                f"vocab_size is {part.vocab_size}; pass the tokenizer's vocab_size to "
                f"token_file, or check the file was written with the right dtype"
            )
        return {"tokens": torch.from_numpy(rows.astype(np.int64))}

    def iter_from(self, step: int) -> Iterator[dict[str, torch.Tensor]]:
        """``batch_at(step), batch_at(step + 1), ...``: resume a run at ``step``."""
        while True:
            yield self.batch_at(step)
            step += 1

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        return self.iter_from(0)


def check_batch_size(batch_size: int, mesh: Any, axis: str | tuple[str, ...] = "data") -> int:
    """The per-shard batch size when ``batch_size`` rows are split over ``axis`` of ``mesh``.

    Raises ``ValueError`` saying what would divide it. ``mesh`` is an ``fsharded.Mesh`` (or an
    int, the axis size). A mesh without ``axis`` does not split the batch.

    >>> from fsharded import Mesh
    >>> check_batch_size(16, Mesh({"data": 4, "tensor": 2}))
    4
    """
    if isinstance(mesh, int):
        n, label = mesh, repr(axis)
    else:
        names = (axis,) if isinstance(axis, str) else tuple(axis)
        present = [a for a in names if a in mesh.shape]
        n, label = mesh.axis_size(tuple(present)) if present else 1, f"{axis!r} of {mesh!r}"
    if not isinstance(batch_size, int) or isinstance(batch_size, bool) or batch_size < 1:
        raise ValueError(f"batch size must be a positive int, got {batch_size!r}")
    if batch_size % n:
        lo, hi = max(n, batch_size // n * n), (batch_size // n + 1) * n
        raise ValueError(
            f"batch size {batch_size!r} cannot be split evenly over the {n} shards of axis "
            f"{label}; use a multiple of {n} (e.g. {lo} or {hi})"
        )
    return batch_size // n
