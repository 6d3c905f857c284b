"""docs/configuration.md is generated from the defaults' source and cannot drift: a stale file, a
key without a meaning, or a preset key missing from the page fails here."""
import re
import tomllib
from pathlib import Path

from workflows import reference as config_doc
from zgcore.config.defaults import DEFAULTS
from zgcore.local.config import LOCAL_DEFAULTS

ROOT = Path(__file__).resolve().parents[1]
PRESETS = ROOT / "workflows" / "presets"


def _section(text: str, title: str) -> str:
    return text.split(f"## {title}", 1)[1].split("\n## ", 1)[0]


def test_the_reference_is_up_to_date():
    assert config_doc.DOC.read_text() == config_doc.markdown(), \
        f"docs/configuration.md is out of date; regenerate it with: {config_doc.COMMAND}"


def test_every_key_has_its_default_and_a_meaning():
    for title, _, defaults, means, _ in config_doc.sections():
        rows = {m[1]: m[2] for m in re.finditer(r"^\| `([^`]+)` \| (.*?) \|", _section(config_doc.markdown(), title), re.M)}
        keys = [k for k, _ in config_doc.flat(defaults)]
        assert sorted(rows) == sorted(keys) and len(keys) > 30
        missing = [k for k in keys if not means.get(k)]
        assert not missing, f"give these keys a comment of meaning in the defaults' source: {missing}"
    text = config_doc.markdown()
    assert "| `corpus.max_tokens` | `0` |  | cap on the tokens read" in text
    assert "| `train.keep` | `\"spread\"` | `spread`, `first`, `last`, `importance` |" in text
    assert "| `train.objective` | `\"clean\"` | `clean`, `noisy`, `denoise`, `attention_transfer` |" in text
    assert "| `heal.steps` | `0` |  | 0 = no healing stage" in text  # HEAL_DEFAULTS
    assert "| `distill.steps` | `0` |  | 0 = matched" in text  # DISTILL_DEFAULTS overrides HEAL_DEFAULTS' comment
    assert "| `distill.weight_decay` | `0.0` |  | AdamW weight decay |" in text  # inherited through **HEAL_DEFAULTS
    local = _section(text, "LocalLearningStudy")
    assert "| `corpus.seq_len` | `128` |  | tokens per sequence" in local  # LOCAL's override, the main corpus' comment
    assert "| `model.vocab` | `\"compact\"` | `compact`, `full`, `top:N` |" in local


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
        documented = set(re.findall(r"^\| `([^`]+)` \|", _section(text, title), re.M))
        keys = set(_preset_keys(tomllib.loads(p.read_text())))
        assert keys and keys <= documented, (p.name, sorted(keys - documented))
    assert {k for k, _ in config_doc.flat(DEFAULTS)} >= {"corpus.max_tokens", "boundary.shard_sequences"}
    assert "study.lrs" in {k for k, _ in config_doc.flat(LOCAL_DEFAULTS)}


def test_meanings_follow_comments_spreads_and_aliases(tmp_path, monkeypatch):
    (tmp_path / "cfgdoc_base.py").write_text(
        'BASE = {\n    "a": 1,  # the a\n    # about b,\n    # in two lines\n    "b": [1,\n          2],  # the b\n}\n')
    (tmp_path / "cfgdoc_top.py").write_text(
        'from cfgdoc_base import BASE as _B\nTOP = {\n    "s": {**_B, "a": 2},\n    "t": _B,\n'
        '    "u": {"x": 0},  # section note\n    "v": _B["a"],\n}\n')
    monkeypatch.syspath_prepend(str(tmp_path))
    means = config_doc.meanings("cfgdoc_top", "TOP", ("cfgdoc_base",))
    assert means["s.a"] == "the a" and means["t.a"] == "the a"  # the override keeps the spread key's comment
    assert means["s.b"] == "the b — about b, in two lines"
    assert "u.x" not in means and means["u"] == "section note"
