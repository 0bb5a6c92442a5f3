"""Parallelized models under plain `torch.save` / `torch.load` and `copy.deepcopy`.

`sbp.nn.parallelize` hooks the model's modules with closures (and binds a `forward` to a rowwise linear).
pickle cannot store closures ("Can't pickle local object"), and `copy.deepcopy` would share them: the copy's
hooks would still read the original's modules and conversion state. So sbp's hooks never travel:

- `record` notes which hooks an installation added to each module, and keeps a recipe on the root module:
  a module-level function and plain arguments (mesh, options) that install them on a loaded or copied tree;
- the classes of those modules get a reduction (`copyreg`, which pickle and `copy.deepcopy` consult first):
  a hooked module is stored as its state less sbp's hooks, everything else as before (user hooks included:
  they pickle as torch would, and a closure of the user's fails as it does in plain torch);
- the root is rebuilt through `_new_root`: once its state is set (its submodules are complete by then), the
  recipe runs on it, so the new modules get fresh hooks. Parameters travel as global tensors do (local
  tensor, layout, mesh description), already laid out: nothing is sharded again.

Modules are found wherever the tree holds them (plain lists of layers, wrappers added after `parallelize`,
references back to the root), as pickle finds them. A hooked submodule saved or copied without its root
comes back without sbp's hooks: its global parameters compute the same values (ops on global tensors follow
their rules), in the placements those rules pick. `copy.copy` (shallow) shares everything, as torch's does.

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

import copy
import copyreg
import functools
import sys
import weakref
from typing import Any, Callable

from torch import nn
from torch.utils.hooks import RemovableHandle

from ..values.errors import SbpError

# the module dicts forward hooks live in; the with_kwargs / always_called ones are keyed by the same ids
_FORWARD_HOOK_DICTS = ("_forward_pre_hooks", "_forward_pre_hooks_with_kwargs", "_forward_hooks",
                       "_forward_hooks_with_kwargs", "_forward_hooks_always_called")
_HOOK_DICTS = _FORWARD_HOOK_DICTS + ("_load_state_dict_post_hooks",)
_RECIPE = "_sbp_rebuild"
_SHALLOW = copy.copy.__code__

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
            _register(type(m))
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
    _register(type(module))


def _register(cls: type) -> None:
    if cls not in _REGISTERED:   # pickle and copy.deepcopy consult copyreg's table before a class's own reduce
        copyreg.pickle(cls, _reduce)
        _REGISTERED.add(cls)


def foreign_hooks(module: nn.Module, own: "frozenset[int] | set[int]" = frozenset()) -> bool:
    """Whether `module` has forward hooks (or pre-hooks) that neither sbp's `record` nor `own` (ids) account for:
    a user's, which may read or keep what the module computes.

    >>> import torch
    >>> m = torch.nn.Linear(2, 2)
    >>> record(m, lambda: m.register_forward_hook(lambda *a: None), (print, ()))
    >>> foreign_hooks(m), foreign_hooks(m.register_forward_hook(lambda *a: None) and m)
    (False, True)
    """
    return bool(_hook_ids(module, _FORWARD_HOOK_DICTS) - _OWN.get(module, (frozenset(), False))[0] - set(own))


def _hook_ids(module: nn.Module, dicts: tuple[str, ...] = _HOOK_DICTS) -> set[int]:
    return {k for name in dicts for k in module.__dict__.get(name, ())}


def _reduce(module: nn.Module) -> Any:
    """copyreg's reduction for the classes `record` saw: a hooked module as its state less sbp's hooks, a
    recorded root rebuilt through `_new_root`; any other instance of those classes as always."""
    recipe = module.__dict__.get(_RECIPE)
    if isinstance(recipe, str):
        raise SbpError(recipe)
    if (recipe is None and module not in _OWN) or sys._getframe(1).f_code is _SHALLOW:
        return module.__reduce_ex__(4)   # (copy.copy: a shallow copy shares the hooks, as in torch)
    state = module.__getstate__()   # the class's own (torch's parametrized modules refuse to pickle there)
    state = dict(state if isinstance(state, dict) else module.__dict__)
    state.pop(_RECIPE, None)
    ids, bound = _OWN.get(module, (frozenset(), False))
    for name in _HOOK_DICTS:
        if name in state and ids:
            state[name] = type(state[name])((k, v) for k, v in state[name].items() if k not in ids)
    if bound:
        state.pop("forward", None)
    if recipe is None:
        return copyreg.__newobj__, (type(module),), state
    return _new_root, (type(module), recipe), state


def _new_root(cls: type, recipe: tuple[Callable, tuple]) -> nn.Module:
    """An empty root whose state, once set (by unpickling or deepcopy, after its submodules are complete),
    runs `recipe` on it (`_set_state`)."""
    module = cls.__new__(cls)
    module.__dict__["__setstate__"] = functools.partial(_set_state, module, recipe)
    return module


def _set_state(module: nn.Module, recipe: tuple[Callable, tuple], state: dict) -> None:
    del module.__dict__["__setstate__"]
    type(module).__setstate__(module, state)
    for m in module.modules():   # hooks loaded from another process may hold ids this one hands out again
        _renumber_hooks(m)
    function, args = recipe
    function(module, *args)


def _renumber_hooks(module: nn.Module) -> None:
    """Give the forward hooks `module` holds fresh ids (the same id in every dict that names one)."""
    fresh: dict[int, int] = {}
    for name in _HOOK_DICTS:
        hooks = module.__dict__.get(name)
        if not hooks:
            continue
        for k in list(hooks):
            if k not in fresh:
                fresh[k] = RemovableHandle.next_id
                RemovableHandle.next_id += 1
        module.__dict__[name] = type(hooks)((fresh[k], v) for k, v in hooks.items())
