"""Greedy local learning for LM pretraining: K gradient-isolated blocks, auxiliary heads, MTP.

Source: "Greedy Local Learning for Language Model Pretraining: Gaps and Objective Design"
(arXiv 2610.04867). A decoder-only Llama-style LM is trained from scratch, split into ``K`` blocks
of consecutive layers. Block ``j`` (0-based) owns layers ``[b_j, b_{j+1})``; block 0 also owns
the token embedding, the last block also owns the final norm and LM head. Each block reads the
previous block's output *detached* (no gradient crosses a boundary; communication between blocks
is forward-only) and steps its own AdamW optimizer. Every non-final block trains through a local
auxiliary head at its output boundary:

* ``mlp`` — a residual SwiGLU MLP, then RMSNorm and an LM head;
* ``transformer`` — one Llama decoder layer, then RMSNorm and an LM head.

The last block trains through the model's own final norm and LM head. An optional multi-token
prediction (MTP) objective at chosen boundaries adds, for offsets ``k = 2..n``, a small residual
MLP on the aux head's trunk that predicts token ``t + k`` through the same aux LM head; its mean CE
is added with weight ``mtp_weight`` (0.3 as DeepSeek-V3's MTP lambda). ``K = 1`` is ordinary
end-to-end backprop, bit for bit.

Boundaries are numbered ``1..K``: boundary ``i`` is the output of block ``i - 1``; boundaries
``1..K-1`` carry aux heads (and may carry MTP), boundary ``K`` is the model's output.

Three executions compute the same update: ``together`` (every block's forward, one backward over
the summed block losses, every optimizer steps), ``per_block`` (block by block: forward, backward,
step, keep only the detached boundary activation) and ``pipeline`` (one process per block,
:mod:`.pipeline`; its sync schedule gives ``per_block``'s weights bit for bit). Their peak
activation memory is measured: :class:`zgcore.training.memory.SavedTensorMeter`.

Modules: :mod:`.config` (settings, study expansion, boundaries), :mod:`.data` (vocabulary, id
remapping, tuning split), :mod:`.model` (model, aux heads, save/load), :mod:`.training` (execution
modes on :class:`zgcore.training.loop.TrainLoop`) and :mod:`.report`; this module re-exports their
public names. A bad configuration raises :class:`zgcore.config.experiment.ConfigError` before any
expensive work.
"""
from __future__ import annotations

from zgcore.data.order import data_order
from zgcore.training.loop import lr_at
from zgcore.training.memory import SavedTensorMeter
from .seeds import SEED_VARIES, expand_seeds, seeded, validate_seeds
from .resolve import resolve_local
from .config import (AUX_HEADS, EXECUTIONS, LOCAL_DEFAULTS, MTP_CHOICES, UNHASHED_TOP, VOCABS, boundaries, expand_study,
                     mtp_boundaries_for, normalise_run, steps_for, study_lrs, sweep_run, tune_budget,
                     validate_local, validate_model, validate_sweep, validate_train)
from .data import UNK, holdout_split, model_splits, parse_vocab, remap, top_ids, vocab_ids
from .model import (AuxHead, LocalLM, ResidualMLP, TransformerTrunk, build_local, llama_config, load_local, mtp_targets,
                    save_local, shifted_ce)
from .report import (choose_lr, paper_findings, planned_tokens_per_parameter, plot_gap_vs_k, report_markdown, study_report,
                     tokens_per_parameter)
from .training import (STEPS, batch_indices, evaluate_local, measure_activation_memory, step_per_block, step_together,
                       train_local)
from .pipeline import PipelineStageError, check_pipeline, resume_point, train_pipeline

__all__ = ["SEED_VARIES", "seeded", "validate_seeds", "AUX_HEADS", "EXECUTIONS", "LOCAL_DEFAULTS", "MTP_CHOICES", "UNHASHED_TOP", "UNK", "VOCABS", "AuxHead",
           "LocalLM", "ResidualMLP", "STEPS", "SavedTensorMeter", "TransformerTrunk", "batch_indices", "boundaries",
           "build_local", "choose_lr", "planned_tokens_per_parameter", "tokens_per_parameter", "data_order", "evaluate_local", "expand_seeds", "expand_study", "holdout_split", "llama_config",
           "load_local", "lr_at", "measure_activation_memory", "model_splits", "mtp_boundaries_for", "mtp_targets",
           "normalise_run", "paper_findings", "parse_vocab", "plot_gap_vs_k", "remap", "report_markdown",
           "resolve_local", "save_local", "shifted_ce", "step_per_block", "step_together", "steps_for", "study_lrs",
           "study_report", "sweep_run", "top_ids", "train_local", "tune_budget", "validate_local", "validate_model",
           "validate_sweep", "validate_train", "vocab_ids", "PipelineStageError", "check_pipeline", "resume_point",
           "train_pipeline"]
