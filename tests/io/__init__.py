"""Tests of sbp.io: checkpoints and DTensor interop."""
