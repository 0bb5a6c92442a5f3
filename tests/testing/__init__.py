"""Tests of sbp.testing: the kit's strategies, SPMD runners and layout assertions."""
