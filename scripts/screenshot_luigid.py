"""Screenshot luigid's visualiser showing a finished tiny experiment's dependency graph.

    python scripts/screenshot_luigid.py [--out docs/luigid.png]

Starts luigid on a free loopback port (temporary state file and log folder), runs
``luigi --module workflows RunExperiment --preset tiny`` against it into a temporary outputs
folder, opens the visualiser's graph tab for the RunExperiment task in headless Chromium, saves
the PNG (atomically) and stops luigid. Needs ``chromium`` (Debian/Ubuntu: ``apt-get install chromium``).
"""
from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import urllib.parse
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]
from luigid_util import api, free_port, start_luigid  # noqa: E402  (tests/luigid_util.py)
BROWSERS = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")


def find_chromium(explicit: str | None) -> str:
    for name in ([explicit] if explicit else [os.environ.get("CHROMIUM", ""), *BROWSERS]):
        if name and (path := shutil.which(name)):
            return path
    sys.exit("error: Chromium not found" + (f" at {explicit!r}" if explicit else f" (looked for {', '.join(BROWSERS)})")
             + ".\nInstall it, e.g. on Debian/Ubuntu: sudo apt-get update && sudo apt-get install -y chromium\n"
             "or pass --chromium /path/to/chromium (or set CHROMIUM).")


def run_experiment(tmp: Path, port: int, preset: str, overrides: str) -> None:
    cmd = [sys.executable, "-m", "luigi", "--module", "workflows", "RunExperiment", "--scheduler-host", "127.0.0.1",
           "--scheduler-port", str(port), "--preset", preset, "--outputs", str(tmp / "outputs")]
    if overrides:
        cmd += ["--set", overrides]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    print("running:", " ".join(cmd), flush=True)
    with open(tmp / "worker.log", "w+") as log:
        rc = subprocess.run(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT).returncode
        if rc != 0:
            log.seek(0)
            sys.exit(f"error: the experiment exited with code {rc}:\n{log.read()[-3000:]}")


def root_task(port: int) -> str:
    """The finished RunExperiment's task id, after checking every task under it is DONE."""
    done = api(port, "task_list", {"status": "DONE"})
    roots = [t for t in done if t.startswith("RunExperiment_")]
    if len(roots) != 1:
        sys.exit(f"error: expected one finished RunExperiment in luigid, found {roots}")
    graph = api(port, "dep_graph", {"task_id": roots[0]})
    bad = {t: v["status"] for t, v in graph.items() if v["status"] != "DONE"}
    if bad:
        sys.exit(f"error: tasks not DONE in luigid: {bad}")
    print(f"{len(graph)} tasks DONE under {roots[0]}", flush=True)
    return roots[0]


def screenshot(chromium: str, url: str, png: Path, tmp: Path, size: str, budget_ms: int) -> None:
    profile = tmp / "chromium-profile"
    profile.mkdir()
    cmd = [chromium, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
           "--disable-background-networking", "--disable-component-update", "--disable-sync", f"--user-data-dir={profile}",
           "--hide-scrollbars", f"--window-size={size}", f"--virtual-time-budget={budget_ms}", f"--screenshot={png}", url]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    if r.returncode != 0 or not png.is_file() or png.stat().st_size == 0:
        sys.exit(f"error: Chromium made no screenshot (exit {r.returncode}):\n{r.stderr[-2000:]}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=str(ROOT / "docs" / "luigid.png"), help="PNG to write (default: docs/luigid.png)")
    ap.add_argument("--preset", default="tiny", help="experiment preset (default: tiny, seconds on a CPU)")
    ap.add_argument("--set", default="", help="extra experiment overrides")
    ap.add_argument("--vis-type", choices=("d3", "svg"), default="svg", help="visualiser graph style (default: svg; d3 may not fit the window)")
    ap.add_argument("--chromium", default=None, help="Chromium executable (default: $CHROMIUM or chromium on PATH)")
    ap.add_argument("--window-size", default="1600,1000", help="browser window WIDTH,HEIGHT (default: 1600,1000)")
    ap.add_argument("--wait-ms", type=int, default=5000, help="virtual time for the page's scripts (default: 5000)")
    args = ap.parse_args()

    chromium = find_chromium(args.chromium)
    out = Path(args.out).resolve()
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix="zg-screenshot-"))
    port = free_port()
    luigid = None
    try:
        try:
            luigid = start_luigid(tmp, port)
        except RuntimeError as e:
            sys.exit(f"error: {e}")
        run_experiment(tmp, port, args.preset, args.set)
        task_id = root_task(port)
        url = (f"http://127.0.0.1:{port}/static/visualiser/index.html#"
               + urllib.parse.urlencode({"tab": "graph", "taskId": task_id, "visType": args.vis_type}))
        print("screenshot of", url, flush=True)
        shot = tmp / "shot.png"
        screenshot(chromium, url, shot, tmp, args.window_size, args.wait_ms)
        fd, part = tempfile.mkstemp(dir=out.parent, prefix=f".{out.name}.", suffix=".tmp")
        os.close(fd)
        shutil.copyfile(shot, part)
        os.chmod(part, 0o644)  # mkstemp makes it 0600
        os.replace(part, out)
        print(f"wrote {out} ({out.stat().st_size // 1024} KiB)")
    finally:
        if luigid is not None:
            luigid.terminate()
            try:
                luigid.wait(timeout=20)
            except subprocess.TimeoutExpired:
                luigid.kill()
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
