"""`zerograph slurm` against a real Slurm: a one-node cluster on this machine
(scripts/slurm_local.sh, which installs Debian's slurm-wlm and munge when they are missing and it
runs as root). Skipped, with the reason, where that cluster cannot start.

The launches run the tiny preset with two worker jobs of one CPU each (the machine's two CPUs)."""
from __future__ import annotations

import configparser
import json
import os
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "slurm_local.sh"
DOC = ROOT / "docs" / "slurm.md"
SHARED = "/shared/zerograph/outputs"  # the guide's outputs folder, replaced by a temporary one
LAUNCH = ["slurm", "RunExperiment", "--workers", "2", "--cpus-per-worker", "1", "--partition", "cpu",
          "--time", "00:20:00", "--poll", "1", "--preset", "tiny"]
TIMINGS: dict[str, float] = {}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """The environment of a started one-node cluster (``SLURM_CONF`` set); stopped afterwards."""
    folder = tmp_path_factory.mktemp("slurm")
    t0 = time.monotonic()
    try:
        r = subprocess.run(["bash", str(SCRIPT), "start", str(folder)], capture_output=True, text=True, timeout=600)
    except subprocess.TimeoutExpired:
        pytest.skip("Slurm did not start within 10 minutes")
    if r.returncode != 0:
        why = (r.stderr.strip().splitlines() or [f"exit {r.returncode}"])[-1]
        pytest.skip(f"Slurm cannot start on this machine: {why}")
    TIMINGS["cluster start (install included)"] = time.monotonic() - t0
    env = {**os.environ, "SLURM_CONF": str(folder / "slurm.conf"), "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1",
           "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
    env.pop("LUIGI_CONFIG_PATH", None)
    try:
        yield env
    finally:
        subprocess.run(["bash", str(SCRIPT), "stop", str(folder)], capture_output=True, timeout=120)
        print("\ntest_slurm timings (s):", json.dumps({k: round(v, 1) for k, v in TIMINGS.items()}))


@pytest.fixture(autouse=True)
def no_stray_luigid(tmp_path):
    """Stop any luigid a failing test left running in its folder (the launcher stops its own)."""
    yield
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            cmd = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if "luigid" in cmd and str(tmp_path) in cmd:
            os.kill(int(proc.name), 15)


def zg(args: list[str], env: dict):
    """Run ``zerograph ARGS`` in this process (typer's runner: no second torch import) with ``env``
    as the environment; the result has ``returncode``, ``stdout`` and ``stderr``."""
    from typer.testing import CliRunner

    from workflows.cli import app

    r = CliRunner().invoke(app, args, env={**{k: None for k in os.environ}, **env}, catch_exceptions=False)
    r.returncode = r.exit_code
    return r


def squeue(env: dict) -> list[str]:
    return subprocess.run(["squeue", "-h", "-o", "%i %T"], env=env, capture_output=True, text=True).stdout.split("\n")[:-1]


def doc_commands() -> list[list[str]]:
    """Every `.venv/bin/zerograph slurm` command of docs/slurm.md's bash blocks, in order."""
    cmds = []
    for block in re.findall(r"```bash\n(.*?)```", DOC.read_text(), re.S):
        for line in block.replace("\\\n", " ").splitlines():
            if line.startswith(".venv/bin/zerograph slurm"):
                cmds.append(shlex.split(line, comments=True))
    return cmds


def dependent_job_runs(job: str, marker: Path, env: dict, timeout_s: float = 300) -> bool:
    """Submit a job with ``--dependency=afterok:<job>`` that creates ``marker``; wait for it. True
    when it ran (Slurm starts it only if ``job`` ended COMPLETED)."""
    r = subprocess.run(["sbatch", "--parsable", f"--dependency=afterok:{job}", "--kill-on-invalid-dep=yes",
                        f"--output={marker}.log", "--time=00:02:00", "--wrap", f"touch {marker}"],
                       env=env, capture_output=True, text=True, check=True)
    dep, deadline = r.stdout.strip().split(";")[0], time.time() + timeout_s
    while any(line.split()[0] == dep for line in squeue(env) if line.strip()) and time.time() < deadline:
        time.sleep(0.5)
    return marker.exists()


def worker_logs(outputs: Path) -> dict[str, str]:
    """Each worker job's log text by job id (``<array>_<index>``)."""
    return {p.stem.removeprefix("worker-"): p.read_text() for p in sorted(outputs.glob("slurm/*/logs/worker-*.log"))}


def ran_by(graph, logs: dict[str, str]) -> dict[str, list[str]]:
    """For each task of ``graph`` (task id -> task), the logs of the workers that ran it: each task a
    worker runs prints its own lines, ``[<Family> <label>] ...`` (:meth:`tasks.base.ZGTask.log`;
    Luigi's INFO lines are off by default)."""
    titles = [t.title() for t in graph]
    assert len(set(titles)) == len(titles), "two tasks of the graph share a title"
    return {t.task_id: [k for k, text in logs.items()
                        if any(line.startswith(f"[{t.title()}] ") for line in text.splitlines())] for t in graph}


def test_the_guide_commands_work_on_the_test_cluster(cluster, tmp_path):
    """docs/slurm.md's commands as written, on the tiny preset: launch (waits, exit 0, prints the
    report), status (0), cancel (nothing left to cancel); the GPU launch is checked with --dry-run
    (the test cluster has no GPUs) and its status finds no launch of that experiment (exit 2)."""
    out = tmp_path / "shared"
    cmds = doc_commands()
    assert len(cmds) >= 5 and any("--gpus-per-worker" in c for c in cmds)
    t0 = time.monotonic()
    for cmd in cmds:
        args = [a.replace(SHARED, str(out)) for a in cmd[1:]]
        args += [] if "--preset" in args else ["--preset", "tiny"]
        gpus = int(args[args.index("--gpus-per-worker") + 1]) if "--gpus-per-worker" in args else 0
        sub = args[1]
        if gpus and sub not in ("status", "cancel"):
            r = zg([*args, "--dry-run"], cluster)
            assert r.returncode == 0, r.stderr
            assert "#SBATCH --gres=gpu:1" in r.stdout and "#SBATCH --array=0-3" in r.stdout
            assert "#SBATCH --cpus-per-task=8" in r.stdout and "#SBATCH --mem=64G" in r.stdout
            assert "--set device=cuda" in r.stdout and "--no-lock --workers 1" in r.stdout
            assert not (out / "slurm").exists() or not any((out / "slurm").glob("*cuda*"))
            continue
        r = zg(args, cluster)
        if gpus:
            assert r.returncode == 2 and "was never launched" in r.stderr, (args, r.stdout, r.stderr)
        elif sub == "status":
            assert r.returncode == 0 and "complete: every task is done" in r.stdout, (args, r.stdout, r.stderr)
        elif sub == "cancel":
            assert r.returncode == 0 and "no job pending or running" in r.stdout, (args, r.stdout, r.stderr)
            assert not squeue(cluster)
        else:
            assert r.returncode == 0, (args, r.stdout[-3000:], r.stderr[-3000:])
            report = Path(re.search(r"^report: (.*)$", r.stdout, re.M)[1])
            assert report.is_file() and report.read_text().startswith("# ZeroGraph report — tiny")
            # every worker job of a complete run ends COMPLETED (exit 0), so afterok chains work
            assert re.search(r"job \d+_0: COMPLETED exit 0", r.stdout) and re.search(r"job \d+_1: COMPLETED exit 0", r.stdout), r.stdout
            assert "pre-flight: " in r.stdout and "reaches luigid" in r.stdout
            array = re.search(r"submitted job array (\d+)", r.stdout)[1]
            assert dependent_job_runs(array, tmp_path / f"after-{array}", cluster)
    TIMINGS["guide commands"] = time.monotonic() - t0


# long enough blocks (several seconds: longer than a waiting worker's 0.5-1.5 s poll) that the two
# workers must share them
SPREAD = "train.max_steps=1000 train.checkpoint_every=250"


def _without_timings(x):
    """A report.json with its timings, memory peaks and paths left out: what must equal bytewise."""
    if isinstance(x, dict):
        return {k: _without_timings(v) for k, v in x.items()
                if not re.search(r"seconds|rss|_dir|path|finished|break_even|saving|method|mfu|flops_per_second|peak", k)}
    if isinstance(x, list):
        return [_without_timings(v) for v in x]
    return x


def test_two_worker_jobs_share_the_work_once_each_and_match_a_local_run(cluster, tmp_path):
    from workflows import RunExperiment
    from workflows.slurm_graph import walk_all

    out, ref = tmp_path / "shared", tmp_path / "local"
    t0 = time.monotonic()
    r = zg([*LAUNCH, "--set", SPREAD, "--outputs", str(out)], cluster)
    TIMINGS["two-job launch"] = time.monotonic() - t0
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]

    logs = worker_logs(out)
    assert len(logs) == 2, list(logs)
    for job, text in logs.items():  # both jobs ran a worker against luigid
        assert "zerograph worker: job" in text and "luigi exited" in text, job
    prepare = {"prepare": next(out.glob("slurm/*/logs/prepare.log")).read_text()}
    graph = walk_all(RunExperiment(preset="tiny", set=SPREAD, outputs=str(out)))
    by = ran_by(graph, {**logs, **prepare})
    assert not any(" failed    " in text for text in logs.values())
    for t in graph:  # every task ran exactly once, on one worker job (teacher and corpus: on this host)
        assert len(by[t.task_id]) == 1, (t.task_id, by[t.task_id])
        expected_here = t.get_task_family() in ("PrepareTeacher", "PrepareCorpus")
        assert (by[t.task_id] == ["prepare"]) == expected_here, (t.task_id, by[t.task_id])
    work = {t.task_id: by[t.task_id][0] for t in graph if t.get_task_family() in ("BoundaryShard", "TrainBlock")}
    blocks = sorted(job for tid, job in work.items() if tid.startswith("TrainBlock_"))
    shards = sorted(job for tid, job in work.items() if tid.startswith("BoundaryShard_"))
    assert len(blocks) == 2 and len(set(blocks)) == 2, blocks  # one block on each job
    assert len(shards) == 2 and set(shards) <= set(logs), shards
    assert set(blocks) | set(shards) == set(logs)

    t0 = time.monotonic()
    local = subprocess.run([sys.executable, "-m", "luigi", "--module", "workflows", "RunExperiment", "--local-scheduler",
                            "--preset", "tiny", "--set", SPREAD, "--outputs", str(ref)], cwd=ROOT, env=cluster,
                           capture_output=True, text=True, timeout=600)
    TIMINGS["local reference run"] = time.monotonic() - t0
    assert local.returncode == 0, local.stderr[-3000:]
    for pattern in ("TrainBlock/*/block.safetensors", "Assemble/*/model/model.safetensors"):
        a, b = sorted(out.glob(pattern)), sorted(ref.glob(pattern))
        assert len(a) == len(b) >= 1 and [p.relative_to(out) for p in a] == [p.relative_to(ref) for p in b]
        for x, y in zip(a, b):
            assert x.read_bytes() == y.read_bytes(), x
    for pattern in ("BoundaryShard/*/shard.json",):  # each shard file's SHA-256
        for x in sorted(out.glob(pattern)):
            files = lambda p: {k: v["sha256"] for k, v in json.loads(p.read_text())["files"].items()}  # noqa: E731
            assert files(x) == files(ref / x.relative_to(out))
    (rep,), (rep_ref,) = list(out.glob("Evaluate/*/report.json")), list(ref.glob("Evaluate/*/report.json"))
    assert rep.relative_to(out) == rep_ref.relative_to(ref)
    a, b = (_without_timings(json.loads(p.read_text())) for p in (rep, rep_ref))
    assert a == b and a["cross_entropy"]["student"] > 0


def test_a_cancelled_worker_job_is_replaced_by_the_other_which_ends_completed(cluster, tmp_path):
    """scancel the job training block 0 (Slurm's SIGTERM, then SIGKILL) after its first checkpoint:
    luigid fails the lost worker's task (worker_disconnect_delay: 5 s in this test's luigi.cfg,
    Luigi's default 60 s) and the other job takes it over, resumes it from its checkpoint,
    completes the experiment and ends COMPLETED (exit 0); a job submitted with
    --dependency=afterok on it runs; status exits 0 and a relaunch submits nothing."""
    parser = configparser.ConfigParser()
    parser.read(ROOT / "luigi.cfg")
    parser["scheduler"]["worker_disconnect_delay"] = "5"
    cfg = tmp_path / "luigi.cfg"
    with open(cfg, "w") as f:
        parser.write(f)
    env = {**cluster, "LUIGI_CONFIG_PATH": str(cfg)}
    out = tmp_path / "shared"
    opts = ["--set", "train.max_steps=1200 train.checkpoint_every=100", "--outputs", str(out)]
    t0 = time.monotonic()
    r = zg([*LAUNCH, *opts, "--detach"], env)
    assert r.returncode == 0 and "submitted job array" in r.stdout, r.stdout + r.stderr
    array = re.search(r"submitted job array (\d+)", r.stdout)[1]

    victim, deadline = None, time.time() + 300
    while victim is None and time.time() < deadline:
        if list(out.glob("TrainBlock/block0-*.partial/checkpoint.pt")):
            victim = next((job for job, text in worker_logs(out).items()
                           if re.search(r"^TrainBlock block0-\S+: training ", text, re.M)), None)
        time.sleep(0.1)
    assert victim is not None, "block 0 never wrote a checkpoint"
    survivor = f"{array}_{1 - int(victim.split('_')[1])}"
    marker = tmp_path / "after-survivor"
    dep = subprocess.run(["sbatch", "--parsable", f"--dependency=afterok:{survivor}", "--kill-on-invalid-dep=yes",
                          f"--output={marker}.log", "--time=00:02:00", "--wrap", f"touch {marker}"],
                         env=env, capture_output=True, text=True, check=True)
    subprocess.run(["scancel", victim], env=env, check=True)
    deadline = time.time() + 600
    while squeue(env) and time.time() < deadline:  # the array and the dependent job
        time.sleep(0.5)
    assert not squeue(env), squeue(env)
    TIMINGS["cancel, take over and complete"] = time.monotonic() - t0

    st = zg(["slurm", "status", "--preset", "tiny", *opts], env)
    assert st.returncode == 0 and "complete: every task is done" in st.stdout, st.stdout + st.stderr
    assert f"job {victim}: CANCELLED" in st.stdout and f"job {survivor}: COMPLETED exit 0" in st.stdout, st.stdout
    text = worker_logs(out)[survivor]
    assert "resumed from step" in text and "[TrainBlock block0-" in text  # it took block 0 over
    assert marker.exists(), dep.stdout  # afterok on the surviving job: it ran
    done = zg([*LAUNCH, *opts], env)
    assert done.returncode == 0 and "already complete, nothing submitted" in done.stdout


def test_a_node_that_cannot_see_the_outputs_or_reach_luigid_fails_before_submission(cluster, tmp_path, monkeypatch):
    """The pre-flight probe (srun on the partition) before the array is submitted: an outputs folder
    the node does not see (a tmpfs mounted only in the launcher's own mount namespace, unshare -m)
    and a luigid port nothing answers on each fail in one line, exit 2, nothing submitted."""
    before = squeue(cluster)
    hidden = tmp_path / "hidden"
    hidden.mkdir()
    zerograph = Path(sys.executable).parent / "zerograph"
    launch = shlex.join([str(zerograph), *LAUNCH, "--outputs", str(hidden)])
    r = subprocess.run(["unshare", "-m", "--propagation", "private", "bash", "-c",
                        f"mount -t tmpfs tmpfs {shlex.quote(str(hidden))} && exec {launch}"],
                       env=cluster, capture_output=True, text=True, timeout=600, check=False)
    if r.returncode != 2 and "mount" in r.stderr and "permission" in r.stderr.lower():
        pytest.skip(f"no private mounts here: {r.stderr.strip()}")
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1, (r.stdout, r.stderr)
    assert lines[0].startswith("error: pre-flight") and "does not see the outputs folder" in lines[0], lines
    assert "submitted" not in r.stdout and not list(hidden.iterdir())  # the node's view: nothing there

    from workflows import slurm

    monkeypatch.setattr(slurm, "start_luigid", lambda folder, port, cfg: 2 ** 22 + 1)  # nothing listens on the port
    out = tmp_path / "shared"
    r = zg([*LAUNCH, "--outputs", str(out)], cluster)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1 and "cannot connect to luigid" in lines[0], (r.stdout, r.stderr)
    assert squeue(cluster) == before
    assert all(not la.get("array_job") for la in json.loads(next(out.glob("slurm/*/launch.json")).read_text())["launches"])


def test_bad_launches_fail_in_one_line_before_anything_is_submitted(cluster, tmp_path, monkeypatch):
    out = tmp_path / "shared"
    before = squeue(cluster)
    cases = {
        "not on PATH": ([*LAUNCH, "--outputs", str(out)], {"PATH": str(Path(sys.executable).parent)}),
        "absolute path": ([*LAUNCH, "--outputs", "relative/outputs"], {}),
        "no partition 'nope'": ([*LAUNCH, "--partition", "nope", "--outputs", str(out)], {}),
        "sbatch refused the job": ([*LAUNCH, "--gpus-per-worker", "1", "--outputs", str(out)], {}),
        "Invalid --time": ([*LAUNCH, "--time", "soon", "--outputs", str(out)], {}),
    }
    for what, (args, env) in cases.items():
        r = zg(args, {**cluster, **env})
        assert r.returncode == 2, (what, r.stdout, r.stderr)
        lines = r.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: ") and what in lines[0], (what, r.stderr)
    assert squeue(cluster) == before and not list(out.glob("slurm/*/launch.json"))

    # outputs on a node-local folder while the partition has other nodes than this one
    from typer.testing import CliRunner

    from workflows import slurm
    from workflows.cli import app
    from workflows.slurm_cluster import local_folder_reason

    monkeypatch.setenv("SLURM_CONF", cluster["SLURM_CONF"])
    monkeypatch.setattr(slurm, "partition_nodes", lambda p: ["node01", "node02"])
    r = CliRunner().invoke(app, [*LAUNCH, "--outputs", str(out)])
    assert r.exit_code == 2 and "is not shared by the nodes of the partition" in r.output, r.output
    assert local_folder_reason(Path("/tmp/x/y")) and local_folder_reason(Path("/dev/shm/z"))
    assert squeue(cluster) == before


def test_a_job_runs_one_worker_per_gpu_slurm_gave_it_with_its_share_of_the_cpus(tmp_path):
    """The generated job script, run by bash with the environment Slurm gives a job (no cluster
    needed): one luigi worker per device in CUDA_VISIBLE_DEVICES, each seeing only its own, with
    the job's CPUs split between them; one worker with every CPU on a CPU job; exit 2 with one line
    on a node that does not see the outputs folder."""
    from workflows.slurm_cluster import worker_script

    def run(gpus: int, env: dict, seen: bool = True):
        folder = tmp_path / f"g{gpus}"
        folder.mkdir(exist_ok=True)
        if seen:
            (folder / "launch.json").write_text("{}")
        script = worker_script(folder, "RunExperiment", ["--outputs", str(tmp_path), "--set", "device=cuda"], workers=4,
                               gpus=gpus, cpus=8, partition="gpu", time_limit="04:00:00", mem="64G",
                               sched_host="login1", sched_port=8082, name="zg-x", extra=["--account=abc"])
        luigi_line = re.compile(r"^  \S+ -m luigi --module workflows RunExperiment --scheduler-host login1 "
                                r"--scheduler-port 8082 --no-lock --workers 1 --outputs \S+ --set device=cuda &$", re.M)
        assert len(luigi_line.findall(script)) == 1
        fake = luigi_line.sub('  echo "worker ${CUDA_VISIBLE_DEVICES:-} $OMP_NUM_THREADS" &', script)
        r = subprocess.run(["bash", "-c", fake], env={"PATH": os.environ["PATH"], **env}, capture_output=True, text=True)
        return script, r, sorted(line for line in r.stdout.splitlines() if line.startswith("worker"))

    script, r, workers = run(2, {"CUDA_VISIBLE_DEVICES": "3,5", "SLURM_CPUS_PER_TASK": "8"})
    for opt in ("--gres=gpu:2", "--array=0-3", "--cpus-per-task=8", "--mem=64G", "--partition=gpu", "--time=04:00:00",
                "--requeue", "--signal=B:USR1@90", "--account=abc"):
        assert f"#SBATCH {opt}\n" in script, opt
    assert r.returncode == 0 and workers == ["worker 3 4", "worker 5 4"], (r.stdout, r.stderr)
    _, r, workers = run(0, {"SLURM_CPUS_PER_TASK": "8"})
    assert r.returncode == 0 and workers == ["worker  8"], (r.stdout, r.stderr)
    _, r, workers = run(1, {"SLURM_CPUS_PER_TASK": "8"}, seen=False)
    assert r.returncode == 2 and not workers and r.stderr.count("\n") == 1 and "does not see" in r.stderr
    # the first command that fails stops the job, with a line in its log saying which
    script, _, _ = run(0, {"SLURM_CPUS_PER_TASK": "8"})
    broken = script.replace(f"cd {shlex.quote(str(ROOT))}", "cd /nonexistent/repository", 1)
    r = subprocess.run(["bash", "-c", broken], env={"PATH": os.environ["PATH"]}, capture_output=True, text=True)
    assert r.returncode != 0 and "zerograph worker: job" not in r.stdout, r.stdout
    assert re.search(r"error: zerograph worker on \S+: line \d+: cd /nonexistent/repository failed", r.stderr), r.stderr
