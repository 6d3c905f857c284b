"""Experiment configuration: TOML/YAML loading, command-line overrides, validation, and the layer
arithmetic of a configuration (boundaries, kept layers). Every key is declared once, with its type,
default, bounds and hash rule, in :mod:`zgcore.config.schema`; the checks here that relate keys sit
beside the section checks those declarations give.

An experiment is one nested mapping. ``train`` holds the defaults of every block; ``blocks``
holds per-block overrides keyed by block index (``blocks.1.lr = 5e-5``). Everything is checked
here, before any expensive work, and a bad value raises :class:`ConfigError` naming what to fix.
"""
from __future__ import annotations

import copy
import os
import tomllib
from pathlib import Path
from typing import Any
from collections.abc import Collection, Mapping

import yaml

from zgcore.checks import ConfigError
from zgcore.config import schema
from zgcore.config.defaults import DEFAULTS, UNHASHED_TOP  # noqa: F401 (re-exported)
from zgcore.config.distill import validate_distill
from zgcore.config.fields import KEY_ALIASES, check_keys as _check_keys, check_section, nearest_key  # noqa: F401
from zgcore.models.shapes import n_kept, resolve_boundaries
from zgcore.config.overrides import parse_overrides, split_overrides, yaml_load as _yaml  # noqa: F401 (re-exported)


def deep_merge(base: Mapping[str, Any], over: Mapping[str, Any]) -> dict[str, Any]:
    """Return ``base`` updated recursively by ``over`` (neither input is modified)."""
    out = copy.deepcopy(dict(base))
    for k, v in over.items():
        if isinstance(v, Mapping) and isinstance(out.get(k), Mapping):
            out[k] = deep_merge(out[k], v)
        else:
            out[k] = copy.deepcopy(v)
    return out


def load_file(path: str | os.PathLike) -> dict[str, Any]:
    """Read an experiment file (``.toml``, ``.yaml`` or ``.yml``).

    Raises:
        ConfigError: missing file, unknown extension or a parse error.
    """
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"experiment file {p} does not exist")
    text = p.read_text()
    try:
        if p.suffix == ".toml":
            data = tomllib.loads(text)
        elif p.suffix in (".yaml", ".yml"):
            data = _yaml(text) or {}
        else:
            raise ConfigError(f"experiment file {p}: use .toml, .yaml or .yml")
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"experiment file {p} does not parse: {e}") from e
    except yaml.YAMLError as e:  # PyYAML's message spans lines (the context and a caret): one line, like TOML's
        mark = getattr(e, "problem_mark", None)
        why = str(getattr(e, "problem", None) or e).splitlines()[0]
        where = f" (at line {mark.line + 1}, column {mark.column + 1})" if mark is not None else ""
        raise ConfigError(f"experiment file {p} does not parse: {why}{where}") from e
    if not isinstance(data, dict):
        raise ConfigError(f"experiment file {p} must hold a mapping at the top level")
    return data


def _normalise_blocks(cfg: dict[str, Any]) -> None:
    blocks = cfg.get("blocks") or {}
    if not isinstance(blocks, Mapping):
        raise ConfigError("`blocks` must map a block index to its overrides, e.g. blocks.1.lr=5e-5")
    norm = {}
    for k, v in blocks.items():
        try:
            idx = int(k)
        except (TypeError, ValueError):
            raise ConfigError(f"blocks.{k}: block keys are integers (0, 1, ...)") from None
        if not isinstance(v, Mapping):
            raise ConfigError(f"blocks.{k} must be a mapping of train settings")
        norm[str(idx)] = deep_merge(norm.get(str(idx), {}), v)
    cfg["blocks"] = norm


SECTIONS = ("corpus", "boundary", "train", "eval", "heal", "distill", "library")  # tables of schema.Experiment


def resolve(file: str | os.PathLike | None = None, overrides: str | Mapping | None = None,
            base: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Build a full experiment config: defaults < ``base`` < file < overrides, then validate
    what can be checked without the teacher (see :func:`validate_against_teacher` for the rest).

    Raises:
        ConfigError: on any bad key or value.
    """
    cfg = deep_merge(DEFAULTS, base or {})
    if file:
        cfg = deep_merge(cfg, load_file(file))
    if overrides:
        cfg = deep_merge(cfg, parse_overrides(overrides) if isinstance(overrides, str) else overrides)
    _normalise_blocks(cfg)
    _check_keys("experiment", cfg, schema.Experiment)
    for section in SECTIONS:
        if not isinstance(cfg[section], Mapping):
            raise ConfigError(f"`{section}` must be a mapping")
        _check_keys(section, cfg[section], schema.Experiment.model_fields[section].annotation)
    for idx, over in cfg["blocks"].items():
        _check_keys(f"blocks.{idx}", over, schema.Train)
    check_section(schema.Experiment, {k: v for k, v in cfg.items() if k not in SECTIONS}, "")
    if cfg["seeds"] is not None and (not cfg["seeds"] or len(set(cfg["seeds"])) != len(cfg["seeds"])):
        raise ConfigError(f"seeds must be a non-empty list of distinct integers, got {cfg['seeds']!r}")
    canonical_paths(cfg, "teacher")
    _validate_static(cfg)
    from zgcore.config import library

    library.validate(cfg)
    return cfg


def canonical_paths(cfg: dict[str, Any], model_key: str) -> None:
    """Make ``cfg[model_key]`` (the teacher, or a local study's tokenizer), ``corpus.source`` and the
    sources of ``eval.extra`` canonical in place when they are local paths (:mod:`zgcore.config.paths`), so
    that every spelling of one path gives one hash."""
    from zgcore.config.paths import canonical_path, canonical_source

    if isinstance(cfg.get(model_key), str):
        cfg[model_key] = canonical_path(cfg[model_key])
    if isinstance(cfg.get("corpus"), Mapping) and "source" in cfg["corpus"]:
        cfg["corpus"]["source"] = canonical_source(cfg["corpus"]["source"])
    extra = cfg.get("eval", {}).get("extra") if isinstance(cfg.get("eval"), Mapping) else None
    if isinstance(extra, list):
        cfg["eval"]["extra"] = [{**x, "source": canonical_source(x["source"])} if isinstance(x, Mapping) and "source" in x
                                else canonical_source(x) for x in extra]


def _validate_static(cfg: dict[str, Any]) -> None:
    """The checks that need no teacher, section by section: each section against its declarations
    (:mod:`zgcore.config.schema`), then the checks that relate keys."""
    import torch

    try:
        torch.device(cfg["device"])
    except (RuntimeError, TypeError):
        raise ConfigError(f"device must be a torch device such as 'cpu', 'cuda' or 'cuda:1', got {cfg['device']!r}") from None
    c = cfg["corpus"]
    validate_corpus(c)
    b = cfg["boundary"]
    _check_boundaries(b)
    check_section(schema.Boundary, b, "boundary")
    if int(b["shard_sequences"]) % int(b["batch_size"]):
        raise ConfigError(f"boundary.shard_sequences={b['shard_sequences']} must be a multiple of boundary.batch_size="
                          f"{b['batch_size']} (so that every shard runs the teacher on the same batches)")
    from zgcore.models.mixers import check_window  # imports transformers: only when checking

    for i in range(int(b["num_blocks"])):
        over = cfg["blocks"].get(str(i), {})
        validate_train(t := block_train_config(cfg, i), f"block {i}", i, over)
        check_window(f"blocks.{i}.window" if "window" in over else "train.window", t["mixer"], t["window"], c["seq_len"])
    extra = [k for k in cfg["blocks"] if int(k) >= int(b["num_blocks"])]
    if extra:
        raise ConfigError(f"blocks.{extra[0]}: there are only {b['num_blocks']} blocks (0..{int(b['num_blocks']) - 1})")
    e = cfg["eval"]
    check_section(schema.Eval, e, "eval")
    for k in ("heal", "distill"):
        validate_distill(cfg[k], k)
        if float(cfg[k]["hidden_weight"]) > 0 and int(b["num_blocks"]) < 2:
            raise ConfigError(f"{k}.hidden_weight={cfg[k]['hidden_weight']} matches the residual stream at interior "
                              "boundaries, and one block has none: set boundary.num_blocks >= 2 or the weight to 0")
    searching = [f"blocks.{i}.lrs" if "lrs" in cfg["blocks"].get(str(i), {}) else "train.lrs"
                 for i in range(int(b["num_blocks"])) if block_train_config(cfg, i)["lrs"]]
    searching += ["distill.lrs"] if cfg["distill"]["lrs"] else []
    if searching and not int(e["max_sequences"]):
        raise ConfigError(f"{searching[0]} scores its candidates on validation sequences outside the test subset, but "
                          "eval.max_sequences = 0 makes every validation sequence a test sequence: set "
                          "eval.max_sequences (e.g. half the validation split; no lr is chosen on test sequences)")
    from zgcore.data.heldout import validate_extra  # heldout imports this module

    validate_extra(e, c)
    if int(e["context_window"]) > int(c["seq_len"]) // 2:
        raise ConfigError(f"eval.context_window={e['context_window']} must be at most half of corpus.seq_len "
                          f"({int(c['seq_len']) // 2}): context use compares the second half of each sequence")


def _check_boundaries(b: dict[str, Any]) -> None:
    """``boundary.boundaries``, when given, is ``[0, ..., n]`` strictly increasing, and sets ``num_blocks``."""
    bs = b["boundaries"]
    if bs is None:
        return
    if not isinstance(bs, (list, tuple)) or len(bs) < 2 or not all(isinstance(x, int) and not isinstance(x, bool) for x in bs):
        raise ConfigError(f"boundary.boundaries must be a list of at least two integers, got {bs!r}")
    if any(y <= x for x, y in zip(bs, bs[1:])):
        raise ConfigError(f"boundary.boundaries must be strictly increasing, got {list(bs)}")
    if bs[0] != 0:
        raise ConfigError(f"boundary.boundaries must start at 0 (the embedding output), got {list(bs)}")
    b["num_blocks"] = len(bs) - 1


def validate_corpus(c: Mapping[str, Any]) -> None:
    """Check a ``corpus`` section's values (experiments and local-learning studies). Raises :class:`ConfigError`."""
    check_section(schema.Corpus, c, "corpus")
    corpus_files(c)  # raises on missing or unusable files


def validate_train(t: Mapping[str, Any], where: str, block: int | None = None,
                   block_keys: Collection[str] = ()) -> None:
    """Check one block's resolved train settings against :class:`zgcore.config.schema.Train` and the rules
    between them; messages name the key the user wrote: ``blocks.<block>.<k>`` for a key in ``block_keys``
    (that block's overrides), else ``train.<k>``. Raises :class:`ConfigError`."""

    def n(k: str) -> str:
        return f"blocks.{block}.{k}" if block is not None and k in block_keys else f"train.{k}"

    check_section(schema.Train, {k: v for k, v in t.items() if k != "tune"}, n)  # tune: block_settings' test subset
    if t["objective"] == "attention_transfer" and t["mixer"] in ("softmax", "none"):
        raise ConfigError(f"{n('objective')}=attention_transfer with {n('mixer')}={t['mixer']}: there is nothing to transfer "
                          "(the mixer is the teacher's attention, or has none); set mixer to window, linear or linear_window")
    if float(t["epochs"]) == 0 and int(t["max_steps"]) == 0:
        raise ConfigError(f"{where}: set {n('epochs')} > 0 or {n('max_steps')} > 0")
    distinct_lrs(n("lrs"), t["lrs"])


def distinct_lrs(where: str, lrs: Collection[float]) -> None:
    """An lr search tries each learning rate once. Raises :class:`ConfigError` naming ``where`` (``train.lrs``)."""
    if len({float(x) for x in lrs}) != len(lrs):
        raise ConfigError(f"{where} repeats a learning rate: {list(lrs)!r}")


def block_train_config(cfg: Mapping[str, Any], i: int) -> dict[str, Any]:
    """Block ``i``'s train settings: ``train`` defaults merged with ``blocks.<i>`` overrides."""
    return deep_merge(cfg["train"], cfg["blocks"].get(str(i), {}))


def effective_train(t: Mapping[str, Any]) -> dict[str, Any]:
    """The block train settings ``t`` less those that cannot change its result under the rest of ``t``: what a
    block's hash covers, as each setting of :class:`zgcore.config.schema.Train` declares (``hashed``). Left out:
    the settings the chosen objective does not read (``clean`` draws no noise); ``epochs`` when ``max_steps`` is
    set; ``keep_fraction`` when ``n_layers`` is; ``checkpoint_every``, ``log_every``, ``prefetch*`` and
    ``tensorboard`` (how, not what); ``intermediate_size``, ``kv_heads``, ``mixer`` and ``compile`` at their
    defaults, and ``importance_sequences`` when nothing is measured; ``window`` unless the mixer is windowed; the
    auxiliary terms' settings at weight 0; ``lrs``/``lr_rounds`` (and ``tune``) without an lr search, ``lr`` with
    one. Configurations from before a setting existed keep their hashes.

    Raises ``KeyError`` for an unknown objective (validated earlier by :func:`validate_train`).
    """
    from zgcore.config.fields import hashed_view

    out = hashed_view(schema.Train, t)
    if not out.get("lrs"):
        out.pop("tune", None)  # the test subset a search avoids (workflows.experiment.block_settings)
    return out


def corpus_files(corpus: Mapping[str, Any]) -> list[Path]:
    """The files / dataset folders of ``corpus.source``, checked cheaply ([] for the built-in
    ``pydoc`` and ``python-stdlib``); see :mod:`zgcore.data.sources`.

    Raises:
        ConfigError: a pattern that matches nothing, an explicitly named empty file, a missing
            text column, or nothing usable at all.
    """
    from zgcore.data.sources import check

    return [e.path for e in check(corpus)]


def validate_against_teacher(cfg: Mapping[str, Any], n_layers: int, max_positions: int, teacher: str = "teacher",
                             mlp_width: int | None = None) -> list[int]:
    """Check the parts of ``cfg`` that depend on the teacher's shape; return the boundaries.

    Raises:
        ConfigError: boundaries out of range, ``seq_len`` above the context, a block asking
            for more student layers than its partition has, or an ``intermediate_size`` above
            the teacher's MLP width ``mlp_width``.
    """
    if int(cfg["corpus"]["seq_len"]) > max_positions:
        raise ConfigError(f"corpus.seq_len={cfg['corpus']['seq_len']} exceeds the context of {teacher} "
                          f"({max_positions} tokens); lower corpus.seq_len")
    bs = resolve_boundaries(cfg["boundary"], n_layers)
    for i in range(len(bs) - 1):
        t = block_train_config(cfg, i)
        try:
            n_kept(bs[i], bs[i + 1], t)
        except ConfigError as e:
            raise ConfigError(f"block {i}: {e}") from None
        if mlp_width is not None and t["intermediate_size"] is not None and int(t["intermediate_size"]) > mlp_width:
            raise ConfigError(f"block {i}: intermediate_size={t['intermediate_size']} exceeds the MLP width of {teacher} "
                              f"({mlp_width}); a student block can only be narrower")
    return bs
