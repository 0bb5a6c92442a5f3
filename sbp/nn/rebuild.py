"""Parallelized models under plain `torch.save` / `torch.load` and `copy.deepcopy`.

`sbp.nn.parallelize` hooks the model's modules with closures (and binds a `forward` to a rowwise linear);
pickle cannot store closures ("Can't pickle local object"), and `copy.deepcopy` shares them: the copy's
hooks would still read the original's modules and conversion state. So the hooks never travel. `record`
notes which hooks an installation added and keeps a recipe -- a module-level function and plain arguments
(mesh, styles by module path, options) -- on the root module. Pickling or deep-copying that root then stores a
copy of the module tree without those hooks plus the recipe, and rebuilding it runs the recipe on the loaded
(or copied) tree: fresh hooks bound to the new modules. Parameters travel as global tensors do (local tensor,
layout, mesh description), already laid out, so nothing is sharded again. Hooks the user registered stay
(pickled as torch would; a closure of theirs fails as it does in plain torch).

Only the root carries the recipe: saving a submodule of a parallelized model on its own pickles its hooks
as they are (and fails on the closures), as plain torch would.

>>> import copy, io, torch, sbp, sbp.testing
>>> def fn(mesh):
...     torch.manual_seed(0)
...     tp = sbp.nn.parallelize(torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 4)), mesh,
...                             {"0": "colwise", "1": "rowwise"})
...     buf = io.BytesIO()
...     torch.save(tp, buf)
...     back = torch.load(io.BytesIO(buf.getvalue()), weights_only=False)
...     x = torch.ones(2, 4)
...     return back[0].weight.placements, torch.equal(back(x).full(), tp(x).full())
>>> sbp.testing.spmd(fn, (2,))[0]
((S(0),), True)
"""
from __future__ import annotations

import copyreg
import weakref
from typing import Any, Callable

from torch import nn

from ..values.errors import SbpError

# the module dicts forward hooks live in; the with_kwargs / always_called ones are keyed by the same ids
_HOOK_DICTS = ("_forward_pre_hooks", "_forward_pre_hooks_with_kwargs", "_forward_hooks",
               "_forward_hooks_with_kwargs", "_forward_hooks_always_called")
_RECIPE = "_sbp_rebuild"

# module -> (ids of the hooks sbp installed on it, whether sbp bound a `forward` to it)
_OWN: "weakref.WeakKeyDictionary[nn.Module, tuple[frozenset[int], bool]]" = weakref.WeakKeyDictionary()
_REGISTERED: set[type] = set()


def record(root: nn.Module, install: Callable[[], None], recipe: tuple[Callable, tuple]) -> None:
    """Run `install()`, which hooks modules of `root`'s tree; remember the hooks (and instance ``forward``
    attributes) it added, and keep `recipe` -- ``(function, args)``, both picklable -- on `root`:
    ``function(module, *args)`` installs the same hooks on a rebuilt copy of the tree.

    >>> import torch
    >>> m = torch.nn.Linear(2, 2)
    >>> record(m, lambda: m.register_forward_hook(lambda *a: None), (print, ()))
    >>> len(_OWN[m][0]), m.__dict__[_RECIPE][0] is print
    (1, True)
    """
    before = {m: (_hook_ids(m), "forward" in m.__dict__) for m in root.modules()}
    install()
    for m in root.modules():
        ids, bound = before.get(m, (set(), False))
        added = frozenset(_hook_ids(m) - ids)
        bound = "forward" in m.__dict__ and not bound
        if added or bound:
            old_ids, old_bound = _OWN.get(m, (frozenset(), False))
            _OWN[m] = (old_ids | added, old_bound or bound)
    _keep(root, recipe)


def refuse(module: nn.Module, message: str) -> None:
    """Make pickling or deep-copying `module` (alone or inside a parent) raise `SbpError(message)`: a
    module whose state cannot be rebuilt elsewhere (`fully_shard`'s units).

    >>> import copy, torch
    >>> m = torch.nn.Linear(2, 2)
    >>> refuse(m, "not this one")
    >>> copy.deepcopy(torch.nn.Sequential(m))
    Traceback (most recent call last):
    ...
    sbp.values.errors.SbpError: not this one
    """
    _keep(module, message)


def _keep(module: nn.Module, recipe: "tuple[Callable, tuple] | str") -> None:
    module.__dict__[_RECIPE] = recipe
    cls = type(module)
    if cls not in _REGISTERED:   # pickle and copy.deepcopy consult copyreg's table before a class's own reduce
        copyreg.pickle(cls, _reduce)
        _REGISTERED.add(cls)


def _hook_ids(module: nn.Module) -> set[int]:
    return {k for name in _HOOK_DICTS for k in module.__dict__.get(name, ())}


def _reduce(module: nn.Module) -> Any:
    """copyreg's reduction for the classes of recorded roots: the tree without sbp's hooks, and the recipe;
    any other module of those classes reduces as it always does."""
    recipe = module.__dict__.get(_RECIPE)
    if recipe is None:
        return module.__reduce_ex__(4)
    if isinstance(recipe, str):
        raise SbpError(recipe)
    return _rebuilt, (_without_hooks(module, {}), recipe)


def _rebuilt(module: nn.Module, recipe: tuple[Callable, tuple]) -> nn.Module:
    """A loaded (or copied) tree with sbp's hooks installed again by `recipe`."""
    function, args = recipe
    function(module, *args)
    return module


def _without_hooks(module: nn.Module, done: dict[int, nn.Module]) -> nn.Module:
    """A shallow copy of `module`'s tree (shared submodules stay shared) holding the same parameters,
    buffers and attributes, less the hooks and bound ``forward`` sbp installed and the recipe."""
    if id(module) in done:
        return done[id(module)]
    state = dict(module.__dict__)
    if isinstance(state.pop(_RECIPE, None), str):
        raise SbpError(module.__dict__[_RECIPE])
    ids, bound = _OWN.get(module, (frozenset(), False))
    for name in _HOOK_DICTS:
        if name in state and ids:
            state[name] = type(state[name])((k, v) for k, v in state[name].items() if k not in ids)
    if bound:
        state.pop("forward", None)
    out = module.__class__.__new__(module.__class__)
    done[id(module)] = out
    state["_modules"] = {name: None if sub is None else _without_hooks(sub, done)
                         for name, sub in module.__dict__["_modules"].items()}
    out.__dict__.update(state)
    return out
