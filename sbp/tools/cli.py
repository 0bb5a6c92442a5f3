"""The command line: ``python -m sbp plan ...`` prints a redistribution plan without any processes.

Bad arguments exit with status 2 and one line on stderr naming the argument; no traceback.
Pure: imports no torch (dtypes are looked up in a table of item sizes).
"""
from __future__ import annotations

import argparse
import json
import sys
from typing import NoReturn, Optional, Sequence

from ..planning.api import plan
from ..values.errors import SbpError
from ..values.layout import check_global_shape
from ..values.mesh import as_mesh_shape
from ..values.placement import is_partial, normalize, placements
from ..values.topology import PRESETS, Topology

# torch dtype name -> bytes per element (also accepted with a "torch." prefix)
DTYPE_ITEMSIZE = {
    "float64": 8, "double": 8, "float32": 4, "float": 4, "float16": 2, "half": 2, "bfloat16": 2,
    "float8_e4m3fn": 1, "float8_e4m3fnuz": 1, "float8_e5m2": 1, "float8_e5m2fnuz": 1, "float8_e8m0fnu": 1,
    "complex128": 16, "cdouble": 16, "complex64": 8, "cfloat": 8, "complex32": 4, "chalf": 4,
    "int64": 8, "long": 8, "int32": 4, "int": 4, "int16": 2, "short": 2, "int8": 1,
    "uint64": 8, "uint32": 4, "uint16": 2, "uint8": 1, "bool": 1,
}


class _Parser(argparse.ArgumentParser):
    """argparse, but errors are one line (``sbp plan: error: argument --mesh: ...``) and exit 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}\n")


def parse_dims(text: str, what: str, example: str = "1024x1024") -> tuple[int, ...]:
    """``"1024x1024"`` -> ``(1024, 1024)``; ``"13"`` -> ``(13,)``; ``"()"`` -> ``()`` (a 0-d tensor).

    >>> parse_dims("8x0x3", "shape")
    (8, 0, 3)
    """
    text = text.strip().lower()
    if text in ("()", "scalar"):
        return ()
    try:
        return tuple(int(p) for p in text.split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"cannot parse {what} {text!r}; write it like {example!r}") from None


def dtype_name(name: str) -> str:
    """A torch dtype name as `DTYPE_ITEMSIZE` spells it (an ``argparse`` type: unknown names are refused).

    >>> dtype_name("torch.int64"), DTYPE_ITEMSIZE[dtype_name("bfloat16")]
    ('int64', 2)
    """
    key = name.strip().removeprefix("torch.")
    if key not in DTYPE_ITEMSIZE:
        raise argparse.ArgumentTypeError(f"unknown dtype {name!r} (valid: {', '.join(sorted(DTYPE_ITEMSIZE))})")
    return key


def itemsize_of(name: str) -> int:
    """Bytes per element of a torch dtype name.

    >>> itemsize_of("bfloat16"), itemsize_of("torch.int64")
    (2, 8)
    """
    return DTYPE_ITEMSIZE[dtype_name(name)]


def partial_dtype_error(pls: tuple, dtype: str) -> Optional[str]:
    """Why a dtype cannot hold these placements (as a global tensor refuses them), or None: ``P(sum)`` of
    bools, ``P(min|max)`` of complex numbers.

    >>> partial_dtype_error(placements("P, B"), "bool")
    'P(sum) cannot hold bool values: a sum of bools is not a bool (valid for bool: S(d), B, P(min), P(max))'
    >>> partial_dtype_error(placements("P(max)"), "float32") is None
    True
    """
    ops = {p.op for p in pls if is_partial(p)}
    if dtype == "bool" and "sum" in ops:
        return "P(sum) cannot hold bool values: a sum of bools is not a bool (valid for bool: S(d), B, P(min), P(max))"
    if dtype in ("complex128", "cdouble", "complex64", "cfloat", "complex32", "chalf") and ops & {"min", "max"}:
        return f"P(min|max) needs ordered values; {dtype} has no min/max (valid for complex: S(d), B, P(sum))"
    return None


def _shape(text: str) -> tuple[int, ...]:
    try:
        return check_global_shape(parse_dims(text, "shape"))
    except SbpError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _mesh(text: str) -> tuple[int, ...]:
    try:
        return as_mesh_shape(parse_dims(text, "mesh shape", "2x2"))
    except SbpError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _placements(text: str) -> tuple:
    try:
        return placements(text)
    except SbpError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _positive_int(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        n = 0
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be a positive int, got {text!r}")
    return n


def build_parser() -> argparse.ArgumentParser:
    """The ``sbp`` argument parser (one subcommand: ``plan``)."""
    parser = _Parser(prog="sbp", description="sbp: sharded global tensors; plan redistributions offline.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    p = sub.add_parser("plan", help="print the cheapest redistribution plan for a placement change",
                       description="Print the plan sbp runs for a change of placements, its bytes per rank "
                                   "(busiest rank) and the lower bound.")
    p.add_argument("--mesh", required=True, type=_mesh, help="mesh shape, e.g. 2x2 or 8")
    p.add_argument("--shape", required=True, type=_shape, help="global shape, e.g. 1024x1024, 13 or ()")
    p.add_argument("--src", required=True, type=_placements, help='source placements, e.g. "S(0),S(1)"')
    p.add_argument("--dst", required=True, type=_placements, help='destination placements, e.g. "S(1),S(0)"')
    p.add_argument("--dtype", default="float32", type=dtype_name, help="torch dtype name (default float32)")
    p.add_argument("--latency-bytes", default=0, type=int, metavar="N",
                   help="price each collective as N extra bytes (default 0: bytes first)")
    p.add_argument("--topology", metavar="FILE|PRESET", default=None,
                   help=f"minimise modeled time on this network: a topology JSON file (Topology.to_json, "
                        f"sbp.calibrate) or a preset ({', '.join(sorted(PRESETS))})")
    p.add_argument("--devices-per-host", default=8, type=_positive_int, metavar="N",
                   help="with a --topology preset: devices per host, innermost mesh axes first (default 8)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    return parser


_TOPOLOGY_CHARS = 1 << 20   # a topology file is one small JSON object per mesh axis


def load_topology(text: str, mesh_shape: tuple[int, ...], devices_per_host: int = 8) -> Topology:
    """A `--topology` argument: a preset name laid over the mesh, else a path to a topology JSON file,
    which must describe the mesh's axes (`Topology.check`).

    >>> load_topology("dgx-h100", (2, 8)).spans_hosts
    (True, False)
    """
    if text in PRESETS:
        return Topology.preset(text, mesh_shape, devices_per_host)
    try:
        with open(text, encoding="utf-8-sig") as f:   # (a byte-order mark, as some editors write, is skipped)
            data = f.read(_TOPOLOGY_CHARS + 1)        # (a device or a huge file: not read to the end)
    except (OSError, UnicodeDecodeError) as e:
        why = e.strerror if isinstance(e, OSError) else f"not UTF-8 text: {e.reason}"
        raise SbpError(f"--topology {text!r} is neither a preset ({', '.join(sorted(PRESETS))}) nor a readable "
                       f"JSON file ({why})") from None
    if len(data) > _TOPOLOGY_CHARS:
        raise SbpError(f"--topology {text!r} is not a topology JSON file: longer than {_TOPOLOGY_CHARS} characters")
    return Topology.from_json(data).check(mesh_shape)



def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run the command line; returns the exit status (0 ok, 2 bad arguments).

    >>> main(["plan", "--mesh", "2", "--shape", "4", "--src", "S(0)", "--dst", "B"])  # doctest: +ELLIPSIS
    Plan (S(0),) -> (B,)  shape=(4,) mesh=(2,) itemsize=4
    ...
    0
    """
    try:
        args = build_parser().parse_args(_attach_dims(sys.argv[1:] if argv is None else list(argv)))
    except SystemExit as e:  # argparse already printed its one-line error (or --help)
        return e.code if isinstance(e.code, int) else 2
    if args.command is None:
        return _fail("sbp: error: missing command (valid: plan)")
    ndim, naxes = len(args.shape), len(args.mesh)
    for name in ("src", "dst"):
        try:
            normalize(getattr(args, name), ndim, naxes)
        except SbpError as e:
            return _fail(f"sbp plan: error: argument --{name}: {e}")
        why = partial_dtype_error(getattr(args, name), args.dtype)
        if why is not None:
            return _fail(f"sbp plan: error: argument --{name}: {why}")
    if args.latency_bytes < 0:
        return _fail(f"sbp plan: error: argument --latency-bytes: must be >= 0, got {args.latency_bytes}")
    topology = None
    if args.topology is not None:
        try:
            topology = load_topology(args.topology, args.mesh, args.devices_per_host)
        except SbpError as e:
            return _fail(f"sbp plan: error: argument --topology: {e}")
    try:
        p = plan(args.shape, args.mesh, args.src, args.dst, DTYPE_ITEMSIZE[args.dtype], latency_bytes=args.latency_bytes,
                 topology=topology)
    except SbpError as e:
        return _fail(f"sbp plan: error: {e}")
    if args.json:
        print(json.dumps(p.to_dict()))
        return 0
    print(p.explain())
    print(f"bytes per rank: {p.bytes_per_rank} ({_human(p.bytes_per_rank)}), "
          f"lower bound: {p.lower_bound} ({_human(p.lower_bound)}), "
          f"collectives: {p.num_collectives}, peak: {p.peak_bytes} ({_human(p.peak_bytes)})"
          + ("" if p.time_us is None else f", modeled time: {p.time_us:.3f} us"))
    return 0


def _attach_dims(argv: list[str]) -> list[str]:
    """``--shape -4x4`` as ``--shape=-4x4``: argparse takes a value that starts with '-' (and is no plain
    negative number) for an option, so the bad size would be reported as a missing value."""
    out: list[str] = []
    for arg in argv:
        if out and out[-1] in ("--mesh", "--shape") and arg[:1] == "-" and arg[1:2].isdigit():
            out[-1] = f"{out[-1]}={arg}"
        else:
            out.append(arg)
    return out


def _fail(line: str) -> int:
    print(line, file=sys.stderr)
    return 2


def _human(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n} B"  # pragma: no cover
