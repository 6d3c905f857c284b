"""The shared task base: hash-named output folders (gokart-style unique ids), atomic completion."""
from __future__ import annotations

import contextlib
import json
import math
import time
from functools import cached_property
from pathlib import Path
from typing import Any, Iterator

import luigi
from luigi.parameter import ParameterVisibility
from luigi.task import flatten

from zgcore.atomic import atomic_path
from zgcore.hashing import canonical, config_hash

HIDDEN = ParameterVisibility.HIDDEN  # long configs: kept out of the visualiser's task names
PROGRESS_INTERVAL_S = 2.0  # seconds between two progress reports to the scheduler


class ZGTask(luigi.Task):
    """Base of every ZeroGraph task.

    A task's output is one folder, ``<outputs>/<TaskFamily>/<label>-<hash>``, where the hash covers
    :meth:`own_config` and the hashes of everything :meth:`requires` returns. The folder is built
    under a temporary name and renamed when complete, so it exists only when the task is done.
    """

    outputs = luigi.Parameter(default="outputs", significant=False, description="root folder of all run artifacts")
    device = luigi.Parameter(default="cpu", significant=False, description="torch device for this task's work")
    uses_device = True  # False on tasks that only tokenise, convert on CPU or aggregate files
    # Luigi's per-task retry policy: the scheduler disables a task at its first failure instead of
    # retrying it 15 minutes later, whatever luigid's own config says. Workers waiting on it
    # (luigi.cfg: keep_alive) then stop and exit non-zero instead of waiting forever; luigi.cfg's
    # [scheduler] disable_persist enables it again seconds later, so that a rerun retries it.
    retry_count = 1

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

    @cached_property
    def uid(self) -> str:
        """The task's unique id: hash of family, own config and upstream ids."""
        ups = [t.uid for t in flatten(self.requires()) if isinstance(t, ZGTask)]
        return config_hash(self.get_task_family(), self.own_config(), ups)

    @property
    def out_dir(self) -> Path:
        """Final output folder."""
        return Path(self.outputs) / self.get_task_family() / f"{self.label()}-{self.uid}"

    def output(self):
        return luigi.LocalTarget(str(self.out_dir))

    def verify(self) -> str | None:
        """Cheap integrity check of a finished output: ``None`` when sound, else what is wrong.
        Subclasses check what they wrote (sizes, manifests)."""
        return None

    def complete(self) -> bool:
        """Done when the output folder exists and passes :meth:`verify`; a folder that fails is
        reported and rebuilt (the damaged one is moved aside, never deleted)."""
        if not self.out_dir.is_dir():
            return False
        problem = self.verify()
        if problem:
            self.log(f"output {self.out_dir} is damaged ({problem}); it will be rebuilt")
            return False
        return True

    @contextlib.contextmanager
    def building(self) -> Iterator[Path]:
        """Yield a temporary folder; it becomes :attr:`out_dir` when the block exits cleanly.
        A ``task.json`` recording family, label, hash, config and upstream ids is added."""
        if self.out_dir.exists():  # failed verify(): keep the damaged folder for inspection
            import time

            self.out_dir.rename(self.out_dir.with_name(f"{self.out_dir.name}.damaged-{int(time.time())}"))
        with atomic_path(self.out_dir) as tmp:
            tmp.mkdir(parents=True)
            yield tmp
            info = {"family": self.get_task_family(), "label": self.label(), "uid": self.uid,
                    "config": canonical(self.own_config()),
                    "upstream": [t.uid for t in flatten(self.requires()) if isinstance(t, ZGTask)]}
            (tmp / "task.json").write_text(json.dumps(info, indent=2, sort_keys=True) + "\n")

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

    def log(self, msg: str) -> None:
        """Print a line prefixed with the task's label (stdout, flushed)."""
        print(f"[{self.get_task_family()} {self.label()}] {msg}", flush=True)
