"""Tests of sbp.planning: the planner's search, costs and bounds, exchange schedules, cross-mesh plans."""
