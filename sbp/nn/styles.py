"""Tensor-parallel styles: what one module's parameters, input and output look like on the tp axis.

A style is a frozen value. It names the placement, *on the tensor-parallel mesh axis*, of each parameter
and of the module's input and output; every other mesh axis holds parameters Broadcast and keeps the
batch `S(0)` (data parallelism). `sbp.nn.parallelize` reads the style and does the work.

=====================  ==========  ==========  ==========  ============  ====================================
style                  weight      bias        input       output        collectives (forward / backward)
=====================  ==========  ==========  ==========  ============  ====================================
``Colwise()``          ``S(0)``    ``S(0)``    ``B``       ``S(-1)``     none / all_reduce of the input grad
``Rowwise()``          ``S(1)``    ``B``       ``S(-1)``   ``B``         all_reduce of the output / none
``Embedding()``        ``S(0)``    --          ``B``       ``B``         all_reduce of the output / none
``SequenceParallel()`` ``B``       ``B``       ``S(1)``    ``S(1)``      none (the neighbours switch to
                                                                         all_gather / reduce_scatter)
``Replicated()``       ``B``       ``B``       as is       as is         none (gradients of parameters
                                                                         used on split activations: all_reduce)
``AllReduce()``        ``B``       ``B``       as is       ``B``         all_reduce of a partial output / none
=====================  ==========  ==========  ==========  ============  ====================================

`Embedding(shard_dim=1)` splits the embedding vectors instead of the vocabulary (weight `S(1)`, output
gathered to `B` by one all_gather).

`Packed(along="colwise" | "rowwise", parts=2)` is a fused `nn.Linear` (gate_up = ``[gate; up]``) split per
part: the weight is held unfolded, ``(parts, out // parts, in)`` `S(1)`, and the module computes on local
tensors (a local output, or a local input), as transformers' ``packed_colwise`` / ``packed_rowwise``.

`nn.Linear` computes ``y = x @ W.T + b`` with W of shape (out, in): `Colwise` splits the *output*
features (rows of W), `Rowwise` the *input* features (columns of W).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Union

from torch import nn

from ..values.errors import SbpError
from ..values.placement import Broadcast, Placement, Split, placements

PlacementLike = Union[Placement, str]


def _one(value: PlacementLike, what: str) -> Placement:
    pls = placements(value)
    if len(pls) != 1:
        raise SbpError(f"{what} must be one placement (the tensor-parallel axis only), got {value!r}")
    return pls[0]


@dataclass(frozen=True, slots=True)
class Style:
    """Base of the tensor-parallel styles; use `Colwise`, `Rowwise`, `Embedding` or `SequenceParallel`.

    Fields (placements are on the tp axis; strings like ``"S(1)"`` are accepted):

    - `input_placement`: what the module computes on. A global input is redistributed to it; a plain
      input is the full value (Broadcast on every rank), or this rank's local block when `local_input`.
    - `output_placement`: what the output is redistributed to after the module ran.
    - `use_local_output`: return `output.to_local()` (a plain tensor) instead of a global tensor.
    - `local_input`: a plain input is this rank's local block (as `sbp.from_local`), not the full value.

    >>> style = Rowwise(output_placement="S(1)")
    >>> isinstance(style, Style), style.param_placement("weight"), style.param_placement("bias")
    (True, S(1), B)
    """

    input_placement: PlacementLike = Broadcast()
    output_placement: PlacementLike = Broadcast()
    use_local_output: bool = False
    local_input: bool = False

    kind: ClassVar[str] = "style"
    modules: ClassVar[tuple[type, ...]] = ()
    weights: ClassVar[dict[str, Placement]] = {}

    def __post_init__(self) -> None:
        object.__setattr__(self, "input_placement", _one(self.input_placement, f"{self.kind} input_placement"))
        object.__setattr__(self, "output_placement", _one(self.output_placement, f"{self.kind} output_placement"))
        for flag in ("use_local_output", "local_input"):
            if not isinstance(getattr(self, flag), bool):
                raise SbpError(f"{type(self).__name__}({flag}=...) must be a bool, got {getattr(self, flag)!r}")

    def check_module(self, path: str, module: nn.Module) -> None:
        """Refuse a module this style cannot shard, saying which module types are valid."""
        if not isinstance(module, self.modules):
            valid = ", ".join(f"nn.{m.__name__}" for m in self.modules)
            raise SbpError(f"style {self.kind!r} cannot shard {path or '<root>'!r}, a {type(module).__name__}; "
                           f"valid modules for {self.kind!r}: {valid}")

    def param_placement(self, name: str) -> Placement:
        """The tp-axis placement of the parameter `name` (Broadcast for parameters the style does not split)."""
        return self.weights.get(name, Broadcast())


@dataclass(frozen=True, slots=True)
class Colwise(Style):
    """Column-parallel `nn.Linear`: weight and bias `S(0)` (output features), input `B`, output `S(-1)`.

    >>> Colwise()
    Colwise(input_placement=B, output_placement=S(-1), use_local_output=False, local_input=False)
    >>> Colwise(output_placement="B").output_placement      # gather the output (e.g. an LM head)
    B
    """

    input_placement: PlacementLike = Broadcast()
    output_placement: PlacementLike = Split(-1)

    kind: ClassVar[str] = "colwise"
    modules: ClassVar[tuple[type, ...]] = (nn.Linear,)
    weights: ClassVar[dict[str, Placement]] = {"weight": Split(0), "bias": Split(0)}


@dataclass(frozen=True, slots=True)
class Rowwise(Style):
    """Row-parallel `nn.Linear`: weight `S(1)` (input features), bias `B`, input `S(-1)`, output `B`.

    The matmul of `S(-1)` inputs with an `S(1)` weight gives `P(sum)` partial outputs; the output
    placement decides the collective: `B` is one all_reduce, `S(1)` (sequence parallel) one
    reduce_scatter.

    >>> Rowwise(output_placement="S(1)").output_placement
    S(1)
    """

    input_placement: PlacementLike = Split(-1)
    output_placement: PlacementLike = Broadcast()

    kind: ClassVar[str] = "rowwise"
    modules: ClassVar[tuple[type, ...]] = (nn.Linear,)
    weights: ClassVar[dict[str, Placement]] = {"weight": Split(1)}


@dataclass(frozen=True, slots=True)
class Embedding(Style):
    """Vocab-parallel `nn.Embedding`: weight `S(0)` (the vocabulary), ids `B`, output `B` (or `S(1)`).

    Each rank looks up the ids in its slice of the vocabulary (zeros elsewhere): a `P(sum)` output,
    reduced by one all_reduce to `B`, or by one reduce_scatter to `S(1)` for sequence parallelism.
    `shard_dim=1` splits the embedding vectors instead (weight `S(1)`): each rank looks up its slice of
    every vector, an `S(-1)` output gathered by one all_gather to `B`.

    >>> Embedding(output_placement="S(1)")
    Embedding(input_placement=B, output_placement=S(1), use_local_output=False, local_input=False, shard_dim=0)
    >>> Embedding(shard_dim=1).param_placement("weight")
    S(1)
    """

    shard_dim: int = 0

    kind: ClassVar[str] = "embedding"
    modules: ClassVar[tuple[type, ...]] = (nn.Embedding,)

    def __post_init__(self) -> None:
        Style.__post_init__(self)
        if self.shard_dim not in (0, 1):
            raise SbpError(f"Embedding(shard_dim={self.shard_dim!r}): an embedding weight (vocab, dim) is split on "
                           f"dim 0 (the vocabulary) or 1 (the vectors); valid: 0, 1")

    def param_placement(self, name: str) -> Placement:
        """`S(shard_dim)` for the weight."""
        return Split(self.shard_dim) if name == "weight" else Broadcast()


@dataclass(frozen=True, slots=True)
class SequenceParallel(Style):
    """Sequence-parallel region (layer norm, dropout): activations `S(1)` (the sequence dim), parameters `B`.
    Any module: a model's own norm class (``LlamaRMSNorm``) too, as DTensor's and transformers' style take it;
    its ops run on global tensors, so a module that is not per token is still exact (it communicates).

    Element-wise and last-dim ops need no communication on `S(1)`; the neighbouring `Colwise` gathers
    its input (all_gather instead of nothing) and the `Rowwise` before scatters its output
    (reduce_scatter instead of all_reduce). Parameter gradients arrive `P(sum)` and are all_reduced
    to `B` by the leaf rule.

    >>> SequenceParallel(input_placement="S(0)")    # activations laid out (T, B, C)
    SequenceParallel(input_placement=S(0), output_placement=S(0), use_local_output=False, local_input=False)
    """

    input_placement: PlacementLike = Split(1)
    output_placement: PlacementLike = None  # type: ignore[assignment]  # None: same as input_placement

    kind: ClassVar[str] = "sequence"
    modules: ClassVar[tuple[type, ...]] = (nn.Module,)

    def __post_init__(self) -> None:
        if self.output_placement is None:
            object.__setattr__(self, "output_placement", self.input_placement)
        Style.__post_init__(self)


@dataclass(frozen=True, slots=True)
class Replicated(Style):
    """Every parameter `B`; the module's input and output are left as they come (no conversion, no hook).

    A module computing on split activations (Qwen3's or Gemma3's per-head ``q_norm``) gets `P(sum)`
    parameter gradients, which the leaf rule all_reduces to `B`: the `B` parameter's gradient is exact
    with no collective written here.

    >>> Replicated().param_placement("weight"), Replicated().input_placement
    (B, None)
    """

    input_placement: PlacementLike = None  # type: ignore[assignment]  # None: the input is left as it comes
    output_placement: PlacementLike = None  # type: ignore[assignment]  # None: the output is left as it is

    kind: ClassVar[str] = "replicated"
    modules: ClassVar[tuple[type, ...]] = (nn.Module,)

    def __post_init__(self) -> None:
        if self.input_placement is not None or self.output_placement is not None:
            raise SbpError(f"Replicated() leaves the module's input and output as they are; got "
                           f"input_placement={self.input_placement!r}, output_placement={self.output_placement!r} "
                           f"(valid: None; use Colwise/Rowwise/SequenceParallel to lay them out)")
        for flag in ("use_local_output", "local_input"):
            if getattr(self, flag):
                raise SbpError(f"Replicated({flag}=True) is not valid: the module's tensors are left as they are")


@dataclass(frozen=True, slots=True)
class AllReduce(Style):
    """The module's output is reduced to `B` on the tp axis; its input is left as it comes, parameters `B`.

    A global output is redistributed (a `P(sum)` output: one all_reduce; `B`: nothing); a plain output is
    taken as this rank's partial sum (`P(sum)`) of the full value, as transformers' ``"all_reduce"``.

    >>> AllReduce().output_placement, AllReduce().input_placement
    (B, None)
    """

    input_placement: PlacementLike = None  # type: ignore[assignment]  # None: the input is left as it comes

    kind: ClassVar[str] = "all_reduce"
    modules: ClassVar[tuple[type, ...]] = (nn.Module,)

    def __post_init__(self) -> None:
        if self.input_placement is not None:
            raise SbpError(f"AllReduce() leaves the module's input as it comes; got "
                           f"input_placement={self.input_placement!r} (valid: None)")
        object.__setattr__(self, "output_placement", _one(self.output_placement, f"{self.kind} output_placement"))
        if not isinstance(self.output_placement, (Broadcast, Split)):
            raise SbpError(f"AllReduce(output_placement={self.output_placement!r}): the reduced output is B or "
                           f"S(d) (valid: Broadcast or Split)")


@dataclass(frozen=True, slots=True)
class Packed(Style):
    """A fused `nn.Linear` whose weight packs `parts` equal parts (gate_up = ``[gate; up]``), split *per part*:
    every rank holds its slice of each part, and the module computes on local tensors (transformers'
    ``packed_colwise`` / ``packed_rowwise``).

    A Split is one contiguous block per rank, which "a slice of each part" is not; so the packed dim is held
    *unfolded*: a colwise weight ``(out, in)`` is the parameter ``(parts, out // parts, in)`` laid out `S(1)`
    (its bias ``(parts, out // parts)``, `S(1)`), a rowwise weight ``(out, parts, in // parts)``, `S(2)`
    (bias `B`). The global parameter is exact (``p.full().flatten(0, 1)`` is the fused weight, as
    transformers' ``_StridedShard(dim, split_factor=parts)`` describes); the module sees its local block
    flattened back, ``[part_0 slice; part_1 slice; ...]``, exactly the local weight transformers computes on.

    - ``along="colwise"``: input `B` (a global input is gathered on the tp axis, a plain one is the full
      value), the output is this rank's *local* ``[part_0 slice, part_1 slice, ...]`` on the last dim (a plain
      tensor, as transformers' ``use_local_output``): the model's own ``chunk(parts, -1)`` then splits it
      locally, and the next ``rowwise`` module takes the plain tensor as its local input.
    - ``along="rowwise"``: the input is a plain local tensor, this rank's slice of each part (what a
      packed colwise module returns); the partial output is all_reduced to `B`.

    >>> Packed(parts=2).unfolded_dim("weight"), Packed(along="rowwise").unfolded_dim("weight")
    (0, 1)
    """

    input_placement: PlacementLike = Broadcast()
    output_placement: PlacementLike = None  # type: ignore[assignment]  # colwise: a local output; rowwise: B
    along: str = "colwise"
    parts: int = 2

    kind: ClassVar[str] = "packed"
    modules: ClassVar[tuple[type, ...]] = (nn.Linear,)

    def __post_init__(self) -> None:
        if self.along not in ("colwise", "rowwise"):
            raise SbpError(f"Packed(along={self.along!r}): a fused weight is packed along its output features "
                           f"('colwise') or its input features ('rowwise'); valid: 'colwise', 'rowwise'")
        if not isinstance(self.parts, int) or isinstance(self.parts, bool) or self.parts < 1:
            raise SbpError(f"Packed(parts={self.parts!r}): the number of packed parts is an int >= 1")
        object.__setattr__(self, "input_placement", Broadcast() if self.along == "colwise" else Split(-1))
        object.__setattr__(self, "output_placement", None if self.along == "colwise" else Broadcast())
        for flag in ("use_local_output", "local_input"):
            if getattr(self, flag):
                raise SbpError(f"Packed({flag}=True) is not an option: a packed colwise module always returns its "
                               f"local output and a packed rowwise one always takes a local input")

    def unfolded_dim(self, name: str) -> "int | None":
        """The dim of parameter `name` (weight or bias of the `nn.Linear`) that holds the parts, or None."""
        if self.along == "colwise":
            return 0 if name in ("weight", "bias") else None
        return 1 if name == "weight" else None

    def param_placement(self, name: str) -> Placement:
        """`S(unfolded dim + 1)`: the slice of each part (`B` for a rowwise bias)."""
        dim = self.unfolded_dim(name)
        return Broadcast() if dim is None else Split(dim + 1)


STYLES: dict[str, type[Style]] = {"colwise": Colwise, "rowwise": Rowwise, "embedding": Embedding,
                                  "sequence": SequenceParallel, "replicated": Replicated, "all_reduce": AllReduce}


def as_style(value: "str | Style", pattern: str) -> Style:
    """A style from a plan entry: a `Style` object or one of the names in `STYLES`.

    >>> as_style("rowwise", "mlp.fc2")
    Rowwise(input_placement=S(-1), output_placement=B, use_local_output=False, local_input=False)
    """
    if isinstance(value, Style) and type(value) is not Style:
        return value
    if isinstance(value, str) and value in STYLES:
        return STYLES[value]()
    valid = ", ".join(repr(k) for k in STYLES)
    raise SbpError(f"plan entry {pattern!r}: {value!r} is not a style; valid: {valid} or an sbp.nn style object "
                   f"(Colwise(...), Rowwise(...), Embedding(...), SequenceParallel(...))")
