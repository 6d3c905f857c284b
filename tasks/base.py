"""The shared task base: hash-named output folders (gokart-style unique ids), atomic completion,
and what "complete" means.

A task's hash covers its own configuration, its upstream tasks' hashes, the numerics that change
its results (compute precision on its device) and its family's code version. Its folder holds a
``task.json`` that records every file written with its size and the build of every upstream
output it read; a folder whose files are missing or cut short, or whose inputs were rebuilt since,
is not complete: it is moved aside and rebuilt, and so is everything downstream of it.
"""
from __future__ import annotations

import contextlib
import json
import math
import time
import uuid
from functools import cached_property
from pathlib import Path
from typing import Any
from collections.abc import Iterator

import luigi
from luigi.parameter import ParameterVisibility
from luigi.task import flatten

from zgcore.atomic import atomic_path, remove_registered_temps, remove_stale_temps
from zgcore.device import precision
from zgcore.hashing import canonical, config_hash, file_sha256, file_sha256_cached, remember_sha256
from zgcore.threads import decoder_params

from .integrity import (  # noqa: F401 (completion_pass: zerograph status's, re-exported)
    _PASS, METADATA_BYTES, DamagedOutputError, OutputUnreadableError, _checking_inputs, completion_pass, kill_point,
    record_problem, write_record)

HIDDEN = ParameterVisibility.HIDDEN  # long configs: kept out of the visualiser's task names
PROGRESS_INTERVAL_S = 2.0  # seconds between two progress reports to the scheduler
RECORD = "task.json"  # in every output folder: identity, files written (with sizes), upstream builds
_said: set[tuple[str, str]] = set()  # (folder, problem) already logged by complete()


class zerograph(luigi.Config):  # noqa: N801 (Luigi names the section and the flags after the class)
    """ZeroGraph's settings that are not part of an experiment (nothing here is hashed): the
    ``[zerograph]`` section of ``luigi.cfg``, or ``--zerograph-<name>`` on the ``luigi`` command line."""

    threads = luigi.IntParameter(default=0, description="torch threads per task; 0 = chosen per task from the model's "
                                                        "size and the usable cores (OMP_NUM_THREADS wins)")


class ZGTask(luigi.Task):
    """Base of every ZeroGraph task.

    A task's output is one folder, ``<outputs>/<TaskFamily>/<label>-<hash>``, where the hash covers
    :meth:`own_config`, :meth:`numerics` (code version, compute precision) and the hashes of
    everything :meth:`requires` returns. The folder is built under a temporary name and renamed
    when complete, so it exists only when the task is done; :meth:`complete` also checks it is whole.

    ``code_version``: bump it in the commit that changes what the family computes. The code it
    covers is derived from imports (its class's module and every module of ``zgcore/`` and
    ``tasks/`` that module imports, transitively: :func:`tasks.versions.closure`) and guarded by
    ``tests/test_code_versions.py``; record the new state with ``python -m tasks.versions --write``.
    """

    code_version = 1

    outputs = luigi.Parameter(default="outputs", significant=False, description="root folder of all run artifacts")
    device = luigi.Parameter(default="cpu", significant=False, description="torch device for this task's work")
    uses_device = True  # False on tasks that only tokenise, convert on CPU or aggregate files
    # every file of the output gets its SHA-256 in task.json, checked by complete() and by consumers
    # (checked()); off where the files carry their own checks (the boundary store's shards)
    content_hashes = True
    # Luigi's per-task retry policy. A task whose worker is lost (killed, preempted, node gone) is
    # failed by the scheduler and handed to another live worker retry_delay seconds later (luigi.cfg),
    # which resumes it from its checkpoints; after 3 such losses within Luigi's disable_window (an
    # hour) it is disabled. A task that raises is disabled at once by the worker that ran it
    # (workflows/failover.py), so a real error is never retried in a loop.
    retry_count = 3

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        run = getattr(cls, "run", None)  # its own, or a mixin's (an lr search's)
        if callable(run) and not getattr(run, "checks_inputs", False):
            cls.run = _checking_inputs(run)

    @property
    def resources(self) -> dict[str, int]:
        """Luigi resources: ``{"gpu": 1}`` while a task works on a CUDA device, else ``{}``.

        The scheduler (luigid, or the local one) runs at most ``[resources] gpu = N`` such tasks
        at once across all its workers; with no ``gpu`` entry in its config Luigi allows 1."""
        if self.uses_device and str(self.device).startswith("cuda"):
            return {"gpu": 1}
        return {}

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        # Luigi's own id covers public parameters only; ours covers the whole configuration and
        # reads well in luigid's visualiser: e.g. TrainBlock_block1-clean-cached-s0_3f2a...
        self.task_id = f"{self.get_task_family()}_{self.label()}_{self.uid}"

    def __repr__(self) -> str:
        """``Family(label-hash)``, the output folder's name: what Luigi's log lines and summary print
        (``str(task)``) instead of every parameter's JSON; the full configuration is in ``task.json``."""
        return f"{self.get_task_family()}({self.label()}-{self.uid})"

    def to_str_params(self, only_significant=False, only_public=False):
        """Luigi's string parameters plus ``name`` (the readable label) for the visualiser."""
        out = super().to_str_params(only_significant, only_public)
        out["name"] = self.label()
        return out

    def own_config(self) -> dict[str, Any]:
        """The task's significant configuration (what its hash covers besides upstream hashes)."""
        raise NotImplementedError

    def label(self) -> str:
        """Readable prefix of the output folder name."""
        return self.get_task_family().lower()

    def title(self) -> str:
        """How logs, progress bars, errors and ``zerograph status`` name the task: ``"<Family> <label>"``
        (e.g. ``"TrainBlock block0-clean-cached-s0"``)."""
        return f"{self.get_task_family()} {self.label()}"

    def numerics(self) -> dict[str, Any]:
        """What changes results besides the configuration: the family's ``code_version`` and, for a
        task that computes on its device, the compute precision there (``float32`` on CPU,
        ``bf16-autocast`` on CUDA). The device itself is not included: cuda:0 and cuda:1 compute alike."""
        out: dict[str, Any] = {"code_version": int(self.code_version)}
        if self.uses_device:
            out["precision"] = precision(self.device)
        return out

    def upstream(self) -> list[ZGTask]:
        """The ZeroGraph tasks :meth:`requires` returns, in order."""
        return [t for t in flatten(self.requires()) if isinstance(t, ZGTask)]

    def dynamic_upstream(self) -> list[ZGTask]:
        """Tasks whose outputs this one reads besides :meth:`requires`: the dynamic dependencies its
        ``run`` yields, once they can be named ([] by default). Not hashed (they follow from the
        static inputs), but recorded and checked like them, so a rebuilt one makes this task stale."""
        return []

    def read_upstream(self) -> list[ZGTask]:
        """Every task whose output this one reads: :meth:`upstream`, then :meth:`dynamic_upstream`."""
        return self.upstream() + [t for t in self.dynamic_upstream() if isinstance(t, ZGTask)]

    @cached_property
    def uid(self) -> str:
        """The task's unique id: hash of family, own config, numerics and upstream ids."""
        return config_hash(self.get_task_family(), {"config": self.own_config(), **self.numerics()},
                           [t.uid for t in self.upstream()])

    @property
    def out_dir(self) -> Path:
        """Final output folder."""
        return Path(self.outputs) / self.get_task_family() / f"{self.label()}-{self.uid}"

    def output(self):
        return luigi.LocalTarget(str(self.out_dir))

    def verify(self) -> str | None:
        """Extra integrity check of a finished output beyond :meth:`check_output`'s file list:
        ``None`` when sound, else what is wrong. Subclasses check what they wrote (manifests)."""
        return None

    def record(self) -> dict[str, Any] | None:
        """The output folder's ``task.json``, or ``None`` when it is missing or unreadable."""
        try:
            return json.loads((self.out_dir / RECORD).read_text())
        except (OSError, ValueError):
            return None

    def content_problem(self, rec: dict[str, Any] | None = None, names: Any = None, deep: bool = False) -> str | None:
        """``None`` when every file ``task.json`` records (or those of ``names``) is present with its
        recorded size and, where a SHA-256 is recorded (every output written since content hashes
        were added, unless :attr:`content_hashes` is off), its recorded content; else what is wrong.

        Without ``deep`` (what :meth:`complete` asks) only metadata-scale files (up to
        :data:`METADATA_BYTES`) are hashed, each once per process and version of it
        (:func:`zgcore.hashing.file_sha256_cached`); with ``deep`` every recorded file is hashed
        now, in full (what a reader asks before it loads). Raises ``OSError`` when the file system
        cannot read a file (that is not damage)."""
        rec = self.record() if rec is None else rec
        if rec is None or "files" not in rec or record_problem(self.out_dir):
            return record_problem(self.out_dir) or f"{RECORD} is missing or unreadable"
        hashes = rec.get("sha256") or {}
        for name, size in rec["files"].items():
            if names is not None and name not in names:
                continue
            f = self.out_dir / name
            if not f.is_file():
                return f"{name} is missing"
            if f.stat().st_size != size:
                return f"{name} has {f.stat().st_size} bytes, {size} when written"
            if name not in hashes:
                continue
            if deep:
                digest = file_sha256(f)
                remember_sha256(f, digest)
            elif size <= METADATA_BYTES:
                digest = file_sha256_cached(f)
            else:
                continue
            if digest != hashes[name]:
                return f"{name}'s bytes differ from the SHA-256 recorded when it was written"
        return None

    def bulk_files(self, rec: dict[str, Any] | None = None) -> list[str]:
        """The recorded files with a SHA-256 that :meth:`complete` checks by size only (larger than
        :data:`METADATA_BYTES`): what :meth:`check_inputs` and :meth:`checked` hash in full."""
        rec = self.record() if rec is None else rec
        if not rec:
            return []
        return [n for n, size in rec.get("files", {}).items() if n in (rec.get("sha256") or {}) and size > METADATA_BYTES]

    def checked(self, name: str) -> Path:
        """``out_dir / name`` once its bytes match the SHA-256 recorded when it was written, hashed
        now in full (not through the per-process cache: a long-lived worker sees a corruption that
        kept the file's size and modification time): what a consumer calls before it loads a file
        of this task's output.

        Raises:
            DamagedOutputError: the file is missing, cut short or its content changed; the whole
                output folder is moved aside (``<folder>.damaged-<time>-<id>``) so that the next
                run rebuilds this task (and only it, of its kind)."""
        problem = self.content_problem(names={name}, deep=True)
        if problem:
            moved = self.move_aside("damaged")
            raise DamagedOutputError(f"{self.title()}: {self.out_dir / name}: {problem}; "
                                     f"moved the output aside to {moved}, the next run rebuilds it")
        return self.out_dir / name

    def check_inputs(self) -> None:
        """Before this task's run reads anything: hash in full, uncached, every recorded file of
        every output it reads (:meth:`read_upstream`): the bulk files (:meth:`bulk_files`) that
        :meth:`complete` checked by size only, and the metadata-scale ones it took from a long-lived
        process's cache. Every family's ``run`` calls it first (wrapped when the class is defined).

        Raises:
            DamagedOutputError: one line naming the file; that input is moved aside, the next run rebuilds it."""
        for t in self.read_upstream():
            rec = t.record() if t.out_dir.is_dir() else None
            if rec and rec.get("sha256"):
                t.checked_all(rec["sha256"])

    def checked_all(self, names: Any) -> None:
        """:meth:`checked` for each of ``names`` (one pass); raises as it does."""
        problem = self.content_problem(names=set(names), deep=True)
        if problem:
            moved = self.move_aside("damaged")
            raise DamagedOutputError(f"{self.title()}: {self.out_dir}: {problem}; "
                                     f"moved the output aside to {moved}, the next run rebuilds it")

    def move_aside(self, kind: str) -> Path:
        """Rename the output folder to ``<folder>.<kind>-<time>-<id>`` (kept for inspection, never
        deleted); returns the new path."""
        aside = self.out_dir.with_name(f"{self.out_dir.name}.{kind}-{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:6]}")
        self.out_dir.rename(aside)
        return aside

    def check_output(self) -> tuple[str, str] | None:
        """``None`` when the output folder is whole and current, else ``(kind, what)``: kind
        ``"damaged"`` (``task.json`` unreadable, a recorded file missing, of another size or of
        other content (:meth:`content_problem`), :meth:`verify` fails) or ``"stale"`` (an upstream output is not complete, or was rebuilt
        after this one read it)."""
        rec = self.record()
        problem = self.content_problem(rec)
        if problem:
            return "damaged", problem
        problem = self.verify()
        if problem:
            return "damaged", problem
        for t in self.read_upstream():
            name = t.title()
            if not t.complete():
                return "stale", f"its input {name} is not complete and will be rebuilt first"
            if (t.record() or {}).get("build") != rec.get("upstream_builds", {}).get(t.uid):
                return "stale", f"its input {name} was rebuilt after it was read"
        return None

    def complete(self) -> bool:
        """Done when the output folder exists and passes :meth:`check_output`; a folder that fails
        is reported and rebuilt (the old one is moved aside, never deleted). Reads metadata only:
        ``task.json``, the files' sizes, metadata-scale files' content and what :meth:`verify` reads.

        :meth:`check_output` asks each input whether it is complete, and each input its own inputs:
        within one call (and within a :func:`completion_pass`) each task of the graph is checked
        once, however many paths lead to it (a library graph: 192 tasks checked 17,277 times
        without it).

        Raises:
            OutputUnreadableError: the file system could not read the output (an ``OSError`` with an
                errno): one line naming the task and the error; nothing is moved."""
        memo = _PASS.get()
        if memo is None:
            with completion_pass():
                return self.complete()
        if self.task_id not in memo:
            memo[self.task_id] = self._complete()
        return memo[self.task_id]

    def _complete(self) -> bool:
        if not self.out_dir.is_dir():
            return False
        try:
            problem = self.check_output()
        except OSError as e:
            if e.errno is None:
                raise
            raise OutputUnreadableError(f"{self.title()}: {self.out_dir} could not be read ({e}); it is kept: "
                                        f"rerun when the file system answers again") from e
        if problem:
            if (str(self.out_dir), problem[1]) not in _said:
                _said.add((str(self.out_dir), problem[1]))
                self.log(f"output {self.out_dir} is {problem[0]} ({problem[1]}); it will be rebuilt")
            return False
        return True

    def remove_leftovers(self) -> list[Path]:
        """Remove what writers of this task that no longer exist left behind
        (:func:`zgcore.atomic.remove_stale_temps`): temporary output folders beside :attr:`out_dir`,
        temporary files in its ``.partial`` work folder (a checkpoint cut off mid-write) and those in
        every registered temp root (:data:`zgcore.atomic.TEMP_ROOTS`, e.g. the teacher cache). Run at
        the start of every run of the task; returns what was removed."""
        removed = remove_stale_temps(self.out_dir.parent, self.out_dir.name)
        work = self.out_dir.with_name(self.out_dir.name + ".partial")
        if work.is_dir():
            removed += remove_stale_temps(work)
        removed += remove_registered_temps(self.outputs)  # caches outside task folders (zgcore.atomic.TEMP_ROOTS)
        for p in removed:
            self.log(f"removed {p}, left by a writer that no longer runs")
        return removed

    @contextlib.contextmanager
    def building(self) -> Iterator[Path]:
        """Yield a temporary folder; it becomes :attr:`out_dir` when the block exits cleanly.

        A ``task.json`` is added recording family, label, hash, config, numerics, upstream ids, a
        fresh ``build`` id, the ``build`` of every upstream output as read now, and every file
        written with its size in bytes (what :meth:`check_output` checks)."""
        if problem := self.check_output() if self.out_dir.exists() else None:  # keep the old folder for inspection
            self.move_aside(problem[0])
        ups = self.read_upstream()
        try:
            with atomic_path(self.out_dir) as tmp:
                tmp.mkdir(parents=True)
                yield tmp
                files = {str(f.relative_to(tmp)): f.stat().st_size for f in sorted(tmp.rglob("*")) if f.is_file()}
                hashes = {name: file_sha256(tmp / name) for name in files} if self.content_hashes else {}
                info = {"family": self.get_task_family(), "label": self.label(), "uid": self.uid,
                        "config": canonical(self.own_config()), "numerics": self.numerics(),
                        "upstream": [t.uid for t in self.upstream()], "build": uuid.uuid4().hex,
                        "upstream_builds": {t.uid: (t.record() or {}).get("build") for t in ups}, "files": files}
                info.update({"sha256": hashes} if hashes else {})
                write_record(tmp, json.dumps(info, indent=2, sort_keys=True) + "\n")
                kill_point(self.get_task_family())
        except FileExistsError:  # another run finished it meanwhile (no locks here: tasks/exclusive.py)
            if self.check_output() is not None:
                raise
            return self.log(f"built by another run meanwhile; its output {self.out_dir} is whole and is kept")
        for name, digest in hashes.items():  # the bytes just hashed: complete() need not read them again
            remember_sha256(self.out_dir / name, digest)

    def progress(self, done: int, total: int, message: str = "") -> None:
        """Report progress to the Luigi scheduler (shown in luigid's visualiser): percentage and a
        status message, at most once per ``PROGRESS_INTERVAL_S`` seconds plus the final call
        (``done >= total``). Each report is two calls to the scheduler (HTTP with luigid), which
        would cost as much as a training step on a GPU if made every step."""
        now = time.monotonic()
        if done < total and now - getattr(self, "_progress_at", -math.inf) < PROGRESS_INTERVAL_S:
            return
        self._progress_at = now
        pct = int(100 * done / max(1, total))
        self.set_progress_percentage(pct)
        self.set_status_message(message or f"{done}/{total} ({pct}%)")

    def model_params(self) -> int | None:
        """Rough parameter count of the model this task computes with, which sizes its torch thread
        count (:mod:`zgcore.threads`): the teacher's decoder for tasks with a ``teacher``; ``None``
        (unknown: every usable core) for the others or when the teacher cannot be described."""
        teacher = getattr(self, "teacher", None)
        if not isinstance(teacher, str):
            return None
        from zgcore.models.teacher import describe

        try:
            info = describe(teacher, self.outputs)
        except Exception:  # noqa: BLE001 (a sizing hint only; the task's own run reports real errors)
            return None
        return decoder_params(info.n_layers, info.hidden_size, info.mlp_width)

    def log(self, msg: str) -> None:
        """Print a line prefixed with the task's label (stdout, flushed)."""
        self._said = True
        print(f"[{self.title()}] {msg}", flush=True)
