"""Helpers shared by the tests (no test files here): the shape and mesh table, the conformance runner,
the op-rule checker, DTensor's reference planner, repository paths."""
