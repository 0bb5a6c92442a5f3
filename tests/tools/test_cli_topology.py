"""`sbp plan --topology FILE|PRESET`: the CLI plans for modeled time, prints it, and rejects bad topologies
with one line naming the argument (exit 2)."""
from __future__ import annotations

import json

import sbp
from sbp.tools.cli import main

ARGS = ["plan", "--mesh", "2x4", "--shape", "64x64", "--src", "S(0),S(0)", "--dst", "S(1),B"]


def run(argv, capsys):
    rc = main(argv)
    out, err = capsys.readouterr()
    return rc, out, err


def test_preset_plans_for_time_and_prints_it(capsys):
    rc, out, err = run(ARGS + ["--topology", "dgx-h100", "--devices-per-host", "4"], capsys)
    expect = sbp.plan((64, 64), (2, 4), "S(0),S(0)", "S(1),B", topology=sbp.Topology.preset("dgx-h100", (2, 4), 4))
    assert rc == 0 and err == ""
    assert out.startswith(expect.explain()) and f"modeled time: {expect.time_us:.3f} us" in out
    assert "time=" in out.splitlines()[3]   # per step


def test_json_file_round_trips_and_changes_the_plan(tmp_path, capsys):
    slow = sbp.Topology((50.0, 50.0), (1.0, 1.0), name="lab")
    path = tmp_path / "lab.json"
    path.write_text(slow.to_json())
    rc, out, _ = run(ARGS + ["--topology", str(path), "--json"], capsys)
    data = json.loads(out)
    assert rc == 0 and sbp.Topology.from_dict(data["topology"]) == slow
    assert [s["kind"] for s in data["steps"]] == ["all_gather", "all_to_all"]
    rc, out, _ = run(ARGS + ["--json"], capsys)   # no topology: the bytes plan, no time
    assert [s["kind"] for s in json.loads(out)["steps"]] == ["transfer"] and "time_us" not in json.loads(out)


def test_json_file_with_a_call_cost_plans_one_call(tmp_path, capsys):
    # the same network with and without its cost per call (3 ms a call on this mesh's host, folded into the
    # rounds of the classic fit): the call cost makes the one-call exchange win, and the file keeps it
    folded = sbp.Topology((5500.0, 3500.0), (0.1, 0.1), exchange_us=(4000.0, 2000.0), name="folded")
    per_call = sbp.Topology((2500.0, 2500.0), (0.1, 0.1), exchange_us=(1000.0, 1000.0), call_us=(3000.0, 3000.0),
                            name="per-call")
    kinds = {}
    for t in (folded, per_call):
        path = tmp_path / f"{t.name}.json"
        path.write_text(t.to_json())
        rc, out, _ = run(ARGS + ["--topology", str(path), "--json"], capsys)
        data = json.loads(out)
        assert rc == 0 and sbp.Topology.from_dict(data["topology"]) == t
        kinds[t.name] = [s["kind"] for s in data["steps"]]
    assert kinds == {"folded": ["transfer", "all_to_all"], "per-call": ["transfer"]}   # two calls against one
    bad = tmp_path / "bad_call.json"
    bad.write_text('{"axes": [{"latency_us": 1, "bandwidth_gbps": 1, "call_us": -3}, '
                   '{"latency_us": 1, "bandwidth_gbps": 1, "call_us": 1}]}')
    rc, out, err = run(ARGS + ["--topology", str(bad)], capsys)
    assert rc == 2 and out == "" and err.count("\n") == 1 and "call_us" in err and "-3.0" in err


def test_a_topology_file_with_a_byte_order_mark_is_read(tmp_path, capsys):
    marked = tmp_path / "marked.json"
    marked.write_bytes(b"\xef\xbb\xbf" + sbp.Topology((3.0,) * 2, (4.0,) * 2).to_json().encode())
    rc, out, err = run(ARGS + ["--topology", str(marked)], capsys)
    assert rc == 0 and err == "" and "topology=custom" in out


def test_bad_topologies_exit_2_with_one_line(tmp_path, capsys):
    bad = tmp_path / "bad.json"
    bad.write_text('{"axes": [{"latency_us": -1, "bandwidth_gbps": 1}, {"latency_us": 1, "bandwidth_gbps": 1}]}')
    three = tmp_path / "three.json"
    three.write_text(sbp.Topology((1.0,) * 3, (1.0,) * 3).to_json())
    binary = tmp_path / "binary.json"
    binary.write_bytes(b"\xff\xfe{")
    huge = tmp_path / "huge.json"   # an int no float holds, a latency whose times overflow
    huge.write_text('{"axes": [{"latency_us": ' + "9" * 400 + ', "bandwidth_gbps": 1}, '
                    '{"latency_us": 1e306, "bandwidth_gbps": 1}]}')
    deep = tmp_path / "deep.json"
    deep.write_text("[" * 100_000 + "]" * 100_000)
    for value, words in [("no-such-preset", "neither a preset"), (str(bad), "latency_us"),
                         (str(three), "describes 3 mesh axes"), (str(binary), "not UTF-8"),
                         (str(huge), "finite numbers"), (str(deep), "JSON text"),
                         ("/dev/zero", "longer than 1048576 characters")]:   # (read to the end: a MemoryError)
        rc, out, err = run(ARGS + ["--topology", value], capsys)
        assert rc == 2 and out == "" and err.count("\n") == 1, err
        assert "--topology" in err or "topology" in err
        assert words in err and "Traceback" not in err
        assert err.startswith("sbp plan: error: argument --topology: "), err   # the file's axes too
