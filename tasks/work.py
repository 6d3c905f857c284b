"""Work folders of training tasks: checkpoints and logs of an unfinished run, kept across
interruptions; and the live TensorBoard view of a training run."""
from __future__ import annotations

import os
import shutil
from pathlib import Path


class Resumable:
    """Mixin for a :class:`~tasks.base.ZGTask` that trains on :class:`zgcore.training.loop.TrainLoop`.

    Its checkpoints live in ``<out_dir>.partial`` (same folder, so a rerun by any worker of the
    same configuration resumes there). A failed run, non-finite values included, leaves the folder
    with its last checkpoint for inspection; a finished run moves what it keeps into its output
    and removes the rest.
    """

    @property
    def work_dir(self) -> Path:
        """Checkpoints and logs of an unfinished run (kept across interruptions)."""
        return self.out_dir.with_name(self.out_dir.name + ".partial")

    def keep_work(self, tmp: Path, names: tuple[str, ...]) -> None:
        """Move the files ``names`` of the work folder into the output being built at ``tmp``."""
        for name in names:
            os.replace(self.work_dir / name, tmp / name)

    @property
    def tensorboard_dir(self) -> Path:
        """This task's TensorBoard run: ``<outputs>/tensorboard/<family>/<label>-<hash>`` (a
        local-learning run: ``<outputs>/tensorboard/<study>/<family>/<K..-aux-mtp-seed>-<hash>``, its
        study's name first), outside the atomic output folder so that it fills while the task runs."""
        from zgcore.training.watch import tensorboard_dir

        study = getattr(self, "study", "")
        family = f"{study}/{self.get_task_family()}" if study else self.get_task_family()
        return tensorboard_dir(self.outputs, family, self.out_dir.name)

    def watchers(self, tensorboard: bool, flops_per_token: float | None = None) -> list:
        """The :class:`zgcore.training.loop.TrainLoop` callbacks of this task's run: a
        :class:`zgcore.training.watch.TensorBoardWatch` writing to :attr:`tensorboard_dir` when
        ``tensorboard`` (the configuration's switch, never hashed) is true, else none. Given the
        run's training ``flops_per_token``, it also draws ``throughput/mfu`` against this process's
        matmul peak (:func:`zgcore.training.mfu.probe`)."""
        from zgcore.training.watch import TensorBoardWatch

        if not tensorboard:
            return []
        peak = None
        if flops_per_token:
            from zgcore.training.mfu import probe

            peak = probe(str(getattr(self, "device", "cpu")))["peak_flops_per_second"]
        return [TensorBoardWatch(self.tensorboard_dir, flops_per_token, peak)]

    def drop_work(self) -> None:
        """Remove the work folder (after the output is complete)."""
        shutil.rmtree(self.work_dir, ignore_errors=True)
