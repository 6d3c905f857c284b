"""The experiment's report joined from its scoring outputs (what the ``Evaluate`` task asks for in
one call, :func:`evaluate`): the held-out cross-entropies of the teacher, the untrained and the
trained student on the validation split's test rows and on every ``eval.extra`` corpus, their
comparisons, the blocks' metrics and boundary shift and, with a boundary store, the cache
economics measured against running the teacher online (:func:`measured_economics`).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from collections.abc import Callable, Mapping, Sequence

import numpy as np

from zgcore.atomic import write_json, write_text
from zgcore.evaluation import flops, metrics, report as zreport, utilisation
from zgcore.evaluation.compare import SCORES, save_scores, scores_part, subset_digest
from zgcore.evaluation.heldout_score import entry as extra_entry

MODELS = ("teacher", "untrained", "student")
ECONOMICS_METHOD = ("Each job's time in the mode it ran in is measured; the other mode is projected from its measured "
                    "compute time plus the teacher's forward time per batch up to the block's output boundary, taken "
                    "from the cache build's own measured time per sequence (scaled by the FLOPs of the layers up to "
                    "that boundary), not from another forward.")


@dataclass(frozen=True)
class EvaluationInputs:
    """What an experiment's report is joined from (plain data, read from the upstream outputs).

    Attributes:
        name: the experiment's name. teacher: the teacher's spec. eval: the eval section.
        train: each block's resolved train settings (``seed``, ``batch_size``), in block order.
        val: the token store's validation split ``[n_val, seq_len]``.
        scores: ``{model: scores.json}`` of the validation scoring (:data:`MODELS`).
        extra: the same per ``eval.extra`` corpus.
        blocks: each TrainBlock's ``metrics.json``. shift: the boundary shift's ``shift.json``.
        heal_steps: the healing stage's steps (0: the assembled student is the one scored).
        cache: the boundary store's manifest when a block read it (the cache economics), else ``None``.
        logits: the top-k logit store's manifest when the healing stage read one, else ``None``.
    """
    name: str
    teacher: str
    eval: Mapping[str, Any]
    train: Sequence[Mapping[str, Any]]
    val: np.ndarray
    scores: Mapping[str, Any]
    blocks: Sequence[Mapping[str, Any]]
    shift: Mapping[str, Any]
    extra: Sequence[Mapping[str, Any]] = ()
    heal_steps: int = 0
    cache: Mapping[str, Any] | None = None
    logits: Mapping[str, Any] | None = None


@dataclass
class Evaluation:
    """An experiment's report (:func:`zgcore.evaluation.report.experiment_report`'s, with ``economics``
    and ``logit_store`` where they apply), its per-sequence CEs and the shapes the utilisation table needs."""
    report: dict[str, Any]
    per_seq: dict[str, np.ndarray]
    rows: np.ndarray
    docs: np.ndarray | None
    extra_scores: dict[str, Any] = field(default_factory=dict)

    @property
    def parameters(self) -> dict[str, Any]:
        """The teacher's and the student's parameter counts (:func:`zgcore.evaluation.flops.model_parameters`)."""
        return self.report["parameters"]

    def save(self, folder: Path) -> None:
        """Write ``report.json``, ``report.md`` (with the utilisation table of ``report["mfu"]``)
        and ``per_sequence_ce.json`` (:func:`zgcore.evaluation.compare.save_scores`) into ``folder``."""
        write_json(folder / "report.json", self.report)
        write_text(folder / "report.md", zreport.report_markdown(self.report) + "\n"
                   + utilisation.markdown(self.report["mfu"]))
        save_scores(folder / SCORES, scores_part(self.per_seq, self.rows, self.docs), self.extra_scores)


def as_floats(values) -> np.ndarray:
    """A per-sequence CE list as float64 ``[n]`` (JSON keeps every float64 exactly)."""
    return np.asarray(values, dtype=np.float64)


def as_ints(values) -> np.ndarray:
    """Document ids as int64 ``[n]``."""
    return np.asarray(values, dtype=np.int64)


def evaluate(inp: EvaluationInputs) -> Evaluation:
    """The experiment's report from its scoring outputs: cross-entropies (nats/token, means over the
    test rows), context use, the fixed-model comparisons over sequences (documents resampled where
    the rows carry document ids), the ``eval.extra`` corpora, the blocks, the boundary shift and
    the cache economics (``report["mfu"]`` is left to the caller, who reads each phase's metrics)."""
    ev, sc = inp.eval, inp.scores
    rows = metrics.eval_subset(len(inp.val), int(ev["max_sequences"]), int(ev["subset_seed"]))
    val = inp.val[rows]
    docs = sc["teacher"].get("documents")
    docs = None if docs is None else as_ints(docs)
    per_seq = {k: as_floats(sc[k]["ce"][k]) for k in MODELS}
    extra, extra_scores = [], {}
    for es in inp.extra:
        ex_docs = es["teacher"].get("documents")
        part = scores_part({k: es[k]["ce"][k] for k in MODELS}, es["teacher"]["rows"],
                           None if ex_docs is None else as_ints(ex_docs))
        extra_scores[es["teacher"]["name"]] = part
        extra.append(extra_entry(es["teacher"], part))
    blocks = list(inp.blocks)
    bounds = [b["start"] for b in blocks] + [blocks[-1]["end"]]
    parameters = {k: sc[k]["parameters"] for k in ("teacher", "student")}
    report = zreport.experiment_report(
        {"name": inp.name, "teacher": inp.teacher, "boundaries": bounds, "seq_len": int(val.shape[1]),
         "val_sequences": int(len(val)), "val_tokens": int(val.size),
         "cross_entropy": {k: float(v.mean()) for k, v in per_seq.items()},
         "subset": {"sequences": int(len(rows)), "of": int(len(inp.val)), "seed": int(ev["subset_seed"]),
                    "sha256": subset_digest(rows)}, "extra": extra,
         "layers": {k: sc[k]["layers"] for k in MODELS}, "parameters": parameters, "blocks": blocks,
         "model_dir": sc["student"]["model_dir"], "sample": sc["student"]["sample"],
         "context_use": {k: sc[k]["context_use"] for k in MODELS if sc[k]["context_use"] is not None},
         "heal_steps": int(inp.heal_steps),
         "comparisons": zreport.model_comparisons(per_seq, int(inp.train[0]["seed"]), extra_scores, docs),
         "context_window": int(ev["context_window"]), "context_sequences": min(int(ev["context_sequences"]), len(val)),
         "shift": inp.shift}, ev)
    if inp.cache is not None:
        report["economics"] = measured_economics(inp.cache, blocks, [t["batch_size"] for t in inp.train],
                                                 parameters["teacher"], int(val.shape[1]), bounds[-1])
    if inp.logits is not None:
        report["logit_store"] = zreport.logit_store_cost(inp.logits)
    return Evaluation(report, per_seq, rows, docs, extra_scores)


def measured_economics(manifest: Mapping[str, Any], blocks: Sequence[Mapping[str, Any]], batch_sizes: Sequence[int],
                       teacher: Mapping[str, Any], seq_len: int, last: int) -> dict[str, Any]:
    """The cache economics (:func:`zgcore.evaluation.economics.economics`) of blocks trained on the
    boundary store of ``manifest``, the teacher's time per batch taken from the build's own
    measurement (:func:`build_time_per_batch`), with its ``method`` said (:data:`ECONOMICS_METHOD`)."""
    out = zreport.economics(manifest, blocks, batch_sizes, build_time_per_batch(manifest, teacher, seq_len, last))
    out["method"] = ECONOMICS_METHOD
    return out


def build_time_per_batch(manifest: Mapping[str, Any], teacher: Mapping[str, Any], seq_len: int,
                         last: int) -> Callable[[int, int, int], float]:
    """``(start, end, batch_size) -> s``: the teacher's forward time for one batch up to boundary
    ``end``, from the cache build's own measurement (``build_seconds`` over its sequences, each
    through the first ``last`` layers), scaled by the FLOPs of the first ``end`` layers over those of ``last``."""
    per_seq = float(manifest["build_seconds"]) / (int(manifest["n_train"]) + int(manifest["n_val"]))
    full = flops.layers_forward(teacher["layers"][:last], seq_len, teacher["width"])

    def seconds(start: int, end: int, batch_size: int) -> float:
        return per_seq * batch_size * flops.layers_forward(teacher["layers"][:end], seq_len, teacher["width"]) / full

    return seconds
