"""Score a heterogeneous student folder with lm-eval-harness, as a user would, and check its numbers.

    pip install lm-eval==0.4.13          # not a dependency of ZeroGraph: only this check needs it
    python scripts/lm_eval_check.py
    python scripts/lm_eval_check.py --converted   # a converted student (window, linear_window, none mixers)
    python scripts/lm_eval_check.py --folder outputs/Assemble/student-<hash>/model   # a folder you built

Builds a tiny random Llama teacher and a heterogeneous student from it (partitions with their own
MLP widths and key-value heads, as a library selection assembles: ``zgcore.models.hetero``), saves
the folder (modelling code inside, ``trust_remote_code``), then loads it through lm-eval-harness's
Hugging Face wrapper (``lm_eval.models.huggingface.HFLM``, what ``lm_eval --model hf --model_args
pretrained=<folder>,trust_remote_code=True`` builds) and asks it for ``loglikelihood`` and
``loglikelihood_rolling`` of a few requests. Each answer is compared with the same sum of
log-probabilities (nats) computed from the folder's own logits. No benchmark dataset is
downloaded (the Hub is not reachable here): the requests are written below. With ``--converted``
the folder is a converted student instead (``zgcore.models.hf_converted_llama``: layers whose token
mixers are softmax, window, linear_window and none), scored the same way. With ``--folder`` the
folder is one already on disk (an assembled, healed or library student), scored the same way.

Exit status 0 when every answer matches to 1e-4 nats, 1 otherwise; the last line says which.
"""
from __future__ import annotations

import shutil
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

REQUESTS = [("The quick brown fox", " jumps over the lazy dog"), ("def f(x):\n", "    return x + 1"),
            ("Blockwise training ", "composes"), ("", "a")]


def build_folder(root: Path, converted: bool = False) -> Path:
    """A heterogeneous (or, ``converted``, a converted) student folder from a tiny random Llama
    teacher (byte tokenizer)."""
    import numpy as np
    import torch
    from transformers import AutoModelForCausalLM

    from zgcore.models.adapters import build_block
    from zgcore.models.hetero import assemble_exact, save_student
    from zgcore.models.teacher import build_tiny, byte_tokenizer

    torch.manual_seed(0)
    teacher = AutoModelForCausalLM.from_pretrained(build_tiny("llama", root / "teacher"), dtype=torch.float32).eval()
    channels = [list(np.arange(64, dtype=float)[::-1]) for _ in range(4)]
    if converted:
        blocks = [build_block(teacher, [0], "teacher", 0, mixer="linear_window", window=4),
                  build_block(teacher, [1, 2], "teacher", 0, mixer="window", window=4),
                  build_block(teacher, [3], "teacher", 0, mixer="none")]
    else:
        blocks = [build_block(teacher, [0], "teacher", 0, intermediate_size=24, channels=channels),
                  build_block(teacher, [1, 2], "teacher", 0, kv_heads=1),
                  build_block(teacher, [3], "random", 1, intermediate_size=40, kv_heads=1)]
    save_student(assemble_exact(teacher, blocks), byte_tokenizer(), root / "student")
    return root / "student"


def own_logprob(model, tok, context: str, continuation: str, prefix_id: int) -> float:
    """Sum over the continuation's tokens of log p(token | everything before it), nats. As
    lm-eval-harness does, the context's trailing whitespace is moved to the continuation, and an
    empty context is the one token ``prefix_id`` (lm-eval's ``prefix_token_id``: the tokenizer's
    beginning-of-text token, else its end-of-text token)."""
    import torch

    context, continuation = context.rstrip(), context[len(context.rstrip()):] + continuation

    ctx = tok(context, add_special_tokens=False)["input_ids"]
    cont = tok(continuation, add_special_tokens=False)["input_ids"]
    if not ctx:  # lm-eval puts its prefix token first when the context is empty
        ctx = [prefix_id]
    ids = torch.tensor([ctx + cont])
    with torch.no_grad():
        logp = torch.log_softmax(model(input_ids=ids).logits.float(), -1)[0]
    return float(sum(logp[len(ctx) - 1 + i, t] for i, t in enumerate(cont)))


def main() -> int:
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--converted", action="store_true", help="build a converted tiny student instead")
    ap.add_argument("--folder", type=Path, default=None, help="score this student folder instead of building one")
    a = ap.parse_args()
    if a.folder is not None and not (a.folder / "config.json").is_file():
        ap.error(f"--folder {a.folder}: no config.json there; give a model folder (e.g. outputs/Assemble/<name>/model)")

    import torch
    from lm_eval.api.instance import Instance
    from lm_eval.models.huggingface import HFLM
    from importlib.metadata import version
    from transformers import AutoModelForCausalLM, AutoTokenizer

    root = Path(tempfile.mkdtemp(prefix="lm_eval_check-"))
    try:
        folder = a.folder if a.folder is not None else build_folder(root, a.converted)
        lm = HFLM(pretrained=str(folder), trust_remote_code=True, dtype="float32", device="cpu", batch_size=1)
        print(f"lm-eval {version('lm-eval')} loaded {type(lm.model).__name__} from {folder}")
        got = [ll for ll, _ in lm.loglikelihood([Instance("loglikelihood", {}, r, i) for i, r in enumerate(REQUESTS)])]
        rolling = lm.loglikelihood_rolling([Instance("loglikelihood_rolling", {}, (c + x,), i)
                                            for i, (c, x) in enumerate(REQUESTS)])
        model = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True, dtype=torch.float32).eval()
        tok = AutoTokenizer.from_pretrained(folder, trust_remote_code=True)
        want = [own_logprob(model, tok, c, x, lm.prefix_token_id) for c, x in REQUESTS]
        want_rolling = [own_logprob(model, tok, "", c + x, lm.prefix_token_id) for c, x in REQUESTS]
        worst = 0.0
        for (c, x), g, w, gr, wr in zip(REQUESTS, got, want, rolling, want_rolling):
            worst = max(worst, abs(g - w), abs(gr - wr))
            print(f"  {c + x!r:48} loglikelihood {g:10.4f} (own {w:10.4f})  rolling {gr:10.4f} (own {wr:10.4f})")
        ok = worst <= 1e-4
        what = str(a.folder) if a.folder is not None else "converted" if a.converted else "heterogeneous"
        print(f"lm-eval-harness scores the {what} folder {'as' if ok else 'NOT as'} its own logits do: "
              f"largest difference {worst:.2e} nats")
        return 0 if ok else 1
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
