"""Shared fixtures: tiny teachers, a task recorder, a Luigi runner."""
from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import luigi
import pytest

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
if os.environ.get("PYTEST_XDIST_WORKER"):  # two workers on two cores: one thread each, else OpenMP's spinning
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # threads slow a test up to 9x (set before torch is imported)

RAN: list[luigi.Task] = []


def pytest_collection_modifyitems(config, items):
    """Run the suite in parallel without building a shared fixture twice: under pytest-xdist
    (README's test command: ``-n 2 --dist loadgroup``) the tests that share a module- or
    session-scoped fixture of this suite (a smoke run, a built graph, a Slurm cluster), directly or
    through another test that shares one with them, get one ``xdist_group`` and so one worker. Derived
    from each test's fixtures, so a fixture added tomorrow is grouped the day it lands."""
    parent: dict[str, str] = {}

    def find(k: str) -> str:
        while parent.setdefault(k, k) != k:
            k = parent[k]
        return k

    keys = {}
    for item in items:
        info = getattr(item, "_fixtureinfo", None)
        shared = [f"{d.baseid}::{name}" for name, defs in (info.name2fixturedefs.items() if info else ())
                  for d in defs[-1:] if d.scope in ("module", "package", "session") and d.baseid.startswith("tests")]
        keys[item.nodeid] = shared
        for k in shared[1:]:
            parent[find(k)] = find(shared[0])
    for item in items:
        if keys[item.nodeid]:
            item.add_marker(pytest.mark.xdist_group(find(keys[item.nodeid][0]).replace("/", ".")))


@luigi.Task.event_handler(luigi.Event.START)
def _record_start(task):
    RAN.append(task)


@pytest.fixture
def run_graph():
    """Run tasks with the local scheduler; return ``(ok, [(family, label), ...] that ran)``."""
    def run(*tasks, workers: int = 1):
        RAN.clear()
        res = luigi.build(list(tasks), local_scheduler=True, workers=workers, log_level="WARNING", detailed_summary=True)
        ran = [(t.get_task_family(), t.label() if hasattr(t, "label") else "wrapper") for t in RAN]
        return res.scheduling_succeeded and "failed" not in res.summary_text.lower().split("this progress looks")[0], ran
    return run


def tiny_cfg(teacher: str = "tiny-llama", **over) -> str:
    """An override string for a seconds-long experiment on a tiny teacher."""
    base = {"teacher": teacher, "corpus.seq_len": 32, "corpus.max_tokens": 3072, "boundary.num_blocks": 2,
            "train.n_layers": 1, "train.max_steps": 6, "train.lr": 1e-3, "train.checkpoint_every": 2,
            "eval.context_window": 8, "eval.context_sequences": 2,
            # no out-of-domain text unless a test asks: on the `luigi` command line `--preset ""` resolves to
            # the default preset (Luigi reads an empty value as unset), whose eval.extra would add PrepareHeldOut
            "eval.extra": "[]"}
    base.update(over)
    return " ".join(f"{k}={v}" for k, v in base.items())


def kill_at_first_checkpoint(cmd: list[str], cwd: Path, env: dict, pattern: Path, timeout_s: float = 120.0) -> None:
    """Start ``cmd`` and SIGKILL it as soon as a file matching the glob ``pattern`` (e.g.
    ``out / "TrainBlock/*.partial/checkpoint.pt"``) appears. Fails the test if the run ended first."""
    proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    root, glob = Path(pattern.anchor), str(pattern.relative_to(pattern.anchor))
    deadline, found = time.time() + timeout_s, []
    while time.time() < deadline and proc.poll() is None:
        found = list(root.glob(glob))
        if found:
            break
        time.sleep(0.02)
    assert found, "no checkpoint appeared before the run ended"
    proc.send_signal(signal.SIGKILL)
    proc.wait()


@pytest.fixture(scope="session")
def smoke_run(tmp_path_factory):
    """``smoke_run(preset) -> outputs folder``: every smoke preset (``tiny``, ``*_tiny``) built once per
    test session by the workflow that owns it (workflows/registry.py), each in a folder of its own,
    shared by every contract that reads a tiny run (the workflow, report and golden-digest contracts).
    Readers only: a test that damages or changes outputs copies the folder first."""
    from tests.workflow_checks import run_tiny
    from workflows import registry

    done: dict[str, Path] = {}

    def get(preset: str) -> Path:
        if preset not in done:
            wf = registry.owner(preset)
            assert wf is not None, f"no registered workflow owns the preset {preset!r}"
            out = tmp_path_factory.mktemp(f"smoke-{preset}") / "o"
            problems = run_tiny(wf, out, preset)
            assert not problems, problems
            done[preset] = out
        return done[preset]
    return get

