"""Experiment configuration: TOML/YAML loading, command-line overrides, validation, and the layer
arithmetic of a configuration (boundaries, kept layers). Every key's default and the allowed
choices live in :mod:`zgcore.config.defaults` (re-exported here).

An experiment is one nested mapping. ``train`` holds the defaults of every block; ``blocks``
holds per-block overrides keyed by block index (``blocks.1.lr = 5e-5``). Everything is checked
here, before any expensive work, and a bad value raises :class:`ConfigError` naming what to fix.
"""
from __future__ import annotations

import copy
import os
import tomllib
from pathlib import Path
from typing import Any, Collection, Mapping

import yaml

from zgcore.checks import ConfigError, positive_int as _positive_int, validate_lr_search  # noqa: F401 (re-exported; validators below use the short name)
from zgcore.config.defaults import (  # noqa: F401 (re-exported)
    CHOICES, DEFAULTS, DTYPES, INITS, KEEP_POLICIES, LOSS_NORMS, MIXERS, PREFETCH_MODES, TARGETS, UNHASHED_TOP)
from zgcore.config.distill import validate_distill
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


# names other tools give settings that exist here under another name (what difflib cannot guess)
KEY_ALIASES = {"learning_rate": "lr", "learning_rates": "lrs", "lr_warmup": "warmup_steps", "warmup": "warmup_steps",
               "steps": "max_steps", "num_steps": "max_steps", "wd": "weight_decay", "clip": "grad_clip",
               "max_grad_norm": "grad_clip", "bs": "batch_size", "layers": "n_layers", "num_layers": "n_layers"}


def nearest_key(key: str, allowed) -> str | None:
    """The known key a misspelled ``key`` most likely means: a common alias (:data:`KEY_ALIASES`:
    ``learning_rate`` -> ``lr``) or the closest spelling (:func:`difflib.get_close_matches`); None."""
    import difflib

    allowed = list(allowed)
    if KEY_ALIASES.get(key) in allowed:
        return KEY_ALIASES[key]
    close = difflib.get_close_matches(key, allowed, n=1, cutoff=0.6)
    return close[0] if close else None


def _check_keys(section: str, got: Mapping[str, Any], allowed: Mapping[str, Any]) -> None:
    """Raise ``ConfigError`` naming the first unknown key of ``got`` (``section.key``), the known key
    it most likely means (:func:`nearest_key`), and the known keys."""
    unknown = sorted(set(got) - set(allowed))
    if unknown:
        where = "" if section == "experiment" or " " in section else f"{section}."  # top level: no prefix
        guess = nearest_key(unknown[0], allowed)
        hint = f": did you mean {where}{guess}?" if guess else ""
        more = f" (and {', '.join(where + k for k in unknown[1:])})" if unknown[1:] else ""
        raise ConfigError(f"unknown key {where}{unknown[0]}{hint}{more}; known in {section}: "
                          f"{', '.join(sorted(allowed))}")


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
    _check_keys("experiment", cfg, DEFAULTS)
    for section in ("corpus", "boundary", "train", "eval", "heal", "distill", "library"):
        if not isinstance(cfg[section], Mapping):
            raise ConfigError(f"`{section}` must be a mapping")
        _check_keys(section, cfg[section], DEFAULTS[section])
    for idx, over in cfg["blocks"].items():
        _check_keys(f"blocks.{idx}", over, DEFAULTS["train"])
    if cfg["seeds"] is not None:
        if not isinstance(cfg["seeds"], (list, tuple)) or not cfg["seeds"] or len(set(cfg["seeds"])) != len(cfg["seeds"]):
            raise ConfigError(f"seeds must be a non-empty list of distinct integers, got {cfg['seeds']!r}")
        for s in cfg["seeds"]:
            _positive_int("seeds[]", s, zero_ok=True)
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


def _number(where: str, v: Any) -> float:
    """``v`` as a float, or a :class:`ConfigError` naming ``where`` (e.g. ``train.lr=abc``)."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise ConfigError(f"{where} must be a number, got {v!r}")
    return float(v)


def _validate_static(cfg: dict[str, Any]) -> None:
    import torch

    try:
        torch.device(cfg["device"])
    except (RuntimeError, TypeError):
        raise ConfigError(f"device must be a torch device such as 'cpu', 'cuda' or 'cuda:1', got {cfg['device']!r}") from None
    if cfg["teacher_stream"] not in ("auto", True, False):
        raise ConfigError(f'teacher_stream must be "auto", true or false, got {cfg["teacher_stream"]!r}')
    c = cfg["corpus"]
    validate_corpus(c)
    b = cfg["boundary"]
    if b["dtype"] not in DTYPES:
        raise ConfigError(f"boundary.dtype must be one of {DTYPES}, got {b['dtype']!r}")
    _positive_int("boundary.batch_size", b["batch_size"])
    if b["teacher_dtype"] not in DTYPES:
        raise ConfigError(f"boundary.teacher_dtype must be one of {DTYPES}, got {b['teacher_dtype']!r}")
    _positive_int("boundary.shard_sequences", b["shard_sequences"])
    if b["codec"] not in CHOICES["boundary.codec"] or type(b["codec_keep"]) is not int or b["codec_keep"] < 0:
        raise ConfigError(f"boundary.codec must be one of {CHOICES['boundary.codec']} and boundary.codec_keep an "
                          f"integer >= 0, got {b['codec']!r} and {b['codec_keep']!r}")
    if int(b["shard_sequences"]) % int(b["batch_size"]):
        raise ConfigError(f"boundary.shard_sequences={b['shard_sequences']} must be a multiple of boundary.batch_size="
                          f"{b['batch_size']} (so that every shard runs the teacher on the same batches)")
    if b["boundaries"] is None:
        _positive_int("boundary.num_blocks", b["num_blocks"])
    else:
        bs = b["boundaries"]
        if not isinstance(bs, (list, tuple)) or len(bs) < 2 or not all(isinstance(x, int) and not isinstance(x, bool) for x in bs):
            raise ConfigError(f"boundary.boundaries must be a list of at least two integers, got {bs!r}")
        if any(y <= x for x, y in zip(bs, bs[1:])):
            raise ConfigError(f"boundary.boundaries must be strictly increasing, got {list(bs)}")
        if bs[0] != 0:
            raise ConfigError(f"boundary.boundaries must start at 0 (the embedding output), got {list(bs)}")
        b["num_blocks"] = len(bs) - 1
    from zgcore.models.mixers import check_window  # imports transformers: only when checking

    for i in range(int(b["num_blocks"])):
        over = cfg["blocks"].get(str(i), {})
        validate_train(t := block_train_config(cfg, i), f"block {i}", i, over)
        check_window(f"blocks.{i}.window" if "window" in over else "train.window", t["mixer"], t["window"], c["seq_len"])
    extra = [k for k in cfg["blocks"] if int(k) >= int(b["num_blocks"])]
    if extra:
        raise ConfigError(f"blocks.{extra[0]}: there are only {b['num_blocks']} blocks (0..{int(b['num_blocks']) - 1})")
    _positive_int("eval.batch_size", cfg["eval"]["batch_size"])
    for k in ("heal", "distill"):
        validate_distill(cfg[k], k)
        if float(cfg[k]["hidden_weight"]) > 0 and int(b["num_blocks"]) < 2:
            raise ConfigError(f"{k}.hidden_weight={cfg[k]['hidden_weight']} matches the residual stream at interior "
                              "boundaries, and one block has none: set boundary.num_blocks >= 2 or the weight to 0")
    e = cfg["eval"]
    _positive_int("eval.max_sequences", e["max_sequences"], zero_ok=True)
    _positive_int("eval.subset_seed", e["subset_seed"], zero_ok=True)
    searching = [f"blocks.{i}.lrs" if "lrs" in cfg["blocks"].get(str(i), {}) else "train.lrs"
                 for i in range(int(b["num_blocks"])) if block_train_config(cfg, i)["lrs"]]
    searching += ["distill.lrs"] if cfg["distill"]["lrs"] else []
    if searching and not int(e["max_sequences"]):
        raise ConfigError(f"{searching[0]} scores its candidates on validation sequences outside the test subset, but "
                          "eval.max_sequences = 0 makes every validation sequence a test sequence: set "
                          "eval.max_sequences (e.g. half the validation split; no lr is chosen on test sequences)")
    from zgcore.data.heldout import validate_extra  # heldout imports this module

    validate_extra(e, c)
    _positive_int("eval.context_sequences", e["context_sequences"], zero_ok=True)
    _positive_int("eval.context_window", e["context_window"])
    if int(e["context_window"]) > int(c["seq_len"]) // 2:
        raise ConfigError(f"eval.context_window={e['context_window']} must be at most half of corpus.seq_len "
                          f"({int(c['seq_len']) // 2}): context use compares the second half of each sequence")
    for k in ("gate_gap", "gate_context"):
        _number(f"eval.{k}", e[k])


def validate_corpus(c: Mapping[str, Any]) -> None:
    """Check a ``corpus`` section's values (experiments and local-learning studies). Raises :class:`ConfigError`."""
    _positive_int("corpus.seq_len", c["seq_len"])
    if c["seq_len"] < 2:
        raise ConfigError("corpus.seq_len must be at least 2 (one prediction needs two tokens)")
    if not (0 < _number("corpus.val_fraction", c["val_fraction"]) < 1):
        raise ConfigError(f"corpus.val_fraction must be in (0, 1), got {c['val_fraction']!r}")
    _positive_int("corpus.max_tokens", c["max_tokens"], zero_ok=True)
    if "buffer_tokens" in c:
        _positive_int("corpus.buffer_tokens", c["buffer_tokens"])
    corpus_files(c)  # raises on missing or unusable files


def validate_train(t: Mapping[str, Any], where: str, block: int | None = None,
                   block_keys: Collection[str] = ()) -> None:
    """Check one block's resolved train settings; messages name the key the user wrote:
    ``blocks.<block>.<k>`` for a key in ``block_keys`` (that block's overrides), else ``train.<k>``.
    Raises :class:`ConfigError`."""
    from zgcore.training.objectives import OBJECTIVES  # local import: objectives imports torch

    def n(k: str) -> str:
        return f"blocks.{block}.{k}" if block is not None and k in block_keys else f"train.{k}"

    if t["objective"] not in OBJECTIVES:
        raise ConfigError(f"{n('objective')}: unknown objective {t['objective']!r}; known: {', '.join(sorted(OBJECTIVES))}")
    for k, allowed in (("targets", TARGETS), ("loss_norm", LOSS_NORMS),
                       ("keep", KEEP_POLICIES), ("init", INITS), ("mixer", MIXERS)):
        if t[k] not in allowed:
            raise ConfigError(f"{n(k)} must be one of {', '.join(map(str, allowed))}, got {t[k]!r}")
    if not isinstance(t["noise"], (int, float)) or isinstance(t["noise"], bool) or t["noise"] < 0:
        raise ConfigError(f"{n('noise')} must be a number >= 0, got {t['noise']!r}")
    if t["n_layers"] is not None:
        _positive_int(n("n_layers"), t["n_layers"])
    for k in ("keep_fraction", "lr", "epochs", "weight_decay", "grad_clip"):
        _number(n(k), t[k])
    for k in ("intermediate_size", "kv_heads"):
        if t[k] is not None:
            _positive_int(n(k), t[k])
    _positive_int(n("importance_sequences"), t["importance_sequences"])
    _positive_int(n("window"), t["window"])
    _positive_int(n("transfer_steps"), t["transfer_steps"])
    if t["objective"] == "attention_transfer" and t["mixer"] in ("softmax", "none"):
        raise ConfigError(f"{n('objective')}=attention_transfer with {n('mixer')}={t['mixer']}: there is nothing to transfer "
                          "(the mixer is the teacher's attention, or has none); set mixer to window, linear or linear_window")
    if not (0 < float(t["keep_fraction"]) <= 1):
        raise ConfigError(f"{n('keep_fraction')} must be in (0, 1], got {t['keep_fraction']!r}")
    for k in [k for k in ("ce_weight", "mtp_weight") if isinstance(t[k], bool) or not isinstance(t[k], (int, float)) or not 0 <= t[k] < float("inf")]:
        raise ConfigError(f"{n(k)} must be a finite number >= 0 (0 = off), got {t[k]!r}")
    _positive_int(f"{n('mtp_n')} (tokens predicted ahead, >= 1)", t["mtp_n"])
    if not float(t["lr"]) > 0:
        raise ConfigError(f"{n('lr')} must be positive, got {t['lr']!r}")
    if float(t["epochs"]) < 0:
        raise ConfigError(f"{n('epochs')} must be >= 0, got {t['epochs']!r}")
    for k in ("max_steps", "warmup_steps", "seed", "prefetch"):
        _positive_int(n(k), t[k], zero_ok=True)
    if t["prefetch_mode"] not in PREFETCH_MODES:
        raise ConfigError(f"{n('prefetch_mode')} must be one of {', '.join(map(repr, PREFETCH_MODES))}, "
                          f"got {t['prefetch_mode']!r}")
    if not isinstance(t.get("compile", False), bool):
        raise ConfigError(f"{n('compile')} must be true or false, got {t['compile']!r}")
    if not isinstance(t["tensorboard"], bool):
        raise ConfigError(f"{n('tensorboard')} must be true or false, got {t['tensorboard']!r}")
    for k in ("batch_size", "checkpoint_every", "log_every"):
        _positive_int(n(k), t[k])
    if t["prefetch_workers"] != "auto":
        _positive_int(n("prefetch_workers") + ' (or "auto")', t["prefetch_workers"])
    if float(t["epochs"]) == 0 and int(t["max_steps"]) == 0:
        raise ConfigError(f"{where}: set {n('epochs')} > 0 or {n('max_steps')} > 0")
    validate_lr_search(n("lrs").rsplit(".", 1)[0], t["lrs"], t["lr_rounds"])  # train.lrs or blocks.<i>.lrs


def block_train_config(cfg: Mapping[str, Any], i: int) -> dict[str, Any]:
    """Block ``i``'s train settings: ``train`` defaults merged with ``blocks.<i>`` overrides."""
    return deep_merge(cfg["train"], cfg["blocks"].get(str(i), {}))


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
