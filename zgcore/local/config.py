"""Local-learning configuration: defaults (``LOCAL_DEFAULTS``), validation, the study's expansion
into normalised configurations (what a configuration's hash covers), block boundaries and the
step count of a token budget.

Validation reuses :mod:`zgcore.config.experiment`'s checks (unknown keys, integers, the corpus section); a bad
value raises :class:`zgcore.config.experiment.ConfigError` naming the key, before any expensive work.
"""
from __future__ import annotations

import copy
from typing import Any, get_args
from collections.abc import Mapping

from zgcore.config.experiment import ConfigError, resolve_boundaries
from zgcore.config.fields import check_section, defaults, hashed_view, never_hashed
from .data import parse_vocab
from .schema import AuxHead, Local, LocalStudy, LocalTrain, Model, StudyConfig

AUX_HEADS = get_args(AuxHead)
EXECUTIONS = get_args(LocalTrain.model_fields["execution"].annotation)
# the execution modes computed in one process (their activation memory is measured in both)
ONE_PROCESS = ("together", "per_block")
VOCABS = ("compact", "full", "top:N")
MTP_CHOICES = ("off", "first", "all")
# every key's default, derived from the declarations (zgcore.local.schema)
LOCAL_DEFAULTS: dict[str, Any] = defaults(LocalStudy)
UNHASHED_TOP = never_hashed(LocalStudy)


# ----------------------------------------------------------------------------- configuration

def validate_model(m: Mapping[str, Any]) -> None:
    """Check the ``model`` section. Raises :class:`ConfigError`."""
    check_section(Model, m, "model")
    if m["hidden_size"] % m["n_heads"]:
        raise ConfigError(f"model.hidden_size={m['hidden_size']} must be divisible by model.n_heads={m['n_heads']}")
    if m["n_heads"] % m["n_kv_heads"]:
        raise ConfigError(f"model.n_heads={m['n_heads']} must be divisible by model.n_kv_heads={m['n_kv_heads']}")
    if (m["hidden_size"] // m["n_heads"]) % 2:
        raise ConfigError("model.hidden_size / model.n_heads must be even (rotary embeddings rotate pairs)")
    parse_vocab(m["vocab"])


def validate_local(loc: Mapping[str, Any], n_layers: int) -> None:
    """Check one configuration's ``local`` section against a model of ``n_layers`` layers.

    Raises:
        ConfigError: ``K`` above the layer count, an unknown aux head, an MTP boundary that does
            not exist (valid: ``1..K-1``), or ``mtp_n < 2`` where MTP is on.
    """
    check_section(Local, loc, "local")
    k = int(loc["K"])
    if k > n_layers:
        raise ConfigError(f"local.K={k} exceeds the model's {n_layers} layers (model.n_layers): each block needs at least one layer")
    if k > 1 and loc["aux"] not in AUX_HEADS:
        raise ConfigError(f"unknown aux head local.aux={loc['aux']!r}; known: {', '.join(AUX_HEADS)}")
    bs = loc["mtp_boundaries"]
    for b in bs:
        if not 1 <= b <= k - 1:
            where = "there are none (K=1 has no boundary between blocks)" if k == 1 else f"they are 1..{k - 1}"
            raise ConfigError(f"MTP at boundary {b} does not exist: with K={k} the boundaries that carry an aux head "
                              f"are numbered from 1 (output of block 0) and {where}")
    if len(set(bs)) != len(bs):
        raise ConfigError(f"local.mtp_boundaries repeats a boundary: {list(bs)}")
    if bs and int(loc["mtp_n"]) < 2:
        raise ConfigError(f"local.mtp_n must be >= 2 (next n tokens) where MTP is on, got {loc['mtp_n']!r}")


def validate_train(t: Mapping[str, Any], seq_len: int) -> None:
    """Check the ``train`` section. Raises :class:`ConfigError`."""
    check_section(LocalTrain, t, "train")
    b, budget = int(t["batch_size"]), int(t["token_budget"])
    if budget < b * seq_len:
        raise ConfigError(f"train.token_budget={budget} is below one batch ({b} x {seq_len} = {b * seq_len} tokens)")
    _check_execution(t, "train.")


def _check_execution(t: Mapping[str, Any], where: str) -> None:
    """``pipeline_sync`` is false only with ``execution = "pipeline"`` (their values are checked by their
    declarations)."""
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
    if run["train"].get("execution") == "pipeline" and loc["K"] == 1:  # one block: a pipeline of one stage is per_block
        run["train"]["execution"] = "per_block"
    run["train"] = hashed_view(LocalTrain, run["train"])  # as declared: no log/checkpoint cadence, sync of a pipeline
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
    lrs = st["lrs"]  # each entry and the other settings are checked by their declarations (zgcore.local.schema.Study)
    if not lrs:
        return
    if len({float(x) for x in lrs}) != len(lrs):
        raise ConfigError(f"study.lrs repeats a learning rate: {list(lrs)!r}")
    f = st["tune_fraction"]
    if tune_budget(t, f, seq_len) < int(t["batch_size"]) * seq_len:
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
        check_section(StudyConfig, c, f"study.configs[{i}]")
        if "K" not in c:
            raise ConfigError(f"study.configs[{i}] needs K")
        train = {k: c[k] for k in ("lr", "execution", "pipeline_sync") if k in c}
        _check_execution({**base["train"], **train}, f"study.configs[{i}].")
        out.append((int(c["K"]), c.get("aux", base["local"]["aux"]), c.get("mtp", "off"), train))
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


