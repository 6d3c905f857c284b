"""`zerograph slurm` where no Slurm answers: the help lists every registered workflow, and
--dry-run prints the job script with placeholders for luigid. Neither needs a live cluster: the
dry run is given a slurm.conf whose controller port nothing listens on (tests/test_slurm.py runs
the launches against a real one-node cluster)."""
from __future__ import annotations

import os

from typer.testing import CliRunner

from workflows import registry
from workflows.cli import app

LAUNCH = ["slurm", "RunExperiment", "--workers", "2", "--cpus-per-worker", "1", "--partition", "cpu",
          "--time", "00:20:00", "--preset", "tiny"]


def test_slurm_help_lists_every_registered_workflow():
    for args in (["slurm", "--help"], ["slurm", "launch", "--help"]):
        r = CliRunner().invoke(app, args, terminal_width=400)
        assert r.exit_code == 0
        text = " ".join(r.stdout.split())
        missing = [n for n in registry.names() if n not in text]
        assert not missing, f"`zerograph {' '.join(args)}` omits {missing}"
    assert "SelectStudent" in registry.names()


def test_dry_run_prints_the_job_script_when_slurm_does_not_answer(tmp_path):
    conf = tmp_path / "slurm.conf"
    conf.write_text("ClusterName=offline\nSlurmctldHost=localhost\nSlurmctldPort=9\n"
                    "NodeName=localhost CPUs=1 State=UNKNOWN\nPartitionName=cpu Nodes=localhost Default=YES\n")
    env = {**{k: None for k in os.environ}, "PATH": os.environ.get("PATH", ""), "SLURM_CONF": str(conf),
           "HF_HUB_OFFLINE": "1", "PYTHONPATH": os.environ.get("PYTHONPATH", ""), "HOME": os.environ.get("HOME", "")}
    r = CliRunner().invoke(app, [*LAUNCH, "--outputs", str(tmp_path / "o"), "--dry-run"], env=env)
    assert r.exit_code == 0, r.output
    assert "#SBATCH --array=0-1" in r.stdout and "Slurm did not answer" in r.stdout, r.stdout
    assert "--scheduler-port LUIGID_PORT" in r.stdout and "set -Eeuo pipefail" in r.stdout
    assert not (tmp_path / "o").exists()
