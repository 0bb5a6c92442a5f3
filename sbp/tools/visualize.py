"""`visualize`: a text grid of which coord holds which block of a global tensor (pure layout maths)."""
from __future__ import annotations

import itertools
from typing import Optional, Sequence

from ..tensor.global_tensor import GlobalTensor
from ..values.errors import SbpError
from ..values.layout import check_global_shape, local_slices
from ..values.mesh import DeviceMesh, as_mesh_shape
from ..values.placement import Partial, normalize


def visualize(x=None, *, global_shape: Optional[Sequence[int]] = None, mesh: Optional[DeviceMesh] = None,
              placements=None) -> str:
    """Which rank holds which block (global index ranges), as a grid over the last two mesh axes.

    Pass a `GlobalTensor`, or `global_shape`, `mesh` and `placements` (no processes needed). A Partial
    local is marked with its ops, e.g. ``P(sum) part``; 3-axis meshes print one grid per leading coord.

    >>> import sbp
    >>> print(visualize(global_shape=(10, 12), mesh=sbp.DeviceMesh((2, 2), names=("dp", "tp")),
    ...                 placements="S(0), P"))
    shape=(10, 12) placements=(S(0), P(sum)) mesh=(2, 2)
              tp=0                              tp=1
    dp=0      rank 0: [0:5, 0:12] P(sum) part   rank 1: [0:5, 0:12] P(sum) part
    dp=1      rank 2: [5:10, 0:12] P(sum) part  rank 3: [5:10, 0:12] P(sum) part
    """
    if x is not None:
        if not isinstance(x, GlobalTensor):
            raise SbpError(f"visualize(x) needs an sbp.GlobalTensor, got {type(x).__name__}; for a layout without "
                           f"data pass global_shape=, mesh= and placements=")
        given = [name for name, v in (("global_shape", global_shape), ("mesh", mesh), ("placements", placements))
                 if v is not None]
        if given:
            raise SbpError(f"visualize(x) takes the layout from x; {', '.join(given)}= would be ignored (pass "
                           f"either a GlobalTensor or global_shape=, mesh= and placements=)")
        global_shape, mesh, placements = tuple(x.shape), x.mesh, x.placements
    if global_shape is None or mesh is None or placements is None:
        raise SbpError("visualize needs a GlobalTensor, or global_shape=, mesh= and placements=")
    shape = check_global_shape(global_shape)
    if not isinstance(mesh, DeviceMesh):
        mesh = DeviceMesh(as_mesh_shape(mesh))
    pls = normalize(placements, len(shape), mesh.ndim)
    ops = sorted({p.op for p in pls if isinstance(p, Partial)})
    mark = (" " + ",".join(f"P({op})" for op in ops) + " part") if ops else ""
    names = mesh.names or tuple(f"axis{a}" for a in range(mesh.ndim))

    def cell(coord: tuple[int, ...]) -> str:
        block = ", ".join(f"{s.start}:{s.stop}" for s in local_slices(shape, mesh.shape, pls, coord))
        return f"rank {mesh.rank_of(coord)}: [{block}]{mark}"

    head = f"shape={shape} placements={pls!r} mesh={mesh.shape}"
    lines = [head]
    lead = mesh.shape[:-2]
    for outer in itertools.product(*(range(n) for n in lead)):
        if lead:
            lines.append(", ".join(f"{names[a]}={c}" for a, c in enumerate(outer)) + ":")
        rows = mesh.shape[-2] if mesh.ndim >= 2 else 1
        cols = mesh.shape[-1]
        grid = [[cell(outer + ((r, c) if mesh.ndim >= 2 else (c,))) for c in range(cols)] for r in range(rows)]
        width = max(len(s) for row in grid for s in row) + 2
        label = (lambda r: f"{names[-2]}={r}") if mesh.ndim >= 2 else (lambda r: "")
        pad = max(len(label(r)) for r in range(rows)) + 2 if mesh.ndim >= 2 else 0
        pad = max(pad, 10) if mesh.ndim >= 2 else 0
        lines.append(" " * pad + "".join(f"{names[-1]}={c}".ljust(width) for c in range(cols)).rstrip())
        for r in range(rows):
            lines.append((label(r).ljust(pad) + "".join(s.ljust(width) for s in grid[r])).rstrip())
    return "\n".join(lines)
