"""Placements and meshes read off a global tensor made inside a compiled graph.

Dynamo answers ``y.placements`` / ``y.mesh`` of a tensor the graph made (``y = x.redistribute("B")``; a
layer's output) from the traced example value, with no source to guard: it must build the Python values
(`S(0)`, a `DeviceMesh`) "sourcelessly", which it refuses for types it does not know ("Unexpected type in
sourceless builder" under ``fullgraph=True``). The values are immutable constants of the graph (placements
are interned, a mesh is a frozen value whose binding lives outside its fields), so sbp registers them with
dynamo's sourceless builder as constants: attributes and comparisons are read from the real value, they pass
into sbp calls (``x.redistribute(y.placements)``, ``sbp.from_local(t, y.mesh, y.placements)``) as constants,
and a compiled function may return them (rebuilt by a call: ``Split(0)``; for a mesh ``live_mesh(shape, names,
ranks, device_type)``, this process's live bound mesh).

Inputs' placements and meshes take dynamo's ordinary path (a value with a source, guarded); only the
sourceless case is added here. On a torch whose dynamo lacks the hooks used, `register` does nothing and
such reads stay a documented graph break (docs/compile.md).
"""
from __future__ import annotations

from typing import Any

from ..values.mesh import DeviceMesh
from ..values.placement import Broadcast, Partial, Split


def rebuilt_by(value: Any) -> tuple[str, str, tuple]:
    """(module, callable, constant arguments): the call a compiled function's bytecode makes to return
    `value` (a placement or a mesh made inside the graph) -- the one its pickle makes (`__reduce__`): a
    placement's class, a bound mesh's `live_mesh` (this process's live mesh of that description).

    >>> import sbp, sbp.testing
    >>> rebuilt_by(sbp.S(1)), rebuilt_by(sbp.Partial("max"))
    (('sbp.values.placement', 'Split', (1,)), ('sbp.values.placement', 'Partial', ('max',)))
    >>> sbp.testing.spmd(lambda mesh: rebuilt_by(mesh), (2,), names=("tp",))[0]
    ('sbp.values.mesh', 'live_mesh', ((2,), ('tp',), (0, 1), 'cpu'))
    """
    call, args = value.__reduce__()[:2]
    return call.__module__, call.__qualname__, args


def register() -> bool:
    """Teach dynamo's sourceless builder sbp's placements and meshes (idempotent); False where this torch's
    dynamo has no such hook (the reads then stay a graph break).

    >>> register()
    True
    """
    try:
        from torch._dynamo.bytecode_transformation import create_call_function
        from torch._dynamo.variables.builder import SourcelessBuilder
        from torch._dynamo.variables.user_defined import FrozenDataClassVariable
        handlers = SourcelessBuilder._type_handlers
    except (ImportError, AttributeError):
        return False
    if not isinstance(handlers, dict):
        return False

    class GraphConstantVariable(FrozenDataClassVariable):
        """An sbp placement or mesh that a traced tensor carries: a constant (no guard, no source)."""

        def as_python_constant(self) -> Any:
            return self.value

        def reconstruct(self, codegen) -> None:
            module, name, args = rebuilt_by(self.value)
            codegen.add_push_null(lambda: codegen.load_import_from(module, name))
            for a in args:
                codegen.append_output(codegen.create_load_const(a))
            codegen.extend_output(create_call_function(len(args), False))

    for cls in (Split, Broadcast, Partial, DeviceMesh):
        handlers.setdefault(cls, lambda tx, value: GraphConstantVariable(value))
    return True
