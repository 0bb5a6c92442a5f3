"""Neural-network ops: softmax backward, layer/RMS/group norm, embedding, losses, convolution, pooling, GLU.

===============================  ==============================================  =========================
op                               inputs per mesh axis                            outputs
===============================  ==============================================  =========================
_softmax/_log_softmax_backward   (S(d), S(d)), d != dim | (P(sum), B) | (B, B)    S(d) | P(sum) | B
native_layer_norm                x S(d) over a batch dim, weight/bias B           (S(d), S(d), S(d))
native_layer_norm_backward       grad, x, mean, rstd S(d); weight, bias B         (S(d), P(sum), P(sum))
                                 grad P(sum), the rest B                          (P(sum), P(sum), P(sum))
_fused_rms_norm (+ backward)     as layer norm (no bias, no mean)                 as layer norm
embedding                        weight B, indices S(d)                           S(d)
                                 weight S(1), indices B                           S(last)
                                 weight S(0) (vocab-parallel), indices B          P(sum) (rows masked)
                                 weight P(sum), indices B                         P(sum)
embedding_dense_backward         grad S(d), indices S(d)                          P(sum)
                                 grad S(last), indices B                          S(1)
                                 grad B, indices B                                S(0) (rows masked) or B
                                 grad P(sum), indices B                           P(sum)
nll_loss_forward                 self S(0), target S(0), weight B                 (B, B) mean, (P(sum), P(sum)) sum,
                                                                                  (S(0), B) none
                                 self P(sum), target B                            (P(sum), B)
nll_loss_backward                grad B, self S(0), target S(0), total B          S(0)
                                 grad P(sum), self B, target B, total B           P(sum)
scaled dot-product attention     q, k, v (mask) S(batch or head dim)              S(same dim)
(CPU flash kernel, + backward)   (grouped kv heads: each rank's q heads are the
                                 groups of its kv heads)
                                 backward: grad P(sum), the rest B                P(sum)
mse / smooth_l1 / huber /        self, target S(d) (a broadcast weight S where    S(d) none, P(sum) reduced
binary_cross_entropy(_logits)    it spans d, else B)
(+ backward)                     backward: grad S(d) none, else B                 S(d); grad P(sum) -> P(sum)
convolution (+ backward)         input (grad) S(0), weight, bias B                S(0) (grads of weight and
                                                                                  bias P(sum))
                                 no bias: input P(sum)                            P(sum)
max/avg_pool2d/3d (+ backward)   S(d) of a batch or channel dim                   S(d)
native_group_norm (+ backward)   input S(0) (N: this rank's rows)                 as layer norm
glu (+ backward)                 S(d), d != dim                                   S(d)
===============================  ==============================================  =========================

The batch-split `mean` NLL divides the local sum by the *global* total weight (one all_reduce of a
scalar), so uneven batch shards give the exact mean. Every op also accepts all-B.
"""
from __future__ import annotations

import itertools
import math
from typing import Any

import torch

from ..runtime.traced import is_tracing
from ..tensor.global_tensor import GlobalTensor, redistribute_raw
from ..values.errors import ShapeError, torch_alike
from ..values.layout import block
from ..values.placement import Split
from .apply import first_out_of_range
from .spec import ANY, PSUM, B, Call, Choice, OpSpec, Rule, Sig, splits

aten = torch.ops.aten
NONE, MEAN, SUM = 0, 1, 2   # ATen reduction codes


# ---- softmax backward --------------------------------------------------------------------------------------------
def _softmax_backward_sigs(spec: OpSpec, axis: int) -> list[Sig]:
    out = spec.out
    dim = spec.arg("dim") % max(out.ndim, 1)
    sigs = [Sig((Split(d), Split(d)), (Split(d),)) for d in range(out.ndim) if d != dim]
    return sigs + [Sig((B, B), (B,)), Sig((PSUM, B), (PSUM,))]


SOFTMAX_BACKWARD = Rule(_softmax_backward_sigs, doc="(S(d),S(d))->S(d), d != dim; (P(sum),B)->P(sum); B")


# ---- layer norm / RMS norm ----------------------------------------------------------------------------------------
def _norm_sigs(spec: OpSpec, axis: int) -> list[Sig]:
    x = spec.inputs[0]
    lead = x.ndim - len(spec.arg("normalized_shape"))
    nout = len(spec.outputs)
    sigs = [spec.sig({"input": Split(d)}, (Split(d),) * nout) for d in range(lead)]
    return sigs + [spec.sig({}, (B,) * nout)]


def _norm_backward_sigs(spec: OpSpec, axis: int) -> list[Sig]:
    x = spec.tensor("input")
    lead = x.ndim - len(spec.arg("normalized_shape"))
    stats = [name for name in ("mean", "rstd") if spec.tensor(name) is not None]
    nout = len(spec.outputs)
    sigs = []
    for d in range(lead):
        placed = {name: Split(d) for name in ["grad_out", "input"] + stats}
        sigs.append(spec.sig(placed, (Split(d),) + (PSUM,) * (nout - 1)))
    sigs.append(spec.sig({}, (B,) * nout))
    sigs.append(spec.sig({"grad_out": PSUM}, (PSUM,) * nout))
    return sigs


LAYER_NORM = Rule(_norm_sigs, doc="x S(batch dim)->(S, S, S); weight, bias B")
LAYER_NORM_BACKWARD = Rule(_norm_backward_sigs, doc="S(batch dim)->(S, P(sum), P(sum)); grad P(sum)->P(sum)")
RMS_NORM = Rule(_norm_sigs, doc="x S(batch dim)->(S, S); weight B")
RMS_NORM_BACKWARD = Rule(_norm_backward_sigs, doc="S(batch dim)->(S, P(sum)); grad P(sum)->P(sum)")


# ---- embedding ------------------------------------------------------------------------------------------------------
def _embedding_sigs(spec: OpSpec, axis: int) -> list[Sig]:
    idx = spec.tensor("indices")
    sigs = [spec.sig({"indices": Split(d)}, (Split(d),)) for d in range(idx.ndim)]
    sigs += [spec.sig({"weight": Split(1)}, (Split(idx.ndim),)),
             spec.sig({"weight": Split(0)}, (PSUM,)),
             spec.sig({"weight": PSUM}, (PSUM,)),
             spec.sig({}, (B,))]
    return sigs


def _run_embedding(call: Call) -> Any:
    """Vocab-parallel rows: look up the indices this rank owns, zeros for the rest (P(sum) over the axis)."""
    weight, indices = call.args[0], call.args[1]
    if not splits(call.choice.inputs[0], 0):
        return call.default()
    lo, hi = call.in_block(0)[0]
    vocab = call.spec.inputs[0].shape[0]
    # another rank's rows are masked; an index outside the whole vocabulary is left out of range of the
    # local rows too, so the lookup raises as torch's does (not a silent row of zeros)
    outside = (indices < lo) | (indices >= hi)
    outside &= (indices >= 0) & (indices < vocab)
    if hi == lo:
        if not bool(outside.all()) and indices.numel():
            raise torch_alike(ShapeError, "index out of range in self", IndexError)   # torch's message
        return weight.new_zeros(tuple(indices.shape) + (weight.shape[1],))
    local = (indices - lo).masked_fill(outside, 0)
    padding = call.args[2] if len(call.args) > 2 else -1
    args = list(call.args)
    args[1] = local
    if len(args) > 2:
        args[2] = padding - lo if lo <= padding < hi else -1
    out = call.func(*args, **call.kwargs)
    return out.masked_fill(outside.unsqueeze(-1), 0)


EMBEDDING = Rule(_embedding_sigs, run=_run_embedding,
                 doc="indices S(d)->S(d); weight S(1)->S(last); weight S(0)->P(sum) (masked rows); B")


def _embedding_backward_sigs(spec: OpSpec, axis: int) -> list[Sig]:
    g, idx = spec.tensor("grad_output"), spec.tensor("indices")
    sigs = []
    if not spec.arg("scale_grad_by_freq"):  # frequencies must be counted over all indices
        sigs += [spec.sig({"grad_output": Split(d), "indices": Split(d)}, (PSUM,)) for d in range(idx.ndim)]
    sigs += [spec.sig({"grad_output": Split(g.ndim - 1)}, (Split(1),)),
             spec.sig({}, (Split(0),)),
             spec.sig({"grad_output": PSUM}, (PSUM,)),
             spec.sig({}, (B,))]
    return sigs


def _run_embedding_backward(call: Call) -> Any:
    """Rows split (vocab-parallel gradient): scatter only the indices this rank owns."""
    grad, indices, num_weights, padding, scale = call.args[:5]
    if not splits(call.choice.outputs[0], 0):
        return call.func(*call.args, **call.kwargs)
    lo, hi = call.out_block(0)[0]
    outside = (indices < lo) | (indices >= hi)
    local = (indices - lo).masked_fill(outside, hi - lo)   # a spare row collects what is not ours
    pad = padding - lo if padding >= 0 and lo <= padding < hi else -1
    out = call.func(grad, local, hi - lo + 1, pad, scale)
    return out[: hi - lo]


EMBEDDING_BACKWARD = Rule(_embedding_backward_sigs, run=_run_embedding_backward,
                          doc="(S(d),S(d))->P(sum); grad S(last)->S(1); B->S(0) (masked rows) or B; P->P")


# ---- negative log likelihood -----------------------------------------------------------------------------------------
def _nll_sigs(spec: OpSpec, axis: int) -> list[Sig]:
    x = spec.tensor("self")
    reduction = spec.arg("reduction")
    sigs = []
    if x.ndim == 2:
        outs = {NONE: (Split(0), B), MEAN: (B, B), SUM: (PSUM, PSUM)}[reduction]
        sigs.append(spec.sig({"self": Split(0), "target": Split(0)}, outs))
    sigs += [spec.sig({"self": PSUM}, (PSUM, B)), spec.sig({}, (B, B))]
    return sigs


def _run_nll(call: Call) -> Any:
    """A batch-split mean is the global sum over the global total weight: both local sums reduced by one
    all_reduce of two scalars, so the loss comes out whole (Broadcast), with no second reduction when it is
    read."""
    reduction = call.spec.arg("reduction")
    split_axes = [a for a, p in enumerate(call.choice.inputs[call.spec.index("target")]) if isinstance(p, Split)]
    if reduction != MEAN or not split_axes:
        return call.default()
    args = list(call.args)
    args[3] = SUM
    # an out-of-range target raises on every rank: its owner counts it into the all_reduce the others
    # wait in, instead of raising alone (SPMD)
    # (not while traced: a compiled graph cannot branch on values; torch's kernel checks there)
    target, x = args[1], args[0]
    traced = is_tracing(target)
    classes = x.shape[1] if x.ndim >= 2 else x.shape[0]
    bad = None if traced else first_out_of_range(target, classes, call.spec.arg("ignore_index"))
    first_bad = [] if bad is None else [bad]
    if first_bad:   # the kernel would raise here: zeros instead, the all_reduce below raises everywhere
        total, weight = x.new_zeros(()), x.new_zeros(())
    else:
        total, weight = call.func(*args, **call.kwargs)
    parts = tuple(PSUM if a in split_axes else B for a in range(call.mesh.ndim))
    sums = [total, weight.to(total.dtype)] + ([] if traced else [total.new_tensor(float(len(first_bad)))])
    both = torch.stack(sums)
    both = redistribute_raw(GlobalTensor(both, call.mesh, parts, (len(sums),)), (B,) * call.mesh.ndim)._local
    if not traced and both[2] > 0:
        where = f"Target {first_bad[0]} is out of bounds." if first_bad else "Target is out of bounds."
        raise torch_alike(ShapeError, f"{where} (on {int(both[2])} of the ranks holding the split target)", IndexError)
    return both[0] / both[1], both[1].to(weight.dtype)


NLL_LOSS = Rule(_nll_sigs, run=_run_nll, doc="batch S(0)->(B, B) mean | (S(0), B) none | (P(sum), P(sum)) sum; "
                                          "self P(sum)->P(sum); B")


def _nll_backward_sigs(spec: OpSpec, axis: int) -> list[Sig]:
    x = spec.tensor("self")
    reduction = spec.arg("reduction")
    total = B if reduction == MEAN else ANY   # the total weight is only read by the mean
    sigs = []
    if x.ndim == 2:
        grad = Split(0) if reduction == NONE else B
        sigs.append(spec.sig({"grad_output": grad, "self": Split(0), "target": Split(0), "total_weight": total},
                             (Split(0),)))
    sigs += [spec.sig({"grad_output": PSUM, "total_weight": total}, (PSUM,)),
             spec.sig({"total_weight": total}, (B,))]
    return sigs


NLL_LOSS_BACKWARD = Rule(_nll_backward_sigs, doc="batch S(0)->S(0); grad P(sum)->P(sum); B")


# ---- scaled dot-product attention (the fused CPU kernel) -----------------------------------------------------------
_Q_HEADS = ("query", "grad_out", "out", "logsumexp")   # tensors with the query's heads (backward: all of them)
_KV_HEADS = ("key", "value")


def _sdpa_sigs(spec: OpSpec, axis: int) -> list[Sig]:
    """Split a batch dim (batch or heads) of q, k, v alike; the mask follows where it has that dim.

    Grouped-query attention (``Hq = g * Hkv`` query heads, query head h reads kv head ``h // g``) splits the
    heads of q and of k, v too: exact when every rank's query heads are the `g` groups of its kv heads,
    which `_sdpa_check` verifies per coord (so whenever the kv heads divide evenly over the splitting axes).
    """
    q, mask = spec.tensor("query"), spec.tensor("attn_mask")
    nout = len(spec.outputs)
    backward = spec.tensor("grad_out") is not None
    names = [n for n in _Q_HEADS + _KV_HEADS if spec.tensor(n) is not None]
    sigs = []
    for d in range(q.ndim - 2):
        kv = spec.tensor("key").shape[d]
        grouped = d == q.ndim - 3 and 0 < kv < q.shape[d] and q.shape[d] % kv == 0   # GQA: heads split alike
        if not grouped and any(spec.tensor(n).shape[d] != q.shape[d] for n in names):
            continue
        placed = {n: Split(d) for n in names}
        if mask is not None:
            k = d - (q.ndim - mask.ndim)
            placed["attn_mask"] = Split(k) if k >= 0 and mask.shape[k] == q.shape[d] else B
        sigs.append(spec.sig(placed, (Split(d),) * nout))
    sigs.append(spec.sig({}, (B,) * nout))
    if backward:
        sigs.append(spec.sig({"grad_out": PSUM}, (PSUM,) * nout))
    return sigs


def _sdpa_check(spec: OpSpec, choice: Choice) -> bool:
    """Grouped heads split: on every coord the query's head block is `g` times the kv heads' block."""
    q, k = spec.tensor("query"), spec.tensor("key")
    d = q.ndim - 3
    if d < 0 or q.shape[d] == k.shape[d] or k.shape[d] == 0:
        return True
    qi, ki = spec.index("query"), spec.index("key")
    if not (splits(choice.inputs[qi], d) or splits(choice.inputs[ki], d)):
        return True
    g = q.shape[d] // k.shape[d]
    for coord in itertools.product(*(range(n) for n in spec.mesh_shape)):
        (qlo, qhi), (klo, khi) = (block(t.shape, spec.mesh_shape, choice.inputs[i], coord)[d]
                                  for t, i in ((q, qi), (k, ki)))
        if (qlo, qhi) != (klo * g, khi * g):
            return False
    return True


def _run_sdpa(call: Call) -> Any:
    """The CPU kernel divides by zero on empty shards (SIGFPE): an empty block gives empty results. The fused
    kernels read the last dim as contiguous: torch chose them from the global tensors' (contiguous) strides,
    but a local laid out anew may have others (a head cut between ranks, then moved: strides (5, 80, 1, 10)),
    which the CPU flash kernel silently misreads; such locals are made contiguous."""
    if any(call.args[i].numel() == 0 for i in range(3)):
        like = call.args[0]
        return tuple(like.new_zeros(call.out_shape(k), dtype=meta.dtype) for k, meta in enumerate(call.spec.outputs))
    args = [a.contiguous() if isinstance(a, torch.Tensor) and a.dim() and a.stride(-1) != 1 else a
            for a in call.args]
    return call.func(*args, **call.kwargs)


SDPA = Rule(_sdpa_sigs, run=_run_sdpa, check=_sdpa_check,
            doc="q, k, v (and grads) S(batch or head dim) -> S (grouped kv heads: when each rank's q heads are its "
                "kv heads' groups); backward: grad P(sum) -> P(sum); B")


# ---- element-wise losses: mean squared error, smooth L1, Huber, binary cross-entropy (with logits) ----------------
def _loss_sigs(spec: OpSpec, axis: int) -> list[Sig]:
    """`self` and `target` split alike (S(d) -> S(d) for 'none', P(sum) when reduced); a `weight` /
    `pos_weight` broadcast against them split on the dim that spans d (B where it is broadcast along d);
    backward also P(sum) in the gradient (it is linear in it). A target of another shape (broadcast): B."""
    x = spec.tensor("self")
    reduction = spec.arg("reduction", MEAN)
    backward = spec.tensor("grad_output") is not None
    out = Split if reduction == NONE or backward else (lambda d: PSUM)
    sigs = []
    if spec.tensor("target").shape == x.shape:
        for d in range(x.ndim):
            placed = {"self": Split(d), "target": Split(d)}
            for name in ("weight", "pos_weight"):
                w = spec.tensor(name)
                if w is not None:
                    wd = d - (x.ndim - w.ndim)
                    placed[name] = Split(wd) if wd >= 0 and w.shape[wd] != 1 else B
            if backward:
                placed["grad_output"] = Split(d) if reduction == NONE else B
            sigs.append(spec.sig(placed, (out(d),)))
    sigs.append(spec.sig({}, (B,)))
    if backward:
        sigs.append(spec.sig({"grad_output": PSUM}, (PSUM,)))
    return sigs


def _run_loss(call: Call) -> Any:
    """A split mean is the local *sum* divided by the global number of elements (forward and backward)."""
    spec = call.spec
    index = spec.index("self")
    if spec.arg("reduction", MEAN) != MEAN or not any(isinstance(p, Split) for p in call.choice.inputs[index]):
        return call.default()
    return _call_with(call, "reduction", SUM) / math.prod(spec.inputs[index].shape)


def _call_with(call: Call, name: str, value: Any) -> Any:
    """The op on the call's local tensors with its argument `name` (by schema, given or not) set to `value`."""
    args, kwargs = list(call.args), dict(call.kwargs)
    at = [a.name for a in call.func._schema.arguments].index(name)
    if at < len(args):
        args[at] = value
    else:
        kwargs[name] = value
    return call.func(*args, **kwargs)


LOSS = Rule(_loss_sigs, run=_run_loss, doc="S(d)->S(d) ('none') or P(sum) (sum; mean over the global count); a "
                                           "broadcast weight split where it spans d; B")
LOSS_BACKWARD = Rule(_loss_sigs, run=_run_loss, doc="S(d)->S(d) (grad B, mean over the global count); "
                                                    "grad P(sum)->P(sum); B")


# ---- convolution and pooling: each sample (and, pooling, each channel) on its own -----------------------------------
def _conv_sigs(spec: OpSpec, axis: int) -> list[Sig]:
    """Batch S(0) -> S(0) (weight, bias B); without a bias, linear in the input: P(sum) -> P(sum); B."""
    sigs = [spec.sig({"input": Split(0)}, (Split(0),)), spec.sig({}, (B,))]
    if spec.tensor("bias") is None:
        sigs.append(spec.sig({"input": PSUM}, (PSUM,)))
    return sigs


def _conv_backward_sigs(spec: OpSpec, axis: int) -> list[Sig]:
    """grad and input S(0) -> (S(0), P(sum), P(sum)) (the weight's and bias's gradients sum over the batch);
    linear in the gradient: P(sum) -> P(sum); B."""
    nout = len(spec.outputs)
    return [spec.sig({"grad_output": Split(0), "input": Split(0)}, (Split(0),) + (PSUM,) * (nout - 1)),
            spec.sig({}, (B,) * nout), spec.sig({"grad_output": PSUM}, (PSUM,) * nout)]


def _planes(k: int):
    """Pooling over the last `k` dims: any other dim (batch, channels) split alike in and out; B. The backward
    (a `grad_output` input) is linear in the gradient: P(sum) -> P(sum)."""
    def sigs(spec: OpSpec, axis: int) -> list[Sig]:
        x = spec.tensor("self")
        names = [n for n in ("grad_output", "self", "indices") if spec.tensor(n) is not None]
        nout = len(spec.outputs)
        out = [spec.sig(dict.fromkeys(names, Split(d)), (Split(d),) * nout) for d in range(x.ndim - k)]
        out.append(spec.sig({}, (B,) * nout))
        if spec.tensor("grad_output") is not None:
            out.append(spec.sig({"grad_output": PSUM}, (PSUM,) * nout))
        return out
    return sigs


CONVOLUTION = Rule(_conv_sigs, doc="batch S(0)->S(0) (weight, bias B); no bias: P(sum)->P(sum); B")
CONVOLUTION_BACKWARD = Rule(_conv_backward_sigs, doc="grad, input S(0)->(S(0), P(sum), P(sum)); "
                                                     "grad P(sum)->P(sum); B")


def _run_planes(call: Call) -> Any:
    """Pooling on the local block; a block left empty by a split channel dim (torch refuses empty non-batch dims)
    gives empty outputs of the block's shape where the global input is not empty (else torch decides)."""
    x = call.args[call.spec.index("self")]
    if x.numel() or not math.prod(call.spec.tensor("self").shape):
        return call.default()
    outs = tuple(torch.empty(call.out_shape(i), dtype=meta.dtype, device=x.device)
                 for i, meta in enumerate(call.spec.outputs))
    return outs if len(outs) > 1 else outs[0]


_POOL_DOC = "S(d) of a batch or channel dim->S(d); backward also grad P(sum)->P(sum); B"
POOL_2D = Rule(_planes(2), run=_run_planes, doc=_POOL_DOC)
POOL_3D = Rule(_planes(3), run=_run_planes, doc=_POOL_DOC)


# ---- group norm (per sample) and GLU (halves one dim) ----------------------------------------------------------------
def _group_norm_sigs(spec: OpSpec, axis: int) -> list[Sig]:
    """Batch S(0) -> S(0) (the per-sample mean and rstd too; weight, bias B); backward: grad, input, mean, rstd
    S(0) -> (S(0), P(sum), P(sum)), linear in the gradient: P(sum) -> P(sum); B."""
    nout = len(spec.outputs)
    if spec.tensor("grad_out") is None:
        return [spec.sig({"input": Split(0)}, (Split(0),) * nout), spec.sig({}, (B,) * nout)]
    batch = dict.fromkeys(("grad_out", "input", "mean", "rstd"), Split(0))
    return [spec.sig(batch, (Split(0),) + (PSUM,) * (nout - 1)), spec.sig({}, (B,) * nout),
            spec.sig({"grad_out": PSUM}, (PSUM,) * nout)]


def _run_group_norm(call: Call) -> Any:
    """The op with its batch-size argument `N` this rank's rows (the global batch where the batch is whole)."""
    return _call_with(call, "N", call.args[call.spec.index("input")].shape[0])


def _glu_sigs(spec: OpSpec, axis: int) -> list[Sig]:
    """Any dim but the halved one split alike (input, and the backward's gradient) -> S(d); the backward is
    linear in the gradient: P(sum) -> P(sum); B."""
    x = spec.tensor("self")
    dim = spec.arg("dim", -1) % x.ndim
    names = [n for n in ("grad_output", "self") if spec.tensor(n) is not None]
    sigs = [spec.sig(dict.fromkeys(names, Split(d)), (Split(d),)) for d in range(x.ndim) if d != dim]
    sigs.append(spec.sig({}, (B,)))
    if "grad_output" in names:
        sigs.append(spec.sig({"grad_output": PSUM}, (PSUM,)))
    return sigs


GROUP_NORM = Rule(_group_norm_sigs, run=_run_group_norm, doc="batch S(0)->(S(0), S(0), S(0)); weight, bias B")
GROUP_NORM_BACKWARD = Rule(_group_norm_sigs, run=_run_group_norm,
                           doc="batch S(0)->(S(0), P(sum), P(sum)); grad P(sum)->P(sum)")
GLU = Rule(_glu_sigs, doc="S(d != dim)->S(d); backward also grad P(sum)->P(sum); B")
