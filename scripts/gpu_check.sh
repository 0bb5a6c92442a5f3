#!/usr/bin/env bash
# The checks sbp needs a GPU for (issue 23), for a session that has one. Run from anywhere:
#
#   scripts/gpu_check.sh            # every GPU of this machine: 1 GPU -> the one-rank checks; >= 2 -> also
#                                   # torchrun over all of them (NCCL)
#   scripts/gpu_check.sh --cpu N    # the same script on N gloo CPU processes (what this machine can try
#                                   # without a GPU: it checks the script itself, not NCCL)
#
# 1. pytest of the device tests (tests/runtime/test_devices.py: conformance with the locals on the GPU and a
#    one-rank NCCL world taking every call of sbp's CUDA route; tests/runtime/test_cuda_review.py);
# 2. torchrun --nproc-per-node N of the per-rank checks below: the conformance cases on NCCL, every dtype
#    sbp allows (complex, bool, int8, int16 included) through all_gather / all_to_all / reductions, random
#    factories and ops with a CUDA generator, a compiled tensor-parallel step where torch.compile is
#    available, sbp.save / sbp.load (barrier included), a cross-mesh move and its debug check (N >= 2);
# 3. examples/train_tp.py --check on N ranks (N >= 2; its mesh must divide the model's heads: N in 2, 4).
#
# Prints one line per check and "gpu_check: N failed" at the end; exits non-zero when something failed.
set -uo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
py="${PYTHON:-python}"
export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}"

device=cuda
if [[ "${1:-}" == "--cpu" ]]; then
    device=cpu
    nproc="${2:-2}"
else
    nproc="$("$py" -c 'import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)')"
    if [[ "$nproc" == 0 ]]; then
        echo "gpu_check: no GPU here (torch.cuda.is_available() is False); scripts/gpu_check.sh --cpu N tries the script on gloo" >&2
        exit 2
    fi
fi
failed=0
step() { echo; echo "== $*"; }
run() { "$@" || { echo "gpu_check: FAILED: $*"; failed=$((failed + 1)); }; }

step "1. device tests (pytest)"
if [[ "$device" == cuda ]]; then
    run "$py" -m pytest -q -p no:cacheprovider tests/runtime/test_devices.py tests/runtime/test_cuda_review.py
else
    run "$py" -m pytest -q -p no:cacheprovider -m "not gloo" tests/runtime/test_cuda_review.py
fi

work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
cat > "$work/ranks.py" <<'PY'
"""Per-rank checks under torchrun (device from SBP_CHECK_DEVICE, checkpoint directory SBP_CHECK_DIR)."""
import dataclasses
import os
import sys

import torch
import torch.distributed as dist

import sbp
from tests.support import conformance as conf

device_type = os.environ["SBP_CHECK_DEVICE"]
world = int(os.environ["WORLD_SIZE"])
mesh = sbp.init_mesh((world,), device_type=device_type, timeout=120)
dev = mesh.binding.device
rank = mesh.rank
failed = []


def check(what, ok, detail="", always=False):
    if rank == 0 or not ok or always:
        print(f"rank {rank}: {'ok  ' if ok else 'FAIL'} {what} {detail}".rstrip(), flush=True)
    if not ok:
        failed.append(what)


def attempt(what, fn):
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - report and go on with the other checks
        check(what, False, f"raised {type(e).__name__}: {e}")


def same_on_all(value):
    got = [None] * world
    dist.all_gather_object(got, value)
    return all(v == got[0] for v in got)


# conformance cases on this backend (1-D over all ranks, 2-D on 4)
def conformance():
    # the 1-D table (written for 4 ranks) on however many ranks there are; the 2x2 table on 4
    meshes = [(mesh, [dataclasses.replace(c, mesh_shape=(world,)) for c in conf.cases_1d(conf.FEW_VARIANTS)])]
    if world == 4:
        meshes.append((sbp.init_mesh((2, 2), device_type=device_type, timeout=120), conf.cases_2d()))
    for m, cases in meshes:
        for case in cases:
            mine = conf.run_case(case, m, device=str(dev))
            per_rank = [None] * world
            dist.all_gather_object(per_rank, mine)
            try:
                conf.check_case(case, per_rank)
                ok, detail = True, ""
            except AssertionError as e:
                ok, detail = False, str(e)[:300]
            check(f"conformance {case.id}", ok, detail)


attempt("conformance", conformance)


# every dtype sbp allows, through moves and reductions
def dtypes():
    for name in ("float32", "float64", "float16", "bfloat16", "int64", "int32", "int16", "int8", "uint8", "bool",
                 "complex64", "complex128"):
        dtype = getattr(torch, name)
        full = ((torch.arange(6 * world * 4).view(6 * world, 4) % 7) - 3)
        full = (full != 0) if dtype == torch.bool else full.to(dtype) * ((1 + 2j) if dtype.is_complex else 1)
        full = full.to(dev)
        x = sbp.distribute(full, mesh, "S(0)")
        check(f"{name} S(0)->B (all_gather)", torch.equal(x.redistribute("B").to_local(), full))
        check(f"{name} S(0)->S(1) (all_to_all)", torch.equal(x.redistribute("S(1)").full(), full))
        if dtype != torch.bool and dtype != torch.uint8:
            p = sbp.distribute(full, mesh, "P(sum)")
            check(f"{name} P(sum)->S(0) (reduce_scatter)", torch.equal(p.redistribute("S(0)").full(), full))
            check(f"{name} P(sum)->B (all_reduce)", torch.equal(p.redistribute("B").to_local(), full))
        if not dtype.is_complex and dtype != torch.bool:
            p = sbp.distribute(full, mesh, "P(max)")
            check(f"{name} P(max)->B (all_reduce)", torch.equal(p.redistribute("B").to_local(), full))


attempt("dtypes", dtypes)


# random draws with a generator on the mesh's device
def generators():
    g = torch.Generator(device=dev).manual_seed(1234 + rank)   # ranks' generators differ: the seed is agreed
    r = sbp.rand((8 * world, 3), mesh, "S(0)", generator=g)
    check("sbp.rand(generator=<device generator>) agrees across ranks", same_on_all(r.full().cpu().tolist()))
    w = sbp.distribute(torch.zeros(8 * world, 3, device=dev), mesh, "S(0)")
    torch.nn.init.normal_(w, generator=g)
    check("normal_(generator=<device generator>) agrees across ranks", same_on_all(w.full().cpu().tolist()))


attempt("generators", generators)


# a compiled tensor-parallel step (torch.compile of a Colwise -> Rowwise MLP)
def compiled_step():
    import sbp.nn
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 16)).to(dev)
    ref = [p.detach().clone() for p in model.parameters()]
    sbp.nn.parallelize(model, mesh, {"0": sbp.nn.Colwise(), "2": sbp.nn.Rowwise()})
    step = torch.compile(lambda x: model(x).square().sum())
    x = torch.randn(4, 16, device=dev, generator=torch.Generator(device=dev).manual_seed(0))
    loss = step(x)
    plain = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 16)).to(dev)
    with torch.no_grad():
        for p, v in zip(plain.parameters(), ref):
            p.copy_(v)
    want = plain(x).square().sum()
    got = loss.full() if hasattr(loss, "full") else loss
    check("compiled TP step matches one device", torch.allclose(got, want, rtol=1e-4, atol=1e-4),
          f"{float(got):.6f} vs {float(want):.6f}")


attempt("compiled TP step", compiled_step)


# from_local of a Split without global_shape, compiled: even shards checked in the graph (read on the host)
def compiled_from_local():
    f = torch.compile(lambda t: sbp.from_local(t, mesh, "S(0)") * 2, fullgraph=True)
    got = f(torch.ones(4, 3, device=dev))
    check("compiled from_local infers even shards", tuple(got.shape) == (4 * world, 3), str(tuple(got.shape)))
    if world > 1:
        try:
            f(torch.ones(3 if rank == 0 else 2, 3, device=dev))
            told = "no error"
        except RuntimeError as e:
            told = "global_shape=" in str(e) or str(e)[:200]
        check("compiled from_local refuses uneven shards with a clear error", told is True, str(told))
        check("the device still works after it", float(torch.ones(2, device=dev).sum()) == 2.0)


attempt("compiled from_local", compiled_from_local)


# save / load, the closing barrier included (every rank reads metadata.json right after save returns)
def checkpoint():
    path = os.environ["SBP_CHECK_DIR"]
    full = torch.arange(6 * world * 2, dtype=torch.float32, device=dev).view(6 * world, 2)
    sbp.save({"x": sbp.distribute(full, mesh, "S(0)"), "step": 3}, path)
    check("metadata.json is there when save returns", os.path.exists(os.path.join(path, "metadata.json")))
    state = {"x": sbp.zeros(tuple(full.shape), mesh, "S(1)"), "step": 0}
    sbp.load(path, state)
    check("save / load reshards S(0) -> S(1)", torch.equal(state["x"].full(), full) and state["step"] == 3)


attempt("checkpoint", checkpoint)


# a cross-mesh move between two halves of the world, with its debug check (every rank binds both meshes)
def cross_mesh():
    half = world // 2
    a = mesh.binding.bind(sbp.DeviceMesh((half,), ranks=list(range(half))))
    b = mesh.binding.bind(sbp.DeviceMesh((world - half,), ranks=list(range(half, world))))
    full = torch.arange(4 * world * 3, dtype=torch.float32, device=dev).view(4 * world, 3)
    x = sbp.distribute(full, a, "S(0)")
    with sbp.debug():
        y = x.redistribute("S(1)", mesh=b)
    if b.coord is not None:
        check("cross-mesh move S(0) on ranks [0, half) -> S(1) on the others", torch.equal(y.full(), full),
              always=b.coord == (0,))


if world >= 2:
    attempt("cross-mesh", cross_mesh)

dist.barrier()
print(f"rank {rank}: {len(failed)} failed", flush=True)
dist.destroy_process_group()
sys.exit(1 if failed else 0)
PY

step "2. torchrun --nproc-per-node $nproc: per-rank checks on $([[ $device == cuda ]] && echo NCCL || echo gloo)"
run env SBP_CHECK_DEVICE="$device" SBP_CHECK_DIR="$work/ckpt" "$py" -m torch.distributed.run --standalone \
    --nproc-per-node "$nproc" "$work/ranks.py"

if (( nproc >= 2 )); then
    step "3. examples/train_tp.py --check on $nproc ranks"
    if [[ "$device" == cuda ]]; then
        run "$py" -m torch.distributed.run --standalone --nproc-per-node "$nproc" examples/train_tp.py --mesh "$nproc" --check --device "$device"
    else
        run "$py" examples/train_tp.py --mesh "$nproc" --check --steps 3
    fi
fi

echo
echo "gpu_check: $failed failed"
(( failed == 0 ))
