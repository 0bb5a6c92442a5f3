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

A placement or mesh read from the frame (an input's ``x.placements[0]`` or ``x.mesh``, a module constant
``S0 = sbp.S(0)``) is the same constant, guarded by identity. Left to dynamo it would be a plain frozen
dataclass: its ints (a ``Split``'s dim, a mesh's shape) turned into symbols by automatic dynamic at the first
recompile (or by ``dynamic=True`` at once), which sbp then met as ``Split(<symbol>)`` or a mesh shape of
proxies, and ``placements.index(p)`` could not rebuild it. On a torch whose dynamo lacks the hooks used,
`register` does nothing and such reads stay a documented graph break (docs/compile.md).
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
    """Teach dynamo sbp's placements and meshes as constants (idempotent); False where this torch's dynamo has
    no such hook (the reads then stay a graph break).

    >>> register()
    True
    """
    try:
        from torch._dynamo.bytecode_transformation import create_call_function
        from torch._dynamo.guards import GuardBuilder
        from torch._dynamo.variables.builder import SourcelessBuilder, VariableBuilder
        from torch._dynamo.variables.user_defined import FrozenDataClassVariable
        handlers = SourcelessBuilder._type_handlers
        # by type, for values read from the frame (an input's or a global's placement); one table per
        # value of dynamo's trace_numpy setting
        sourced = [VariableBuilder._type_dispatch_impl(flag) for flag in (False, True)]
    except (ImportError, AttributeError, TypeError):
        return False
    if not all(isinstance(table, dict) for table in (handlers, *sourced)):
        return False

    class GraphConstantVariable(FrozenDataClassVariable):
        """An sbp placement or mesh as a constant of the graph."""

        def as_python_constant(self) -> Any:
            return self.value

        def as_proxy(self) -> Any:   # an argument of a call in the graph: the constant itself
            return self.value

        def var_getattr(self, tx, name: str):
            if name in self.value.__dataclass_fields__:   # a field (a Split's dim): the constant, not an input
                return SourcelessBuilder.create(tx, getattr(self.value, name))
            return super().var_getattr(tx, name)

        def reconstruct(self, codegen) -> None:
            module, name, args = rebuilt_by(self.value)
            codegen.add_push_null(lambda: codegen.load_import_from(module, name))
            for a in args:
                codegen.append_output(codegen.create_load_const(a))
            codegen.extend_output(create_call_function(len(args), False))

    def guarded(builder, value) -> GraphConstantVariable:
        # placements are interned, and a tensor's mesh is the live one its tensors share: the identity guard
        # reuses the compiled code exactly for the same value (an equal mesh object of its own compiles anew)
        builder.install_guards(GuardBuilder.ID_MATCH)
        return GraphConstantVariable(value, source=builder.source)

    for cls in (Split, Broadcast, Partial, DeviceMesh):
        handlers.setdefault(cls, lambda tx, value: GraphConstantVariable(value))
        for table in sourced:
            table.setdefault(cls, guarded)
    return True
