"""Every experiment setting, declared once (:func:`zgcore.config.fields.setting`): its type, default, bounds or
allowed values, whether it enters the hash, and what it means. Sections nest as an experiment file does
(``[corpus]``, ``[train]``, ...); ``blocks.N.<key>`` overrides any :class:`Train` setting for one block.

Checks that relate several keys, or need the teacher, stay beside these as functions
(:mod:`zgcore.config.experiment`). Imports no torch: a rule that needs a registry imports it when it runs.

Adding a setting is one line in its section, e.g. ``codec: Literal["none", "zstd"] = setting("none",
"boundary compression", hashed=NOT_DEFAULT)``; its check, its hash rule and its row in ``docs/configuration.md``
(``.venv/bin/python -m workflows.reference --write``) follow from it.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any, Literal

from pydantic import Field

from zgcore.config.fields import NOT_DEFAULT, Bool, Float, Int, Positive, Section, Str, section, setting

Dtype = Literal["float32", "float16", "bfloat16"]
Mixer = Literal["softmax", "window", "linear", "linear_window", "none"]  # zgcore.models.hf_converted_llama.MIXERS
Keep = Literal["spread", "first", "last", "importance"]
Targets = Literal["cached", "online"]
LRS = "a list of distinct numbers > 0 ([] = no search)"


def _objectives() -> tuple[str, ...]:
    from zgcore.training.objectives import OBJECTIVES  # imports torch: only when a value is checked or documented

    return tuple(OBJECTIVES)


def _read_by_objective(key: str):
    def rule(t: Mapping[str, Any]) -> bool:
        from zgcore.training.objectives import OBJECTIVES

        return key in OBJECTIVES[t["objective"]].reads
    rule.__doc__ = f"when the objective reads {key}"
    return rule


def _no_search(t: Mapping[str, Any]) -> bool:
    """without an lr search (lrs empty)"""
    return not t.get("lrs")


def _search(t: Mapping[str, Any]) -> bool:
    """with an lr search (lrs given)"""
    return bool(t.get("lrs"))


def _no_max_steps(t: Mapping[str, Any]) -> bool:
    """when max_steps is 0"""
    return not int(t.get("max_steps") or 0)


def _no_n_layers(t: Mapping[str, Any]) -> bool:
    """when n_layers is null"""
    return t.get("n_layers") is None


def _measured(t: Mapping[str, Any]) -> bool:
    """when something is measured (keep = importance or an intermediate_size)"""
    return t.get("intermediate_size") is not None or t.get("keep") == "importance"


def _windowed(t: Mapping[str, Any]) -> bool:
    """for a window or linear_window mixer"""
    from zgcore.models.mixers import WINDOWED  # imports torch: only when a hash is taken

    return t.get("mixer") in WINDOWED


def _mtp_on(t: Mapping[str, Any]) -> bool:
    """when mtp_weight > 0"""
    return float(t.get("mtp_weight") or 0.0) > 0


def _ce_on(t: Mapping[str, Any]) -> bool:
    """when ce_weight > 0"""
    return float(t.get("ce_weight") or 0.0) > 0


class Corpus(Section):
    """The training corpus and its split."""

    source: Str | list[Str] = setting("pydoc", '"pydoc" = the English reference text shipped in the standard library '
                          '(pydoc_data.topics); "python-stdlib" = the standard library\'s own .py files (~30 MB); or '
                          "files / globs: text, .jsonl / .parquet (field / column `text_field`), or a "
                          "datasets.save_to_disk folder", expect="a built-in name, a file, a glob or a list of them")
    text_field: Str = setting("text", "the field (.jsonl) or column (.parquet, saved dataset) holding the text")
    buffer_tokens: Int = setting(1 << 20, "tokens held in memory while tokenising (bounds PrepareCorpus' memory)",
                                 ge=1)
    seq_len: Int = setting(256, "tokens per sequence (at most the teacher's context)", ge=2)
    val_fraction: Float = setting(0.1, "share of the sequences held out (seeded split) for evaluation", gt=0, lt=1)
    max_tokens: Int = setting(0, "cap on the tokens read (sources are read in order; later files are never opened); "
                              "0 = all tokens", ge=0)
    split_seed: Int = setting(0, "seed of the train/val split")


def _with_codec(b: Mapping[str, Any]) -> bool:
    """when boundary.codec is not none"""
    return b.get("codec", "none") != "none"


class Boundary(Section):
    """The teacher's partitions and the boundary cache."""

    num_blocks: Int = setting(3, "K: partitions of the teacher's layers, each trained as one student block", ge=1)
    boundaries: list[Int] | None = setting(None, "None = evenly spaced: [0, n/K, 2n/K, ..., n]",
                                           expect="a list of at least two integers or null")
    dtype: Dtype = setting("float32", "storage dtype of the boundaries in the cache")
    batch_size: Int = setting(8, "sequences per teacher forward", ge=1)
    shard_sequences: Int = setting(1024, "sequences per BoundaryShard task (a multiple of batch_size); how the cache "
                                   "build is split over workers, not what it holds (the bytes are identical for any "
                                   "value)", ge=1, hashed=False)
    teacher_dtype: Dtype = setting("float32", "dtype the teacher is loaded and run in (cache build, online targets)")
    codec: Literal["none", "fp8", "int8", "int4"] = setting(
        "none", "how the store codes each boundary (zgcore.data.boundary_store.codec, docs/storage.md): none (dtype as "
        "it is), or position 0 and codec_keep channels in bfloat16 and the rest, with one scale per token, as fp8 "
        "(e4m3, 8.3 bits/element at SmolLM2's shape), int8 (8.3) or int4 (randomized Hadamard first, 4.3)",
        hashed=NOT_DEFAULT)
    codec_keep: Int = setting(8, "channels of largest RMS kept in bfloat16 per sequence by a codec", ge=0,
                              hashed=_with_codec)


class Train(Section):
    """Every block's train settings (``blocks.N.<key>`` overrides one block's)."""

    objective: Str = setting("clean", "the local objective (zgcore.training.objectives registry): what a block sees "
                             "and must output; attention_transfer: a converted mixer first matches the teacher's "
                             "attention", choices=_objectives)
    targets: Targets = setting("cached", '"cached": read the teacher boundary store; "online": run the teacher each '
                               "step")
    noise: Float = setting(0.1, "noisy/denoise objectives: noise std as a multiple of each channel's RMS", ge=0,
                           hashed=_read_by_objective("noise"))
    loss_norm: Literal["none", "token", "channel"] = setting(
        "channel", "per-channel RMS (channel), per-token norm (token) or plain MSE (none)")
    n_layers: Int | None = setting(None, "None = round(keep_fraction * partition size)", ge=1)
    keep_fraction: Float = setting(0.8, "share of each partition's teacher layers the student block keeps", gt=0,
                                   le=1, hashed=_no_n_layers)
    keep: Keep = setting("spread", "which teacher layers of the partition the student starts from")
    importance_sequences: Int = setting(32, 'keep="importance" / intermediate_size: train sequences measured on the '
                                        "teacher", ge=1, hashed=_measured)
    intermediate_size: Int | None = setting(None, "None = the teacher's MLP width; narrower keeps the most active "
                                            "channels", ge=1, hashed=NOT_DEFAULT)
    kv_heads: Int | None = setting(None, "None = the teacher's key-value heads; fewer (dividing them; Llama, Mistral, "
                                   "Qwen2/3) starts each group from the mean of its heads", ge=1, hashed=NOT_DEFAULT)
    init: Literal["teacher", "random"] = setting("teacher", '"teacher" (copy kept layers) or "random"')
    mixer: Mixer = setting("softmax", "the token mixer of the block's layers (zgcore.models.mixers, "
                           "docs/conversion.md): softmax = the teacher's attention; window = softmax over the last "
                           "train.window tokens; linear = causal linear attention with a learned (Hedgehog) feature "
                           "map; linear_window = softmax inside the window, linear beyond it, one normaliser "
                           "(LoLCATs); none = no attention sub-layer. Each starts from the teacher's q/k/v/o and "
                           "rotary positions", hashed=NOT_DEFAULT)
    window: Int = setting(64, "tokens a window / linear_window mixer attends to with softmax (the current one "
                          "included)", ge=1, hashed=_windowed)
    transfer_steps: Int = setting(50, "objective attention_transfer: steps of per-layer attention-output matching "
                                  "before clean regression (the rest)", ge=1,
                                  hashed=_read_by_objective("transfer_steps"))
    lr: Float = setting(2e-3, "AdamW peak; block-1 sweep on SmolLM2: 2e-4 < 5e-4 < 1e-3 < 2e-3 in recovered CE", gt=0,
                        hashed=_no_search)
    lrs: list[Positive] = setting([], "lr search per block (zgcore.training.lr_search): the first round's lrs ([] = no "
                                  "search, train.lr), scored on the block's validation loss over the validation "
                                  "sequences outside the test subset (needs eval.max_sequences)", hashed=_search,
                                  expect=LRS)
    lr_rounds: Int = setting(4, "lr-search rounds at most (refine around the best, extend past an edge)", ge=1,
                             hashed=_search)
    epochs: Float = setting(1.5, "passes over the training split per block", ge=0, hashed=_no_max_steps)
    max_steps: Int = setting(0, "0 = epochs decide", ge=0)
    batch_size: Int = setting(4, "more, smaller steps beat fewer large ones at this token budget", ge=1)
    warmup_steps: Int = setting(10, "linear learning-rate warmup, then cosine decay", ge=0)
    weight_decay: Float = setting(0.0, "AdamW weight decay")
    grad_clip: Float = setting(1.0, "gradient-norm clipping (0 = none)")
    seed: Int = setting(0, "initialisation, noise and batch order of the block", ge=0)
    checkpoint_every: Int = setting(25, "steps between checkpoints (resume after an interruption)", ge=1,
                                    hashed=False)
    log_every: Int = setting(10, "steps between read-backs of the losses and gradient norms from the device (one host "
                             "sync each; a non-finite value fails the run there, before any checkpoint; "
                             "zgcore.training.loop)", ge=1, hashed=False)
    prefetch: Int = setting(2, "batches read from the boundary store ahead of the step by each background worker (0 = "
                            "read synchronously); same order and bytes either way (zgcore.data.feed)", ge=0,
                            hashed=False)
    prefetch_workers: Literal["auto"] | Annotated[Int, Field(ge=1)] = setting(
        "auto", 'workers reading ahead (each reads every n-th batch): "auto" = 2 for an accelerator, 1 on a CPU '
        "(zgcore.data.feed.choose_workers), or a number", hashed=False, expect='a positive integer or "auto"')
    prefetch_mode: Literal["auto", "thread", "process"] = setting(
        "auto", '"auto": worker threads on a CPU and for an accelerator\'s batches under 12 MiB, worker processes for '
        'larger ones (zgcore.data.feed.choose_mode, docs/performance.md); "thread" or "process" force one kind',
        hashed=False)
    compile: Bool = setting(False, "torch.compile the block's training step (forward and backward): 3-9% faster steps "
                            "on CPU blocks after a one-off compile (docs/performance.md), bitwise reproducible run to "
                            "run but not bitwise the eager weights", hashed=NOT_DEFAULT)
    tensorboard: Bool = setting(True, "write loss, lr, grad norm, tokens/s to <outputs>/tensorboard "
                                "(zgcore.training.watch)", hashed=False)
    ce_weight: Float = setting(0.0, "local auxiliary next-token cross-entropy through the teacher's frozen head "
                               "(zgcore.training.objectives.aux_losses); 0 = off", ge=0, hashed=_ce_on)
    mtp_weight: Float = setting(0.0, "local auxiliary multi-token prediction over the next mtp_n tokens; 0 = off",
                                ge=0, hashed=_mtp_on)
    mtp_n: Int = setting(2, "tokens ahead predicted by the multi-token term", ge=1, hashed=_mtp_on)


class Heal(Section):
    """End-to-end logit KD of the assembled student (healing; zgcore.training.distill, task Heal)."""

    steps: Int = setting(0, "0 = no healing stage (no task, no hash change)", ge=0)
    lr: Float = setting(1e-4, "AdamW peak learning rate", gt=0, hashed=_no_search)
    batch_size: Int = setting(4, "sequences per step", ge=1)
    temperature: Float = setting(1.0, "softmax temperature of the logit KD", gt=0)
    top_k: Int = setting(0, "0 = KD on the full vocabulary; k > 0 = KL over the teacher's top k tokens plus one bucket "
                         "for the rest (zgcore.training.topk; 64 measured as close to the full vocabulary: "
                         "docs/topk-distillation.md)", ge=0, hashed=NOT_DEFAULT)
    targets: Literal["online", "cached"] = setting(
        "online", '"online": the teacher runs each step; "cached": read top_k targets from the logit store (the '
        "teacher's layers are never loaded; needs top_k > 0 and hidden_weight = 0); the same bytes either way",
        hashed=NOT_DEFAULT)
    hidden_weight: Float = setting(0.0, "weight of the hidden-state term at the interior boundaries (0 = logits only)",
                                   ge=0)
    warmup_steps: Int = setting(0, "linear learning-rate warmup steps", ge=0)
    weight_decay: Float = setting(0.0, "AdamW weight decay", ge=0)
    grad_clip: Float = setting(1.0, "gradient-norm clipping (0 = none)", ge=0)
    seed: Int = setting(0, "batch order", ge=0)
    checkpoint_every: Int = setting(25, "steps between checkpoints (resume after an interruption)", ge=1,
                                    hashed=False)
    log_every: Int = setting(10, "steps between read-backs of the losses and gradient norms from the device (one host "
                             "sync each; a non-finite value fails the run there)", ge=1, hashed=False)
    tensorboard: Bool = setting(True, "write loss, lr, grad norm, tokens/s to <outputs>/tensorboard "
                                "(zgcore.training.watch)", hashed=False)


class Distill(Heal):
    """DistillStudy's end-to-end arm: the heal settings with these changes."""

    steps: Int = setting(0, "0 = matched: as many student layer-token passes as the blockwise arm "
                         "(zgcore.training.distill.e2e_steps)", ge=0)
    lr: Float = setting(3e-4, "AdamW peak learning rate", gt=0, hashed=_no_search)
    lrs: list[Positive] = setting([], "lr search of the end-to-end arm (zgcore.training.lr_search), each candidate at "
                                  "the arm's full budget, scored by held-out CE (needs eval.max_sequences): the first "
                                  "round's lrs ([] = no search, distill.lr)", hashed=_search, expect=LRS)
    lr_rounds: Int = setting(4, "lr-search rounds at most", ge=1, hashed=_search)


class Variant(Section):
    """One candidate shape of a library partition; a key left out keeps the block's train setting."""

    n_layers: Int = setting(None, "teacher layers the candidate keeps", ge=1)
    keep_fraction: Float = setting(None, "share of the partition's layers kept (instead of n_layers)", gt=0, le=1)
    keep: Keep = setting(None, "which layers")
    mlp: Float = setting(None, "MLP width as a share of the teacher's (1 = the teacher's width)", gt=0, le=1)
    kv_heads: Int = setting(None, "key-value heads (fewer: grouped-query conversion)", ge=1)
    mixer: Mixer = setting(None, "the token mixer")


class LibraryBlock(Section):
    """One partition's own candidates."""

    variants: list[Variant] = setting([], "the partition's candidate shapes", expect="a list of tables")


class Library(Section):
    """The library of candidate blocks (SelectStudent, docs/library.md)."""

    variants: list[Variant] = setting([], "candidate shapes at every partition: tables of n_layers | keep_fraction, "
                                      "keep, mlp (share of the teacher's MLP width), kv_heads, mixer; a key left out "
                                      "keeps the block's train setting", expect="a list of tables")
    blocks: dict[str, LibraryBlock] = setting({}, "per-partition lists replacing library.variants there: "
                                              "library.blocks.<i>.variants", expect="a table of {variants = [...]}")
    budgets: list[Positive] = setting([], "one student per budget: an amount of budget_unit, or a share of the teacher's "
                                   "when <= 1", expect="a list of numbers > 0")
    budget_unit: Literal["params", "flops", "kv_bytes"] = setting(
        "params", "params (non-embedding) | flops (per token at corpus.seq_len) | kv_bytes (per token)")
    context: Int = setting(0, "kv_bytes counted as one sequence's decode state at this many tokens (softmax caches "
                           "grow, window and linear mixers' stop); 0 = per token", ge=0)


class Eval(Section):
    """Evaluation of teacher, untrained and assembled students."""

    batch_size: Int = setting(8, "sequences per evaluation forward", ge=1)
    max_sequences: Int = setting(0, "0 = the whole validation split; else a seeded random subset of it (the same for "
                                 "every arm)", ge=0)
    subset_seed: Int = setting(0, "seed of that subset (its row indices are hashed into each evaluation's output)",
                               ge=0)
    extra: list[Any] = setting([], "out-of-domain held-out corpora, never trained on, each scored for teacher, "
                               'untrained and assembled student: sources as corpus.source takes them ("stdlib-'
                               'docstrings", files, globs) or tables {name, source, text_field, max_tokens}',
                               expect="a list of sources or tables")
    context_window: Int = setting(16, "W: tokens visible in the restricted condition of context use", ge=1)
    context_sequences: Int = setting(8, "validation sequences used for context use (it costs ~W/2 forwards each)",
                                     ge=0)
    gate_gap: Float = setting(0.8, "quality gate: share of the untrained->teacher CE gap recovered")
    gate_context: Float = setting(0.8, "context gate: student context use >= this x teacher's (and > 0)")


class Experiment(Section):
    """An experiment: the teacher, its corpus and partitions, how blocks are trained, assembled, healed and scored."""

    name: Str = setting("default", "the experiment's name, shown in reports", hashed=False)
    teacher: Str = setting("smollm2-135m", "smollm2-135m | tiny-<family> | a Hugging Face folder | a .gguf file | a "
                           "Hub id org/name")
    device: Str = setting("cpu", "torch device of the cache build, blocks, assembly and evaluation (cpu, cuda, "
                          "cuda:1)", hashed=False)
    teacher_stream: Literal["auto"] | Bool = setting(
        "auto", "run the teacher layer by layer over stored tokens (one decoder layer held at a time; the same "
        'bytes); "auto" streams when the whole teacher does not fit the device\'s free memory', hashed=False,
        expect='"auto", true or false')
    seeds: list[Annotated[Int, Field(ge=0)]] | None = setting(None, "e.g. [0, 1, 2]: one set of blocks and one student per seed (train.seed "
                                      "replaced), one cache", expect="a non-empty list of distinct integers >= 0 or "
                                      "null")
    corpus: Corpus = section(Corpus)
    boundary: Boundary = section(Boundary)
    train: Train = section(Train)
    blocks: dict[str, dict[str, Any]] = setting({}, "per-block overrides of any train key: blocks.N.<key> (N = 0, 1, "
                                                "...)", expect="a table of block index -> train settings")
    heal: Heal = section(Heal)
    library: Library = section(Library)
    distill: Distill = section(Distill)
    eval: Eval = section(Eval)
