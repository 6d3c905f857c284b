"""Luigi tasks: parameters, requires, output, and a run that calls zgcore. Nothing else."""
from .base import ZGTask
from .pipeline import Assemble, Evaluate, PrepareCorpus, PrepareTeacher, TeacherBoundary, TrainBlock
from .study import ObjectiveStudyReport, SeedSummary

__all__ = ["ZGTask", "PrepareTeacher", "PrepareCorpus", "TeacherBoundary", "TrainBlock", "Assemble", "Evaluate", "SeedSummary",
           "ObjectiveStudyReport"]
