"""Every experiment key and its default value (``DEFAULTS``, with what each one means), and the
choices a key may take. Data only: loading and checking a configuration is :mod:`zgcore.config.experiment`.

A configuration's hash is taken from its canonical values (:mod:`zgcore.hashing`), never from
where a default is written down.
"""
from __future__ import annotations

from typing import Any

# the heal section (end-to-end logit KD of the assembled student; zgcore.training.distill, tasks Heal)
HEAL_DEFAULTS: dict[str, Any] = {
    "steps": 0,  # 0 = no healing stage (no task, no hash change)
    "lr": 1e-4,  # AdamW peak learning rate
    "batch_size": 4,  # sequences per step
    "temperature": 1.0,  # softmax temperature of the logit KD (> 0)
    # 0 = KD on the full vocabulary; k > 0 = KL over the teacher's top k tokens plus one bucket for the rest
    # (zgcore.training.topk), computed in chunks of positions; online or from the top-k logit store (64 measured
    # as close to the full vocabulary as three seeds can tell on SmolLM2's healing: docs/topk-distillation.md)
    "top_k": 0,
    # "online": the teacher runs each step; "cached": read top_k targets from the logit store (TeacherLogitStore:
    # the teacher's layers are never loaded; needs top_k > 0 and hidden_weight = 0); the same bytes either way
    "targets": "online",
    "hidden_weight": 0.0,  # weight of the hidden-state term at the interior boundaries (0 = logits only)
    "warmup_steps": 0,  # linear learning-rate warmup steps
    "weight_decay": 0.0,  # AdamW weight decay
    "grad_clip": 1.0,  # gradient-norm clipping (0 = none)
    "seed": 0,  # batch order
    "checkpoint_every": 25,  # steps between checkpoints (resume after an interruption); not hashed
    # steps between read-backs of the losses and gradient norms from the device (one host sync each; a
    # non-finite value fails the run there, before any checkpoint); not hashed (zgcore.training.loop)
    "log_every": 10,
    "tensorboard": True,  # write loss, lr, grad norm, tokens/s to <outputs>/tensorboard (zgcore.training.watch); not hashed
}

# the distill section (DistillStudy's end-to-end arm): the heal settings with these changes
DISTILL_DEFAULTS: dict[str, Any] = {
    **HEAL_DEFAULTS,
    "steps": 0,  # 0 = matched: as many student layer-token passes as the blockwise arm (zgcore.training.distill.e2e_steps)
    "lr": 3e-4,
    # lr search of the end-to-end arms (zgcore.training.lr_search), each candidate at the arm's full budget, scored by held-out
    # CE on the validation sequences outside the test subset (needs eval.max_sequences below the split's size)
    "lrs": [],  # the first round's lrs ([] = no search, distill.lr)
    "lr_rounds": 4,  # lr-search rounds at most
}

DEFAULTS: dict[str, Any] = {
    "name": "default",  # the experiment's name, shown in reports; not hashed
    "teacher": "smollm2-135m",  # smollm2-135m | tiny-<family> | a Hugging Face folder | a .gguf file | a Hub id org/name
    "device": "cpu",  # torch device of the cache build, blocks, assembly and evaluation (cpu, cuda, cuda:1); not hashed
    # "auto" | true | false: run the teacher layer by layer over stored tokens (one decoder layer held at a time; the
    # same bytes); "auto" streams when the whole teacher does not fit the device's free memory; not hashed
    "teacher_stream": "auto",
    "seeds": None,  # e.g. [0, 1, 2]: one set of blocks and one student per seed (train.seed replaced), one cache
    "corpus": {
        # "pydoc" = the English reference text shipped in the standard library (pydoc_data.topics);
        # "python-stdlib" = the standard library's own .py files (~30 MB); or files / globs: text,
        # .jsonl / .parquet (field / column `text_field`), or a datasets.save_to_disk folder.
        "source": "pydoc",
        "text_field": "text",  # the field (.jsonl) or column (.parquet, saved dataset) holding the text
        "buffer_tokens": 1 << 20,  # tokens held in memory while tokenising (bounds PrepareCorpus' memory)
        "seq_len": 256,  # tokens per sequence (at most the teacher's context)
        "val_fraction": 0.1,  # share of the sequences held out (seeded split) for evaluation
        "max_tokens": 0,  # cap on the tokens read (sources are read in order; later files are never opened); 0 = all tokens
        "split_seed": 0,  # seed of the train/val split
    },
    "boundary": {
        "num_blocks": 3,  # K: partitions of the teacher's layers, each trained as one student block
        "boundaries": None,  # None = evenly spaced: [0, n/K, 2n/K, ..., n]
        "dtype": "float32",  # storage dtype of the boundaries in the cache
        "batch_size": 8,  # sequences per teacher forward
        # sequences per BoundaryShard task (a multiple of batch_size); how the cache build is split
        # over workers, not what it holds: unhashed, the bytes are identical for any value
        "shard_sequences": 1024,
        "teacher_dtype": "float32",  # dtype the teacher is loaded and run in (cache build, online targets)
        # how the store codes each boundary (zgcore.data.boundary_store.codec, docs/storage.md): none (dtype as it
        # is), or position 0 and codec_keep channels in bfloat16 and the rest, with one scale per token, as fp8
        # (e4m3, 8.4 bits/element at SmolLM2's shape), int8 (8.4) or int4 (randomized Hadamard first, 4.4);
        # hashed only when not none
        "codec": "none",
        "codec_keep": 8,  # channels of largest RMS kept in bfloat16 per sequence by a codec; hashed only with one
    },
    "train": {
        "objective": "clean",  # clean | noisy | denoise | attention_transfer (a converted mixer first matches the teacher's attention); the local objective (zgcore.training.objectives registry): what a block sees and must output
        "targets": "cached",  # "cached": read the teacher boundary store; "online": run the teacher each step
        "noise": 0.1,  # noisy/denoise objectives: noise std as a multiple of each channel's RMS
        "loss_norm": "channel",  # per-channel RMS (channel), per-token norm (token) or plain MSE (none)
        "n_layers": None,  # None = round(keep_fraction * partition size)
        "keep_fraction": 0.8,  # share of each partition's teacher layers the student block keeps
        "keep": "spread",  # which teacher layers of the partition the student starts from (or "importance")
        "importance_sequences": 32,  # keep="importance" / intermediate_size: train sequences measured on the teacher
        "intermediate_size": None,  # None = the teacher's MLP width; narrower keeps the most active channels
        # None = the teacher's key-value heads; fewer (dividing them; Llama, Mistral, Qwen2/3) starts each group from the mean of its heads
        "kv_heads": None,
        "init": "teacher",  # "teacher" (copy kept layers) or "random"
        # the token mixer of the block's layers (zgcore.models.mixers, docs/conversion.md): softmax = the teacher's attention;
        # window = softmax over the last train.window tokens; linear = causal linear attention with a learned (Hedgehog)
        # feature map; linear_window = softmax inside the window, linear beyond it, one normaliser (LoLCATs); none = no
        # attention sub-layer. Each starts from the teacher's q/k/v/o and rotary positions; not hashed when softmax
        "mixer": "softmax",
        "window": 64,  # tokens a window / linear_window mixer attends to with softmax (the current one included); hashed only for those
        # objective attention_transfer: steps of per-layer attention-output matching before clean regression (the rest)
        "transfer_steps": 50,
        "lr": 2e-3,  # AdamW peak; block-1 sweep on SmolLM2: 2e-4 < 5e-4 < 1e-3 < 2e-3 in recovered CE
        # lr search per block (zgcore.training.lr_search), scored on the block's validation loss over the validation
        # sequences outside the test subset (needs eval.max_sequences below the split's size)
        "lrs": [],  # the first round's lrs ([] = no search, train.lr)
        "lr_rounds": 4,  # lr-search rounds at most (refine around the best, extend past an edge)
        "epochs": 1.5,  # passes over the training split per block
        "max_steps": 0,  # 0 = epochs decide
        "batch_size": 4,  # more, smaller steps beat fewer large ones at this token budget
        "warmup_steps": 10,  # linear learning-rate warmup, then cosine decay
        "weight_decay": 0.0,  # AdamW weight decay
        "grad_clip": 1.0,  # gradient-norm clipping (0 = none)
        "seed": 0,  # initialisation, noise and batch order of the block
        "checkpoint_every": 25,  # steps between checkpoints (resume after an interruption); not hashed
        # steps between read-backs of the losses and gradient norms from the device (one host sync each; a
        # non-finite value fails the run there, before any checkpoint); not hashed (zgcore.training.loop)
        "log_every": 10,
        # batches read from the boundary store ahead of the step by each background worker (0 = read
        # synchronously); same order and bytes either way, so not hashed (zgcore.data.feed)
        "prefetch": 2,
        # workers reading ahead (each reads every n-th batch): "auto" = 2 for an accelerator, 1 on a CPU
        # (zgcore.data.feed.choose_workers), or a number; not hashed
        "prefetch_workers": "auto",
        # "auto": worker threads on a CPU and for an accelerator's batches under 12 MiB, worker processes for
        # larger ones (zgcore.data.feed.choose_mode, measured in docs/performance.md); "thread" or "process"
        # force one kind. Not hashed
        "prefetch_mode": "auto",
        # torch.compile the block's training step (forward and backward; zgcore.training.blocks.train_block):
        # 3-9% faster steps on the default experiment's CPU blocks after a one-off compile (docs/performance.md),
        # bitwise reproducible run to run but not bitwise the eager weights, so hashed when true
        "compile": False,
        "tensorboard": True,  # write loss, lr, grad norm, tokens/s to <outputs>/tensorboard (zgcore.training.watch); not hashed
        # local auxiliary terms through the teacher's frozen head (zgcore.training.objectives.aux_losses); 0 = off, not hashed
        "ce_weight": 0.0,  # next-token cross-entropy
        "mtp_weight": 0.0,  # multi-token prediction over the next mtp_n tokens
        "mtp_n": 2,  # tokens ahead predicted by the multi-token term
    },
    "blocks": {},  # per-block overrides of any train key: blocks.N.<key> (N = 0, 1, ...)
    "heal": HEAL_DEFAULTS,  # end-to-end logit KD after assembly (healing)
    # the library of candidate blocks (SelectStudent, docs/library.md): shapes tried at every partition,
    # each trained, scored in context and costed once; one student chosen per budget
    "library": {
        # candidate shapes at every partition: tables of n_layers | keep_fraction, keep, mlp (share of the
        # teacher's MLP width), kv_heads; a key left out keeps the block's train setting
        "variants": [],
        "blocks": {},  # per-partition lists replacing library.variants there: library.blocks.<i>.variants
        "budgets": [],  # one student per budget: an amount of budget_unit, or a share of the teacher's when <= 1
        "budget_unit": "params",  # params (non-embedding) | flops (per token at corpus.seq_len) | kv_bytes (per token)
        # kv_bytes counted as one sequence's decode state at this many tokens (softmax caches grow, window and linear
        # mixers' stop: a variant's mixer then answers which partitions keep softmax); 0 = per token. Hashed when > 0
        "context": 0,
    },
    "distill": DISTILL_DEFAULTS,  # DistillStudy's end-to-end arm
    "eval": {
        "batch_size": 8,  # sequences per evaluation forward
        "max_sequences": 0,  # 0 = the whole validation split; else a seeded random subset of it (the same for every arm)
        "subset_seed": 0,  # seed of that subset (its row indices are hashed into each evaluation's output)
        # out-of-domain held-out corpora, never trained on, each scored for teacher, untrained and assembled
        # student: sources as corpus.source takes them ("stdlib-docstrings", files, globs) or tables
        # {name, source, text_field, max_tokens}; workflows/presets/default.toml adds "stdlib-docstrings"
        "extra": [],
        "context_window": 16,  # W: tokens visible in the restricted condition of context use
        "context_sequences": 8,  # validation sequences used for context use (it costs ~W/2 forwards each)
        "gate_gap": 0.8,  # quality gate: share of the untrained->teacher CE gap recovered
        "gate_context": 0.8,  # context gate: student context use >= this x teacher's (and > 0)
    },
}

# Keys that change where results land but not what is computed are never hashed.
UNHASHED_TOP = {"name", "device", "teacher_stream"}
KEEP_POLICIES = ("spread", "first", "last", "importance")
INITS = ("teacher", "random")
MIXERS = ("softmax", "window", "linear", "linear_window", "none")  # zgcore.models.hf_converted_llama.MIXERS
DTYPES = ("float32", "float16", "bfloat16")
LOSS_NORMS = ("none", "token", "channel")
PREFETCH_MODES = ("auto", "thread", "process")  # "auto": zgcore.data.feed.choose_mode; the rest: zgcore.data.feed.MODES
TARGETS = ("cached", "online")
CODECS = ("none", "fp8", "int8", "int4")  # zgcore.data.boundary_store.codec.NAMES

# The values a key may take, by dotted key (the configuration reference lists them). The objective
# registry (zgcore.training.objectives) holds train.objective's.
CHOICES: dict[str, tuple[str, ...]] = {
    "boundary.dtype": DTYPES, "boundary.teacher_dtype": DTYPES, "train.targets": TARGETS, "boundary.codec": CODECS,
    "heal.targets": TARGETS, "distill.targets": TARGETS,
    "train.loss_norm": LOSS_NORMS, "train.keep": KEEP_POLICIES, "train.init": INITS, "train.mixer": MIXERS,
    "train.prefetch_mode": PREFETCH_MODES,
    "library.budget_unit": ("params", "flops", "kv_bytes"),
}
