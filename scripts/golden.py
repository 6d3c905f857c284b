"""Recorded output digests of the tiny presets (``tests/golden/<preset>.json``): what a refactor must
keep byte for byte, or whose change a commit explains.

    .venv/bin/python -m scripts.golden            # run every registered workflow's tiny preset, compare
    .venv/bin/python -m scripts.golden --write    # ... and record the digests (commit the files)
    .venv/bin/python -m scripts.golden --write --workflow SelectStudent

Which bytes are recorded (deterministic on one machine and library version, single-threaded CPU:
the tiny presets fix every seed and the data order):

* every ``*.safetensors`` file of every task output: trained block weights (``TrainBlock``), the
  assembled and healed students' weights (``Assemble``, ``Heal``), end-to-end and local-learning
  weights;
* every number of every ``report.json`` of the graph, rounded to 6 significant digits, except
  those under a key naming a time, a rate, a memory figure or a host (``seconds``, ``_s``,
  ``tokens_per_s``, ``rss``, ``peak``, ``host``, ``date``, ...) or a figure derived from times (the
  cache's ``break_even`` counts), which vary from run to run.

The bytes are a property of the code and of the library versions (:data:`LIBRARIES`): each file
records the versions it was written under, ``constraints.txt`` pins them for the suite, and the
contract compares bytes only under the recorded versions (elsewhere it says which differ).

The bytes are also a property of the machine: the CPU's instruction set picks torch's and MKL's
kernels, whose float32 sums round differently (a move to a newer Xeon moved every trained block's
last bits with no change here). So each file records the machine it was written on
(:func:`machine`: architecture, vendor, torch's CPU capability, the vector instruction flags) and,
beside the digests, the *values* behind them (:func:`values`: every recorded report number, and
each weight tensor's norm and its direction against a fixed pseudo-random tensor). On the recording machine every digest must match byte for byte; on
another machine the values must match within :data:`RTOL`, and the bytes are said not compared.
A file holds the digests of more than one machine kind when they were recorded there
(``other_machines``, keyed by :func:`machine_key`: development machines here alternate between
Intel and AMD CPUs): on each recorded kind the bytes are compared against its own digests. The
first machine's digests and values stay the file's top-level ``machine``/``digests``/``values``;
``--write`` on a recorded kind whose bytes did not move adds or keeps its entry, and ``--write``
that moves a machine's bytes (a change of the code) drops the other machines' digests, which the
old code produced, and records this machine as the first.

Not recorded: ``task.json`` (it carries times and hosts), plots (PNG metadata), logs, TensorBoard
event files, the HDF5 boundary shards (HDF5 writes object timestamps); the weights trained from
them are recorded instead, so a change of their values shows there.

A key is ``<task title>/<file>`` (``TrainBlock block0-clean-cached-s0/block.safetensors``; a title
shared by several tasks, as a library's candidates share theirs, is numbered ``[2]``, ``[3]`` in the
graph's order), so a
change of an output folder's hash alone (a configuration or code-version change) does not count;
only bytes do. ``tests/test_workflow_contract.py`` compares each tiny preset's digests with the
recorded file on the run it already makes.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import math
import platform
import sys
import tempfile
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
GOLDEN = REPO / "tests" / "golden"
COMMAND = ".venv/bin/python -m scripts.golden --write"
# a key containing one of these (or ending in "_s": seconds) holds a figure that varies from run to run
VOLATILE = ("second", "time", "per_s", "rss", "peak", "memory", "host", "date", "mfu", "wall", "elapsed", "threads",
            "pid", "version", "torch", "python", "path", "folder",
            "break_even")  # the cache's break-even counts are ratios of measured times


def _volatile(key: str) -> bool:
    k = key.lower()
    return k.endswith("_s") or any(v in k for v in VOLATILE)


def _numbers(obj: Any, prefix: str = "") -> dict[str, Any]:
    """``{dotted key: value rounded to 6 significant digits}`` of every number in a JSON value,
    skipping the keys :func:`_volatile` names (and everything under them)."""
    out: dict[str, Any] = {}
    if isinstance(obj, dict):
        for k, v in obj.items():
            if not _volatile(str(k)):
                out.update(_numbers(v, f"{prefix}{k}."))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            out.update(_numbers(v, f"{prefix}{i}."))
    elif isinstance(obj, bool) or obj is None:
        pass
    elif isinstance(obj, (int, float)):
        out[prefix.rstrip(".")] = obj if isinstance(obj, int) or not math.isfinite(obj) else float(f"{obj:.6g}")
    return out


def _folders(tasks):
    """``(key title, output folder)`` of each finished task among ``tasks``: a title shared by several
    tasks (a library's candidates) is numbered ``[2]``, ``[3]`` in graph order."""
    seen: dict[str, int] = {}
    for t in tasks:
        folder, title = Path(t.out_dir), t.title()
        seen[title] = seen.get(title, 0) + 1
        if seen[title] > 1:
            title = f"{title} [{seen[title]}]"
        if folder.is_dir():
            yield title, folder


def digests(tasks) -> dict[str, str]:
    """The recorded digests of the finished outputs among ``tasks`` (see the module docstring)."""
    out: dict[str, str] = {}
    for title, folder in _folders(tasks):
        for f in sorted(folder.rglob("*.safetensors")):
            out[f"{title}/{f.relative_to(folder)}"] = hashlib.sha256(f.read_bytes()).hexdigest()
        for f in sorted(folder.rglob("report.json")):
            nums = _numbers(json.loads(f.read_text()))
            out[f"{title}/{f.relative_to(folder)}"] = hashlib.sha256(
                json.dumps(nums, sort_keys=True).encode()).hexdigest()
    return dict(sorted(out.items()))


# tolerance of a recorded value on a machine other than the recording one (|a - b| <= ATOL + RTOL |a|):
# float32 sums rounded by other kernels move a tiny run's values by far less (docs/internals.md says
# how it was measured); a changed computation moves them by far more
RTOL = 1e-3
ATOL = 1e-6


def tensor_values(name: str, x) -> dict[str, float]:
    """``{name + ":l2": ||x||, name + ":z": sqrt(n) cos(x, r)}`` of one tensor, in float64: its norm,
    and its direction against a fixed pseudo-random tensor ``r`` of its size (numpy's PCG64, seed 0:
    the same on every machine), which a sign flip, a transpose or a permutation moves by about 1
    while other kernels' rounding moves it by about their relative error. ``x`` a torch tensor."""
    import numpy as np

    a = x.detach().double().flatten().numpy()
    l2 = float(np.sqrt(a @ a))
    r = np.random.default_rng(0).standard_normal(a.size)
    z = float(a @ r / (l2 * np.sqrt(r @ r)) * np.sqrt(a.size)) if l2 > 0 else 0.0
    return {f"{name}:l2": float(f"{l2:.9g}"), f"{name}:z": float(f"{z:.9g}")}


def values(tasks) -> dict[str, dict[str, float]]:
    """``{key: {name: value}}`` behind :func:`digests`, comparable across machines: each
    ``report.json``'s recorded numbers (the same keys the digest hashes) and, for each
    ``*.safetensors`` file, :func:`tensor_values` of every floating-point tensor in it."""
    from safetensors.torch import load_file

    out: dict[str, dict[str, float]] = {}
    for title, folder in _folders(tasks):
        for f in sorted(folder.rglob("*.safetensors")):
            vals: dict[str, float] = {}
            for name, x in sorted(load_file(f).items()):
                if x.is_floating_point():
                    vals.update(tensor_values(name, x))
            out[f"{title}/{f.relative_to(folder)}"] = vals
        for f in sorted(folder.rglob("report.json")):
            out[f"{title}/{f.relative_to(folder)}"] = _numbers(json.loads(f.read_text()))
    return dict(sorted(out.items()))


def machine() -> dict[str, str]:
    """What picks the CPU kernels, so what can move a recorded byte: ``{"arch", "vendor",
    "cpu_capability" (torch's dispatch level: DEFAULT, AVX2, AVX512, ...), "isa" (a digest of the
    CPU's vector instruction flags: avx*, amx*, fma, f16c, sse*)}``. Two machines with equal
    records compute the tiny presets alike."""
    import torch

    vendor, flags = "", set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, val = line.partition(":")
            if key.strip() == "vendor_id" and not vendor:
                vendor = val.strip()
            elif key.strip() in ("flags", "Features") and not flags:
                flags = set(val.split())
    except OSError:
        pass
    isa = " ".join(sorted(f for f in flags if f.startswith(("avx", "amx", "fma", "f16c", "sse", "ssse", "asimd", "sve"))))
    vendor = vendor or platform.processor() or "unknown"  # no vendor_id line off x86 Linux
    return {"arch": platform.machine(), "vendor": vendor, "cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "isa": hashlib.sha256(isa.encode()).hexdigest()[:16]}


def machine_key(m: dict[str, str]) -> str:
    """The key of a machine kind (:func:`machine`'s record) among a file's ``other_machines``:
    ``"<arch> <vendor> <cpu_capability> <isa>"``."""
    return " ".join(str(m.get(k, "?")) for k in ("arch", "vendor", "cpu_capability", "isa"))


def _record(preset: str) -> dict[str, Any] | None:
    p = golden_path(preset)
    return json.loads(p.read_text()) if p.is_file() else None


def this_machines(rec: dict[str, Any]) -> dict[str, Any] | None:
    """The part of a golden record written on this machine's kind: ``{"machine", "environment",
    "digests"}`` (the top level when it was the first machine, else its ``other_machines`` entry);
    None when this kind recorded none."""
    here = machine()
    if rec.get("machine") == here:
        return rec
    other = rec.get("other_machines", {}).get(machine_key(here))
    return other if other is not None and other.get("machine") == here else None


def machine_difference(preset: str) -> list[str]:
    """How this machine differs from every one ``preset``'s digests were recorded on (``[]``: one
    of them is this kind, so the bytes must match its digests). A record without a machine counts
    as another machine."""
    rec = _record(preset)
    if rec is None or this_machines(rec) is not None:
        return []
    want, have = rec.get("machine", {}), machine()
    lines = [f"{k} {want.get(k, '?')} recorded, {have[k]} here" for k in have if want.get(k) != have[k]]
    return lines + [f"also recorded on {k}" for k in rec.get("other_machines", {})]


def value_difference(preset: str, got: dict[str, dict[str, float]]) -> list[str]:
    """The recorded values of ``preset`` that ``got`` misses by more than :data:`RTOL` (relative;
    for a tensor's direction ``:z``, relative to at least 1) plus :data:`ATOL`, one line each
    (``[]``: all within). A key or value present on one side only is a line; an integer must be
    equal; a non-finite value must be the same one (a NaN matches a NaN)."""
    p = golden_path(preset)
    if not p.is_file():
        return [f"no recorded values at {p}"]
    want = json.loads(p.read_text()).get("values")
    if want is None:
        return [f"{p.name} records no values: re-record with `{COMMAND}`"]
    lines = []
    for k in sorted(set(want) | set(got)):
        w, g = want.get(k), got.get(k)
        if w is None or g is None:
            lines.append(f"{k}: {'recorded' if g is None else 'not recorded'}, {'missing now' if g is None else 'present now'}")
            continue
        for n in sorted(set(w) | set(g)):
            a, b = w.get(n), g.get(n)
            if isinstance(a, int) and isinstance(b, int) or a is None or b is None:
                same = a == b
            elif not (math.isfinite(a) and math.isfinite(b)):  # inf as inf, nan as nan
                same = a == b or (math.isnan(a) and math.isnan(b))
            else:  # a direction (":z", about 1 in size) is held to RTOL however near 0 it falls
                same = abs(a - b) <= ATOL + RTOL * (max(abs(a), 1.0) if n.endswith(":z") else abs(a))
            if not same:
                lines.append(f"{k} {n}: recorded {a}, now {b}")
    return lines


# the libraries whose version can move a recorded byte: the tiny teachers' initialisation and forward
# (torch, transformers), tokenisation (tokenizers), the data path (numpy, h5py, safetensors)
LIBRARIES = ("torch", "transformers", "tokenizers", "numpy", "h5py", "safetensors", "accelerate")


def environment() -> dict[str, str]:
    """``{library: version}`` of :data:`LIBRARIES` in this environment (a local label such as
    ``+cpu`` dropped: the CPU and CUDA builds of one torch release compute alike on the CPU)."""
    from importlib.metadata import version

    return {lib: version(lib).split("+")[0] for lib in LIBRARIES}


def pinned() -> dict[str, str]:
    """``{library: version}`` of :data:`LIBRARIES` as ``constraints.txt`` pins them."""
    pins = {}
    for line in (REPO / "constraints.txt").read_text().splitlines():
        name, _, ver = line.split("#")[0].strip().partition("==")
        if ver and name.lower() in LIBRARIES:
            pins[name.lower()] = ver.strip()
    return pins


def environment_difference(preset: str) -> list[str]:
    """The libraries whose version here differs from the one ``preset``'s digests were recorded
    under (``[]``: the same, so every digest must match byte for byte). Digests of trained weights
    are a property of the code *and* the library versions: a new transformers or tokenizers
    release may move them with no change here, which is why the suite installs ``constraints.txt``."""
    rec = _record(preset)
    if rec is None:
        return []
    want, have = (this_machines(rec) or rec).get("environment", {}), environment()
    return [f"{lib} {want.get(lib, '?')} recorded, {have[lib]} here" for lib in LIBRARIES if want.get(lib) != have[lib]]


def golden_path(preset: str) -> Path:
    """``tests/golden/<preset>.json``."""
    return GOLDEN / f"{preset}.json"


def difference(preset: str, got: dict[str, str]) -> list[str]:
    """What differs between ``got`` and the digests of ``preset`` recorded on this machine's kind
    (:func:`this_machines`; the first machine's where this kind recorded none), one line per key
    (``[]``: the same). A missing record is one line."""
    p = golden_path(preset)
    if not p.is_file():
        return [f"no recorded digests at {p.relative_to(REPO) if p.is_relative_to(REPO) else p}"]
    rec = json.loads(p.read_text())
    want = (this_machines(rec) or rec)["digests"]
    lines = [f"{k}: recorded {want.get(k, 'nothing')[:12]}, now {got.get(k, 'nothing')[:12]}"
             for k in sorted(set(want) | set(got)) if want.get(k) != got.get(k)]
    return lines


def write(preset: str, got: dict[str, str], vals: dict[str, dict[str, float]] | None = None) -> Path:
    """Record ``got`` as this machine's digests of ``preset``, with this environment's library
    versions and this machine; returns the file. On a machine other than the file's first, whose
    bytes did not move (it recorded these digests, or none), they go under ``other_machines`` and
    the first machine's record stays; otherwise ``got`` and ``vals`` become the first machine's and
    every other machine's digests are dropped (see the module docstring)."""
    GOLDEN.mkdir(parents=True, exist_ok=True)
    p = golden_path(preset)
    rec, here = _record(preset), machine()
    mine = {"machine": here, "environment": environment(), "digests": got}
    if rec is not None and rec.get("machine") != here and rec.get("environment") == mine["environment"]:
        before = this_machines(rec)
        if before is None or before["digests"] == got:
            rec.setdefault("other_machines", {})[machine_key(here)] = mine
            p.write_text(json.dumps(rec, indent=1) + "\n")
            return p
    same = rec is not None and rec.get("digests") == got and rec.get("machine") == here
    keep = rec.get("other_machines", {}) if same else {}
    p.write_text(json.dumps({"preset": preset, "written_by": COMMAND, **mine, "values": vals or {},
                             **({"other_machines": keep} if keep else {})}, indent=1) + "\n")
    return p


def run(name: str, outputs: Path) -> tuple[dict[str, str], dict[str, dict[str, float]]]:
    """Run the registered workflow ``name`` on its tiny preset under ``outputs``; its digests and values."""
    import luigi

    import workflows
    from workflows import registry
    from workflows.cli import all_tasks, root_tasks

    wf = registry.get(name)
    task = getattr(workflows, name)(preset=wf.tiny, outputs=str(outputs))
    if not luigi.build([task], local_scheduler=True, log_level="WARNING"):
        raise SystemExit(f"error: {name} --preset {wf.tiny} failed")
    graph = all_tasks(root_tasks("", [], wf.tiny, str(outputs), name))
    return digests(graph), values(graph)


def main(argv: list[str] | None = None) -> int:
    """Run, compare and (``--write``) record; exit 1 when a digest differs and ``--write`` is off."""
    sys.path.insert(0, str(REPO))
    from workflows import registry

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--write", action="store_true", help="record the digests in tests/golden/")
    ap.add_argument("--workflow", action="append", help="only these workflows (repeatable; default: all registered)")
    args = ap.parse_args(argv)
    status = 0
    for name in args.workflow or registry.names():
        with tempfile.TemporaryDirectory() as tmp:
            got, vals = run(name, Path(tmp))
        preset = registry.get(name).tiny
        env = environment_difference(preset)
        mach = machine_difference(preset)
        by_values = bool(mach) and not env  # same libraries, another machine: the values are the check
        diff = value_difference(preset, vals) if by_values else difference(preset, got)
        if args.write:
            print(f"{name}: wrote {write(preset, got, vals).relative_to(REPO)} ({len(got)} digests)")
        elif diff and by_values:
            status = 1
            print(f"{name} ({preset}): " + "\n  ".join([f"values beyond rtol {RTOL} (bytes not compared, recorded on "
                                                       "another machine: " + "; ".join(mach) + "):", *diff]))
        elif diff:
            status = 1
            why = ["recorded under other library versions (install with -c constraints.txt):", *env] if env else []
            print(f"{name} ({preset}): " + "\n  ".join(["digests differ:", *diff, *why]))
        elif by_values:
            print(f"{name} ({preset}): values within rtol {RTOL}; bytes not compared, recorded on another machine: "
                  + "; ".join(mach))
        else:
            print(f"{name} ({preset}): {len(got)} digests as recorded")
    return status


if __name__ == "__main__":
    raise SystemExit(main())
