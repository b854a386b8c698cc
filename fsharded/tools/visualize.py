"""Which device holds which block of a tensor: ``visualize_sharding``.

>>> print(fs.visualize_sharding(torch.zeros(8, 6), P("data", "tensor"), fs.Mesh({"data": 2, "tensor": 2})))

A tensor's layout is a grid of blocks: its dims sharded over mesh axes are cut into equal
blocks (a tuple of axes cuts in their order, the first major), the other dims stay whole,
and every block is held by the devices whose coordinates select it — several where the
spec leaves a mesh axis out (replicated over it). The view draws that grid as text (box
drawing, one cell per block with its index ranges and the devices holding it) and, in a
notebook, as a matplotlib picture (``_repr_png_``, or ``.figure()``): the first sharded
dim down the rows, the second across the columns, any further sharded dims as facets.

Called inside ``shard_map`` without a spec, it shows what the body sees: the local shape
and the mesh axes the value varies over (its type), as ``jax.typeof(x).vma`` does. On real
ranks a tensor is this rank's shard (what ``shard_map`` takes there; the global shape is
the shard's times the cuts), and ``show()`` prints on rank 0 only (every rank computes the
same view).
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field
from typing import Any

import torch

from fsharded.mesh import _tree
from fsharded.mesh._layout import dims
from fsharded.mesh._mesh import Mesh
from fsharded.mesh._spec import PartitionSpec, format_spec_errors, spec_errors
from fsharded.spmd import _env
from fsharded.spmd._transfer import backend_for
from fsharded.spmd.collectives import varying_axes

__all__ = ["visualize_sharding", "ShardingView", "LocalView", "TreeView"]


@dataclass(frozen=True)
class Block:
    """One block of the tensor: ``(start, stop)`` per dim, and the devices holding it."""

    box: tuple[tuple[int, int], ...]
    devices: tuple[int, ...]


@dataclass
class ShardingView:
    """The layout of a tensor of global ``shape`` under ``spec`` on ``mesh``."""

    shape: tuple[int, ...]
    spec: PartitionSpec
    mesh: Mesh
    dtype: torch.dtype | None = None
    name: str = ""
    blocks: list[Block] = field(default_factory=list)

    # -- what the layout is -----------------------------------------------------------

    @property
    def sharded_dims(self) -> list[int]:
        """Tensor dims cut into more than one block."""
        return [d for d, axes in enumerate(dims(self.spec, len(self.shape)))
                if math.prod(self.mesh.shape[a] for a in axes) > 1]

    @property
    def replicated_over(self) -> tuple[str, ...]:
        """Mesh axes (of size > 1) the spec does not name: every block has a copy per
        position along them."""
        named = set(self.spec.axes)
        return tuple(a for a in self.mesh.axis_names if a not in named and self.mesh.shape[a] > 1)

    def holders(self, index: tuple[int, ...]) -> tuple[int, ...]:
        """The devices holding the element at ``index``."""
        for b in self.blocks:
            if all(lo <= i < hi for i, (lo, hi) in zip(index, b.box)):
                return b.devices
        raise IndexError(f"visualize_sharding: index {index} is outside shape {self.shape}")

    # -- text ---------------------------------------------------------------------------

    def _cell(self, b: Block) -> list[str]:
        rng = ", ".join(f"{lo}:{hi}" for d, (lo, hi) in enumerate(b.box) if d in self.sharded_dims) or "all"
        devs = b.devices
        if len(devs) == self.mesh.size and self.mesh.size > 1:
            who = f"all {len(devs)}"
        else:
            who = ",".join(map(str, devs))
        return [f"[{rng}]", f"dev {who}"]

    def _placement(self) -> tuple[int | None, int | None, list[int]]:
        """(the dim down the rows, the dim across the columns, the dims of the facets): the
        first two sharded dims, and one sharded dim alone across the columns when it is the
        tensor's last (a vector is a row, as JAX draws it), else down the rows."""
        sd = self.sharded_dims
        if len(sd) == 1:
            return (None, sd[0], []) if sd[0] == len(self.shape) - 1 else (sd[0], None, [])
        return (sd[0] if sd else None), (sd[1] if len(sd) > 1 else None), sd[2:]

    def _grids(self) -> list[tuple[str, list[list[Block]]]]:
        """(facet title, rows x cols of blocks) for the text and the picture."""
        rows_d, cols_d, facet_ds = self._placement()

        def starts(d: int | None) -> list[int]:
            return sorted({b.box[d][0] for b in self.blocks}) if d is not None else [0]

        out = []
        for facet in itertools.product(*(starts(d) for d in facet_ds)):
            grid = []
            for r in starts(rows_d):
                row = []
                for c in starts(cols_d):
                    want = dict(zip(facet_ds, facet))
                    if rows_d is not None:
                        want[rows_d] = r
                    if cols_d is not None:
                        want[cols_d] = c
                    row.append(next(b for b in self.blocks if all(b.box[d][0] == v for d, v in want.items())))
                grid.append(row)
            title = ", ".join(f"dim {d} [{s}:{s + self.shape[d] // self._cuts(d)}]" for d, s in zip(facet_ds, facet))
            out.append((title, grid))
        return out

    def _cuts(self, d: int) -> int:
        return math.prod(self.mesh.shape[a] for a in dims(self.spec, len(self.shape))[d])

    def header(self) -> str:
        dt = str(self.dtype).replace("torch.", "") + " " if self.dtype is not None else ""
        what = f"{self.name}: " if self.name else ""
        rep = self.replicated_over
        tail = f"; replicated over {', '.join(rep)}" if rep else ""
        return f"{what}{dt}{list(self.shape)} {self.spec!r} on {self.mesh!r}{tail}"

    def text(self) -> str:
        lines = [self.header()]
        axes_of = dims(self.spec, len(self.shape))
        rows_d, cols_d, facet_ds = self._placement()

        def over(d: int) -> str:
            ax = axes_of[d]
            return ax[0] if len(ax) == 1 else "(" + ", ".join(ax) + ")"

        where = [f"{what}: dim {d} over {over(d)}" for what, d in (("rows", rows_d), ("columns", cols_d))
                 if d is not None] + [f"facets: dim {d} over {over(d)}" for d in facet_ds]
        if where:
            lines.append("; ".join(where))
        for title, grid in self._grids():
            if title:
                lines.append(title)
            lines.extend(_box_grid([[self._cell(b) for b in row] for row in grid]))
        return "\n".join(lines)

    __str__ = text

    def __repr__(self) -> str:
        return self.text()

    def show(self) -> None:
        """Print the text (on rank 0 only under torch.distributed)."""
        if _rank() == 0:
            print(self.text())

    # -- picture ------------------------------------------------------------------------

    def figure(self, ax: Any = None) -> Any:
        """A matplotlib figure of the grid: one rectangle per block (sized by its extent),
        coloured by the first device holding it, labelled with the devices."""
        import matplotlib.pyplot as plt

        grids = self._grids()
        rows_d, cols_d, _ = self._placement()
        if ax is None:
            fig, axes = plt.subplots(1, len(grids), figsize=(min(4 * len(grids), 16), 3.2), squeeze=False)
            axes = list(axes[0])
        else:
            fig, axes = ax.figure, [ax] * len(grids)
        cmap = plt.get_cmap("tab20" if self.mesh.size > 10 else "tab10")
        for a, (title, grid) in zip(axes, grids):
            H = self.shape[rows_d] if rows_d is not None else 1
            W = self.shape[cols_d] if cols_d is not None else 1
            for row in grid:
                for b in row:
                    y0, y1 = b.box[rows_d] if rows_d is not None else (0, 1)
                    x0, x1 = b.box[cols_d] if cols_d is not None else (0, 1)
                    a.add_patch(plt.Rectangle((x0, y0), x1 - x0, y1 - y0, facecolor=cmap(b.devices[0] % cmap.N),
                                              edgecolor="black", linewidth=1.5, alpha=0.85))
                    a.text((x0 + x1) / 2, (y0 + y1) / 2, "\n".join(self._cell(b)), ha="center", va="center",
                           fontsize=8)
            a.set_xlim(0, W)
            a.set_ylim(H, 0)
            a.set_xticks([])
            a.set_yticks([])
            a.set_title(title or self.header(), fontsize=8)
        return fig

    def _repr_png_(self) -> bytes:
        import io

        import matplotlib.pyplot as plt  # savefig works on any backend: the notebook's stays

        fig = self.figure()
        buf = io.BytesIO()
        fig.savefig(buf, format="png", dpi=100, bbox_inches="tight")
        plt.close(fig)
        return buf.getvalue()


@dataclass
class LocalView:
    """What a ``shard_map`` body sees of a value: its local shape and the mesh axes it
    varies over."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    varying: tuple[str, ...]
    mesh: Mesh
    name: str = ""

    def text(self) -> str:
        what = f"{self.name}: " if self.name else ""
        dt = str(self.dtype).replace("torch.", "")
        v = ", ".join(self.varying) if self.varying else "none (the same on every shard)"
        return f"{what}local {dt}{list(self.shape)} inside shard_map on {self.mesh!r}; varies over: {v}"

    __str__ = text
    __repr__ = text

    def show(self) -> None:
        if _rank() == 0:
            print(self.text())


@dataclass
class TreeView:
    """One view per tensor leaf of a tree, under its path."""

    views: list[Any]

    def text(self) -> str:
        return "\n\n".join(v.text() for v in self.views)

    __str__ = text
    __repr__ = text

    def show(self) -> None:
        if _rank() == 0:
            print(self.text())

    def __getitem__(self, i: int) -> Any:
        return self.views[i]

    def __len__(self) -> int:
        return len(self.views)


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _box_grid(cells: list[list[list[str]]]) -> list[str]:
    """Rows of cells (each a list of lines) drawn with box-drawing characters."""
    ncols = len(cells[0])
    width = [max(len(line) for row in cells for line in row[c]) + 2 for c in range(ncols)]
    height = [max(len(cell) for cell in row) for row in cells]

    def rule(left: str, mid: str, right: str) -> str:
        return left + mid.join("─" * w for w in width) + right

    out = [rule("┌", "┬", "┐")]
    for r, row in enumerate(cells):
        for i in range(height[r]):
            out.append("│" + "│".join((cell[i] if i < len(cell) else "").center(width[c])
                                      for c, cell in enumerate(row)) + "│")
        out.append(rule("├", "┼", "┤") if r < len(cells) - 1 else rule("└", "┴", "┘"))
    return out


def _layout(shape: tuple[int, ...], spec: PartitionSpec, mesh: Mesh) -> list[Block]:
    """Every device's box; devices with the same box grouped, in box order."""
    axes_of = dims(spec, len(shape))
    boxes: dict[tuple, list[int]] = {}
    for dev in range(mesh.size):
        coords = mesh.coords(dev)
        box = []
        for d, axes in enumerate(axes_of):
            k, i = 1, 0
            for a in axes:
                k *= mesh.shape[a]
                i = i * mesh.shape[a] + coords[a]
            size = shape[d] // k
            box.append((i * size, (i + 1) * size))
        boxes.setdefault(tuple(box), []).append(dev)
    return [Block(b, tuple(devs)) for b, devs in sorted(boxes.items())]


def _one(x: Any, spec: Any, mesh: Mesh | None, name: str) -> Any:
    frame = _env.current()
    if spec is None and frame is not None:  # inside shard_map: the local view
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"visualize_sharding: {name or 'the value'} is a {type(x).__name__}, not a tensor")
        return LocalView(tuple(_local_shape(x)), x.dtype, varying_axes(x), frame.mesh, name)
    if mesh is None:
        raise ValueError("visualize_sharding: give the mesh (visualize_sharding(x, spec, mesh)); only inside "
                         "shard_map may both be left out")
    spec = PartitionSpec() if spec is None else spec
    if not isinstance(spec, PartitionSpec):
        raise TypeError(f"visualize_sharding: spec must be a PartitionSpec, got {type(spec).__name__}")
    if isinstance(x, torch.Tensor):
        shape, dtype = tuple(x.shape), x.dtype
        if backend_for(mesh, None) == "distributed":  # this rank's shard, as shard_map takes it
            shape = tuple(n * math.prod(mesh.shape[a] for a in ax) for n, ax in zip(shape, dims(spec, len(shape))))
    elif isinstance(x, (tuple, list, torch.Size)) and all(isinstance(n, int) for n in x):
        shape, dtype = tuple(x), None  # a global shape alone
    else:
        raise TypeError(f"visualize_sharding: {name or 'the value'} is a {type(x).__name__}; give a tensor "
                        f"or a shape")
    errs = spec_errors(spec, shape, mesh)
    if errs:
        raise ValueError("visualize_sharding: " + format_spec_errors([(name or "<value>", spec, shape, errs)], mesh))
    return ShardingView(shape, spec, mesh, dtype, name, _layout(shape, spec, mesh))


def _local_shape(x: torch.Tensor) -> torch.Size:
    """The shape a shard_map body sees (under the virtual mesh's vmap levels, the
    per-device shape: what ``x.shape`` says there)."""
    return x.shape


def visualize_sharding(x: Any, spec: Any = None, mesh: Mesh | None = None) -> Any:
    """The layout of ``x`` (a global tensor, or its shape) under ``spec`` on ``mesh``: a
    ``ShardingView`` that prints as a text grid and shows as a picture in a notebook.

    ``x`` may be a tree with ``spec`` a spec tree (a prefix of it, as ``shard_map``'s
    ``in_specs``): a ``TreeView`` with one view per tensor leaf, named by its path. Inside
    ``shard_map`` with no spec (and no mesh): the local shape and the axes the value
    varies over (``LocalView``). A spec that does not fit is the error ``shard_map`` gives.

    >>> v = visualize_sharding(torch.zeros(4, 6), P("data"), fs.Mesh({"data": 2, "tensor": 2}))
    >>> [b.devices for b in v.blocks], v.replicated_over
    ([(0, 1), (2, 3)], ('tensor',))
    """
    if isinstance(x, torch.Tensor) or (isinstance(x, (tuple, list, torch.Size)) and x
                                       and all(isinstance(n, int) for n in x)):
        return _one(x, spec, mesh, "")
    paths, leaves, _ = _tree.tree_flatten_with_paths(x)
    specs = _tree.broadcast_prefix(spec if spec is not None else PartitionSpec(), x, what="spec") \
        if spec is not None or mesh is not None else [None] * len(leaves)
    views = [_one(t, s, mesh, p) for p, t, s in zip(paths, leaves, specs) if isinstance(t, torch.Tensor)]
    if not views:
        raise ValueError("visualize_sharding: the tree has no tensor leaves")
    return TreeView(views)
