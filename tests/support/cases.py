"""The one table of global shapes and mesh shapes the test tiers share.

The pure tier (planner, cross-mesh plans, reduce_transfer schedules), the in-process tier (threads) and the
gloo tier draw their shapes and meshes from here, so a case added here reaches every tier that runs it.
Tables of a single test (named state dicts, index lists, a mesh -> placements map) stay in that test.

Global shapes, each for an edge of the layout maths (sizes over 2 and 4 ranks):

=========  =========================================================================
``8x12``   even: every split of either dim is equal
``7x5``    uneven: 7 over 4 is 2,2,2,1; 5 over 4 is 2,1,1,1
``3x1``    dims shorter than the mesh: some ranks hold nothing of a Split
``0x4``    zero-size: every local is empty, collectives still run
=========  =========================================================================
"""
from __future__ import annotations

Shape = tuple[int, ...]

SHAPES: tuple[Shape, ...] = ((8, 12), (7, 5), (3, 1), (0, 4))
# 2x2x2 runs 8 ranks and 64 x 64 placement pairs: it drops 3x1, whose empty blocks the 4-rank meshes cover
SHAPES_8_RANKS: tuple[Shape, ...] = ((8, 12), (7, 5), (0, 4))
# hand-built collectives (conformance.hand_steps): 10x7 in place of 7x5, so the forced steps also meet
# 10 over 4 = 3,3,2,2 (two longer parts, where 7 over 4 has three) and a dim even over 2 but not over 4
HAND_SHAPES: tuple[Shape, ...] = ((8, 12), (10, 7), (3, 1), (0, 4))
BIG: Shape = (1024, 1024)  # 4 MiB in fp32: the planner's byte figures are easy to read in MiB

MESH_1D: Shape = (4,)
MESH_2D: Shape = (2, 2)
MESH_3D: Shape = (2, 2, 2)
# every backend runs the executor tables on these (gloo: 4 processes)
EXEC_MESHES: tuple[Shape, ...] = (MESH_1D, MESH_2D)
# the planner's pure tier affords more ranks: 8 in a row, a non-square 2-D mesh, three axes
PLANNER_MESHES: tuple[Shape, ...] = ((4,), (8,), (2, 2), (2, 4), (2, 2, 2))
# in-process tiers inside Hypothesis loops: an odd axis (3) for uneven splits, two axes, few ranks
SMALL_MESHES: tuple[Shape, ...] = ((2,), (3,), (2, 2))
# the op-rule checks (ops_kit) add 4 ranks in a row; the order is Hypothesis's shrinking order
OP_MESHES: tuple[Shape, ...] = ((2,), (3,), (4,), (2, 2))
