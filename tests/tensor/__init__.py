"""Tests of sbp.tensor: GlobalTensor, autograd, distribute/from_local, factories, setitem."""
