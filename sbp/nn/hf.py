"""transformers' tensor-parallel vocabulary: each style string as the sbp style with the same meaning, and the
`"auto"` plan read from a `transformers` model.

sbp never imports `transformers` (it is the optional extra ``sbp[hf]``): the table below is plain strings,
and `auto_plan` reads only attributes every `PreTrainedModel` has (`_tp_plan`, `config.base_model_tp_plan`,
`base_model_prefix`).

Where transformers hands the next module a *local* tensor (`use_local_output=True`: its model code runs on
each rank's shard of the heads), sbp hands it the *global* tensor: the unchanged model code runs on logical
shapes, so uneven head counts (GQA with fewer kv heads than ranks) stay exact. The placements of weight,
bias, input and output are transformers'; the values every op sees are the single-device values. The
exception is `packed_colwise` (`sbp.nn.Packed`): its output is local, as in transformers, because each
rank's slice of every packed part is no Split of the fused output; the parameter is held unfolded.

>>> import sbp
>>> sbp.nn.hf.style_for("colwise_gather_output", "lm_head")
Colwise(input_placement=B, output_placement=B, use_local_output=False, local_input=False)
"""
from __future__ import annotations

from typing import Any, Mapping

from torch import nn

from ..values.errors import SbpError
from ..values.placement import Broadcast
from .styles import STYLES, AllReduce, Colwise, Embedding, Packed, Replicated, Rowwise, SequenceParallel, Style

# transformers style string -> the sbp style with the same placements (transformers 5.x,
# `transformers/distributed/tensor_parallel.py`, ALL_PARALLEL_STYLES)
TRANSFORMERS_STYLES: dict[str, Style] = {
    "colwise": Colwise(),                                      # W S(0), b S(0), in B -> out S(-1)
    "colwise_rep": Colwise(output_placement=Broadcast()),      # ... out gathered to B
    "colwise_gather_output": Colwise(output_placement=Broadcast()),
    "rowwise": Rowwise(),                                      # W S(1), b B, in S(-1) -> out P(sum) -> B; a
    "rowwise_rep": Rowwise(),                                  # plain input: the full value, or this rank's
    "rowwise_split_input": Rowwise(),                          # slice of the features (told by its length)
    "packed_colwise": Packed(along="colwise", parts=2),        # [gate; up] W (2, out/2, in) S(1): local output
    "packed_rowwise": Packed(along="rowwise", parts=2),        # W (out, 2, in/2) S(2): local input -> out B
    "embedding_rowwise": Embedding(),                          # vocab S(0), ids B -> out P(sum) -> B
    "embedding_colwise": Embedding(shard_dim=1),               # vectors S(1), ids B -> out S(-1) -> B
    "sequence_parallel": SequenceParallel(),                   # params B, in S(1) -> out S(1)
    "replicate": Replicated(),                                 # params B, tensors as they are
    "replicated_with_grad_allreduce": Replicated(),            # params B; the leaf rule all_reduces grads
    "local_params": Replicated(),                              # sbp runs the module on global tensors
    "mla_kv_a_proj": Replicated(),                             # the rope part's partial grad: leaf rule
    "all_reduce": AllReduce(),                                 # out P(sum) -> B
}

# transformers style strings sbp refuses, and why
_MOE = ("the MoE experts' module runs on local shards of its packed expert weights and all_reduces its output in "
        "transformers; sbp builds packed nn.Linear modules ('packed_colwise' / 'packed_rowwise') but not the experts' "
        "local routing: leave the experts out of the plan (they run replicated, exactly) or shard the dense layers "
        "only")
_UNIT = ("transformers (5.25) splits q/k/v and the output projection by whole heads on a mesh of head units of "
         "its own, each head replicated on several ranks when there are fewer heads than ranks; sbp does not build "
         "that mesh: use 'colwise' / 'rowwise' where the head counts divide the tensor-parallel size")
REFUSED: dict[str, str] = {
    "moe_tp_experts": _MOE,
    "moe_identity_expert": "it only pairs with 'moe_tp_experts', which sbp does not support",
    "grouped_gemm": "expert parallelism (experts split over ranks) is not supported by sbp",
    "ep_dispatch_experts": "expert parallelism (experts split over ranks) is not supported by sbp",
    "unit_colwise": _UNIT,
    "unit_rowwise": _UNIT,
}


def valid_names() -> str:
    """Every style string a plan may use: sbp's names, then transformers' (refused ones not included).

    >>> "'colwise_gather_output'" in valid_names()
    True
    """
    names = list(STYLES) + [k for k in TRANSFORMERS_STYLES if k not in STYLES]
    return ", ".join(repr(k) for k in names)


def style_for(value: "str | Style", pattern: str) -> Style:
    """The sbp style of one plan entry: a `Style` object, an sbp style name or a transformers style string.

    >>> style_for("embedding_rowwise", "model.embed_tokens")
    Embedding(input_placement=B, output_placement=B, use_local_output=False, local_input=False, shard_dim=0)
    >>> try:
    ...     style_for("moe_tp_experts", "layers.*.mlp.experts")
    ... except SbpError as e:
    ...     print(str(e)[:str(e).index(" by sbp") + 7])
    plan entry 'layers.*.mlp.experts': transformers style 'moe_tp_experts' is not supported by sbp
    """
    if isinstance(value, Style) and type(value) is not Style:
        return value
    if isinstance(value, str):
        if value in STYLES:
            return STYLES[value]()
        if value in TRANSFORMERS_STYLES:
            return TRANSFORMERS_STYLES[value]
        if value in REFUSED:
            raise SbpError(f"plan entry {pattern!r}: transformers style {value!r} is not supported by sbp: "
                           f"{REFUSED[value]}")
    raise SbpError(f"plan entry {pattern!r}: {value!r} is not a style; valid: {valid_names()}, or an sbp.nn style "
                   f"object (Colwise(...), Rowwise(...), Embedding(...), SequenceParallel(...), Replicated(), "
                   f"AllReduce(), Packed(...))")


def auto_plan(model: nn.Module) -> dict[str, Any]:
    """The tensor-parallel plan a `transformers` model carries, as transformers merges it.

    transformers 5.x merges it on the model itself (`model._tp_plan`: the class's `_tp_plan`, the config's
    `base_model_tp_plan` and the vocab-parallel input embedding for the base model, the children's plans
    under their attribute names). A model without that merged plan gets the same merge here: the class's
    `_tp_plan`, plus `config.base_model_tp_plan` under `base_model_prefix` (e.g. ``"model."``).

    >>> import torch
    >>> class Base(torch.nn.Module):
    ...     pass
    >>> class Lm(torch.nn.Module):
    ...     base_model_prefix, _tp_plan = "model", {"lm_head": "colwise_gather_output"}
    ...     def __init__(self):
    ...         super().__init__()
    ...         self.model = Base()
    ...         self.config = type("Config", (), {"base_model_tp_plan": {"layers.*.mlp.up": "colwise"}})()
    >>> auto_plan(Lm())
    {'lm_head': 'colwise_gather_output', 'model.layers.*.mlp.up': 'colwise'}
    """
    merged = model.__dict__.get("_tp_plan")
    if isinstance(merged, Mapping) and merged:
        return dict(merged)
    plan = dict(getattr(type(model), "_tp_plan", None) or {})
    base_plan = getattr(getattr(model, "config", None), "base_model_tp_plan", None) or {}
    prefix = getattr(model, "base_model_prefix", "") or ""
    under = prefix + "." if prefix and isinstance(getattr(model, prefix, None), nn.Module) else ""
    plan.update({under + k: v for k, v in base_plan.items()})
    if not plan:
        raise SbpError(f"parallelize(..., 'auto'): {type(model).__name__} carries no tensor-parallel plan (no "
                       f"_tp_plan, no config.base_model_tp_plan); valid: a transformers model with a tp plan, "
                       f"or pass the plan as a dict")
    return plan
