"""`parallelize`: apply a `{module path: style}` plan to an unchanged model, sharding its parameters in place.

What it does, in order:

1. match every plan pattern (globs over `named_modules()` paths: `*` within one path component, as DTensor's
   `parallelize_module` and transformers match; `**` across components) to modules -- or, when it matches
   no module, to parameters (transformers' parameter entries: ``"layers.*.self_attn.sinks": "colwise"``
   lays out that parameter only); a pattern that matches nothing, a module matched twice, or a style on a
   module type it cannot shard is an `SbpError`. ``plan="auto"`` is a `transformers` model's own plan
   (`sbp.nn.hf.auto_plan`); entries may be transformers' style strings (`sbp.nn.hf.TRANSFORMERS_STYLES`);
2. replace each parameter of a matched module by ``nn.Parameter(sbp.distribute(full, mesh, pls))``:
   the style's placement on the tp axis, Broadcast on the others; every rank holds the same full init,
   exactly like the single-device model. Every other parameter becomes an all-Broadcast global tensor,
   so that gradients reduce over data-parallel axes through the leaf rule and the optimizer sees one
   kind of parameter;
3. hook the matched modules: a forward-pre hook turns the input into a global tensor with the style's
   input placement, a forward hook redistributes the output to the style's output placement (and
   optionally returns the local tensor). On a mesh with more axes than the tp axis, plain tensors
   entering the root module become `S(0)` (the batch) on those axes: data parallelism. An `nn.Embedding` the
   plan leaves out (Broadcast, e.g. a position table) looks plain indices up in its local table, so its
   gradient is whole on every rank, never split by rows and gathered back. Inside a `fully_shard` unit that
   computes on plain local shares (its gathered parameters bound as plain tensors), a colwise / rowwise layer
   computes on its local pieces instead, the hooks making the tp collectives (`sbp.nn.tp_local`);
4. keep each planned module's style on it and a recipe for the hooks on the root (mesh, options): plain
   `torch.save` / `torch.load` and `copy.deepcopy` of the model store these instead of the hooks (closures)
   and install fresh hooks on the new modules (`sbp.nn.rebuild`).

All communication is what the placements imply; nothing here calls a collective by hand.
"""
from __future__ import annotations

import functools
import itertools
import re
import types
import warnings
import weakref
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional

import torch
from torch import nn

from ..ops.matmul import SplitBatchMatmul
from ..runtime.symbolic import SizeMap
from ..runtime.traced import traced_here, traced_without_dynamo
from ..tensor.autograd import from_full_autograd, from_local_autograd, leaf_grad, redistribute
from ..tensor.construct import distribute, from_local
from ..tensor.global_tensor import GlobalTensor, local_from_full, mesh_description, redistribute_raw
from ..values.errors import SbpError
from ..values.layout import split_range
from ..values.mesh import DeviceMesh
from ..values.placement import Broadcast, Partial, Placement, Split, normalize
from . import packed, tp_local
from .buckets import bucket_gradients, check_bucket_bytes
from .fsdp import sharded_by
from .hf import auto_plan, style_for
from .rebuild import record
from .styles import AllReduce, Colwise, Embedding, Packed, Rowwise, Style


@dataclass
class _Context:
    """What the hooks of one `parallelize` call share: the mesh, the tp axis and the batch lengths seen."""

    mesh: DeviceMesh
    tp_axis: int
    # local -> global length of dim 0 (the batch) on the data-parallel axes, recorded when a global tensor
    # is turned into a local one, so a later local input gets its global shape without a collective
    batch_lengths: SizeMap = field(default_factory=SizeMap)
    # the last input converted at a boundary in this forward pass (weakly held), what it was converted
    # under (target placements, the tensor's version, grad mode) and the result: modules reading one
    # tensor (q, k, v) share one conversion, so their gradients are summed before the one all_reduce, as
    # with Megatron's fused qkv. Forgotten when the root module's forward starts.
    last_input: tuple[Any, Any, Any] = (None, None, None)
    # the conversions the hooks make as opaque calls under torch.compile, by key (see `opaque`)
    serial: int = field(default_factory=lambda: next(_SERIALS))
    opaque_fns: dict[str, Any] = field(default_factory=dict)
    # the parameters' stand-ins under torch.compile (installed on the root module)
    leaves: "_CompiledLeaves" = field(default_factory=lambda: _CompiledLeaves())

    def __post_init__(self) -> None:
        _CONTEXTS[self.serial] = self

    def opaque(self, kind: str, fn, style: Any = None, module: Optional[nn.Module] = None) -> Any:
        """`fn` as one opaque call for torch.compile (`torch._dynamo.nonstrict_trace`, traced by AOTAutograd).

        Dynamo guards a nonstrict-traced function by its code only, not by what its closure holds: the
        compiled code of a hook made for one model would be reused for another model's identical hook and
        call the first model's conversion (another mesh, another style). So the hooks call one module-level
        function with a key -- this `parallelize` call's serial number and, by value, the kind of
        conversion, the style and what it reads off the module -- that dynamo guards like any constant:
        equivalent layers (the blocks of one model) share compiled code, a different model or style
        compiles its own."""
        key = repr((kind, style, _signature(module)))   # within this context's table; `serial` picks the context
        self.opaque_fns.setdefault(key, fn)
        # the serial as a string: dynamo turns an int it sees change (a second model through the same compiled
        # hook) or any int under dynamic=True into a symbol, which cannot pick a context (unhashable)
        serial = str(self.serial)
        return lambda *args: _call_opaque(serial, key, *args)

    def shared(self, x: torch.Tensor, pls: tuple[Placement, ...], convert) -> GlobalTensor:
        """`convert(x)`, reused when the previous conversion in this forward pass was of this very tensor,
        unchanged since (same version), to these placements, in the same grad mode."""
        if torch.compiler.is_compiling() and not isinstance(x, GlobalTensor):
            # a plain local share in a graph (a fully_shard unit on local shares): converted each time, one
            # opaque move per layer (dynamo cannot trace the version / weakref bookkeeping below)
            return convert(x)
        if x.is_inference():   # (no version counter to tell it unchanged: converted each time)
            return convert(x)
        ref, key, out = self.last_input
        now = (pls, x._version, torch.is_grad_enabled())
        if ref is not None and ref() is x and key == now:
            return out
        out = convert(x)
        self.last_input = (weakref.ref(x), now, out)
        return out

    def forget(self, *_: Any) -> None:
        """The root module's forward pass begins or ends: no conversion of an earlier pass is reused."""
        self.last_input = (None, None, None)

    @property
    def dp_axes(self) -> tuple[int, ...]:
        return tuple(a for a in range(self.mesh.ndim) if a != self.tp_axis)

    def input_placements(self, tp: Placement, ndim: int) -> tuple[Placement, ...]:
        """`tp` on the tp axis, the batch `S(0)` on the others (Broadcast for a 0-d tensor)."""
        rest = Split(0) if ndim > 0 else Broadcast()
        return tuple(tp if a == self.tp_axis else rest for a in range(self.mesh.ndim))

    def with_tp(self, pls: tuple[Placement, ...], tp: Placement, ndim: int) -> tuple[Placement, ...]:
        """`pls` with the tp axis set to `tp` (other axes untouched)."""
        out = list(pls)
        out[self.tp_axis] = tp
        return normalize(tuple(out), ndim, self.mesh.ndim)


_SERIALS = itertools.count()
_CONTEXTS: "weakref.WeakValueDictionary[int, _Context]" = weakref.WeakValueDictionary()


@torch._dynamo.nonstrict_trace
def _call_opaque(serial: str, key: str, *args: Any) -> Any:
    return _CONTEXTS[int(serial)].opaque_fns[key](*args)


def _signature(module: Optional[nn.Module]) -> tuple:
    """A module as the conversions see it: its class and its plain settings (``in_features``, ``padding_idx``...)."""
    if module is None:
        return ()
    plain = (bool, int, float, str, type(None))
    return (type(module).__module__, type(module).__qualname__,
            tuple(sorted((k, v) for k, v in vars(module).items()
                         if not k.startswith("_") and k != "training" and isinstance(v, plain))))


def parallelize(module: nn.Module, mesh: DeviceMesh, plan: "Mapping[str, str | Style] | str", *,
                tp_axis: "int | str" = -1, dp_bucket_bytes: Optional[int] = None) -> nn.Module:
    """Shard `module` in place for tensor parallelism on `mesh`'s `tp_axis` (data parallel on the others).

    `plan` maps module paths (glob patterns allowed: ``"blocks.*.mlp.fc1"``) to a style name
    (``"colwise"``, ``"rowwise"``, ``"embedding"``, ``"sequence"``) or a style object with options
    (`Colwise(output_placement="B")`, `Rowwise(output_placement="S(1)")`, ...) or a transformers style
    string (``"colwise_gather_output"``, ``"embedding_rowwise"``, ... see `sbp.nn.hf`); ``plan="auto"``
    applies a `transformers` model's own plan. Returns `module`. With `dp_bucket_bytes`, the gradients of
    parameters replicated on the data-parallel axes are reduced in buckets of about that many bytes, one
    all_reduce each, instead of one per parameter (`sbp.nn.buckets`; not together with `fully_shard`).

    Megatron's MLP on a 1-d tp mesh of 2 ranks (every rank starts from the same full weights):

    >>> import copy, torch, sbp, sbp.testing
    >>> _ = torch.manual_seed(0)
    >>> mlp = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.GELU(), torch.nn.Linear(32, 8))
    >>> def fn(mesh):
    ...     tp = sbp.nn.parallelize(copy.deepcopy(mlp), mesh, {"0": "colwise", "2": "rowwise"})
    ...     y = tp(torch.ones(4, 8))                                   # (4, 8), B: one all_reduce
    ...     same = torch.allclose(y.full(), mlp(torch.ones(4, 8)))
    ...     return tp[0].weight.placements, tp[2].weight.placements, y.placements, same
    >>> sbp.testing.spmd(fn, (2,))[0]
    ((S(0),), (S(1),), (B,), True)
    """
    if not isinstance(module, nn.Module):
        raise SbpError(f"parallelize needs an nn.Module, got {type(module).__name__}")
    if not isinstance(mesh, DeviceMesh) or mesh.binding is None:
        raise SbpError(f"parallelize needs a bound sbp.DeviceMesh (sbp.init_mesh or sbp.testing.spmd), got {mesh!r}")
    if dp_bucket_bytes is not None:
        check_bucket_bytes(dp_bucket_bytes)
    auto = isinstance(plan, str) and plan == "auto"
    if auto:
        plan = auto_plan(module)
    if not isinstance(plan, Mapping):
        raise SbpError(f"plan must map module paths to styles, got {type(plan).__name__} {plan!r} (valid: a dict, "
                       f"or 'auto' for a transformers model's own plan)")
    ctx = _Context(mesh, mesh.axis(tp_axis))
    matched, params = _match(module, plan, optional=auto)
    converted: dict[int, tuple[nn.Parameter, tuple[Placement, ...], str]] = {}
    for path, (owner, name, tp) in params.items():
        pls = tuple(tp if a == ctx.tp_axis else Broadcast() for a in range(mesh.ndim))
        owner._parameters[name] = _shard(owner._parameters[name], mesh, pls, path, converted)
    for path, (style, sub) in matched.items():
        for name, param in list(sub.named_parameters(recurse=False)):
            if f"{path}.{name}".lstrip(".") in params:   # laid out by its own plan entry
                continue
            pls = tuple(style.param_placement(name) if a == ctx.tp_axis else Broadcast() for a in range(mesh.ndim))
            if isinstance(style, Packed):   # held unfolded, (parts, length // parts): sbp.nn.packed
                sub._parameters[name] = _shard_packed(param, style, name, f"{path}.{name}".lstrip("."), mesh, pls,
                                                      converted)
                continue
            sub._parameters[name] = _shard(param, mesh, pls, f"{path}.{name}".lstrip("."), converted)
    replicated = tuple(Broadcast() for _ in range(mesh.ndim))
    for owner_path, owner in module.named_modules():
        for name, param in list(owner.named_parameters(recurse=False)):
            if not isinstance(param, GlobalTensor):
                owner._parameters[name] = _shard(param, mesh, replicated, f"{owner_path}.{name}".lstrip("."),
                                                 converted)
    for style, sub in matched.values():
        sub.__dict__[tp_local.STYLE] = style
    _hook_model(module, ctx, dp_bucket_bytes)
    return module


def _hook_model(module: nn.Module, ctx: _Context, dp_bucket_bytes: Optional[int]) -> None:
    """Install the hooks of a model whose parameters are laid out (by `parallelize`, or loaded / copied
    already laid out), each planned module's style kept on it. Recorded for plain torch.save / deepcopy
    (`sbp.nn.rebuild`): the recipe is `_rehook` with the mesh and options."""
    planned = {path: sub for path, sub in module.named_modules() if tp_local.STYLE in sub.__dict__}
    record(module, lambda: _install_hooks(module, ctx, planned, dp_bucket_bytes),
           (_rehook, (ctx.mesh, ctx.tp_axis, dp_bucket_bytes)))


def _rehook(module: nn.Module, mesh: DeviceMesh, tp_axis: int, dp_bucket_bytes: Optional[int]) -> None:
    """The hooks of a parallelized model again, on a loaded or copied tree (`sbp.nn.rebuild`)."""
    _hook_model(module, _Context(mesh, tp_axis), dp_bucket_bytes)


def _install_hooks(module: nn.Module, ctx: _Context, planned: dict[str, nn.Module],
                   dp_bucket_bytes: Optional[int]) -> None:
    layouts = tuple((path, name, p.placements) for path, owner in module.named_modules()
                    for name, p in owner._parameters.items() if isinstance(p, GlobalTensor))
    module.register_load_state_dict_post_hook(
        lambda mod, incompatible: _lay_out_assigned(mod, ctx.mesh, layouts))
    for sub in planned.values():
        style = sub.__dict__[tp_local.STYLE]
        if isinstance(style, Packed):
            packed.install(sub, style, ctx, _from_full)
        else:
            _hook(sub, style, ctx)
    for owner_path, owner in module.named_modules():   # lookups in a Broadcast table run on the local table
        if owner_path not in planned and type(owner) is nn.Embedding and _replicable(owner):
            _hook_replicated_embedding(owner, ctx)
    if dp_bucket_bytes is not None and ctx.dp_axes:   # one all_reduce per bucket of dp gradients (sbp.nn.buckets)
        bucket_gradients(module, ctx.mesh, ctx.dp_axes, dp_bucket_bytes)
    module.register_forward_pre_hook(ctx.forget, prepend=True)   # before any conversion of this pass
    # and after it: a kept conversion would hold the pass's input and its autograd graph until the next pass
    # (an eval forward without no_grad: `model.half()` then found the parameters still referenced)
    module.register_forward_hook(ctx.forget, always_call=True)
    matmuls = _MatmulMode()   # batched matmuls keep a split batch dim (heads): sbp.ops.matmul.SplitBatchMatmul
    module.register_forward_pre_hook(matmuls.enter, prepend=True)
    module.register_forward_hook(matmuls.exit, always_call=True)
    for sub in module.modules():   # a submodule recomputed alone in the backward (activation checkpointing)
        if sub is not module:
            sub.register_forward_pre_hook(matmuls.enter_eager, prepend=True)
            sub.register_forward_hook(matmuls.exit_eager, always_call=True)
    if ctx.dp_axes and "" not in planned:
        module.register_forward_pre_hook(_root_hook(ctx), with_kwargs=True)
    # under torch.compile, parameter gradients are laid out in the compiled backward
    module.register_forward_pre_hook(ctx.leaves.enter, prepend=True)
    module.register_forward_hook(ctx.leaves.exit, always_call=True)


def _lay_out_assigned(module: nn.Module, mesh: DeviceMesh, layouts: tuple) -> None:
    """After ``load_state_dict(..., assign=True)`` gave the model plain tensors (a single-device state dict):
    each parameter is laid out again as parallelize laid it out (the assigned value's slices, as a new
    parameter: assign's semantics), so the model stays tensor-parallel. Assigned global tensors stay."""
    for path, name, pls in layouts:
        owner = module.get_submodule(path)
        value = owner._parameters.get(name)
        if value is not None and not isinstance(value, GlobalTensor):
            owner._parameters[name] = nn.Parameter(distribute(value.detach(), mesh, pls),
                                                   requires_grad=value.requires_grad)


class _CompiledLeaves:
    """Under torch.compile, from the root module's forward-pre hook to its forward hook, every global parameter
    that requires grad is swapped for `sbp.tensor.autograd.leaf_grad` of itself: the leaf rule's
    redistribution of its gradient (e.g. `P(sum)` -> `B`) then runs in the compiled backward graph, as
    functional collectives, and the leaf's own hook has nothing left to do. Eager forwards are untouched.

    Where dynamo breaks the graph inside the root's forward, the code between graphs runs eagerly on the
    twins (`is_twin`): a rowwise layer computes on a twin's local block as on its leaf's, so a block that
    activation checkpointing recomputes in the backward (with the leaves back in place) runs the very ops
    its forward ran."""

    def __init__(self) -> None:
        # per forward in progress: (module, name, leaf, twin) for each swapped parameter
        self.saved: list[list[tuple[nn.Module, str, torch.Tensor, torch.Tensor]]] = []
        self.wrap = torch._dynamo.nonstrict_trace(lambda params: [leaf_grad(p) for p in params])

    def enter(self, module: nn.Module, *_: Any) -> None:
        # (dynamo only: torch.export traces no backward, and skips the exit that restores the parameters when
        # the forward raises)
        if not (torch.compiler.is_compiling() and traced_here()) or traced_without_dynamo():
            return
        slots = [(m, name, p) for m in module.modules() for name, p in m._parameters.items()
                 if isinstance(p, GlobalTensor) and p.requires_grad]
        unique: list[torch.Tensor] = []
        for _, _, p in slots:
            if not any(q is p for q in unique):   # a tied parameter gets one identity
                unique.append(p)
        wrapped = self.wrap(unique) if unique else []
        swapped = []
        for m, name, p in slots:
            twin = next(w for q, w in zip(unique, wrapped) if q is p)
            m._parameters[name] = twin
            swapped.append((m, name, p, twin))
        self.saved.append(swapped)

    def is_twin(self, value: torch.Tensor) -> bool:
        """Whether `value` is the stand-in of a parameter in the compiled forward in progress (seen eagerly
        after a graph break)."""
        return any(value is twin for swapped in self.saved for _, _, _, twin in swapped)

    def exit(self, *_: Any) -> None:
        if not self.saved:
            return
        for m, name, p, _ in self.saved.pop():
            m._parameters[name] = p


class _MatmulMode:
    """`SplitBatchMatmul` on from the root module's forward-pre hook to its forward hook (also when the forward
    raises); nested calls of the root share one mode. Also when the whole model is compiled (the hooks then
    run while dynamo traces): the compiled attention's batched matmuls keep their split heads as eagerly
    (a Llama's compiled step held 6 + 14 all_to_alls for eager's 2 + 2 before)."""

    def __init__(self) -> None:
        self.mode: Optional[SplitBatchMatmul] = None
        self.depth = 0

    # Eagerly every submodule enters the mode too: activation checkpointing recomputes a block's forward in
    # the backward, outside the root's forward, and the recomputation must run the ops the forward ran (its
    # saved tensors are matched to the forward's by order), or the gradients come out wrong. Compiled, the
    # recomputation is part of the graph traced inside the root's forward, and a submodule's hook changing
    # state would be refused inside a checkpointed region.
    def enter_eager(self, *_: Any) -> None:
        if not (torch.compiler.is_compiling() and traced_here()):
            self.enter()

    def exit_eager(self, *_: Any) -> None:
        if not (torch.compiler.is_compiling() and traced_here()):
            self.exit()

    # Not under torch.export's trace, which skips the always_call exit when the forward raises: the mode
    # would stay on the stack, and export's own modes would pop it in place of theirs (later eager calls broke).
    def enter(self, *_: Any) -> None:
        if torch.compiler.is_compiling() and traced_without_dynamo():
            return
        if self.depth == 0:
            self.mode = SplitBatchMatmul()
            self.mode.__enter__()
        self.depth += 1

    def exit(self, *_: Any) -> None:
        if self.depth == 0 or torch.compiler.is_compiling() and traced_without_dynamo():
            return
        self.depth -= 1
        if self.depth == 0 and self.mode is not None:
            self.mode.__exit__(None, None, None)
            self.mode = None


# ---- matching --------------------------------------------------------------------------------------

@functools.lru_cache(maxsize=1024)
def _path_glob(pattern: str) -> "re.Pattern[str]":
    """A plan pattern as a regex over whole dotted paths: `*` and `?` stay within one path component
    (``"layers.*.mlp"`` names each layer's ``mlp`` and not ``layers.0.attn.mlp``), as DTensor's
    `parallelize_module` and transformers match; ``**`` spans components (``"**.q_proj"``); ``[qkv]`` /
    ``[!0]`` are character classes, as in `fnmatch`.

    >>> bool(_path_glob("layers.*.mlp").match("layers.0.mlp")), bool(_path_glob("layers.*.mlp").match("layers.0.a.mlp"))
    (True, False)
    >>> bool(_path_glob("**.q").match("model.layers.3.attn.q"))
    True
    """
    parts, i = [], 0
    while i < len(pattern):
        if pattern.startswith("**", i):
            parts.append(".*")
            i += 2
        elif pattern[i] == "*":
            parts.append(r"[^.]*")
            i += 1
        elif pattern[i] == "?":
            parts.append(r"[^.]")
            i += 1
        elif pattern[i] == "[" and (end := pattern.find("]", i + 2)) != -1:   # fnmatch's class: ']' may come first
            body = pattern[i + 1:end].replace("\\", "\\\\")
            parts.append("[" + ("^" + body[1:] if body.startswith("!") else body) + "]")
            i = end + 1
        else:
            parts.append(re.escape(pattern[i]))
            i += 1
    return re.compile("".join(parts) + r"\Z", re.DOTALL)


def _match(module: nn.Module, plan: Mapping[str, "str | Style"], optional: bool = False
           ) -> tuple[dict[str, tuple[Style, nn.Module]], dict[str, tuple[nn.Module, str, Placement]]]:
    """({module path: (style, module)}, {parameter path: (owner, name, tp placement)}) for the plan entries.

    A pattern is matched against module paths first; one matching no module is matched against parameter
    paths (a parameter entry). Every pattern must match something -- unless `optional` (a transformers
    model's own plan, `"auto"`: it lists alternatives, e.g. DeepSeek-V3's ``q_proj`` and ``q_b_proj``, or a
    dense MLP no layer of a sparse config has): the entries matching nothing are skipped with one warning,
    as transformers does, and at least one must match.
    """
    modules = dict(module.named_modules())
    out: dict[str, tuple[Style, nn.Module]] = {}
    params: dict[str, tuple[nn.Module, str, Placement]] = {}
    by: dict[str, str] = {}
    unmatched = []
    for pattern, value in plan.items():
        if not isinstance(pattern, str):
            raise SbpError(f"plan keys must be module paths (str), got {pattern!r}")
        style = style_for(value, pattern)
        glob = _path_glob(pattern)
        hits = [p for p in modules if p == pattern or (p and glob.match(p))]
        if not hits:
            for path, param in module.named_parameters(remove_duplicate=False):
                if path == pattern or glob.match(path):
                    owner_path, _, name = path.rpartition(".")
                    params[path] = (modules[owner_path], name, _param_entry(style, name, param.ndim))
                    hits.append(path)
            if hits:
                continue
        if not hits and optional:
            unmatched.append(pattern)
            continue
        if not hits:
            raise SbpError(f"plan entry {pattern!r} matches no module of {type(module).__name__} "
                           f"(module paths look like: {_sample_paths(modules)})")
        for path in hits:
            if path in out:
                raise SbpError(f"module {path!r} is matched by plan entries {by[path]!r} and {pattern!r}; "
                               f"each module may have one style")
            style.check_module(path, modules[path])
            out[path], by[path] = (style, modules[path]), pattern
    if unmatched and not out and not params:
        raise SbpError(f"parallelize(..., 'auto'): no entry of {type(module).__name__}'s tensor-parallel plan matches "
                       f"a module (entries: {unmatched[:6]}{' ...' if len(unmatched) > 6 else ''}; module paths look "
                       f"like: {_sample_paths(modules)})")
    if unmatched:
        warnings.warn(f"parallelize(..., 'auto'): {len(unmatched)} entries of {type(module).__name__}'s "
                      f"tensor-parallel plan match no module and were not applied (as transformers skips them): "
                      f"{unmatched}", UserWarning, stacklevel=3)
    return out, params


def _sample_paths(modules: dict[str, nn.Module]) -> str:
    return ", ".join(repr(p) for p in list(modules)[1:9]) + (", ..." if len(modules) > 9 else "")


def _param_entry(style: Style, name: str, ndim: int) -> Placement:
    """The tp placement of a parameter named by a plan entry of its own, as transformers lays it out:
    colwise splits the output dim (dim -2; dim 0 of a vector), rowwise the last dim (a bias stays `B`),
    an embedding its `shard_dim`; every other style keeps the parameter `B`."""
    match style:
        case Colwise():
            return Split(max(ndim - 2, 0))
        case Rowwise():
            return Broadcast() if name == "bias" else Split(max(ndim - 1, 0))
        case Embedding(shard_dim=dim):
            return Split(min(dim, max(ndim - 1, 0)))
        case Packed():
            raise SbpError(f"a packed parameter entry ({name!r}) is the expert weights of a 'moe_tp_experts' "
                           f"module in transformers' plans, which sbp does not support; valid: 'packed_colwise' / "
                           f"'packed_rowwise' on a fused nn.Linear module")
        case _:
            return Broadcast()


# ---- parameters ------------------------------------------------------------------------------------

def _shard_packed(param: nn.Parameter, style: Packed, name: str, path: str, mesh: DeviceMesh,
                  pls: tuple[Placement, ...],
                  converted: dict[int, tuple[nn.Parameter, tuple[Placement, ...], str]]) -> nn.Parameter:
    """The global parameter of a packed parameter, its packed dim unfolded into (parts, length // parts)."""
    if id(param) in converted:
        raise SbpError(f"packed parameter {path!r} is shared with {converted[id(param)][2]!r}; a tied parameter "
                       f"cannot be packed (valid: give the fused module its own weight)")
    full = packed.unfold(param, style, name, path)
    if full is None:
        return _shard(param, mesh, pls, path, converted)
    out = nn.Parameter(distribute(full, mesh, pls), requires_grad=param.requires_grad)
    converted[id(param)] = (out, pls, path)
    return out


def _shard(param: nn.Parameter, mesh: DeviceMesh, pls: tuple[Placement, ...], name: str,
           converted: dict[int, tuple[nn.Parameter, tuple[Placement, ...], str]]) -> nn.Parameter:
    """The global parameter for `param` (a tied parameter is converted once and shared)."""
    if isinstance(param, GlobalTensor):
        unit = sharded_by(param)
        if unit is not None:   # fully_shard came first: the tp layout must exist before the dp split (FSDP2's order)
            raise SbpError(f"parameter {name!r} is already sharded by fully_shard (unit {unit}, placements "
                           f"{param.placements}); call parallelize before fully_shard: parallelize(model, mesh, plan, "
                           f"tp_axis=...) first, then fully_shard each block and the root on the data-parallel axis")
        raise SbpError(f"parameter {name!r} is already a global tensor (placements {param.placements}); "
                       f"parallelize a module once")
    seen = converted.get(id(param))
    if seen is not None:
        if normalize(seen[1], param.ndim, mesh.ndim) != normalize(pls, param.ndim, mesh.ndim):
            raise SbpError(f"tied parameter {name!r} (same as {seen[2]!r}) would be laid out as {pls} here and "
                           f"{seen[1]} there; give the tied modules styles with one layout for it")
        return seen[0]
    out = nn.Parameter(distribute(param.detach(), mesh, pls), requires_grad=param.requires_grad)
    converted[id(param)] = (out, pls, name)
    return out


# ---- hooks -----------------------------------------------------------------------------------------

def _hook(module: nn.Module, style: Style, ctx: _Context) -> None:
    if isinstance(style, Rowwise) and isinstance(module, nn.Linear):
        _hook_rowwise(module, style, ctx)
        return
    pre, post = _hook_fns(module, style, ctx)
    if style.input_placement is not None:
        module.register_forward_pre_hook(pre)
    if style.output_placement is not None:
        module.register_forward_hook(post)


def _hook_fns(module: nn.Module, style: Style, ctx: _Context):
    """The forward-pre and forward hooks of `style` on `module`: input and output conversions."""
    # under torch.compile the conversions are opaque calls that AOTAutograd traces (sbp.runtime.traced):
    # dynamo then never reads a mesh or placements off an intermediate tensor
    compiled_in = ctx.opaque("input", lambda x: _to_input(x, style, module, ctx), style, module)
    compiled_out = ctx.opaque("output", lambda out: convert_out(out), style, module)

    def pre(mod: nn.Module, args: tuple) -> Optional[tuple]:
        if not args or not isinstance(args[0], torch.Tensor):
            return None
        if _computes_locally(mod):   # inside a fully_shard unit computing on plain local shares
            return (_local_input(args[0], style, mod, ctx),) + tuple(args[1:])
        if torch.compiler.is_compiling() and traced_here():
            return (compiled_in(args[0]),) + tuple(args[1:])
        return (_to_input(args[0], style, mod, ctx),) + tuple(args[1:])

    def post(mod: nn.Module, args: tuple, out: Any) -> Any:
        if _computes_locally(mod) and isinstance(out, torch.Tensor):
            return _local_output(out, style, mod, ctx)
        if torch.compiler.is_compiling() and traced_here() and isinstance(out, torch.Tensor):
            return compiled_out(out)
        return convert_out(out)

    def convert_out(out: Any) -> Any:
        if isinstance(style, AllReduce) and _is_plain(out):   # this rank's partial sum of the output
            out = from_local(out, ctx.mesh, normalize(ctx.input_placements(Partial(), out.ndim), out.ndim,
                                                      ctx.mesh.ndim))
        if not isinstance(out, GlobalTensor):
            return out
        if style.use_local_output:  # a local tensor is always this rank's block of the batch S(0) on dp
            out = _redistribute(out, normalize(ctx.input_placements(style.output_placement, out.ndim), out.ndim,
                                               ctx.mesh.ndim))
            return _to_local(out, ctx)
        return _redistribute(out, ctx.with_tp(out.placements, style.output_placement, out.ndim))

    return pre, post


def _hook_rowwise(module: nn.Linear, style: Rowwise, ctx: _Context) -> None:
    """A rowwise `nn.Linear` computes on its local blocks, as Megatron's row-parallel linear: this rank's
    input features (`S(-1)`) times its columns of the weight (`S(1)`) is its partial sum of the output,
    `P(sum)` on the tp axis, plus the bias, reduced once to the output placement (one all_reduce to `B`, one
    reduce_scatter to `S(1)`). Left to the matmul's own rule, the op alone would
    look cheapest moving the input to the batch split and gathering the weight (three collectives where one
    does, and the weight's gradient reduce_scattered in the backward); the module knows where its output
    goes. The parameters are swapped for the local weight (its gradient: `S(1)` on tp, `P(sum)` on the
    data-parallel axes, each rank's batch) and no bias for the forward, and restored after it."""
    saved: list[tuple[Any, Any, GlobalTensor]] = []
    compiled_prepare = ctx.opaque("rowwise_operands", lambda x, w: _rowwise_operands(x, w, style, module, ctx),
                                  style, module)
    compiled_finish = ctx.opaque("rowwise_output", lambda out, x, b: _rowwise_output(out, x, b, style, ctx),
                                 style, module)
    compiled_finish_nobias = ctx.opaque("rowwise_output_nobias",
                                        lambda out, x: _rowwise_output(out, x, None, style, ctx), style, module)

    w_pls = tuple(Split(1) if a == ctx.tp_axis else Broadcast() for a in range(ctx.mesh.ndim))
    global_pre, global_post = _hook_fns(module, style, ctx)   # the matmul's own rule: a weight not plainly ours
    # compiled, a plain nn.Linear computes in a forward of its own that changes no state, not through the hooks'
    # swap of its parameters: dynamo refuses a change of outside state inside a region it traces as one higher
    # order op (activation checkpointing: torch.utils.checkpoint, checkpoint_wrapper, around a block)
    pure = type(module).forward is nn.Linear.forward

    def compiled_pure(mod: nn.Module) -> bool:
        return (pure and torch.compiler.is_compiling() and traced_here()
                and isinstance(mod._parameters.get("weight"), GlobalTensor) and "bias" in mod._parameters
                and not _computes_locally(mod))

    def forward(mod: nn.Linear, input: torch.Tensor) -> Any:
        if not (compiled_pure(mod) and isinstance(input, torch.Tensor)):
            return nn.Linear.forward(mod, input)
        x, x_local, w_local = compiled_prepare(input, mod._parameters["weight"])
        out = torch.nn.functional.linear(x_local, w_local)
        bias = mod._parameters["bias"]
        return compiled_finish_nobias(out, x) if bias is None else compiled_finish(out, x, bias)

    if pure:   # bound to the module: a deepcopy's forward is bound to the copy
        module.forward = types.MethodType(forward, module)

    def pre(mod: nn.Module, args: tuple) -> Optional[tuple]:
        if compiled_pure(mod):
            return None
        if args and isinstance(args[0], torch.Tensor) and _computes_locally(mod):   # a fully_shard unit's local shares
            x = _local_rowwise_input(args[0], style, mod, ctx)
            bias = mod._parameters["bias"]
            saved.append((None, bias, None))
            if bias is not None:   # added to the partial sums as `P(sum)`, as the global layer's addmm does
                mod._parameters["bias"] = tp_local.move(bias, ctx.mesh, ctx.tp_axis, tuple(bias.shape), Broadcast(),
                                                        Partial())
            return (x,) + tuple(args[1:])
        if not args or not isinstance(args[0], torch.Tensor):
            return None
        params = mod._parameters
        weight = params.get("weight")
        if weight is None or "bias" not in params:   # parametrized (register_parametrization, weight_norm): the
            return global_pre(mod, args)             # forward computes it, no parameter to swap: the op's rules
        if not isinstance(weight, GlobalTensor):
            return None
        if torch.compiler.is_compiling() and traced_here():
            prepare = compiled_prepare
        else:
            # a weight not ours to swap (e.g. fully_shard's: it manages the weight); after a graph break inside a
            # compiled forward, a parameter's twin is ours as its leaf is (_CompiledLeaves.is_twin)
            if not (weight.is_leaf or ctx.leaves.is_twin(weight)) or weight.placements != w_pls:
                return global_pre(mod, args)
            prepare = lambda x, w: _rowwise_operands(x, w, style, mod, ctx)  # noqa: E731
        x, x_local, w_local = prepare(args[0], weight)
        saved.append((weight, params["bias"], x))
        params["weight"] = w_local
        params["bias"] = None
        return (x_local,) + tuple(args[1:])

    def post(mod: nn.Module, args: tuple, out: Any) -> Any:
        if compiled_pure(mod):
            return None
        if not saved:
            return global_post(mod, args, out) if isinstance(out, GlobalTensor) else None
        weight, bias, x = saved.pop()
        if weight is None:   # computed on plain local tensors: reduce the partial sums on tp
            mod._parameters["bias"] = bias
            if not isinstance(out, torch.Tensor):
                return None
            return tp_local.move(out, ctx.mesh, ctx.tp_axis, tuple(out.shape), Partial(), Broadcast())
        mod._parameters["weight"] = weight
        mod._parameters["bias"] = bias
        if not isinstance(out, torch.Tensor):   # the forward raised (always_call) or returned something else
            return None
        if torch.compiler.is_compiling() and traced_here():
            return compiled_finish_nobias(out, x) if bias is None else compiled_finish(out, x, bias)
        return _rowwise_output(out, x, bias, style, ctx)

    module.register_forward_pre_hook(pre)
    module.register_forward_hook(post, always_call=True)


def _computes_locally(module: nn.Module) -> bool:
    """Whether the parallelized `module` holds plain parameters: a `fully_shard` unit computing on this rank's
    plain share of the batch bound its gathered locals there (`parallelize` made every parameter global)."""
    return any(p is not None and not isinstance(p, GlobalTensor) for p in module._parameters.values())


def _local_input(x: torch.Tensor, style: Style, module: nn.Module, ctx: _Context) -> torch.Tensor:
    """A colwise layer's plain local input (this rank's share of the batch, `B` on tp), through Megatron's `f`
    (`sbp.nn.tp_local.reduce_grad`): its gradient is all-reduced on tp; shared by the layers reading one tensor
    (q, k, v: one all_reduce of their summed gradients)."""
    if not isinstance(style, Colwise) or isinstance(x, GlobalTensor):
        raise tp_local.refuse(module, f"style {type(style).__name__} with a {type(x).__name__} input (valid: Colwise "
                                      f"or Rowwise layers on plain tensors)")
    if not isinstance(style.input_placement, Broadcast):
        raise tp_local.refuse(module, f"Colwise(input_placement={style.input_placement!r}) (valid: B)")
    return ctx.shared(x, "local", lambda t: tp_local.reduce_grad(t, ctx.mesh, ctx.tp_axis))


def _local_output(out: torch.Tensor, style: Style, module: nn.Module, ctx: _Context) -> torch.Tensor:
    """A colwise layer's plain local output (its output features: `S(-1)` on tp) moved to the style's output
    placement on tp, still a plain local tensor."""
    if not isinstance(style, Colwise) or not out.ndim:
        raise tp_local.refuse(module, f"style {type(style).__name__} (valid: Colwise or Rowwise)")
    have, want = Split(out.ndim - 1), normalize((style.output_placement,), out.ndim, 1)[0]
    if want == have:
        return out
    shape = tuple(out.shape[:-1]) + (module.out_features,)
    return tp_local.move(out, ctx.mesh, ctx.tp_axis, shape, have, want)


def _local_rowwise_input(x: torch.Tensor, style: Rowwise, module: nn.Linear, ctx: _Context) -> torch.Tensor:
    """A rowwise layer's plain local input: this rank's slice of the input features (`S(-1)` on tp, what a
    colwise layer's local output is); the output must be reduced to `B`."""
    n, c = ctx.mesh.shape[ctx.tp_axis], ctx.mesh.coord[ctx.tp_axis]
    lo, hi = split_range(0, module.in_features, n, c)
    if isinstance(x, GlobalTensor) or not x.ndim or x.shape[-1] != hi - lo:
        raise tp_local.refuse(module, f"a rowwise layer takes this rank's {hi - lo} of {module.in_features} input "
                                      f"features as a plain tensor, got {type(x).__name__} of shape {tuple(x.shape)}")
    if normalize((style.input_placement,), x.ndim, 1)[0] != Split(x.ndim - 1) or \
            not isinstance(style.output_placement, Broadcast):
        raise tp_local.refuse(module, f"Rowwise(input_placement={style.input_placement!r}, output_placement="
                                      f"{style.output_placement!r}) (valid: S(-1) and B)")
    return x


def _replicable(module: nn.Embedding) -> bool:
    """An unplanned `nn.Embedding` whose lookup can run on its local (whole) table: a weight Broadcast on every
    axis (not laid out by a parameter entry), no in-place renorm of the weight (``max_norm``), no sparse
    gradient."""
    weight = module.weight
    return (module.max_norm is None and not module.sparse and isinstance(weight, GlobalTensor)
            and all(isinstance(p, Broadcast) for p in weight.placements))


def _hook_replicated_embedding(module: nn.Embedding, ctx: _Context) -> None:
    """An embedding the plan leaves Broadcast (e.g. a position table) looked up with plain indices (full
    values, the same on every rank) computes the same rows on every rank: run it on the local table and
    wrap the output as all-`B`. Left to the op's rules, the lookup's backward (``embedding_dense_backward``)
    may split the table's gradient rows among the ranks (the vocab-parallel layout, where that is right)
    and the leaf rule would then gather them back: one all_gather per step for nothing. Here the
    gradient is computed whole on every rank, as the forward was. Where the batch is split (the
    data-parallel axes) the output's gradient is a sum over the ranks' shares: it stays `P(sum)` there
    through the lookup's backward (linear in it), and the table's gradient is `P(sum)` on those axes, reduced
    once with the other parameters' gradients (in a dp bucket, or by `fully_shard`'s reduce_scatter) instead
    of an all_reduce of the output's gradient of its own. Global indices (e.g. the batch, split on dp: a token
    table the plan leaves out, `fully_shard`'s root) are looked up the same way, each rank its local indices in
    the whole table: the output has the indices' placements, the table's gradient is `P(sum)` where they are
    split and `B` elsewhere (eager; under torch.compile they take the op's rules)."""
    saved: list[tuple[GlobalTensor, Optional[GlobalTensor]]] = []
    replicated = tuple(Broadcast() for _ in range(ctx.mesh.ndim))
    summed = tuple(Partial() if a in ctx.dp_axes else Broadcast() for a in range(ctx.mesh.ndim))
    compiled_local = ctx.opaque("replicated_local", lambda w: _replicated_local(w, replicated, summed), None, module)
    compiled_wrap = ctx.opaque("replicated_output", lambda out: _replicated_output(out, ctx.mesh, replicated, summed),
                                None, module)

    def pre(mod: nn.Module, args: tuple) -> Optional[tuple]:
        weight = mod._parameters["weight"]
        if not args or not isinstance(weight, GlobalTensor):
            return None
        if isinstance(args[0], GlobalTensor):   # each rank looks up its local indices in the whole table
            idx = args[0]
            if (torch.compiler.is_compiling() and traced_here() or weight.placements != replicated
                    or not _local_indices(idx, ctx)):
                return None
            grad_w = tuple(Partial() if isinstance(p, Split) else Broadcast() for p in idx.placements)
            saved.append((weight, idx))
            mod._parameters["weight"] = weight.to_local(grad_placements=grad_w)
            return (idx.to_local(),) + tuple(args[1:])
        if not _is_plain(args[0]):
            return None
        if torch.compiler.is_compiling() and traced_here():
            local = compiled_local(weight)
        elif weight.placements != replicated:   # e.g. fully_shard's: it manages the weight
            return None
        else:
            local = _replicated_local(weight, replicated, summed)
        saved.append((weight, None))
        mod._parameters["weight"] = local
        return None

    def post(mod: nn.Module, args: tuple, out: Any) -> Any:
        if not saved:
            return None
        weight, idx = saved.pop()
        mod._parameters["weight"] = weight
        if not isinstance(out, torch.Tensor):   # the forward raised (always_call)
            return None
        if idx is not None:   # this rank's rows of the lookup: the indices' layout
            return from_local_autograd(out, ctx.mesh, idx.placements, tuple(idx.shape) + tuple(out.shape[idx.ndim:]))
        if torch.compiler.is_compiling() and traced_here():
            return compiled_wrap(out)
        return _replicated_output(out, ctx.mesh, replicated, summed)

    module.register_forward_pre_hook(pre)
    module.register_forward_hook(post, always_call=True)


def _local_indices(idx: GlobalTensor, ctx: _Context) -> bool:
    """Whether global indices can be looked up rank by rank in the whole table: integer, on the model's mesh,
    split or Broadcast (no Partial) -- the output is then laid out as the indices."""
    return (not idx.is_floating_point() and not idx.is_complex() and idx.mesh == ctx.mesh
            and not any(isinstance(p, Partial) for p in idx.placements))


def _replicated_local(weight: GlobalTensor, replicated: tuple[Placement, ...],
                      summed: tuple[Placement, ...]) -> torch.Tensor:
    """The whole table on this rank (gathered if it is laid out otherwise); its gradient is taken as
    `summed` (`P(sum)` on the data-parallel axes, `B` elsewhere): every rank computes the gradient of the
    whole table from the same indices and its part of the output's gradient."""
    if weight.placements != replicated:
        weight = weight.redistribute(replicated)
    return weight.to_local(grad_placements=summed)


def _replicated_output(out: torch.Tensor, mesh: DeviceMesh, replicated: tuple[Placement, ...],
                       summed: tuple[Placement, ...]) -> GlobalTensor:
    """The local lookup as an all-`B` global tensor; its backward lays the incoming gradient out as `summed`
    (a `P(sum)` gradient stays so, a `B` one is kept on coord 0 there: no communication either way)."""
    return from_local_autograd(out, mesh, replicated, tuple(out.shape), summed)


def _rowwise_operands(x: torch.Tensor, weight: GlobalTensor, style: Rowwise, module: nn.Module,
                      ctx: _Context) -> tuple[GlobalTensor, torch.Tensor, torch.Tensor]:
    """(the global input, its local block, the local weight) of a rowwise linear computing locally: the input
    `S(-1)` on tp (and, on the other axes, anything but a split of the features or a Partial), the weight
    `S(1)` on tp and `B` elsewhere (redistributed there if it is not)."""
    xg = _to_input(x, style, module, ctx)
    last = xg.ndim - 1
    keep = tuple(p if a == ctx.tp_axis or not (isinstance(p, Partial) or (isinstance(p, Split) and p.dim == last))
                 else Broadcast() for a, p in enumerate(xg.placements))
    want_tp = normalize(ctx.with_tp(keep, Split(-1), xg.ndim), xg.ndim, ctx.mesh.ndim)
    if xg.placements != want_tp:
        xg = xg.redistribute(want_tp)
    w_pls = tuple(Split(1) if a == ctx.tp_axis else Broadcast() for a in range(ctx.mesh.ndim))
    if weight.placements != w_pls:
        weight = weight.redistribute(w_pls)
    grad_w = tuple(Partial() if a != ctx.tp_axis and not isinstance(p, Broadcast) else w
                   for a, (p, w) in enumerate(zip(xg.placements, w_pls)))
    return xg, xg.to_local(), weight.to_local(grad_placements=grad_w)


def _rowwise_output(out: torch.Tensor, x: GlobalTensor, bias: Optional[GlobalTensor], style: Rowwise,
                    ctx: _Context) -> Any:
    """This rank's partial sum of a rowwise linear's output as a global `P(sum)` (tp) tensor, reduced to the
    style's output placement, and the bias.

    To a `B` output (on tp) the bias is added after the reduction, as Megatron's row-parallel linear does:
    the partial sums travel straight from the matmul to the all_reduce (compiled, the bias add fuses into
    the next elementwise kernel instead of costing a pass of its own over the partial sums), and the bias's
    gradient, the sum of a `B` output gradient, needs no collective. To any other output placement (`S(1)`:
    sequence parallel) it is added to the partial sums (on one rank of the tp axis: sbp's rule for
    `P(sum) + B`), so its gradient is the reduced output's, with no collective of its own (added to an
    `S(1)` output, its gradient would be `P(sum)`, one all_reduce more)."""
    pls = tuple(Partial() if a == ctx.tp_axis else p for a, p in enumerate(x.placements))
    y = from_local(out, ctx.mesh, pls, global_shape=tuple(x.shape[:-1]) + (out.shape[-1],))
    if bias is not None and bias.dtype != out.dtype and torch.is_autocast_enabled(out.device.type):
        bias = bias.to(out.dtype)   # as autocast's linear casts its bias: the output keeps autocast's dtype
    after = bias is not None and isinstance(style.output_placement, Broadcast)
    if bias is not None and not after:   # once, to the partial sums (the reduction needs no gradient of its own)
        y = y + bias
    if style.use_local_output:  # a local tensor is always this rank's block of the batch S(0) on dp
        y = _redistribute(y, normalize(ctx.input_placements(style.output_placement, y.ndim), y.ndim, ctx.mesh.ndim))
    else:
        y = _redistribute(y, ctx.with_tp(y.placements, style.output_placement, y.ndim))
    if after:
        y = y + bias
    return _to_local(y, ctx) if style.use_local_output else y


def _root_hook(ctx: _Context):
    """On a dp x tp mesh: plain tensors entering the model are the full batch, laid out `S(0)` on dp."""
    compiled = ctx.opaque("root_input", lambda t: _from_full(t, ctx))

    def pre(mod: nn.Module, args: tuple, kwargs: dict) -> tuple:
        full = compiled if (torch.compiler.is_compiling() and traced_here()) else (lambda t: _from_full(t, ctx))
        convert = lambda t: full(t) if _is_plain(t) else t
        return tuple(convert(a) for a in args), {k: convert(v) for k, v in kwargs.items()}
    return pre


def _to_input(x: torch.Tensor, style: Style, module: nn.Module, ctx: _Context) -> GlobalTensor:
    tp = style.input_placement
    if isinstance(x, GlobalTensor):
        if mesh_description(x.mesh) != mesh_description(ctx.mesh):  # by value: torch.compile traces it
            raise SbpError(f"{type(module).__name__} input lives on mesh {x.mesh!r}, the module on {ctx.mesh!r}; "
                           f"redistribute it onto the module's mesh first")
        want = ctx.with_tp(x.placements, tp, x.ndim)
        if x.placements != want:  # the backward of a redistribution lays the gradient out as x's placements
            return ctx.shared(x, want, lambda t: t.redistribute(want))
        return ctx.shared(x, want, _ReduceGrad.apply) if _needs_boundary(x, tp) else x
    pls = normalize(ctx.input_placements(tp, x.ndim), x.ndim, ctx.mesh.ndim)
    if style.local_input or _local_features(x, style, module, ctx):
        return from_local(x, ctx.mesh, pls, global_shape=_global_shape(x, pls, module, ctx))
    return ctx.shared(x, pls, lambda t: _from_full(t, ctx, pls))


def _local_features(x: torch.Tensor, style: Style, module: nn.Module, ctx: _Context) -> bool:
    """A plain input to a rowwise `nn.Linear` holding this rank's slice of the input features, not all of them
    (transformers' ``rowwise`` takes a plain input as that slice, e.g. the local output of ``packed_colwise``):
    told apart by its last dim, which is unambiguous on a tp axis of more than one rank."""
    if not isinstance(style, Rowwise) or not isinstance(module, nn.Linear) or not x.ndim:
        return False
    n, c = ctx.mesh.shape[ctx.tp_axis], ctx.mesh.coord[ctx.tp_axis]
    lo, hi = split_range(0, module.in_features, n, c)
    return n > 1 and x.shape[-1] != module.in_features and x.shape[-1] == hi - lo


def _needs_boundary(x: GlobalTensor, tp: Placement) -> bool:
    """A Broadcast input that was not just redistributed (whose backward already lays the gradient out)."""
    return x.requires_grad and isinstance(tp, Broadcast) and type(x.grad_fn).__name__ not in _REDISTRIBUTIONS


_REDISTRIBUTIONS = ("_RedistributeBackward", "_ReduceGradBackward", "_FromFullBackward")


class _ReduceGrad(torch.autograd.Function):
    """Megatron's `f`: identity forward; backward lays the gradient out as the input's placements here.

    A module computing on a Broadcast input (colwise) sends back a `P(sum)` gradient. Left Partial, it
    would flow into the producer's backward (a layer norm: its weight and bias gradients become
    `P(sum)` too, each reduced by its own all_reduce); reduced at the boundary it costs one all_reduce.
    """

    @staticmethod
    def forward(ctx, x: GlobalTensor) -> GlobalTensor:  # type: ignore[override]
        ctx.pls, ctx.mesh, ctx.shape = x.placements, x.mesh, tuple(x.shape)
        return GlobalTensor(x._local, x.mesh, x.placements, tuple(x.shape))

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        if torch.is_grad_enabled() and grad.requires_grad:   # create_graph: differentiable again (double backward)
            if not isinstance(grad, GlobalTensor):
                return from_full_autograd(grad, ctx.mesh, ctx.pls)
            return grad if grad.placements == ctx.pls else redistribute(grad, ctx.pls)
        if not isinstance(grad, GlobalTensor):
            return GlobalTensor(local_from_full(grad, ctx.mesh, ctx.pls), ctx.mesh, ctx.pls, ctx.shape)
        return redistribute_raw(grad, ctx.pls)


def _global_shape(local: torch.Tensor, pls: tuple[Placement, ...], module: nn.Module,
                  ctx: _Context) -> Optional[tuple[int, ...]]:
    """The global shape of a local input when it is known without communication, else None.

    The tp axis splits the last dim, whose global length is the module's input features; a batch split
    on the dp axes has the global length recorded when the model last turned a global tensor local.
    """
    shape = list(local.shape)
    for dim in range(local.ndim):
        axes = [a for a, p in enumerate(pls) if isinstance(p, Split) and p.dim == dim]
        if not axes:
            continue
        if axes == [ctx.tp_axis] and dim == local.ndim - 1 and hasattr(module, "in_features"):
            shape[dim] = module.in_features
        elif dim == 0 and ctx.tp_axis not in axes and (length := ctx.batch_lengths.get(shape[0])) is not None:
            shape[0] = length
        else:
            return None  # from_local infers it with one small all_gather of the local shapes
    return tuple(shape)


def _to_local(x: GlobalTensor, ctx: _Context) -> torch.Tensor:
    if x.ndim and any(isinstance(x.placements[a], Split) and x.placements[a].dim == 0 for a in ctx.dp_axes):
        ctx.batch_lengths[x.local_shape[0]] = x.shape[0]
    return x.to_local()


def _redistribute(x: GlobalTensor, pls: tuple[Placement, ...]) -> GlobalTensor:
    return x if x.placements == pls else x.redistribute(pls)


def _is_plain(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and not isinstance(t, GlobalTensor)


def _from_full(t: torch.Tensor, ctx: _Context, pls: Optional[tuple[Placement, ...]] = None) -> GlobalTensor:
    """A plain tensor (the full value, equal on every rank) as a global tensor (slices, no communication);
    differentiable: the gradient of the plain tensor is the full gradient on every rank (a planned
    redistribution of the global gradient to all-`B`; differentiable again under create_graph)."""
    if pls is None:
        pls = normalize(ctx.input_placements(Broadcast(), t.ndim), t.ndim, ctx.mesh.ndim)
    if any(isinstance(p, Partial) for p in pls):
        raise SbpError(f"a plain input is a full value; it cannot enter as {pls} (valid: Split or Broadcast)")
    return from_full_autograd(t, ctx.mesh, pls)
