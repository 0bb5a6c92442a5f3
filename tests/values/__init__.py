"""Tests of sbp.values: placements, meshes, layout maths (pure tier)."""
