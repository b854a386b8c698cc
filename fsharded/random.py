"""Randomness as data, JAX-style: a key is a small tensor, every draw is a pure function of
its key, and the same key gives the same bits in vmap, under autograd, on the virtual mesh
and on real ranks.

A key is an int64 tensor of shape ``(2,)`` holding two 32-bit words. The generator is
Threefry-2x32 with 20 rounds (Salmon et al., "Parallel random numbers: as easy as 1, 2, 3",
SC 2011; JAX's default PRNG), written in int64 tensor arithmetic on 32-bit lanes, so it
needs no ``.item()``, no data-dependent control flow and no generator state.

* ``key(seed)``, ``split(key, n)``, ``fold_in(key, data)`` derive keys as JAX's
  threefry does (``split(key, n)[i] == fold_in(key, i)``, as with JAX's partitionable
  threefry). ``fold_in(key, axis_index("data"))`` works inside ``shard_map`` on both
  backends; ``shard_key(key, axes)`` is that over the bound mesh axes.
* Draws: ``bits``, ``uniform``, ``normal``, ``bernoulli``, ``randint``, ``dropout``. The
  value at flat position ``i`` depends only on the key and ``i`` (block ``i // 2`` of the
  counter, word ``i % 2``), never on the shape. Integer bits, uniforms, Bernoulli masks and
  dropout are exact integer and power-of-two arithmetic: the same on every device.
  ``normal`` goes through ``erfinv``, whose last bit may differ between CPU and CUDA.
* ``scope(key)``: torch's own random ops (``nn.Dropout``, ``torch.rand``, ...) draw from
  the key while the scope is entered; see ``KeyScope`` for what is covered.

>>> import torch, fsharded as fs
>>> k = fs.random.key(0)
>>> a, b = fs.random.split(k)
>>> u = fs.random.uniform(a, (3,))
>>> bool(torch.equal(u, fs.random.uniform(a, (3,))))
True
>>> with fs.random.scope(b):
...     y = torch.nn.functional.dropout(torch.ones(4), 0.5)
"""

from __future__ import annotations

import contextlib
import math
import numbers
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from fsharded.spmd import _env
from fsharded.spmd.collectives import axis_index

__all__ = [
    "key",
    "split",
    "fold_in",
    "shard_key",
    "bits",
    "uniform",
    "normal",
    "bernoulli",
    "randint",
    "dropout",
    "scope",
    "KeyScope",
    "fork",
]

_MASK = 0xFFFFFFFF
_ROTATIONS = ((13, 15, 26, 6), (17, 29, 16, 24))
_PARITY = 0x1BD11BDA  # Threefry's key-schedule constant
# Explicit mantissa bits of each float dtype: a uniform draw has this many random bits.
_MANTISSA = {torch.float16: 10, torch.bfloat16: 7, torch.float32: 23, torch.float64: 52}
Shape = int | Sequence[int]


# -- the generator ----------------------------------------------------------------------


def _threefry2x32(k0: torch.Tensor, k1: torch.Tensor, x0: torch.Tensor,
                  x1: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Threefry-2x32-20 of the counter ``(x0, x1)`` under the key ``(k0, k1)``; all 32-bit
    values in int64 tensors (torch has no uint32 arithmetic). ``x0`` is masked only where
    its high bits would leak into a later step (the xor below is masked right after)."""
    ks = (k0, k1, k0 ^ k1 ^ _PARITY)
    x0 = x0 + ks[0]
    x1 = (x1 + ks[1]) & _MASK
    for i in range(5):
        for r in _ROTATIONS[i % 2]:
            x0 = x0 + x1
            x1 = (((x1 << r) | (x1 >> (32 - r))) ^ x0) & _MASK  # rotl(x1, r) ^ x0
        x0 = (x0 + ks[(i + 1) % 3]) & _MASK
        x1 = (x1 + (ks[(i + 2) % 3] + (i + 1))) & _MASK
    return x0, x1


def _lanes(key: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return key[0] & _MASK, key[1] & _MASK


def _hash(key: torch.Tensor, counter: torch.Tensor) -> torch.Tensor:
    """The key's Threefry block at each int64 ``counter``: shape ``(*counter.shape, 2)``."""
    k0, k1 = _lanes(key)
    y0, y1 = _threefry2x32(k0, k1, (counter >> 32) & _MASK, counter & _MASK)
    return torch.stack([y0, y1], dim=-1)


def _words(key: torch.Tensor, n: int) -> torch.Tensor:
    """``n`` 32-bit words: word ``i`` is word ``i % 2`` of block ``i // 2``."""
    blocks = torch.arange((n + 1) // 2, dtype=torch.int64, device=key.device)
    return _hash(key, blocks).reshape(-1)[:n]


# -- keys -------------------------------------------------------------------------------


def _check_key(k: Any, op: str) -> None:
    if isinstance(k, torch.Tensor) and k.dtype == torch.int64 and tuple(k.shape) == (2,):
        return
    got = (f"a {k.dtype} tensor of shape {tuple(k.shape)}" if isinstance(k, torch.Tensor)
           else type(k).__name__)
    hint = ""
    if isinstance(k, torch.Tensor) and k.dim() > 1 and k.shape[-1] == 2:
        hint = (f"; for a batch of keys, vmap over them: "
                f"torch.func.vmap(lambda k: fsharded.random.{op}(k, ...))(keys)")
    raise TypeError(f"fsharded.random.{op}: key must be an int64 tensor of shape (2,) (from "
                    f"fsharded.random.key, split or fold_in), got {got}{hint}")


def _int64(x: Any, op: str, what: str, device: torch.device | None = None) -> torch.Tensor:
    if isinstance(x, torch.Tensor):
        if x.is_floating_point() or x.is_complex() or x.dtype == torch.bool:
            raise TypeError(f"fsharded.random.{op}: {what} must be an integer or an integer "
                            f"tensor, got a {x.dtype} tensor")
        return x.to(device=device, dtype=torch.int64)
    if isinstance(x, bool) or not isinstance(x, numbers.Integral):
        raise TypeError(f"fsharded.random.{op}: {what} must be an integer or an integer tensor, "
                        f"got {type(x).__name__}")
    if not -(2**63) <= int(x) < 2**63:
        raise ValueError(f"fsharded.random.{op}: {what} {x} does not fit in int64")
    return torch.tensor(int(x), dtype=torch.int64, device=device)


def key(seed: int | torch.Tensor, *, device: torch.device | str | None = None) -> torch.Tensor:
    """The key of an integer seed: its high and low 32-bit words, as ``jax.random.key``
    (with 64-bit seeds). A seed tensor may be batched (``vmap`` over seeds).

    >>> key(2**32 + 7)
    tensor([1, 7])
    """
    s = _int64(seed, "key", "seed", device)
    return torch.stack([(s >> 32) & _MASK, s & _MASK], dim=-1)


def split(key: torch.Tensor, n: int = 2) -> torch.Tensor:
    """``n`` new keys, shape ``(n, 2)``: ``split(key, n)[i]`` is ``fold_in(key, i)``.

    >>> a, b = split(key(0))
    """
    _check_key(key, "split")
    if isinstance(n, bool) or not isinstance(n, numbers.Integral) or n < 0:
        raise ValueError(f"fsharded.random.split: n must be a non-negative int, got {n!r}")
    return _hash(key, torch.arange(int(n), dtype=torch.int64, device=key.device))


def fold_in(key: torch.Tensor, data: int | torch.Tensor) -> torch.Tensor:
    """A new key from ``key`` and an integer (or integer tensor: then one key per element,
    shape ``(*data.shape, 2)``). Data in ``[0, 2**32)`` folds in as in ``jax.random.fold_in``;
    larger (or negative) int64 values use their high word too.

    >>> k = fold_in(key(0), 3)  # inside shard_map: fold_in(k, fs.axis_index("data"))
    """
    _check_key(key, "fold_in")
    return _hash(key, _int64(data, "fold_in", "data", key.device))


def shard_key(key: torch.Tensor, axes: str | Sequence[str]) -> torch.Tensor:
    """``key`` folded with this shard's index over those of ``axes`` that the enclosing
    ``shard_map`` binds (their combined index, major axis first in mesh order): shards
    along them draw differently, shards along the other axes (tensor-parallel replicas of
    a replicated activation) draw the same. Outside ``shard_map``, or when the bound axes
    hold one shard in all, ``key`` itself: a one-device run draws what an unsharded run
    draws.

    >>> import fsharded as fs
    >>> draw = lambda x: x + uniform(shard_key(key(0), "data"), x.shape)
    >>> f = fs.shard_map(draw, mesh=fs.Mesh({"data": 2}), in_specs=fs.P("data"),
    ...                  out_specs=fs.P("data"))
    >>> y = f(torch.zeros(4))  # shard i adds uniform(fold_in(key(0), i), (2,))
    >>> bool(torch.equal(y[2:], uniform(fold_in(key(0), 1), (2,))))
    True
    """
    _check_key(key, "shard_key")
    names = (axes,) if isinstance(axes, str) else tuple(axes)
    if not all(isinstance(a, str) for a in names):
        raise TypeError(f"fsharded.random.shard_key: axes must be a mesh axis name or a "
                        f"sequence of names, got {axes!r}")
    frame = _env.current()
    if frame is None:
        return key
    bound = tuple(a for a in frame.mesh.axis_names if a in names)
    if math.prod(frame.mesh.shape[a] for a in bound) == 1:
        return key
    return fold_in(key, axis_index(bound))


# -- draws ------------------------------------------------------------------------------


def _shape(shape: Shape, op: str) -> tuple[int, ...]:
    if isinstance(shape, numbers.Integral) and not isinstance(shape, bool):
        return (int(shape),)
    try:
        return tuple(int(d) for d in shape)
    except TypeError:
        raise TypeError(f"fsharded.random.{op}: shape must be an int or a sequence of ints, "
                        f"got {shape!r}") from None


def _float(dtype: torch.dtype, op: str) -> None:
    if dtype not in _MANTISSA:
        raise TypeError(f"fsharded.random.{op}: dtype must be one of "
                        f"{[str(d) for d in _MANTISSA]}, got {dtype}")


def bits(key: torch.Tensor, shape: Shape = ()) -> torch.Tensor:
    """Uniform 32-bit words, as int64 values in ``[0, 2**32)``."""
    _check_key(key, "bits")
    shape = _shape(shape, "bits")
    return _words(key, math.prod(shape)).reshape(shape)


def _unit(key: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """Uniform on ``[0, 1)`` with as many random bits as ``dtype`` has mantissa bits: an
    integer scaled by a power of two, exact in every dtype and on every device."""
    n = math.prod(shape)
    nmant = _MANTISSA[dtype]
    if dtype == torch.float64:  # 52 bits from both words of one block per value
        blocks = _hash(key, torch.arange(n, dtype=torch.int64, device=key.device))
        m = (blocks[..., 0] << 20) | (blocks[..., 1] >> 12)
        return (m.to(torch.float64) * 2.0**-52).reshape(shape)
    m = _words(key, n) >> (32 - nmant)
    return (m.to(torch.float32) * 2.0**-nmant).to(dtype).reshape(shape)


def _is_number(v: Any, value: float) -> bool:
    return isinstance(v, numbers.Real) and not isinstance(v, torch.Tensor) and v == value


def uniform(key: torch.Tensor, shape: Shape = (), dtype: torch.dtype = torch.float32,
            low: float | torch.Tensor = 0.0, high: float | torch.Tensor = 1.0) -> torch.Tensor:
    """Uniform on ``[low, high)`` (``low + u * (high - low)``, at least ``low``, as JAX's).

    >>> u = uniform(key(0), (2, 3), low=-1.0, high=1.0)
    """
    _check_key(key, "uniform")
    _float(dtype, "uniform")
    u = _unit(key, _shape(shape, "uniform"), dtype)
    if _is_number(low, 0) and _is_number(high, 1):
        return u
    lo = torch.as_tensor(low, dtype=dtype, device=u.device)
    hi = torch.as_tensor(high, dtype=dtype, device=u.device)
    return torch.maximum(u * (hi - lo) + lo, lo)


def normal(key: torch.Tensor, shape: Shape = (), dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Standard normal: ``sqrt(2) * erfinv(u)`` for ``u`` uniform on ``(-1, 1)``, as JAX's
    (computed in float32 for 16-bit dtypes).

    >>> z = normal(key(0), (1000,))
    """
    _check_key(key, "normal")
    _float(dtype, "normal")
    work = dtype if dtype in (torch.float32, torch.float64) else torch.float32
    lo = -1.0 + 2.0 ** -(_MANTISSA[work] + 1)  # the float after -1: erfinv(-1) = -inf
    u = uniform(key, shape, work, lo, 1.0)
    return (torch.erfinv(u) * math.sqrt(2.0)).to(dtype)


def bernoulli(key: torch.Tensor, p: float | torch.Tensor = 0.5,
              shape: Shape | None = None) -> torch.Tensor:
    """Booleans that are True with probability ``p`` (``uniform < p``); ``shape`` defaults
    to ``p``'s. A float ``p`` compares against float32 uniforms, a float64 ``p`` against
    float64 ones.

    >>> keep = bernoulli(key(0), 0.9, (4, 8))
    """
    _check_key(key, "bernoulli")
    if shape is None:
        shape = tuple(p.shape) if isinstance(p, torch.Tensor) else ()
    dtype = torch.float64 if isinstance(p, torch.Tensor) and p.dtype == torch.float64 else torch.float32
    if isinstance(p, torch.Tensor):
        p = p.detach()
    return uniform(key, shape, dtype) < p


def randint(key: torch.Tensor, shape: Shape, low: int, high: int,
            dtype: torch.dtype = torch.int64) -> torch.Tensor:
    """Integers uniform on ``[low, high)``, for ``high - low`` up to ``2**31`` (64 random
    bits reduced modulo the span: a bias below ``2**-32``).

    >>> tokens = randint(key(0), (2, 16), 0, 50257)
    """
    _check_key(key, "randint")
    ok = all(isinstance(v, numbers.Integral) and not isinstance(v, bool) for v in (low, high))
    if not ok or not 1 <= high - low <= 2**31:
        raise ValueError(f"fsharded.random.randint: low and high must be ints with "
                         f"1 <= high - low <= 2**31, got low={low!r}, high={high!r}")
    shape = _shape(shape, "randint")
    span = int(high - low)
    blocks = _hash(key, torch.arange(math.prod(shape), dtype=torch.int64, device=key.device))
    hi, lo = blocks[..., 0] % span, blocks[..., 1] % span
    r = (hi * (2**32 % span) + lo) % span  # (hi * 2**32 + lo) mod span, in int64
    return (r + low).reshape(shape).to(dtype)


def dropout(key: torch.Tensor, x: torch.Tensor, p: float, *, training: bool = True,
            broadcast_dims: Sequence[int] = ()) -> torch.Tensor:
    """Inverted dropout: each value is zeroed with probability ``p`` and the kept ones are
    scaled by ``1 / (1 - p)`` (flax's ``nn.Dropout``; torch's scaling). ``p = 0`` or
    ``training=False`` returns ``x``; ``p = 1`` gives zeros. The mask is a float32-uniform
    Bernoulli mask whatever ``x``'s dtype, so a bf16 and a float32 run drop the same values.
    ``broadcast_dims``: dims that share one mask value (``(2, 3)`` for channel dropout of
    ``(N, C, H, W)``). The gradient is ``mask / (1 - p)``.

    >>> y = dropout(key(0), torch.ones(4, 8), 0.1)
    """
    _check_key(key, "dropout")
    if not isinstance(p, numbers.Real) or not 0.0 <= p <= 1.0:
        raise ValueError(f"fsharded.random.dropout: dropout probability has to be between 0 "
                         f"and 1, but got {p!r}")
    if not training or p == 0.0:
        return x
    return _apply_mask(x, _keep_mask(key, x, p, broadcast_dims), p)


def _keep_mask(key: torch.Tensor, x: torch.Tensor, p: float, broadcast_dims: Sequence[int]):
    shape = list(x.shape)
    for d in broadcast_dims:
        shape[d] = 1
    if p == 1.0:
        return torch.zeros(shape, dtype=torch.bool, device=x.device)
    return bernoulli(key.to(x.device), 1.0 - p, shape)


def _apply_mask(x: torch.Tensor, keep: torch.Tensor, p: float) -> torch.Tensor:
    if p == 1.0:  # no 1 / 0: the unselected 0 * inf would make the gradient NaN
        return torch.where(keep, x, 0.0)
    # A multiply, not x / (1 - p): CUDA divides by a scalar as a multiply by its
    # reciprocal and CPU does not, and the bits must agree across devices.
    return torch.where(keep, x * (1.0 / (1.0 - p)), 0.0)


# -- implicit keys: torch's random ops under a scope ------------------------------------


class _Source:
    """A scope's key, or the function that derives it at the first use (then kept)."""

    def __init__(self, key: torch.Tensor | Callable[[], torch.Tensor]) -> None:
        lazy = callable(key) and not isinstance(key, torch.Tensor)
        self.make, self.key = (key, None) if lazy else (None, key)
        if self.key is not None:
            _check_key(key, "scope")

    def get(self) -> torch.Tensor:
        if self.key is None:
            k = self.make()
            _check_key(k, "scope")
            self.key, self.make = k, None
        return self.key


class KeyScope(TorchFunctionMode):
    """While entered, torch's random ops draw from ``key``: call ``i`` of a covered op
    uses ``fold_in(key, i)``, so the same program with the same key draws the same values
    (on the virtual mesh, on ranks, under ``torch.func`` transforms). Entered inside a
    ``shard_map`` body it sits above the body's varying-axes mode, so a draw from a
    ``shard_key`` is typed varying over the key's axes.

    Covered: ``F.dropout`` (so ``nn.Dropout``), ``F.dropout1d/2d/3d``, ``torch.dropout``,
    ``torch.feature_dropout``, ``torch.native_dropout`` and their in-place forms;
    ``F.scaled_dot_product_attention`` with ``dropout_p > 0`` (the math reference with
    keyed dropout on the attention weights); ``torch.rand``, ``rand_like``, ``randn``,
    ``randn_like``, ``randint``, ``randint_like``, ``bernoulli``, ``normal``;
    ``Tensor.bernoulli``, ``bernoulli_``, ``uniform_``, ``normal_``; ``nn.init.uniform_``,
    ``normal_`` and ``kaiming_uniform_`` (so ``nn.Linear`` and the other inits built on
    ``Tensor.uniform_``/``normal_`` initialise from the key).

    Every other random op of torch's (``randperm``, ``multinomial``, ``poisson``,
    ``Tensor.exponential_``, ``random_``, ``F.gumbel_softmax``, ``rrelu`` and
    ``alpha_dropout`` in training, ``nn.MultiheadAttention`` with dropout in training,
    ...) and any covered op given ``generator=`` raises ``NotImplementedError`` naming it:
    it would draw from torch's global generator, which neither the key nor the backend
    controls. Not seen at all (they use the global generator): ops run where torch sets
    the modes aside, i.e. inside an autograd Function's forward under ``torch.func`` and
    under ``torch._C.DisableTorchFunction``; a function re-run in backward (remat) must
    ``fork()`` a key and run under ``scope`` of it both times.
    """

    def __init__(self, key: torch.Tensor | Callable[[], torch.Tensor]) -> None:
        super().__init__()
        # A callable is a key derived only when the first draw needs it (most programs
        # run under a step's scope draw nothing: deriving costs ~150 small int ops).
        self._src = _Source(key)
        self.calls = 0  # keys drawn (or reserved) so far

    @property
    def key(self) -> torch.Tensor:
        return self._src.get()

    def next_key(self) -> torch.Tensor:
        """The key of the next draw, ``fold_in(key, calls)``; advances the stream."""
        k = fold_in(self.key, self.calls)
        self.calls += 1
        return k

    @contextlib.contextmanager
    def rekeyed(self, key: torch.Tensor | Callable[[], torch.Tensor]) -> Iterator[None]:
        """Draw from ``key`` (a fresh stream) within the block, then go back to this
        scope's stream: what a nested ``scope(key)`` does, without a second mode on the
        stack (each op would pass through both)."""
        saved = self._src, self.calls
        self._src, self.calls = _Source(key), 0
        try:
            yield
        finally:
            self._src, self.calls = saved

    def reserve(self) -> Callable[[], torch.Tensor]:
        """Advance the stream by one key now and give a function that derives that key
        when (and only when) it is needed, the same key every call."""
        i, box, src = self.calls, [], self._src
        self.calls += 1

        def make() -> torch.Tensor:
            if not box:
                box.append(fold_in(src.get(), i))
            return box[0]

        return make

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if kwargs is None:
            kwargs = {}
        try:
            rule = _RULES.get(func)
        except TypeError:  # an unhashable callable: not one of ours
            rule = None
        if rule is None:
            return func(*args, **kwargs)
        return rule(self, func, args, kwargs)


def scope(key: torch.Tensor | Callable[[], torch.Tensor]) -> KeyScope:
    """Make torch's random ops (``nn.Dropout``, ``torch.rand``, ...) draw from ``key``
    while entered; see ``KeyScope``. Scopes nest (the innermost draws). ``key`` may be a
    function giving the key, called at the first draw.

    >>> drop = torch.nn.Dropout(0.1)
    >>> with scope(key(0)):
    ...     a = drop(torch.ones(8))
    >>> with scope(key(0)):
    ...     b = drop(torch.ones(8))
    >>> bool(torch.equal(a, b))
    True
    """
    return KeyScope(key)


def innermost() -> KeyScope | None:
    """The innermost entered scope, or None outside any."""
    for mode in reversed(torch.overrides._get_current_function_mode_stack()):
        if isinstance(mode, KeyScope):
            return mode
    return None


def fork(*, lazy: bool = False) -> torch.Tensor | Callable[[], torch.Tensor] | None:
    """The next key of the innermost entered scope (advancing it), or None outside any.
    For code that runs a function twice and needs the same draws both times (remat): fork
    before the first run, pass the key along as an argument, and run each time under
    ``scope`` of it. ``lazy=True``: the stream advances now, but the key is derived only
    if the returned function is called (``scope`` takes such a function too)."""
    for mode in reversed(torch.overrides._get_current_function_mode_stack()):
        if isinstance(mode, KeyScope):
            return mode.reserve() if lazy else mode.next_key()
    return None


# The rules: (scope, func, args, kwargs) -> result. Arguments are bound by position and
# name, as torch's signatures give them.


def _arg(args: tuple, kwargs: dict, i: int, name: str, default: Any = None) -> Any:
    return args[i] if len(args) > i else kwargs.get(name, default)


def _no_generator(op: str, kwargs: dict) -> None:
    if kwargs.get("generator") is not None:
        raise NotImplementedError(
            f"{op}(generator=...) inside fsharded.random.scope: the scope's key would be "
            f"ignored; drop generator= to draw from the key, or call it outside the scope")
    if kwargs.get("out") is not None:
        raise NotImplementedError(f"{op}(out=...) inside fsharded.random.scope is not "
                                  f"supported: assign the result instead")


def _name(func: Any) -> str:
    n = func.__name__
    return f"Tensor.{n}" if getattr(torch.Tensor, n, None) is func else f"torch.{n}"


def _finish(x: torch.Tensor, kwargs: dict) -> torch.Tensor:
    return x.requires_grad_() if kwargs.get("requires_grad") else x


def _placement(kwargs: dict, like: torch.Tensor | None, dtype: torch.dtype | None):
    """The dtype and device a factory's result gets: its kwargs', else ``like``'s, else the
    defaults (``device=0`` is a device: compare with None)."""
    dtype = kwargs.get("dtype") if kwargs.get("dtype") is not None else (
        like.dtype if like is not None else dtype)
    device = kwargs.get("device") if kwargs.get("device") is not None else (
        like.device if like is not None else torch.get_default_device())
    return dtype if dtype is not None else torch.get_default_dtype(), torch.device(device)


def _size(args: tuple, kwargs: dict) -> tuple[int, ...]:
    if len(args) == 1 and isinstance(args[0], (tuple, list, torch.Size)):
        return tuple(args[0])
    return tuple(args) if args else tuple(kwargs.get("size", ()))


def _draw(fn: Callable, *, like: bool) -> Callable:
    def rule(s, func, args, kwargs):
        _no_generator(_name(func), kwargs)
        src = args[0] if like else None
        dtype, device = _placement(kwargs, src, None)
        shape = tuple(src.shape) if like else _size(args, kwargs)
        return _finish(fn(s.next_key().to(device), shape, dtype), kwargs)
    return rule


def _randint(s, func, args, kwargs):
    _no_generator(_name(func), kwargs)
    like = func is torch.randint_like
    src = args[0] if like else None
    rest = list(args[1:] if like else args)
    if not like:
        shape = tuple(kwargs["size"]) if "size" in kwargs else tuple(rest.pop())
    else:
        shape = tuple(src.shape)
    if "high" in kwargs:
        rest = [kwargs.get("low", 0), kwargs["high"]] if not rest else [rest[0], kwargs["high"]]
    low, high = (0, rest[0]) if len(rest) == 1 else rest
    dtype, device = _placement(kwargs, src, torch.int64)
    r = randint(s.next_key().to(device), shape, int(low), int(high), dtype)
    return _finish(r, kwargs)


def _probabilities(s, func, args, kwargs):  # torch.bernoulli / Tensor.bernoulli
    _no_generator(_name(func), kwargs)
    x, p = args[0], _arg(args, kwargs, 1, "p")
    k = s.next_key().to(x.device)
    return bernoulli(k, x if p is None else p, tuple(x.shape)).to(x.dtype)


def _bernoulli_(s, func, args, kwargs):
    _no_generator("Tensor.bernoulli_", kwargs)
    x, p = args[0], _arg(args, kwargs, 1, "p", 0.5)
    return x.copy_(bernoulli(s.next_key().to(x.device), p, tuple(x.shape)))


def _fill_uniform(s, x: torch.Tensor, a: float, b: float) -> torch.Tensor:
    return x.copy_(uniform(s.next_key().to(x.device), tuple(x.shape), x.dtype, a, b))


def _fill_normal(s, x: torch.Tensor, mean: float, std: float) -> torch.Tensor:
    return x.copy_(normal(s.next_key().to(x.device), tuple(x.shape), x.dtype) * std + mean)


def _uniform_(s, func, args, kwargs):
    _no_generator("Tensor.uniform_", kwargs)
    return _fill_uniform(s, args[0], _arg(args, kwargs, 1, "from", 0.0),
                         _arg(args, kwargs, 2, "to", 1.0))


def _normal_(s, func, args, kwargs):
    _no_generator("Tensor.normal_", kwargs)
    return _fill_normal(s, args[0], _arg(args, kwargs, 1, "mean", 0.0),
                        _arg(args, kwargs, 2, "std", 1.0))


def _normal(s, func, args, kwargs):  # torch.normal: tensor or float mean and std
    _no_generator("torch.normal", kwargs)
    mean, std = (t.detach() if isinstance(t, torch.Tensor) else t  # as torch's: no gradient
                 for t in (_arg(args, kwargs, 0, "mean", 0.0), _arg(args, kwargs, 1, "std", 1.0)))
    ts = [t for t in (mean, std) if isinstance(t, torch.Tensor)]
    if ts:
        shape = torch.broadcast_shapes(*(t.shape for t in ts))
        dtype, device = torch.result_type(mean, std), ts[0].device
    else:
        shape = tuple(_arg(args, kwargs, 2, "size"))
        dtype, device = _placement(kwargs, None, None)
    z = normal(s.next_key().to(device), tuple(shape), dtype)
    return _finish(z * std + mean, kwargs)


def _init(fill: Callable, names: tuple[str, str], defaults: tuple[float, float]) -> Callable:
    def rule(s, func, args, kwargs):
        _no_generator(f"nn.init.{func.__name__}", kwargs)
        x = _arg(args, kwargs, 0, "tensor")
        a, b = (_arg(args, kwargs, i + 1, n, d) for i, (n, d) in enumerate(zip(names, defaults)))
        with torch.no_grad():
            return fill(s, x, a, b)
    return rule


def _kaiming_uniform_(s, func, args, kwargs):
    _no_generator("nn.init.kaiming_uniform_", kwargs)
    x = _arg(args, kwargs, 0, "tensor")
    if 0 in x.shape:
        warnings.warn("Initializing zero-element tensors is a no-op", stacklevel=4)
        return x
    fan = torch.nn.init._calculate_correct_fan(x, _arg(args, kwargs, 2, "mode", "fan_in"))
    gain = torch.nn.init.calculate_gain(_arg(args, kwargs, 3, "nonlinearity", "leaky_relu"),
                                        _arg(args, kwargs, 1, "a", 0))
    bound = math.sqrt(3.0) * gain / math.sqrt(fan)
    with torch.no_grad():
        return _fill_uniform(s, x, -bound, bound)


def _keyed_dropout(s, x: torch.Tensor, p: float, *, inplace: bool = False, feature: int = 0,
                   with_mask: bool = False):
    """``feature``: how many leading dims keep their own mask value (0: every value)."""
    if not isinstance(p, numbers.Real) or not 0.0 <= p <= 1.0:
        raise ValueError(f"dropout probability has to be between 0 and 1, but got {p}")
    if feature and x.dim() < 2:
        raise RuntimeError("Feature dropout requires at least 2 dimensions in the input")
    keep = _keep_mask(s.next_key(), x, p, tuple(range(feature, x.dim())) if feature else ())
    y = _apply_mask(x, keep, p)
    y = x.copy_(y) if inplace else y
    return (y, keep.expand(x.shape)) if with_mask else y


def _f_dropout(s, func, args, kwargs):  # F.dropout, F.dropout1d/2d/3d
    x = args[0]
    p, training = _arg(args, kwargs, 1, "p", 0.5), _arg(args, kwargs, 2, "training", True)
    if not training or p == 0.0:
        return func(*args, **kwargs)
    func(x, p, False, False)  # torch's own checks and warnings on p and the input's dims
    feature = {F.dropout: 0, F.dropout1d: 2 if x.dim() == 3 else 1, F.dropout2d: 2,
               F.dropout3d: 2 if x.dim() == 5 else 1}[func]
    return _keyed_dropout(s, x, p, inplace=_arg(args, kwargs, 3, "inplace", False),
                          feature=feature)


def _torch_dropout(s, func, args, kwargs):  # torch.dropout(input, p, train) and friends
    x, p, train = args[0], _arg(args, kwargs, 1, "p"), _arg(args, kwargs, 2, "train")
    native = func is torch.native_dropout
    if train is False or (not native and not train) or p == 0.0:  # native: train=None trains
        return func(*args, **kwargs)
    name = func.__name__
    return _keyed_dropout(s, x, p, inplace=name.endswith("_"),
                          feature=2 if "feature" in name else 0, with_mask=native)


def _sdpa(s, func, args, kwargs):
    q, k, v = args[:3]
    mask = _arg(args, kwargs, 3, "attn_mask")
    p = _arg(args, kwargs, 4, "dropout_p", 0.0)
    if not p:
        return func(*args, **kwargs)
    causal, scale = _arg(args, kwargs, 5, "is_causal", False), _arg(args, kwargs, 6, "scale")
    if causal and mask is not None:
        raise RuntimeError("scaled_dot_product_attention: explicit attn_mask should not be "
                           "set when is_causal=True")
    if _arg(args, kwargs, 7, "enable_gqa", False) and k.size(-3) != q.size(-3):
        k = k.repeat_interleave(q.size(-3) // k.size(-3), -3)
        v = v.repeat_interleave(q.size(-3) // v.size(-3), -3)
    # torch's documented math reference, with the keyed dropout on the weights
    scale = 1.0 / math.sqrt(q.size(-1)) if scale is None else scale
    scores = q @ k.transpose(-2, -1) * scale  # (..., L, S)
    if causal:
        keep = torch.ones(q.size(-2), k.size(-2), dtype=torch.bool, device=q.device).tril()
        scores = scores.masked_fill(~keep, float("-inf"))
    elif mask is not None:
        scores = (scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool
                  else scores + mask)
    w = dropout(s.next_key().to(q.device), torch.softmax(scores, dim=-1), p)
    return w @ v


def _refuse(name: str, hint: str, random_if: Callable[[tuple, dict], bool] | None = None):
    def rule(s, func, args, kwargs):
        if random_if is not None and not random_if(args, kwargs):
            return func(*args, **kwargs)
        raise NotImplementedError(
            f"{name} inside fsharded.random.scope: it would draw from torch's global "
            f"generator, which the scope's key does not control (not reproducible from the "
            f"key, and not the same on the virtual mesh and on ranks). {hint}")
    return rule


_FROM_KEY = ("Draw from a key instead (fsharded.random.uniform / normal / bits of "
             "fsharded.random.fork()), or call it outside the scope.")


def _training(i: int, name: str, default: bool = False, p: tuple[int, str] | None = (1, "p")):
    """Random only in training (``args[i]`` / ``name``) with a nonzero probability ``p``."""
    def random_if(args: tuple, kwargs: dict) -> bool:
        prob = 1.0 if p is None else _arg(args, kwargs, p[0], p[1], 0.5)
        return bool(_arg(args, kwargs, i, name, default)) and prob != 0
    return random_if


_RULES: dict[Any, Callable] = {
    F.dropout: _f_dropout, F.dropout1d: _f_dropout, F.dropout2d: _f_dropout,
    F.dropout3d: _f_dropout,
    torch.dropout: _torch_dropout, torch.dropout_: _torch_dropout,
    torch.feature_dropout: _torch_dropout, torch.feature_dropout_: _torch_dropout,
    torch.native_dropout: _torch_dropout,
    F.scaled_dot_product_attention: _sdpa,
    torch.rand: _draw(uniform, like=False), torch.rand_like: _draw(uniform, like=True),
    torch.randn: _draw(normal, like=False), torch.randn_like: _draw(normal, like=True),
    torch.randint: _randint, torch.randint_like: _randint,
    torch.bernoulli: _probabilities, torch.Tensor.bernoulli: _probabilities,
    torch.Tensor.bernoulli_: _bernoulli_,
    torch.Tensor.uniform_: _uniform_, torch.Tensor.normal_: _normal_, torch.normal: _normal,
    torch.nn.init.uniform_: _init(_fill_uniform, ("a", "b"), (0.0, 1.0)),
    torch.nn.init.normal_: _init(_fill_normal, ("mean", "std"), (0.0, 1.0)),
    torch.nn.init.kaiming_uniform_: _kaiming_uniform_,
    torch.randperm: _refuse("torch.randperm", "A keyed permutation: "
                            "torch.argsort(fsharded.random.uniform(k, (n,))); or call it "
                            "outside the scope."),
    torch.multinomial: _refuse("torch.multinomial", _FROM_KEY),
    torch.Tensor.multinomial: _refuse("Tensor.multinomial", _FROM_KEY),
    torch.poisson: _refuse("torch.poisson", _FROM_KEY),
    torch.binomial: _refuse("torch.binomial", _FROM_KEY),
    torch._standard_gamma: _refuse("torch._standard_gamma", _FROM_KEY),
    torch._sample_dirichlet: _refuse("torch._sample_dirichlet", _FROM_KEY),
    torch.Tensor.random_: _refuse("Tensor.random_", _FROM_KEY),
    torch.Tensor.exponential_: _refuse("Tensor.exponential_", _FROM_KEY),
    torch.Tensor.geometric_: _refuse("Tensor.geometric_", _FROM_KEY),
    torch.Tensor.cauchy_: _refuse("Tensor.cauchy_", _FROM_KEY),
    torch.Tensor.log_normal_: _refuse("Tensor.log_normal_", _FROM_KEY),
    F.gumbel_softmax: _refuse("F.gumbel_softmax", "Add Gumbel noise from a key: "
                              "-log(-log(fsharded.random.uniform(k, shape))); or call it "
                              "outside the scope."),
    F.rrelu: _refuse("F.rrelu(training=True)", _FROM_KEY, _training(3, "training", p=None)),
    torch.rrelu: _refuse("torch.rrelu(training=True)", _FROM_KEY,
                         _training(3, "training", p=None)),
    torch.rrelu_: _refuse("torch.rrelu_(training=True)", _FROM_KEY,
                          _training(3, "training", p=None)),
    F.alpha_dropout: _refuse("F.alpha_dropout(training=True)", _FROM_KEY,
                             _training(2, "training")),
    F.feature_alpha_dropout: _refuse("F.feature_alpha_dropout(training=True)", _FROM_KEY,
                                     _training(2, "training")),
    torch.alpha_dropout: _refuse("torch.alpha_dropout(train=True)", _FROM_KEY,
                                 _training(2, "train")),
    torch.alpha_dropout_: _refuse("torch.alpha_dropout_(train=True)", _FROM_KEY,
                                  _training(2, "train")),
    torch.feature_alpha_dropout: _refuse("torch.feature_alpha_dropout(train=True)", _FROM_KEY,
                                         _training(2, "train")),
    torch.feature_alpha_dropout_: _refuse("torch.feature_alpha_dropout_(train=True)",
                                          _FROM_KEY, _training(2, "train")),
    F.multi_head_attention_forward: _refuse(
        "nn.MultiheadAttention / F.multi_head_attention_forward with dropout in training",
        "Use dropout=0 there and F.scaled_dot_product_attention(dropout_p=...) or "
        "nn.Dropout on the weights, which the scope covers.",
        _training(13, "training", True, (10, "dropout_p"))),
}
for _f in (F._fractional_max_pool2d, F._fractional_max_pool3d,
           F.fractional_max_pool2d_with_indices, F.fractional_max_pool3d_with_indices):
    _RULES[_f] = _refuse(f"F.{_f.__name__.lstrip('_')} without _random_samples",
                         "Pass _random_samples=fsharded.random.uniform(k, (N, C, dims)).",
                         lambda a, kw: _arg(a, kw, 5, "_random_samples") is None)
del _f
