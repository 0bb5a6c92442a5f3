"""Tests of sbp.runtime: the executor on each backend, buffer layouts, the simulator, failures, agreement checks."""
