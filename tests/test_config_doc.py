"""docs/configuration.md is generated from the settings' declarations and cannot drift: a stale file, a
setting without a description, or a preset key missing from the page fails here (each setting's type, default
and allowed values: tests/test_settings_declared.py)."""
import re
import tomllib
from pathlib import Path

from workflows import reference as config_doc
from zgcore.config import fields

ROOT = Path(__file__).resolve().parents[1]
PRESETS = ROOT / "workflows" / "presets"


def _section(text: str, title: str) -> str:
    return text.split(f"## {title}", 1)[1].split("\n## ", 1)[0]


def test_the_reference_is_up_to_date():
    assert config_doc.DOC.read_text() == config_doc.markdown(), \
        f"docs/configuration.md is out of date; regenerate it with: {config_doc.COMMAND}"


def test_every_key_has_its_default_and_a_meaning():
    text = config_doc.markdown()
    for title, _, model in config_doc.sections():
        rows = re.findall(r"^\| `([^`]+)` \|", _section(text, title), re.MULTILINE)
        keys = [k for k, _ in fields.settings(model)]
        assert rows == keys and len(keys) > 30
        missing = [k for k, f in fields.settings(model) if not f.description]
        assert not missing, f"give these settings a description in their declaration: {missing}"
    assert "| `corpus.max_tokens` | int | `0` | a non-negative integer | yes | cap on the tokens read" in text
    assert "| `train.keep` | str | `\"spread\"` | one of spread, first, last, importance | yes |" in text
    assert "| `train.objective` | str | `\"clean\"` | one of clean, noisy, denoise, attention_transfer | yes |" in text
    assert "| `train.prefetch_mode` | str | `\"auto\"` | one of auto, thread, process | no |" in text
    assert "| `heal.steps` | int | `0` | a non-negative integer | yes | 0 = no healing stage" in text
    assert "| `distill.steps` | int | `0` | a non-negative integer | yes | 0 = matched" in text  # Distill's own
    assert "| `distill.weight_decay` | float | `0.0` | a number >= 0 | yes | AdamW weight decay |" in text  # Heal's
    local = _section(text, "LocalLearningStudy")
    assert "| `corpus.seq_len` | int | `128` | an integer >= 2 | yes | tokens per sequence" in local
    assert "| `model.vocab` | str | `\"compact\"` | one of compact, full, top:N | yes |" in local


def _preset_keys(data, prefix=""):
    for k, v in data.items():
        if isinstance(v, dict) and v:
            yield from _preset_keys(v, f"{prefix}{k}.")
        else:
            yield f"{prefix}{k}"


def test_every_key_a_preset_sets_is_documented():
    text = config_doc.DOC.read_text()
    presets = sorted(PRESETS.glob("*.toml"))
    assert len(presets) >= 8
    for p in presets:
        title = "LocalLearningStudy" if p.stem.startswith("local_") else "RunExperiment, ObjectiveStudy, DistillStudy"
        documented = set(re.findall(r"^\| `([^`]+)` \|", _section(text, title), re.MULTILINE))
        keys = set(_preset_keys(tomllib.loads(p.read_text())))
        assert keys and keys <= documented, (p.name, sorted(keys - documented))


def test_the_type_column_reads_the_annotation():
    from typing import Literal

    assert config_doc.type_text(int | None) == "int | null"
    assert config_doc.type_text(Literal["a", "b"]) == "str"
    assert config_doc.type_text(fields.Float) == "float" and config_doc.type_text(list[int]) == "list"
