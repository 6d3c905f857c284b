"""Luigi tasks: parameters, requires, output, and a run that calls zgcore. Nothing else."""
from .base import ZGTask
from . import events  # noqa: F401 (each task's start and end: threads, leftovers, its 'done' line)
from .assemble import Assemble
from .blocks import TrainBlock
from .cache import TeacherBoundary
from .evaluate import Evaluate
from .teacher import PrepareCorpus, PrepareTeacher
from .study import ObjectiveStudyReport, SeedSummary

__all__ = ["ZGTask", "PrepareTeacher", "PrepareCorpus", "TeacherBoundary", "TrainBlock", "Assemble", "Evaluate", "SeedSummary",
           "ObjectiveStudyReport"]
