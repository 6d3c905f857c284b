"""Local-learning configuration: defaults (``LOCAL_DEFAULTS``), validation, the study's expansion
into normalised configurations (what a configuration's hash covers), block boundaries and the
step count of a token budget.

Validation reuses :mod:`zgcore.config.experiment`'s checks (unknown keys, integers, the corpus section); a bad
value raises :class:`zgcore.config.experiment.ConfigError` naming the key, before any expensive work.
"""
from __future__ import annotations

import copy
import math
from typing import Any, Mapping

from zgcore.checks import positive_int
from zgcore.config.experiment import (DEFAULTS as _MAIN_DEFAULTS, ConfigError, _check_keys, resolve_boundaries)
from .data import parse_vocab

AUX_HEADS = ("mlp", "transformer")
EXECUTIONS = ("together", "per_block", "pipeline")
# the execution modes computed in one process (their activation memory is measured in both)
ONE_PROCESS = ("together", "per_block")
VOCABS = ("compact", "full", "top:N")
MTP_CHOICES = ("off", "first", "all")
# The values a key may take, by dotted key (the configuration reference lists them).
LOCAL_CHOICES: dict[str, tuple[str, ...]] = {"local.aux": AUX_HEADS, "study.aux": AUX_HEADS, "train.execution": EXECUTIONS,
                                             "model.vocab": VOCABS, "study.mtp": MTP_CHOICES}

LOCAL_DEFAULTS: dict[str, Any] = {
    "name": "local-default",  # the study's name, shown in reports; not hashed
    # Only the tokenizer of this teacher spec is used (PrepareTeacher + PrepareCorpus); no teacher weights.
    "tokenizer": "smollm2-135m",
    "device": "cpu",  # torch device of pretraining and evaluation; not hashed
    "corpus": {**_MAIN_DEFAULTS["corpus"], "seq_len": 128},
    "model": {
        "n_layers": 8,  # decoder layers of the Llama trained from scratch
        "hidden_size": 128,  # residual-stream width
        "intermediate_size": 384,  # MLP width
        "n_heads": 4,  # attention heads
        "n_kv_heads": 2,  # key/value heads (grouped-query attention)
        "rope_theta": 10000.0,  # rotary position embedding base
        # "compact": the model's vocabulary is the token ids present in the token store (train and val),
        # renumbered in sorted order; "full": the tokenizer's whole vocabulary; "top:N": the N most
        # frequent token ids of the training rows (ties: smaller id) plus one UNK id for all others.
        "vocab": "compact",
    },
    "train": {
        "token_budget": 163840,  # tokens seen by every configuration (floored to whole batches)
        "batch_size": 8,  # sequences per step
        "lr": 3e-3,  # AdamW peak learning rate (study.lrs sweeps it instead)
        "warmup_steps": 10,  # linear warmup, then cosine decay
        "weight_decay": 0.0,  # AdamW weight decay
        "grad_clip": 1.0,  # gradient-norm clipping (0 = none)
        "seed": 0,  # model and aux-head initialisation
        "data_seed": 0,  # batch order; shared by every configuration of a study
        # K blocks in one process per step (together), one block after another (per_block), or one process per block
        # with forward-only messages between them (pipeline; zgcore.local.pipeline, docs/local_learning.md)
        "execution": "together",
        # pipeline only: true = block j consumes exactly block j-1's output of the same step (per_block's weights bit for
        # bit); false = asynchronous, block j may train on input up to j steps old (its staleness, recorded per step)
        "pipeline_sync": True,
        "log_every": 10,  # steps between loss-log rows
        "checkpoint_every": 50,  # steps between checkpoints of a PretrainLocal (resume); not hashed
        "tensorboard": True,  # write loss, lr, grad norm, tokens/s to <outputs>/tensorboard (zgcore.training.watch); not hashed
    },
    "local": {
        "K": 1,  # gradient-isolated blocks (1 = end-to-end backprop)
        "aux": "mlp",  # auxiliary head at every interior boundary
        "mtp_boundaries": [],  # boundaries 1..K-1 that add the MTP objective
        "mtp_n": 2,  # predict the next n tokens (offsets 1..n) at an MTP boundary
        "mtp_weight": 0.3,  # weight of the MTP objective at an MTP boundary
    },
    "study": {
        "K": [1, 2, 4],  # block counts compared (the product K x aux x mtp, unless configs is given)
        "aux": ["mlp", "transformer"],  # auxiliary heads compared
        "mtp": ["off", "first", "all"],  # MTP at no boundary, the first, or all interior ones
        # explicit configurations instead of the K x aux x mtp product: [{K = 1}, {K = 4, aux = "mlp", mtp = "first"}, ...];
        # an entry may also set lr, execution and pipeline_sync (arms that differ only in execution are compared)
        "configs": [],
        # learning-rate sweep: peak lrs tried for every configuration ([] = train.lr for all, no tuning split)
        "lrs": [],
        # rounds of the lr search (zgcore.training.lr_search): 1 = the lrs above only; more = refine around the best and
        # extend past an edge until the best is interior with neighbours <= 2x apart, or this many rounds ran
        "lr_rounds": 4,
        "tune_fraction": 1.0,  # tuning runs see this share of train.token_budget (1.0: the tuning run is the final run)
        "tune_sequences": 64,  # training sequences held out (seeded) to pick each configuration's lr; never trained on
        # seeds whose runs search the lr (their runs are listed apart, never reported); every seed of `seeds` then trains
        # each configuration at the lr its search chose. [] = each seed searches its own lr and reports its chosen candidate
        "search_seeds": [],
        # add "K=1 (e2e, FLOPs-matched)": end to end with as many steps as the most expensive configuration's FLOPs buy
        "flops_matched": False,
    },
    "eval": {
        "batch_size": 16,  # sequences per evaluation forward
        # 0 = the whole test split, else a random subset drawn with subset_seed (the same for every configuration)
        "max_sequences": 0,
        "subset_seed": 0,  # seed of that subset
    },
    # e.g. [0, 1, 2]: every configuration once per seed; the seed replaces train.seed and train.data_seed (initialisation,
    # data order and tuning split: the whole run's randomness); every configuration of one seed sees the same tokens
    "seeds": None,
}
UNHASHED_TOP = {"name", "device"}


# ----------------------------------------------------------------------------- configuration

def _int(where: str, v: Any, lo: int = 1) -> int:
    positive_int(where, v, zero_ok=lo == 0)
    return int(v)


def _num(where: str, v: Any, positive: bool = False) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0 or (positive and v == 0):
        raise ConfigError(f"{where} must be a {'positive' if positive else 'non-negative'} number, got {v!r}")
    return float(v)


def validate_model(m: Mapping[str, Any]) -> None:
    """Check the ``model`` section. Raises :class:`ConfigError`."""
    _check_keys("model", m, LOCAL_DEFAULTS["model"])
    for k in ("n_layers", "hidden_size", "intermediate_size", "n_heads", "n_kv_heads"):
        _int(f"model.{k}", m[k])
    if m["hidden_size"] % m["n_heads"]:
        raise ConfigError(f"model.hidden_size={m['hidden_size']} must be divisible by model.n_heads={m['n_heads']}")
    if m["n_heads"] % m["n_kv_heads"]:
        raise ConfigError(f"model.n_heads={m['n_heads']} must be divisible by model.n_kv_heads={m['n_kv_heads']}")
    if (m["hidden_size"] // m["n_heads"]) % 2:
        raise ConfigError("model.hidden_size / model.n_heads must be even (rotary embeddings rotate pairs)")
    _num("model.rope_theta", m["rope_theta"], positive=True)
    parse_vocab(m["vocab"])


def validate_local(loc: Mapping[str, Any], n_layers: int) -> None:
    """Check one configuration's ``local`` section against a model of ``n_layers`` layers.

    Raises:
        ConfigError: ``K`` above the layer count, an unknown aux head, an MTP boundary that does
            not exist (valid: ``1..K-1``), or ``mtp_n < 2`` where MTP is on.
    """
    _check_keys("local", loc, LOCAL_DEFAULTS["local"])
    k = _int("local.K", loc["K"])
    if k > n_layers:
        raise ConfigError(f"local.K={k} exceeds the model's {n_layers} layers (model.n_layers): each block needs at least one layer")
    if k > 1 and loc["aux"] not in AUX_HEADS:
        raise ConfigError(f"unknown aux head local.aux={loc['aux']!r}; known: {', '.join(AUX_HEADS)}")
    bs = loc["mtp_boundaries"]
    if not isinstance(bs, (list, tuple)) or not all(isinstance(b, int) and not isinstance(b, bool) for b in bs):
        raise ConfigError(f"local.mtp_boundaries must be a list of boundary numbers, got {bs!r}")
    for b in bs:
        if not 1 <= b <= k - 1:
            where = "there are none (K=1 has no boundary between blocks)" if k == 1 else f"they are 1..{k - 1}"
            raise ConfigError(f"MTP at boundary {b} does not exist: with K={k} the boundaries that carry an aux head "
                              f"are numbered from 1 (output of block 0) and {where}")
    if len(set(bs)) != len(bs):
        raise ConfigError(f"local.mtp_boundaries repeats a boundary: {list(bs)}")
    if bs and _int("local.mtp_n", loc["mtp_n"]) < 2:
        raise ConfigError(f"local.mtp_n must be >= 2 (next n tokens) where MTP is on, got {loc['mtp_n']!r}")
    _num("local.mtp_weight", loc["mtp_weight"])


def validate_train(t: Mapping[str, Any], seq_len: int) -> None:
    """Check the ``train`` section. Raises :class:`ConfigError`."""
    _check_keys("train", t, LOCAL_DEFAULTS["train"])
    b = _int("train.batch_size", t["batch_size"])
    budget = _int("train.token_budget", t["token_budget"])
    if budget < b * seq_len:
        raise ConfigError(f"train.token_budget={budget} is below one batch ({b} x {seq_len} = {b * seq_len} tokens)")
    _num("train.lr", t["lr"], positive=True)
    _num("train.weight_decay", t["weight_decay"])
    _num("train.grad_clip", t["grad_clip"])
    for k in ("warmup_steps", "seed", "data_seed"):
        _int(f"train.{k}", t[k], lo=0)
    _int("train.log_every", t["log_every"])
    _int("train.checkpoint_every", t["checkpoint_every"])
    if not isinstance(t["tensorboard"], bool):
        raise ConfigError(f"train.tensorboard must be true or false, got {t['tensorboard']!r}")
    _check_execution(t, "train.")


def _check_execution(t: Mapping[str, Any], where: str) -> None:
    """``execution`` is known; ``pipeline_sync`` is a bool, and false only with ``execution = "pipeline"``."""
    if t["execution"] not in EXECUTIONS:
        raise ConfigError(f"{where}execution must be one of {EXECUTIONS}, got {t['execution']!r}")
    if not isinstance(t["pipeline_sync"], bool):
        raise ConfigError(f"{where}pipeline_sync must be true or false, got {t['pipeline_sync']!r}")
    if t["pipeline_sync"] is False and t["execution"] != "pipeline":
        raise ConfigError(f"{where}pipeline_sync=false (the asynchronous schedule) needs {where}execution=\"pipeline\", "
                          f"got {t['execution']!r}: set both, or drop {where}pipeline_sync")


def normalise_run(run: Mapping[str, Any]) -> dict[str, Any]:
    """Canonical form of one configuration ``{"model", "train", "local"}``: K=1 has no aux head
    or MTP (``aux="none"``, ``mtp_boundaries=[]``), MTP boundaries sorted, settings that cannot
    matter dropped from ``local`` (and ``train.pipeline_sync`` outside a pipeline; a pipeline of
    K=1 is ``per_block``), so equal computations hash alike."""
    run = copy.deepcopy(dict(run))
    loc = run["local"]
    if int(loc["K"]) == 1:
        loc.update(aux="none", mtp_boundaries=[])
    loc["K"] = int(loc["K"])
    loc["mtp_boundaries"] = sorted(int(b) for b in loc["mtp_boundaries"])
    if not loc["mtp_boundaries"]:
        loc.update(mtp_n=1, mtp_weight=0.0)
    run["train"] = {k: v for k, v in run["train"].items() if k not in ("log_every", "checkpoint_every", "tensorboard")}
    if run["train"].get("execution") == "pipeline" and loc["K"] == 1:  # one block: a pipeline of one stage is per_block
        run["train"]["execution"] = "per_block"
    if run["train"].get("execution") != "pipeline":  # the schedule of a pipeline only
        run["train"].pop("pipeline_sync", None)
    if not run["train"].get("holdout_sequences"):  # no tuning split: the form (and hash) of a run without a sweep
        run["train"].pop("holdout_sequences", None)
    return run


def mtp_boundaries_for(choice: Any, k: int) -> list[int]:
    """Expand a study's MTP choice for ``K=k``: ``"off"`` → [], ``"first"`` → [1], ``"all"`` →
    [1..k-1], or an explicit list of boundaries (checked later). Raises :class:`ConfigError`."""
    if isinstance(choice, (list, tuple)):
        return [int(b) for b in choice]
    if choice is False or choice == "off":  # YAML 1.1 reads a bare `off` in an override as False
        return []
    if choice == "first":
        return [1] if k > 1 else []
    if choice == "all":
        return list(range(1, k))
    raise ConfigError(f"study.mtp entries must be one of {MTP_CHOICES} or a list of boundaries, got {choice!r}")


def validate_sweep(st: Mapping[str, Any], t: Mapping[str, Any], seq_len: int) -> None:
    """Check the learning-rate sweep settings of ``study`` against the ``train`` section.

    Raises:
        ConfigError: ``study.lrs`` not a list, an lr that is empty, not a number or not positive,
            a repeated lr; ``study.tune_fraction`` outside (0, 1] or a tuning budget below one
            batch; ``study.tune_sequences`` or ``study.lr_rounds`` not a positive integer.
    """
    lrs = st["lrs"]
    if lrs is None or lrs == "":
        return
    if not isinstance(lrs, (list, tuple)):
        raise ConfigError(f"study.lrs must be a list of peak learning rates, got {lrs!r}")
    for lr in lrs:
        if lr is None or lr == "":
            raise ConfigError(f"study.lrs has an empty entry: {list(lrs)!r}")
        _num("study.lrs entry", lr, positive=True)
    if len({float(x) for x in lrs}) != len(lrs):
        raise ConfigError(f"study.lrs repeats a learning rate: {list(lrs)!r}")
    f = st["tune_fraction"]
    if isinstance(f, bool) or not isinstance(f, (int, float)) or not 0 < f <= 1:
        raise ConfigError(f"study.tune_fraction must be in (0, 1] (share of train.token_budget a tuning run sees), got {f!r}")
    _int("study.tune_sequences", st["tune_sequences"])
    _int("study.lr_rounds", st["lr_rounds"])
    if lrs and tune_budget(t, f, seq_len) < int(t["batch_size"]) * seq_len:
        raise ConfigError(f"study.tune_fraction={f} gives a tuning budget below one batch "
                          f"({int(t['batch_size'])} x {seq_len} tokens); raise it or train.token_budget")


def tune_budget(t: Mapping[str, Any], fraction: float, seq_len: int) -> int:
    """Tokens of a tuning run: ``fraction`` of ``train.token_budget``, floored to whole batches
    (the full budget, unchanged, when ``fraction == 1``)."""
    if float(fraction) >= 1:
        return int(t["token_budget"])
    per = int(t["batch_size"]) * int(seq_len)
    return int(int(t["token_budget"]) * float(fraction)) // per * per


def sweep_run(run: Mapping[str, Any], lr: float, fraction: float = 1.0, seq_len: int | None = None) -> dict[str, Any]:
    """Configuration ``run`` (normalised, with its tuning split) at peak lr ``lr``; with
    ``fraction < 1`` on the tuning budget :func:`tune_budget` (needs ``seq_len``). At
    ``fraction == 1`` the tuning run and the final run are the same run (one task)."""
    run = copy.deepcopy(dict(run))
    run["train"] = {**run["train"], "lr": float(lr)}
    if float(fraction) < 1:
        run["train"]["token_budget"] = tune_budget(run["train"], fraction, int(seq_len))
    return run


def study_lrs(cfg: Mapping[str, Any]) -> list[float]:
    """The sweep's learning rates, ascending (so a tie in tuning CE picks the smaller); [] = no sweep."""
    return sorted(float(x) for x in (cfg["study"].get("lrs") or []))


def _explicit_cells(cfg: Mapping[str, Any], base: Mapping[str, Any]) -> list[tuple[int, str, Any]]:
    out = []
    for i, c in enumerate(cfg["study"]["configs"]):
        if not isinstance(c, Mapping):
            raise ConfigError(f"study.configs[{i}] must be a table such as {{K = 4, aux = \"mlp\", mtp = \"first\"}}, got {c!r}")
        _check_keys(f"study.configs[{i}]", c, {"K": 0, "aux": 0, "mtp": 0, "lr": 0, "execution": 0, "pipeline_sync": 0})
        if "K" not in c:
            raise ConfigError(f"study.configs[{i}] needs K")
        if "lr" in c:
            _num(f"study.configs[{i}].lr", c["lr"], positive=True)
        train = {k: c[k] for k in ("lr", "execution", "pipeline_sync") if k in c}
        _check_execution({**base["train"], **train}, f"study.configs[{i}].")
        out.append((_int(f"study.configs[{i}].K", c["K"]), c.get("aux", base["local"]["aux"]), c.get("mtp", "off"), train))
    return out


def execution_label(train: Mapping[str, Any]) -> str:
    """How an arm names a configuration's execution when ``study.configs`` sets it: ``"pipeline"``,
    ``"async pipeline"``, ``"per_block"`` or ``"together"``."""
    if train.get("execution") == "pipeline":
        return "pipeline" if train.get("pipeline_sync", True) else "async pipeline"
    return str(train.get("execution"))


def expand_study(cfg: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The study's configurations: every ``K x aux x mtp`` of ``cfg["study"]`` (K=1 once, as the
    end-to-end baseline), or the list ``study.configs`` when given, each ``{"K", "aux", "mtp",
    "run"}`` (plus ``"execution"``, :func:`execution_label`, where an entry of ``study.configs``
    sets ``execution`` or ``pipeline_sync`` for K > 1: arms that differ only in it) where ``run`` is a normalised configuration (see :func:`normalise_run`). Cells that
    compute the same thing (``first`` and ``all`` at K=2) share one ``run``. An empty ``study.K``
    (and no ``study.configs``) means the single ``local`` configuration. With a learning-rate
    sweep (``study.lrs``) every run holds out ``study.tune_sequences`` training sequences
    (``train.holdout_sequences``), the same in every configuration.

    Raises:
        ConfigError: an invalid configuration in the sweep, or a study without K=1 (no baseline).
    """
    st = cfg["study"]
    ks, auxs, mtps = list(st["K"] or []), list(st["aux"] or []), list(st["mtp"] or [])
    base = {"model": dict(cfg["model"]), "train": dict(cfg["train"]), "local": dict(cfg["local"])}
    if study_lrs(cfg):
        base["train"]["holdout_sequences"] = int(st["tune_sequences"])
    explicit = st.get("configs") or []
    if not ks and not explicit:
        validate_local(base["local"], cfg["model"]["n_layers"])
        run = normalise_run(base)
        return [{"K": run["local"]["K"], "aux": run["local"]["aux"], "mtp": "custom", "run": run}]
    if explicit:
        if not isinstance(explicit, (list, tuple)):
            raise ConfigError(f"study.configs must be a list of tables {{K, aux, mtp}}, got {explicit!r}")
        combos = _explicit_cells(cfg, base)
        ks = [k for k, _, _, _ in combos]
    else:
        if not auxs or not mtps:
            raise ConfigError("study.aux and study.mtp must each list at least one choice")
        combos = []
        for k in ks:
            _int("study.K entry", k)
            combos += [(int(k), aux, mtp, {}) for aux in (["none"] if k == 1 else auxs) for mtp in (["off"] if k == 1 else mtps)]
    if 1 not in ks:
        where = "study.configs must include a configuration with K=1" if explicit else f"study.K={ks} must include 1"
        raise ConfigError(f"{where}: K=1 (end-to-end backprop) is the baseline every gap is measured against")
    cells, seen = [], set()
    for k, aux, mtp, over in combos:
        aux = "none" if k == 1 else aux
        loc = {**cfg["local"], "K": k, "aux": aux if k > 1 else cfg["local"]["aux"],
               "mtp_boundaries": mtp_boundaries_for(mtp, k)}
        validate_local(loc, cfg["model"]["n_layers"])
        label = "off" if mtp is False or k == 1 else mtp if isinstance(mtp, str) else str(list(mtp))
        train = {**base["train"], **over, **({"lr": float(over["lr"])} if "lr" in over else {})}
        execution = execution_label(train) if ("execution" in over or "pipeline_sync" in over) and k > 1 else ""
        if (k, aux, label, execution) in seen:
            raise ConfigError(f"study.configs lists K={k}, aux={aux}, mtp={label}{f', {execution}' if execution else ''} twice")
        seen.add((k, aux, label, execution))
        cell = {"K": k, "aux": aux, "mtp": label, "run": normalise_run({**base, "train": train, "local": loc})}
        cells.append({**cell, "execution": execution} if execution else cell)
    return cells


def boundaries(n_layers: int, k: int) -> list[int]:
    """Layer indices ``0 = b_0 < b_1 < ... < b_K = n_layers`` splitting ``n_layers`` layers into
    ``k`` consecutive blocks, computed as ZeroGraph computes its partitions
    (:func:`zgcore.config.experiment.resolve_boundaries`: ``round(j * n_layers / k)``).

    Raises:
        ConfigError: ``k`` outside ``1..n_layers``.
    """
    if not 1 <= k <= n_layers:
        raise ConfigError(f"K={k} blocks need 1 <= K <= {n_layers} (the layer count)")
    return resolve_boundaries({"boundaries": None, "num_blocks": k}, n_layers)


def steps_for(t: Mapping[str, Any], seq_len: int) -> int:
    """Optimizer steps for the token budget: ``token_budget // (batch_size * seq_len)``."""
    return int(t["token_budget"]) // (int(t["batch_size"]) * int(seq_len))


