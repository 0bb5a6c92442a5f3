"""sbp.nn: tensor parallelism for unchanged `torch.nn` models, driven by a `{module path: style}` plan.

>>> import sbp
>>> sbp.nn.Colwise().output_placement, sbp.nn.Rowwise().output_placement
(S(-1), B)
"""
from .parallelize import parallelize
from .styles import Colwise, Embedding, Rowwise, SequenceParallel, Style

__all__ = ["parallelize", "Colwise", "Rowwise", "Embedding", "SequenceParallel", "Style"]
