"""The rule table: ATen op -> sharding rule, the one place an op's behaviour on global tensors is declared.

`lookup` finds an op's rule, `register` adds one. Lookup order: the exact overload
(``aten.sum.dim_IntList``), then two families found by a property instead of one row per overload:
pointwise ops by ATen tag (``torch.Tag.pointwise``, random ops excluded) and ``_foreach_*`` ops by name
(`sbp.ops.optim.FOREACH`, a composite rule: index by index through the pointwise rule). In-place views
(``squeeze_``, ``t_``, ``detach_``, ...) are rows with the composite rule `sbp.ops.views.INPLACE_VIEW`.
An op with no rule takes the one fallback (`sbp.ops.decide`). Each rule's signatures are documented in
its family module and listed in docs/operators.md (``python -m sbp.ops.table`` prints the table).
"""
from __future__ import annotations

from typing import Any, Optional

import torch

from . import matmul, nn, optim, pointwise, random, reductions, views
from .cache import DECISIONS
from .spec import Rule

aten = torch.ops.aten

TABLE: dict[Any, Rule] = {
    # matmul family (contractions)
    aten.mm.default: matmul.MM.rule(),
    aten.addmm.default: matmul.ADDMM.rule(),
    aten.bmm.default: matmul.BMM.rule(),
    aten.baddbmm.default: matmul.BADDBMM.rule(),
    aten.dot.default: matmul.DOT.rule(),
    aten.mv.default: matmul.MV.rule(),
    aten.addmv.default: matmul.ADDMV.rule(),
    # reductions and ops along dims
    aten.sum.dim_IntList: reductions.SUM.rule(),
    aten.sum.default: reductions.SUM_ALL.rule(),
    aten.mean.dim: reductions.MEAN.rule(),
    aten.mean.default: reductions.MEAN_ALL.rule(),
    aten.amax.default: reductions.AMAX.rule(),
    aten.amin.default: reductions.AMIN.rule(),
    aten.max.default: reductions.MAX_ALL.rule(),
    aten.min.default: reductions.MIN_ALL.rule(),
    aten.max.dim: reductions.ALONG_DIM.rule(),
    aten.min.dim: reductions.ALONG_DIM.rule(),
    aten.argmax.default: reductions.ALONG_DIM.rule(),
    aten.argmin.default: reductions.ALONG_DIM.rule(),
    aten.var.correction: reductions.ALONG_DIM.rule(),
    aten.std.correction: reductions.ALONG_DIM.rule(),
    aten.var_mean.correction: reductions.ALONG_DIM.rule(),
    aten.std_mean.correction: reductions.ALONG_DIM.rule(),
    aten.median.dim: reductions.ALONG_DIM.rule(),
    aten.nanmedian.dim: reductions.ALONG_DIM.rule(),
    aten.mode.default: reductions.ALONG_DIM.rule(),
    aten.norm.ScalarOpt_dim: reductions.ALONG_DIM.rule(),
    aten.logsumexp.default: reductions.ALONG_DIM.rule(),
    aten.linalg_vector_norm.default: reductions.ALONG_DIM.rule(),
    aten.prod.dim_int: reductions.ALONG_DIM.rule(),
    aten.any.dim: reductions.ALONG_DIM.rule(),
    aten.all.dim: reductions.ALONG_DIM.rule(),
    aten.any.dims: reductions.ALONG_DIM.rule(),
    aten.all.dims: reductions.ALONG_DIM.rule(),
    aten.any.default: reductions.ALONG_ALL.rule(),
    aten.all.default: reductions.ALONG_ALL.rule(),
    aten.cumsum.default: reductions.SCAN.rule(),
    aten.cumprod.default: reductions.ALONG_KEEP.rule(),
    aten.logcumsumexp.default: reductions.ALONG_KEEP.rule(),
    aten.cummax.default: reductions.ALONG_KEEP.rule(),
    aten.cummin.default: reductions.ALONG_KEEP.rule(),
    aten.sort.default: reductions.ALONG_KEEP.rule(),
    aten.topk.default: reductions.ALONG_KEEP.rule(),
    aten.tril.default: reductions.TRIANGLE.rule(),
    aten.triu.default: reductions.TRIANGLE.rule(),
    aten.flip.default: reductions.FLIP.rule(),
    aten.roll.default: reductions.ROLL.rule(),
    aten.count_nonzero.default: reductions.COUNT_NONZERO.rule(),
    aten.count_nonzero.dim_IntList: reductions.COUNT_NONZERO.rule(),
    aten.constant_pad_nd.default: views.PAD,
    aten.repeat.default: views.REPEAT,
    aten.gather.default: reductions.INDEXED,
    aten.scatter.src: reductions.INDEXED,
    aten.scatter.value: reductions.INDEXED,
    aten.scatter_add.default: reductions.INDEXED,
    aten.index_select.default: reductions.INDEXED,
    aten.index_add.default: reductions.INDEXED,
    aten.index_add_.default: reductions.INDEXED,
    aten.scatter_.src: reductions.INDEXED,
    aten.scatter_add_.default: reductions.INDEXED,
    # softmax, norms, embedding, loss
    aten._softmax.default: reductions.ALONG_KEEP.rule(),
    aten._log_softmax.default: reductions.ALONG_KEEP.rule(),
    aten._safe_softmax.default: reductions.ALONG_KEEP.rule(),   # attention's softmax (fully masked rows give 0)
    aten._softmax_backward_data.default: nn.SOFTMAX_BACKWARD,
    aten._log_softmax_backward_data.default: nn.SOFTMAX_BACKWARD,
    aten.native_layer_norm.default: nn.LAYER_NORM,
    aten.native_layer_norm_backward.default: nn.LAYER_NORM_BACKWARD,
    aten._fused_rms_norm.default: nn.RMS_NORM,
    aten._fused_rms_norm_backward.default: nn.RMS_NORM_BACKWARD,
    aten.native_dropout.default: random.NATIVE_DROPOUT,
    aten.embedding.default: nn.EMBEDDING,
    aten.embedding_dense_backward.default: nn.EMBEDDING_BACKWARD,
    aten.nll_loss_forward.default: nn.NLL_LOSS,
    aten.nll_loss_backward.default: nn.NLL_LOSS_BACKWARD,
    aten.mse_loss.default: nn.LOSS,
    aten.mse_loss_backward.default: nn.LOSS_BACKWARD,
    aten.smooth_l1_loss.default: nn.LOSS,
    aten.smooth_l1_loss_backward.default: nn.LOSS_BACKWARD,
    aten.huber_loss.default: nn.LOSS,
    aten.huber_loss_backward.default: nn.LOSS_BACKWARD,
    aten.binary_cross_entropy.default: nn.LOSS,
    aten.binary_cross_entropy_backward.default: nn.LOSS_BACKWARD,
    aten.binary_cross_entropy_with_logits.default: nn.LOSS,
    aten.native_group_norm.default: nn.GROUP_NORM,
    aten.native_group_norm_backward.default: nn.GROUP_NORM_BACKWARD,
    aten.glu.default: nn.GLU,
    aten.glu_backward.default: nn.GLU,
    aten.convolution.default: nn.CONVOLUTION,
    aten.convolution_backward.default: nn.CONVOLUTION_BACKWARD,
    aten.max_pool2d_with_indices.default: nn.POOL_2D,
    aten.max_pool2d_with_indices_backward.default: nn.POOL_2D,
    aten.avg_pool2d.default: nn.POOL_2D,
    aten.avg_pool2d_backward.default: nn.POOL_2D,
    aten.max_pool3d_with_indices.default: nn.POOL_3D,
    aten.max_pool3d_with_indices_backward.default: nn.POOL_3D,
    aten.avg_pool3d.default: nn.POOL_3D,
    aten.avg_pool3d_backward.default: nn.POOL_3D,
    aten._scaled_dot_product_flash_attention_for_cpu.default: nn.SDPA,
    aten._scaled_dot_product_flash_attention_for_cpu_backward.default: nn.SDPA,
    # views and shape ops
    aten.view.default: views.VIEW,
    aten._unsafe_view.default: views.VIEW,
    aten.transpose.int: views.TRANSPOSE,
    aten.permute.default: views.TRANSPOSE,
    aten.t.default: views.TRANSPOSE,
    aten.unsqueeze.default: views.UNSQUEEZE,
    aten.squeeze.default: views.SQUEEZE,
    aten.squeeze.dim: views.SQUEEZE,
    aten.squeeze.dims: views.SQUEEZE,
    aten.expand.default: views.EXPAND,
    aten.slice.Tensor: views.SLICE,
    aten.select.int: views.SELECT,
    aten.split.Tensor: views.SPLIT,
    aten.split_with_sizes.default: views.SPLIT,
    aten.unbind.int: views.SPLIT,
    aten.cat.default: views.CAT,
    aten.stack.default: views.CAT,
    aten.select_backward.default: views.SELECT_BACKWARD,
    aten.slice_backward.default: views.SLICE_BACKWARD,
    # in-place views: the tensor becomes its out-of-place view (composite)
    aten.squeeze_.default: views.INPLACE_VIEW,
    aten.squeeze_.dim: views.INPLACE_VIEW,
    aten.squeeze_.dims: views.INPLACE_VIEW,
    aten.unsqueeze_.default: views.INPLACE_VIEW,
    aten.t_.default: views.INPLACE_VIEW,
    aten.transpose_.default: views.INPLACE_VIEW,
    aten.swapdims_.default: views.INPLACE_VIEW,
    aten.swapaxes_.default: views.INPLACE_VIEW,
    aten.detach_.default: views.INPLACE_VIEW,
    # identity-like, casts, factories from a tensor, fills and copies
    aten.detach.default: pointwise.DETACH,
    aten.alias.default: pointwise.IDENTITY,
    aten.clone.default: pointwise.IDENTITY,
    aten.lift_fresh.default: pointwise.IDENTITY,
    aten._conj.default: pointwise.CONJ,
    aten._neg_view.default: pointwise.NEG_VIEW,
    aten.view_as_real.default: pointwise.COMPLEX_VIEW,
    aten.view_as_complex.default: pointwise.COMPLEX_VIEW,
    aten._to_copy.default: pointwise.TO_COPY,
    aten.zeros_like.default: views.LIKE,
    aten.ones_like.default: views.LIKE,
    aten.empty_like.default: views.LIKE,
    aten.full_like.default: views.LIKE,
    aten.new_zeros.default: views.NEW,
    aten.new_ones.default: views.NEW,
    aten.new_empty.default: views.NEW,
    aten.new_full.default: views.NEW,
    aten.new_empty_strided.default: views.NEW,
    aten.fill_.Scalar: views.FILL,
    aten.fill_.Tensor: views.FILL,
    aten.zero_.default: views.ZERO,
    aten.copy_.default: views.COPY,
    # training
    aten._amp_foreach_non_finite_check_and_unscale_.default: optim.UNSCALE,
    # ops that need whole values: Broadcast inputs, no warning
    aten._local_scalar_dense.default: views.FULL_NO_META,
    aten.equal.default: views.FULL_NO_META,
    aten.is_nonzero.default: views.FULL_NO_META,
    aten.allclose.default: views.FULL_NO_META,
}


def lookup(func) -> Optional[Rule]:
    """The rule of `func`: its table entry, else its family's rule (pointwise by tag, ``_foreach_*`` by
    name), else None (the fallback).

    >>> lookup(torch.ops.aten.mm.default).doc
    'contraction mk,kn->mn'
    >>> lookup(torch.ops.aten.gelu.default) is pointwise.POINTWISE
    True
    >>> lookup(torch.ops.aten._foreach_add_.List) is optim.FOREACH, lookup(torch.ops.aten.histc.default)
    (True, None)
    """
    rule = TABLE.get(func)
    if rule is None:
        rule = _FAMILY.get(func, _UNSEEN)
        if rule is _UNSEEN:
            rule = _FAMILY[func] = _family(func)
    return rule


def _family(func) -> Optional[Rule]:
    if pointwise.is_pointwise(func):
        return pointwise.POINTWISE
    if optim.is_foreach(func):
        return optim.FOREACH
    if optim.is_fused_optimizer(func):
        return optim.FUSED
    return None


# an op's family follows from its tags and name alone, so it is found once per op (a cache of `_family`;
# the table itself is read on every lookup: `register` and direct edits of TABLE take effect at once)
_FAMILY: dict[Any, Optional[Rule]] = {}
_UNSEEN = object()


def register(func, rule: Optional[Rule]) -> Optional[Rule]:
    """Add, replace (or with None remove) the rule of one ATen overload; returns the previous rule.

    Decisions made before are dropped from the cache (`sbp.ops.cache.DECISIONS`).

    >>> from sbp.ops.spec import Rule, Sig, B
    >>> previous = register(torch.ops.aten.erfinv.default, Rule(lambda spec, axis: [Sig((B,), (B,))]))
    >>> _ = register(torch.ops.aten.erfinv.default, previous)   # restore
    """
    previous = TABLE.pop(func, None)
    if rule is not None:
        TABLE[func] = rule
    DECISIONS.clear()
    return previous


FAMILIES = (("aten.<pointwise-tagged op>", pointwise.POINTWISE),   # rows `lookup` finds by property
            ("aten._foreach_*", optim.FOREACH), ("aten._fused_{adam,adamw,sgd,adagrad}_", optim.FUSED))


def table_rows() -> list[tuple[str, str]]:
    """(op, signature summary) for every table entry, then the families `lookup` finds by property, for
    docs/operators.md.

    >>> table_rows()[0], table_rows()[-1][0]
    (('aten.mm.default', 'contraction mk,kn->mn'), 'aten._fused_{adam,adamw,sgd,adagrad}_')
    """
    return [(str(func), rule.doc) for func, rule in TABLE.items()] + [(name, rule.doc) for name, rule in FAMILIES]


if __name__ == "__main__":  # pragma: no cover - prints the table for docs/operators.md
    for name, doc in table_rows():
        print(f"| `{name}` | {doc} |")
