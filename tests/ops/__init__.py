"""Tests of sbp.ops: the operator rules and their dispatch, including torch.optim's foreach ops."""
