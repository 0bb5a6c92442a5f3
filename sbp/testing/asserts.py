"""`assert_layout_equivalent`: two global tensors (or a global and a plain one) hold the same logical tensor."""
from __future__ import annotations

from typing import Optional

import torch

from ..runtime.agreement import mesh_gather
from ..runtime.backends.base import comm_device
from ..tensor.global_tensor import GlobalTensor
from ..values.errors import SbpError
from ..values.placement import Partial


def assert_layout_equivalent(x: torch.Tensor, y: torch.Tensor, *, exact: Optional[bool] = None,
                             rtol: Optional[float] = None, atol: Optional[float] = None) -> None:
    """Fail unless `x` and `y` are the same logical tensor, whatever their layouts.

    Either may be a `GlobalTensor` or a plain tensor (the full value). An SPMD call: the full tensors are
    gathered (planned redistributions), so every rank compares the same values and all fail together.
    Comparison is exact unless tolerances are given or a Partial placement is involved (reduction order may
    differ), then `torch.testing.assert_close` with `rtol` / `atol` (the dtype's defaults when not given);
    `exact=` forces either (tolerances with ``exact=True`` are an error). The message names the placements,
    the comparison, the max abs difference and where it is.

    >>> import torch
    >>> assert_layout_equivalent(torch.ones(2), torch.ones(2))
    >>> assert_layout_equivalent(torch.ones(2), torch.zeros(2))
    Traceback (most recent call last):
    ...
    AssertionError: not the same logical tensor: x (plain) vs y (plain), shape (2,), compared exactly: max abs diff 1.0 at index (0,) (x=1.0, y=0.0)
    >>> assert_layout_equivalent(torch.ones(2), torch.ones(2) + 1e-6, rtol=1e-5, atol=1e-5)
    """
    for name, t in (("x", x), ("y", y)):
        if not isinstance(t, torch.Tensor):
            raise SbpError(f"assert_layout_equivalent compares tensors (GlobalTensor or plain torch.Tensor); "
                           f"{name} is a {type(t).__name__}")
    if exact is not None and not isinstance(exact, bool):
        raise SbpError(f"assert_layout_equivalent(exact=...) must be None or a bool, got {exact!r}")
    _check_tolerances(rtol, atol)
    if exact and rtol is not None:
        raise SbpError(f"assert_layout_equivalent: rtol={rtol!r} and atol={atol!r} apply to the close comparison, "
                       f"not to exact=True: drop them, or drop exact=True")
    if isinstance(x, GlobalTensor) and isinstance(y, GlobalTensor) and x.mesh != y.mesh:
        raise SbpError(f"assert_layout_equivalent compares tensors on one mesh; x is on {x.mesh!r}, y on "
                       f"{y.mesh!r}: redistribute one onto the other's mesh first (redistribute(..., mesh=...))")

    def describe(t: torch.Tensor) -> str:
        if isinstance(t, GlobalTensor):
            return f"{_fmt(t.placements)} on mesh {t.mesh.shape}"
        return "plain"

    what = f"x ({describe(x)}) vs y ({describe(y)})"
    if tuple(x.shape) != tuple(y.shape):
        raise AssertionError(f"not the same logical tensor: {what}: global shapes {tuple(x.shape)} != {tuple(y.shape)}")
    if x.dtype != y.dtype:
        raise AssertionError(f"not the same logical tensor: {what}: dtypes {x.dtype} != {y.dtype}")
    if any(isinstance(t, GlobalTensor) and t.mesh.coord is None for t in (x, y)):
        return   # this rank is outside the tensor's mesh: it holds nothing of it to compare
    for name, t in (("x", x), ("y", y)):
        if (t._local if isinstance(t, GlobalTensor) else t).is_meta:
            raise SbpError(f"assert_layout_equivalent compares values; {name} is a meta tensor (shape and dtype only)")
    with torch.no_grad():
        fx = x.full() if isinstance(x, GlobalTensor) else x.detach()
        fy = y.full() if isinstance(y, GlobalTensor) else y.detach()
    if fx.dtype == torch.complex32:   # torch compares no ComplexHalf on CPU: exactly widened
        fx, fy = fx.to(torch.complex64), fy.to(torch.complex64)
    if exact is None:
        exact = _exact_by_default(x, y, fx.dtype, rtol is not None)
    same = _same(fx, fy, exact, rtol, atol)
    mesh = next((t.mesh for t in (x, y) if isinstance(t, GlobalTensor)), None)
    if mesh is not None and (isinstance(x, GlobalTensor) != isinstance(y, GlobalTensor)):
        # a plain side is each rank's own: one that differs between ranks (an SPMD slip) fails every rank
        gather, members = mesh_gather(mesh)
        flags = gather(torch.tensor([int(not same)], dtype=torch.int64, device=comm_device(mesh)))
        failed = [r for r, f in zip(members, flags) if int(f.item())]
        if failed and same:
            raise AssertionError(f"not the same logical tensor on every rank: {what}: ranks {failed} see a difference "
                                 f"(a plain tensor that differs between ranks?)")
    if not same:
        how = "compared exactly" if exact else \
            "compared with " + ("the dtype's default tolerances" if rtol is None else f"rtol={rtol}, atol={atol}")
        raise AssertionError(f"not the same logical tensor: {what}, shape {tuple(fx.shape)}, {how}: "
                             f"{_where(fx, fy, exact, rtol, atol)}")


def _exact_by_default(x: torch.Tensor, y: torch.Tensor, dtype: torch.dtype, tolerances: bool) -> bool:
    """`exact=None`'s comparison: exact for bools; close where tolerances are given; else exact unless a
    P(sum) of floats is involved (only sums round differently by order: P(max|min) are exact)."""
    if dtype is torch.bool or not tolerances and not (dtype.is_floating_point or dtype.is_complex):
        return True
    if tolerances:
        return False
    return not any(isinstance(t, GlobalTensor) and any(isinstance(p, Partial) and p.op == "sum" for p in t.placements)
                   for t in (x, y))


def _same(fx: torch.Tensor, fy: torch.Tensor, exact: bool, rtol: Optional[float], atol: Optional[float]) -> bool:
    """Whether two full tensors are equal (`exact`) or close under `torch.testing.assert_close`'s tolerances."""
    if exact:
        return _equal(fx, fy)
    try:
        torch.testing.assert_close(fx, fy, rtol=rtol, atol=atol, equal_nan=True)
    except AssertionError:
        return False
    return True


def _equal(fx: torch.Tensor, fy: torch.Tensor) -> bool:
    """Equal values, NaN where the other has NaN (a NaN is the same logical value as itself here)."""
    if torch.equal(fx, fy):
        return True
    if not (fx.dtype.is_floating_point or fx.dtype.is_complex):
        return False
    nx, ny = torch.isnan(fx), torch.isnan(fy)
    return torch.equal(nx, ny) and torch.equal(fx[~nx], fy[~ny])


def _check_tolerances(rtol, atol) -> None:
    if (rtol is None) != (atol is None):
        raise SbpError(f"assert_layout_equivalent: give rtol and atol together (or neither, for the dtype's "
                       f"defaults), got rtol={rtol!r}, atol={atol!r}")
    for name, value in (("rtol", rtol), ("atol", atol)):
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
            raise SbpError(f"assert_layout_equivalent({name}=...) must be a number >= 0, got {value!r}")


def _where(fx: torch.Tensor, fy: torch.Tensor, exact: bool, rtol: Optional[float], atol: Optional[float]) -> str:
    """The worst mismatching element, by the rule `_same` used: equal values (NaN matching NaN, an infinity
    matching the same infinity, as in assert_close), or close under the tolerances. Non-finite mismatches
    (a NaN against a number, an infinity against a finite value or the opposite infinity) come first."""
    if fx.numel() == 0:
        return "empty tensors differ"  # pragma: no cover - equal shapes make empty tensors equal
    bad = _mismatched(fx, fy, exact, rtol, atol)
    wide = torch.complex128 if fx.dtype.is_complex else torch.float64
    diff = (fx.to(wide) - fy.to(wide)).abs()          # inf for inf vs finite or +inf vs -inf, nan with a NaN
    rank = torch.where(bad, torch.nan_to_num(diff, nan=float("inf"), posinf=float("inf")),
                       torch.full_like(diff, -1.0))   # matching elements never win, even equal infinities
    flat = int(rank.reshape(-1).argmax())
    index = tuple(int(i) for i in torch.unravel_index(torch.tensor(flat), fx.shape)) if fx.ndim else ()
    a, b = fx[index].item(), fy[index].item()
    # integers exactly (a float64 difference rounds past 2**53); floats as computed: inf or nan where due
    floating = fx.dtype.is_floating_point or fx.dtype.is_complex
    figure = diff.reshape(-1)[flat].item() if floating else abs(int(a) - int(b))
    return f"max abs diff {figure} at index {index} (x={a}, y={b})"


def _mismatched(fx: torch.Tensor, fy: torch.Tensor, exact: bool, rtol: Optional[float],
                atol: Optional[float]) -> torch.Tensor:
    """Element by element, where `_same`'s comparison fails (never empty when `_same` is False)."""
    unequal = fx != fy                     # inf == inf and -0.0 == 0.0, as in torch.equal
    if fx.dtype.is_floating_point or fx.dtype.is_complex:
        unequal &= ~(torch.isnan(fx) & torch.isnan(fy))
    if exact:
        return unequal
    if rtol is None or atol is None:
        try:    # what assert_close(rtol=None, atol=None) uses: the dtype's defaults
            from torch.testing._comparison import default_tolerances
            rtol, atol = default_tolerances(fx)
        except Exception:  # noqa: BLE001 - a private helper: without it, name any unequal element
            return unequal  # pragma: no cover
    far = ~torch.isclose(fx, fy, rtol=rtol, atol=atol, equal_nan=True)
    return far if bool(far.any()) else unequal


def _fmt(pls) -> str:
    return "(" + ", ".join(repr(p) for p in pls) + ")"
