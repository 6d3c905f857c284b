"""Every local-learning setting, declared once (:func:`zgcore.config.fields.setting`): type, default, bounds or
allowed values, whether it enters the hash, and what it means. The checks that relate keys (head sizes, a token
budget against one batch, MTP boundaries against ``K``) stay beside them in :mod:`zgcore.local.config`.
Imports no torch.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any, Literal

from pydantic import Field

from zgcore.config.fields import Bool, Float, Int, Positive, Section, Str, section, setting
from zgcore.config.schema import Corpus

AuxHead = Literal["mlp", "transformer"]


def _pipeline(t: Mapping[str, Any]) -> bool:
    """with execution = pipeline"""
    return t.get("execution") == "pipeline"


class LocalCorpus(Corpus):
    """The training corpus and its split (as an experiment's, with shorter sequences)."""

    seq_len: Int = setting(128, "tokens per sequence (at most the teacher's context)", ge=2)


class Model(Section):
    """The Llama trained from scratch."""

    n_layers: Int = setting(8, "decoder layers of the Llama trained from scratch", ge=1)
    hidden_size: Int = setting(128, "residual-stream width", ge=1)
    intermediate_size: Int = setting(384, "MLP width", ge=1)
    n_heads: Int = setting(4, "attention heads", ge=1)
    n_kv_heads: Int = setting(2, "key/value heads (grouped-query attention)", ge=1)
    rope_theta: Float = setting(10000.0, "rotary position embedding base", gt=0)
    vocab: Str = setting("compact", '"compact": the token ids present in the token store (train and val), renumbered '
                         'in sorted order; "full": the tokenizer\'s whole vocabulary; "top:N": the N most frequent '
                         "token ids of the training rows (ties: smaller id) plus one UNK id for all others",
                         expect="one of compact, full, top:N")


class LocalTrain(Section):
    """How every configuration is trained."""

    token_budget: Int = setting(163840, "tokens seen by every configuration (floored to whole batches)", ge=1)
    batch_size: Int = setting(8, "sequences per step", ge=1)
    lr: Float = setting(3e-3, "AdamW peak learning rate (study.lrs sweeps it instead)", gt=0)
    warmup_steps: Int = setting(10, "linear warmup, then cosine decay", ge=0)
    weight_decay: Float = setting(0.0, "AdamW weight decay", ge=0)
    grad_clip: Float = setting(1.0, "gradient-norm clipping (0 = none)", ge=0)
    seed: Int = setting(0, "model and aux-head initialisation", ge=0)
    data_seed: Int = setting(0, "batch order; shared by every configuration of a study", ge=0)
    execution: Literal["together", "per_block", "pipeline"] = setting(
        "together", "K blocks in one process per step (together), one block after another (per_block), or one "
        "process per block with forward-only messages between them (pipeline; zgcore.local.pipeline, "
        "docs/local_learning.md)")
    pipeline_sync: Bool = setting(True, "pipeline only: true = block j consumes exactly block j-1's output of the same "
                                  "step (per_block's weights bit for bit); false = asynchronous, block j may train on "
                                  "input up to j steps old (its staleness, recorded per step)", hashed=_pipeline)
    log_every: Int = setting(10, "steps between loss-log rows", ge=1, hashed=False)
    checkpoint_every: Int = setting(50, "steps between checkpoints of a PretrainLocal (resume)", ge=1, hashed=False)
    tensorboard: Bool = setting(True, "write loss, lr, grad norm, tokens/s to <outputs>/tensorboard "
                                "(zgcore.training.watch)", hashed=False)


class Local(Section):
    """One configuration's gradient-isolated blocks."""

    K: Int = setting(1, "gradient-isolated blocks (1 = end-to-end backprop)", ge=1)
    aux: Literal["mlp", "transformer", "none"] = setting("mlp", "auxiliary head at every interior boundary (none: K = 1)")
    mtp_boundaries: list[Int] = setting([], "boundaries 1..K-1 that add the MTP objective",
                                        expect="a list of boundary numbers")
    mtp_n: Int = setting(2, "predict the next n tokens (offsets 1..n) at an MTP boundary", ge=1)
    mtp_weight: Float = setting(0.3, "weight of the MTP objective at an MTP boundary", ge=0)


class StudyConfig(Section):
    """One entry of ``study.configs``: a configuration compared (keys left out: the study's own)."""

    K: Int = setting(None, "gradient-isolated blocks", ge=1)
    aux: AuxHead | Literal["none"] = setting(None, "auxiliary head")
    mtp: Any = setting(None, "off, first, all or a list of boundaries")
    lr: Float = setting(None, "peak learning rate", gt=0)
    execution: Literal["together", "per_block", "pipeline"] = setting(None, "how the blocks are computed")
    pipeline_sync: Bool = setting(None, "the pipeline's schedule")


class Study(Section):
    """The configurations compared."""

    K: list[Annotated[Int, Field(ge=1)]] = setting([1, 2, 4], "block counts compared (the product K x aux x mtp, "
                                                   "unless configs is given)", expect="a list of positive integers")
    aux: list[AuxHead] = setting(["mlp", "transformer"], "auxiliary heads compared",
                                 expect="a list of mlp, transformer")
    mtp: list[Any] = setting(["off", "first", "all"], "MTP at no boundary, the first, or all interior ones",
                             expect="a list of off, first, all or lists of boundaries")
    configs: list[StudyConfig] = setting([], 'explicit configurations instead of the K x aux x mtp product: [{K = 1}, {K = 4, '
                                 'aux = "mlp", mtp = "first"}, ...]; an entry may also set lr, execution and '
                                 "pipeline_sync (arms that differ only in execution are compared)",
                                 expect="a list of tables {K, aux, mtp, lr, execution, pipeline_sync}")
    lrs: list[Positive] | Literal[""] | None = setting(
        [], "learning-rate sweep: peak lrs tried for every configuration ([] = train.lr for all, no tuning split)",
        expect="a list of distinct numbers > 0 ([] = no sweep)")
    lr_rounds: Int = setting(4, "rounds of the lr search (zgcore.training.lr_search): 1 = the lrs above only; more = "
                             "refine around the best and extend past an edge until the best is interior with "
                             "neighbours <= 2x apart, or this many rounds ran", ge=1)
    tune_fraction: Float = setting(1.0, "tuning runs see this share of train.token_budget (1.0: the tuning run is the "
                                   "final run)", gt=0, le=1)
    tune_sequences: Int = setting(64, "training sequences held out (seeded) to pick each configuration's lr; never "
                                  "trained on", ge=1)
    search_seeds: list[Any] = setting([], "seeds whose runs search the lr (their runs are listed apart, never "
                                      "reported); every seed of `seeds` then trains each configuration at the lr its "
                                      "search chose. [] = each seed searches its own lr and reports its chosen "
                                      "candidate", expect="a list of seeds")
    flops_matched: Bool = setting(False, 'add "K=1 (e2e, FLOPs-matched)": end to end with as many steps as the most '
                                  "expensive configuration's FLOPs buy")


class LocalEval(Section):
    """Evaluation on the test split."""

    batch_size: Int = setting(16, "sequences per evaluation forward", ge=1)
    max_sequences: Int = setting(0, "0 = the whole test split, else a random subset drawn with subset_seed (the same "
                                 "for every configuration)", ge=0)
    subset_seed: Int = setting(0, "seed of that subset", ge=0)


class LocalStudy(Section):
    """A local-learning study (LocalLearningStudy): configurations of gradient-isolated blocks compared."""

    name: Str = setting("local-default", "the study's name, shown in reports", hashed=False)
    tokenizer: Str = setting("smollm2-135m", "only the tokenizer of this teacher spec is used (PrepareTeacher + "
                             "PrepareCorpus); no teacher weights")
    device: Str = setting("cpu", "torch device of pretraining and evaluation", hashed=False)
    corpus: LocalCorpus = section(LocalCorpus)
    model: Model = section(Model)
    train: LocalTrain = section(LocalTrain)
    local: Local = section(Local)
    study: Study = section(Study)
    eval: LocalEval = section(LocalEval)
    seeds: list[Annotated[Int, Field(ge=0)]] | None = setting(
        None, "e.g. [0, 1, 2]: every configuration once per seed; the seed replaces train.seed and train.data_seed "
        "(initialisation, data order and tuning split: the whole run's randomness); every configuration of one seed "
        "sees the same tokens", expect="a non-empty list of distinct non-negative integers or null")
