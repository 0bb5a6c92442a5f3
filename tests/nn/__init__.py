"""Tests of sbp.nn: parallelize plans, a transformer block and the example training script."""
