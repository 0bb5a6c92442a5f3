"""Tests of sbp.tools: the command line."""
