"""Helpers for talking to a central Luigi scheduler (``luigid``) on this host: start one on a
free loopback port and query its JSON API. Used by the scale-out test and the screenshot script."""
from __future__ import annotations

import configparser
import json
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]  # the repository root (this file is tests/luigid_util.py)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def api(port: int, method: str, data: dict | None = None) -> Any:
    """Call luigid's ``/api/<method>`` on 127.0.0.1 (e.g. ``task_list``, ``dep_graph``) and return
    its ``response``. Raises ``OSError`` when luigid does not answer (10 s timeout)."""
    q = "" if data is None else "?data=" + urllib.parse.quote(json.dumps(data))
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/api/{method}{q}", timeout=10) as r:
        return json.loads(r.read())["response"]


def start_luigid(folder: Path, port: int, timeout_s: float = 30.0,
                 scheduler: dict[str, str] | None = None) -> subprocess.Popen:
    """Start luigid on 127.0.0.1:``port`` with its state file, log folder and output in ``folder``,
    reading this repository's ``luigi.cfg`` (its ``[scheduler]`` section: a failed task is disabled
    at once, not retried), and wait until its API answers. The caller terminates the returned process.

    Args:
        scheduler: ``[scheduler]`` settings to change (e.g. ``{"worker_disconnect_delay": "5"}``);
            luigid then reads a copy of ``luigi.cfg`` written to ``folder`` with them.

    Raises:
        RuntimeError: luigid exited or did not answer within ``timeout_s`` seconds.
    """
    exe = shutil.which("luigid") or str(Path(sys.executable).parent / "luigid")
    (folder / "luigid-logs").mkdir(parents=True, exist_ok=True)
    cfg = ROOT / "luigi.cfg"
    if scheduler:
        parser = configparser.ConfigParser()
        parser.read(cfg)
        parser["scheduler"].update(scheduler)
        cfg = folder / "luigid.cfg"
        with open(cfg, "w") as f:
            parser.write(f)
    log = open(folder / "luigid.log", "w")
    proc = subprocess.Popen([exe, "--port", str(port), "--address", "127.0.0.1", "--state-path", str(folder / "state.pickle"),
                             "--logdir", str(folder / "luigid-logs")], stdout=log, stderr=subprocess.STDOUT, cwd=folder,
                            env={**os.environ, "LUIGI_CONFIG_PATH": str(cfg)})
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"luigid exited with code {proc.returncode}:\n{(folder / 'luigid.log').read_text()[-2000:]}")
        try:
            api(port, "task_list", {"status": "DONE"})
            return proc
        except OSError:
            time.sleep(0.05)
    proc.terminate()
    raise RuntimeError(f"luigid did not answer within {timeout_s:.0f} s")
