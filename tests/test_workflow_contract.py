"""Every registered workflow (workflows/registry.py), on its tiny preset, meets one contract
(tests/workflow_checks.py): it runs; `zerograph status` lists that workflow's own tasks, all done;
`zerograph report` prints its report; `zerograph verify` checks every output of its graph, and the
count is asserted. The same run's outputs are compared with the digests recorded in tests/golden/
(scripts/golden.py). A deliberately broken workflow fails the contract by name."""
from __future__ import annotations

import json

import pytest

import workflows
from scripts import golden
from tests.workflow_checks import check_workflow
from workflows import registry
from workflows.cli import all_tasks, root_tasks
from workflows.experiment import RunExperiment


@pytest.fixture
def built(smoke_run):
    """``built(name)``: the outputs folder of the workflow's tiny run (conftest's ``smoke_run``: one
    run per session, shared with the report contract)."""
    return lambda name: smoke_run(registry.get(name).tiny)


@pytest.mark.parametrize("name", registry.names())
def test_every_workflow_meets_the_contract_on_its_tiny_preset(name, built):
    wf = registry.get(name)
    out = built(name)
    assert check_workflow(wf, out) == []
    graph = all_tasks(root_tasks("", [], wf.tiny, str(out), name))
    got = golden.digests(graph)
    assert any(k.endswith(".safetensors") for k in got), f"{name}: no weights among the digests {sorted(got)}"
    env = golden.environment_difference(wf.tiny)
    if env:  # the bytes are per library version: compared only where they were recorded (CI installs constraints.txt)
        pytest.skip(f"{name}: contract met; output bytes not compared, recorded under other library versions: "
                    + "; ".join(env) + " (install with -c constraints.txt)")
    vals = golden.value_difference(wf.tiny, golden.values(graph))
    assert not vals, (f"{name} ({wf.tiny}): recorded values moved beyond rtol {golden.RTOL} (tests/golden/{wf.tiny}.json); "
                      f"if the change is meant, record it with `{golden.COMMAND} --workflow {name}` and say why in the "
                      "commit:\n" + "\n".join(vals))
    if golden.machine_difference(wf.tiny):  # no recorded machine is of this kind: other kernels round float32 sums
        return  # otherwise, so the values are the check; on every recorded kind the bytes are compared below
    diff = golden.difference(wf.tiny, got)
    assert not diff, (f"{name} ({wf.tiny}): output bytes differ from tests/golden/{wf.tiny}.json; if the change is "
                      f"meant, record it with `{golden.COMMAND} --workflow {name}` and say why in the commit:\n"
                      + "\n".join(diff))


class BrokenStudy(RunExperiment):
    """A deliberately broken workflow: registered with a report file its graph never writes."""


def test_a_broken_workflow_fails_the_contract_by_name(built, monkeypatch):
    out = built("RunExperiment")  # reuses the tiny experiment's run: the broken workflow builds the same graph
    monkeypatch.setattr(workflows, "BrokenStudy", BrokenStudy, raising=False)
    try:
        wf = registry.register(registry.Workflow("BrokenStudy", ("tiny",), "tiny", "tiny", "experiment",
                                                 "nothing", "README.md", report="summary.md"))
        problems = check_workflow(wf, out)
    finally:
        registry.unregister("BrokenStudy")
    assert [p.split(":")[:2] for p in problems] == [["BrokenStudy", " tiny preset"], ["BrokenStudy", " report"]]
    assert "summary.md missing" in problems[1]


def test_library_tiny_status_report_and_verify_show_the_librarys_own_graph(built):
    from typer.testing import CliRunner

    from workflows.cli import app

    out = str(built("SelectStudent"))
    r = CliRunner().invoke(app, ["status", "--preset", "library_tiny", "--outputs", out], terminal_width=400)
    assert r.exit_code == 0 and "LibraryReport" in r.stdout and "missing" not in r.stdout
    r = CliRunner().invoke(app, ["report", "--preset", "library_tiny", "--outputs", out])
    assert r.exit_code == 0 and "LibraryReport" in str(root_tasks("", [], "library_tiny", out)[0].out_dir)
    assert r.stdout.strip() and "RunExperiment" not in r.stderr
    r = CliRunner().invoke(app, ["verify", "--preset", "library_tiny", "--outputs", out])
    graph = all_tasks(root_tasks("", [], "library_tiny", out))
    assert r.exit_code == 0 and f"of {len(graph)} output(s)" in r.stdout and "all whole" in r.stdout
    assert sum(t.get_task_family() == "TrainBlock" for t in graph) >= 6  # every candidate block of both partitions


def test_the_golden_digests_are_recorded_under_the_versions_constraints_txt_pins():
    # the suite installs constraints.txt (README's test command), so its bytes are compared in CI
    from workflows import registry as reg

    pins = golden.pinned()
    assert set(pins) == set(golden.LIBRARIES), f"constraints.txt pins {sorted(pins)}, not every one of {golden.LIBRARIES}"
    for name in reg.names():
        rec = json.loads(golden.golden_path(reg.get(name).tiny).read_text())
        assert rec.get("environment") == pins, (f"tests/golden/{reg.get(name).tiny}.json was recorded under "
                                                f"{rec.get('environment')}, constraints.txt pins {pins}: re-record with "
                                                f"`{golden.COMMAND}` in an environment installed with -c constraints.txt")


def test_golden_digests_name_each_changed_file_and_skip_timings(tmp_path, monkeypatch):
    monkeypatch.setattr(golden, "GOLDEN", tmp_path)
    assert golden.difference("x_tiny", {"a": "1"})[0].startswith("no recorded digests at")
    golden.write("x_tiny", {"TrainBlock b0/block.safetensors": "aa" * 32, "Evaluate report/report.json": "bb" * 32})
    got = {"TrainBlock b0/block.safetensors": "cc" * 32, "Evaluate report/report.json": "bb" * 32}
    assert golden.difference("x_tiny", got) == [f"TrainBlock b0/block.safetensors: recorded {'aa' * 6}, now {'cc' * 6}"]
    assert golden._numbers({"ce": 1.23456789, "seconds": 3.2, "train_s": 1.0, "peak_rss_mb": 9, "rows": [{"gap": 0.5}]}) \
        == {"ce": 1.23457, "rows.0.gap": 0.5}


def test_golden_values_hold_across_machines_within_tolerance_and_bytes_only_on_the_recording_one(tmp_path, monkeypatch):
    monkeypatch.setattr(golden, "GOLDEN", tmp_path)
    here = golden.machine()
    assert set(here) == {"arch", "vendor", "cpu_capability", "isa"}, here
    vals = {"Evaluate report/report.json": {"ce": 5.5635, "n": 13}, "TrainBlock b0/block.safetensors": {"l2": 12.5}}
    golden.write("x_tiny", {"TrainBlock b0/block.safetensors": "aa" * 32}, vals)
    assert golden.machine_difference("x_tiny") == []
    assert golden.value_difference("x_tiny", vals) == []
    drift = {"Evaluate report/report.json": {"ce": 5.5635 * (1 + golden.RTOL / 2), "n": 13},
             "TrainBlock b0/block.safetensors": {"l2": 12.5 * (1 - golden.RTOL / 2)}}
    assert golden.value_difference("x_tiny", drift) == []  # another machine's rounding
    moved = {"Evaluate report/report.json": {"ce": 5.60, "n": 12}, "TrainBlock b0/block.safetensors": {"l2": 12.5}}
    assert golden.value_difference("x_tiny", moved) == ["Evaluate report/report.json ce: recorded 5.5635, now 5.6",
                                                        "Evaluate report/report.json n: recorded 13, now 12"]
    assert golden.value_difference("x_tiny", {k: v for k, v in vals.items() if "report" in k}) == [
        "TrainBlock b0/block.safetensors: recorded, missing now"]
    nan = {**vals, "Evaluate report/report.json": {"ce": float("nan"), "n": 13}}
    golden.write("x_tiny", {"TrainBlock b0/block.safetensors": "aa" * 32}, nan)
    assert golden.value_difference("x_tiny", nan) == []  # a NaN recorded and a NaN now are the same value
    assert golden.value_difference("x_tiny", vals) == ["Evaluate report/report.json ce: recorded nan, now 5.5635"]
    rec = json.loads(golden.golden_path("x_tiny").read_text())
    rec["machine"]["cpu_capability"] = "OTHER"
    golden.golden_path("x_tiny").write_text(json.dumps(rec))
    assert golden.machine_difference("x_tiny") == [f"cpu_capability OTHER recorded, {here['cpu_capability']} here"]


def test_golden_bytes_are_compared_on_every_recorded_machine_kind(tmp_path, monkeypatch):
    monkeypatch.setattr(golden, "GOLDEN", tmp_path)
    intel = {"arch": "x86_64", "vendor": "GenuineIntel", "cpu_capability": "AVX512", "isa": "1" * 16}
    amd = {**intel, "vendor": "AuthenticAMD", "isa": "2" * 16}
    vals = {"TrainBlock b0/block.safetensors": {"w:l2": 12.5}}
    on = lambda m: monkeypatch.setattr(golden, "machine", lambda: dict(m))  # noqa: E731
    on(intel)
    golden.write("x_tiny", {"TrainBlock b0/block.safetensors": "11" * 32}, vals)
    on(amd)
    assert golden.machine_difference("x_tiny")  # not recorded on this kind yet: values only
    golden.write("x_tiny", {"TrainBlock b0/block.safetensors": "22" * 32}, vals)
    rec = json.loads(golden.golden_path("x_tiny").read_text())
    assert rec["machine"] == intel and rec["digests"] == {"TrainBlock b0/block.safetensors": "11" * 32}
    assert list(rec["other_machines"]) == [golden.machine_key(amd)] and rec["values"] == vals
    assert golden.machine_difference("x_tiny") == [] and golden.environment_difference("x_tiny") == []
    assert golden.difference("x_tiny", {"TrainBlock b0/block.safetensors": "22" * 32}) == []
    assert golden.difference("x_tiny", {"TrainBlock b0/block.safetensors": "33" * 32}) == [  # bytes moved on AMD
        f"TrainBlock b0/block.safetensors: recorded {'22' * 6}, now {'33' * 6}"]
    on(intel)
    assert golden.machine_difference("x_tiny") == []
    assert golden.difference("x_tiny", {"TrainBlock b0/block.safetensors": "11" * 32}) == []
    assert golden.difference("x_tiny", {"TrainBlock b0/block.safetensors": "22" * 32}) != []
    on(amd)  # a change of the code moves AMD's bytes: Intel's digests are the old code's and go
    golden.write("x_tiny", {"TrainBlock b0/block.safetensors": "44" * 32}, vals)
    rec = json.loads(golden.golden_path("x_tiny").read_text())
    assert rec["machine"] == amd and "other_machines" not in rec
    on(intel)
    assert golden.machine_difference("x_tiny")


def test_every_golden_file_records_its_machine_and_the_values_behind_each_digest():
    from workflows import registry as reg

    for name in reg.names():
        rec = json.loads(golden.golden_path(reg.get(name).tiny).read_text())
        assert set(rec.get("machine", {})) == set(golden.machine()), f"{reg.get(name).tiny}.json: no machine recorded"
        for key, other in rec.get("other_machines", {}).items():  # another kind's bytes of the same files
            assert key == golden.machine_key(other["machine"]) and set(other["digests"]) == set(rec["digests"]), key
        assert set(rec["values"]) == set(rec["digests"]), f"{reg.get(name).tiny}.json: values and digests name other files"
        for k, v in rec["values"].items():  # every weight tensor has its norm and its direction
            if k.endswith(".safetensors"):
                assert v and {n.rsplit(":", 1)[1] for n in v} == {"l2", "z"}, k


def test_a_tensors_recorded_direction_sees_a_transpose_a_sign_flip_and_a_small_tensor_but_not_rounding():
    import torch

    g = torch.Generator().manual_seed(0)
    w = torch.randn(16, 24, generator=g)
    base = golden.tensor_values("w", w)

    def moved(x):
        new = golden.tensor_values("w", x)
        return {k: (base[k], new[k]) for k in base if abs(new[k] - base[k]) > golden.ATOL + golden.RTOL * (
            max(abs(base[k]), 1.0) if k.endswith(":z") else abs(base[k]))}

    assert moved(w * (1 + 1e-6 * torch.randn(16, 24, generator=g))) == {}  # another machine's rounding
    assert set(moved(w.t().contiguous())) == {"w:z"}  # the same numbers, transposed: the norm cannot see it
    assert set(moved(-w)) == {"w:z"}
    assert set(moved(w.flip(0))) == {"w:z"}
    assert golden.tensor_values("w", torch.zeros(3)) == {"w:l2": 0.0, "w:z": 0.0}
