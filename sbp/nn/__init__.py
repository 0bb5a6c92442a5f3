"""sbp.nn: tensor parallelism for unchanged `torch.nn` models, driven by a `{module path: style}` plan
(`sbp.nn.hf`: transformers' style strings and the "auto" plan of a `transformers` model).

>>> import sbp
>>> sbp.nn.Colwise().output_placement, sbp.nn.Rowwise().output_placement
(S(-1), B)
"""
from . import hf
from .fsdp import FullyShardedModule, UnshardHandle, fully_shard
from .parallelize import parallelize
from .styles import AllReduce, Colwise, Embedding, Packed, Replicated, Rowwise, SequenceParallel, Style

__all__ = ["parallelize", "fully_shard", "FullyShardedModule", "UnshardHandle", "Colwise", "Rowwise", "Embedding",
           "SequenceParallel", "Replicated",
           "AllReduce", "Packed", "Style", "hf"]
