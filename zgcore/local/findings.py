"""The local-learning study's comparisons and the paper's three findings judged on them: which arms
are compared (names, pairs) and when a finding is "reproduced" (only from resolved verdicts of
:func:`zgcore.evaluation.compare.compare`, Holm-adjusted over the report's family).
"""
from __future__ import annotations

from typing import Any
from collections.abc import Mapping, Sequence

from .flops import FLOPS_MATCHED

NOT_MEASURED, REPRODUCED, NOT_REPRODUCED = "not measured", "reproduced", "not reproduced"
NOT_RESOLVED_STATUS = "not resolved"  # a comparison the finding needs has no verdict


def arm_name(cell: Mapping[str, Any]) -> str:
    """A configuration's name in comparisons: ``"K=1 (e2e)"``, ``"K=1 (e2e, FLOPs-matched)"``,
    ``"K=4 transformer"``, ``"K=4 transformer MTP first"``, ``"K=4 mlp [async pipeline]"`` (an entry
    of ``study.configs`` that sets its execution)."""
    if cell.get("flops_matched"):
        return FLOPS_MATCHED
    if int(cell["K"]) == 1:
        return "K=1 (e2e)"
    mtp = cell.get("mtp", "off")
    name = f"K={cell['K']} {cell['aux']}" + ("" if mtp in ("off", False, None) else f" MTP {mtp}")
    return f"{name} [{cell['execution']}]" if cell.get("execution") else name


def compared_pairs(cells: Sequence[Mapping[str, Any]]) -> list[tuple[str, str]]:
    """The pairs the study compares (names by :func:`arm_name`; CE of a minus CE of b): every K>1
    configuration vs K=1; per aux head without MTP, each larger K vs each smaller K>1; per K>1
    without MTP, the Transformer head vs the MLP head; per K>1 and aux head, MTP first vs off, all vs
    off, first vs all; every K>1 configuration vs the FLOPs-matched K=1 arm when there is one; an arm
    with its own execution (``[...]``) vs the same configuration executed otherwise. A pair
    is listed once (never also the other way round)."""
    names = list(dict.fromkeys(arm_name(c) for c in cells))
    have = set(names)
    base = "K=1 (e2e)"
    pairs = [(n, base) for n in names if n not in (base, FLOPS_MATCHED) and base in have]
    pairs += [(n, FLOPS_MATCHED) for n in names if n not in (base, FLOPS_MATCHED) and FLOPS_MATCHED in have]
    ks = sorted({int(c["K"]) for c in cells if int(c["K"]) > 1})
    auxs = list(dict.fromkeys(c["aux"] for c in cells if int(c["K"]) > 1))
    for aux in auxs:
        pairs += [(f"K={k2} {aux}", f"K={k1} {aux}") for i, k1 in enumerate(ks) for k2 in ks[i + 1:]]
    pairs += [(f"K={k} transformer", f"K={k} mlp") for k in ks]
    for k in ks:
        for aux in auxs:
            n = f"K={k} {aux}"
            pairs += [(f"{n} MTP first", n), (f"{n} MTP all", n), (f"{n} MTP first", f"{n} MTP all")]
        at_k = [n for n in names if n.startswith(f"K={k} ")]
        pairs += [(f, o) for f in at_k if f.endswith("MTP first") for o in at_k]  # is MTP first the best at this K?
    for n in sorted(names, key=lambda n: "pipeline]" not in n):  # an arm with its own execution (a pipeline first)
        if " [" in n:  # vs the same configuration executed otherwise
            pairs += [(n, o) for o in names if o != n and o.split(" [")[0] == n.split(" [")[0]]
    seen, out = set(), []
    for p in pairs:
        if p[0] in have and p[1] in have and p[0] != p[1] and frozenset(p) not in seen:
            seen.add(frozenset(p))
            out.append(p)
    return out


def _status(verdicts: Sequence[str], want: str) -> str:
    """All verdicts ``want``: reproduced; any the opposite way: not reproduced; else not resolved."""
    from zgcore.evaluation.compare import NOT_RESOLVED

    if all(v == want for v in verdicts):
        return REPRODUCED
    if any(v not in (want, NOT_RESOLVED) for v in verdicts):
        return NOT_REPRODUCED
    return NOT_RESOLVED_STATUS


def paper_findings(comparisons: Sequence[Mapping[str, Any]]) -> dict[str, dict[str, Any]]:
    """The paper's three findings, judged on the study's comparisons (:mod:`zgcore.evaluation.compare`
    entries named by :func:`arm_name`), never on point estimates alone:

    * ``gap_grows_with_k``: for every aux head measured at K=2 and K=4 without MTP, K=4's CE is
      above K=2's (verdict ``"b better"`` for K=4 vs K=2) and above end-to-end's (a deficit, as the
      paper's gap is; ``"b better"`` for K=4 vs K=1);
    * ``transformer_beats_mlp``: at K=4 without MTP the Transformer aux head's CE is below the MLP's;
    * ``mtp_first_best``: a K=4 configuration with MTP at boundary 1 only beats every other K=4
      configuration measured (the best such one when both aux heads have it).

    A finding is ``"reproduced"`` when every comparison it needs has the verdict it claims, ``"not
    reproduced"`` when one has the opposite verdict (resolved), ``"not resolved"`` when one has no
    verdict (fewer than 3 runs, a Holm-adjusted p of 0.05 or more, seeds that disagree in sign, a
    plumbing check: :func:`zgcore.evaluation.compare.compare`).

    Returns:
        ``{name: {"status": "reproduced" | "not reproduced" | "not resolved" | "not measured",
        "claim", "detail"}}``; ``detail`` is the comparisons' sentences.
    """
    from zgcore.evaluation.compare import A_BETTER, B_BETTER, sentence

    by = {(c["a"], c["b"]): c for c in comparisons}
    out: dict[str, dict[str, Any]] = {}
    grow = [c for (a, b), c in by.items() if a.startswith("K=4 ") and b.startswith("K=2 ") and "MTP" not in a + b
            and a.split(" ", 1)[1] == b.split(" ", 1)[1]]
    deficit = [by[(c["a"], "K=1 (e2e)")] for c in grow if (c["a"], "K=1 (e2e)") in by]
    out["gap_grows_with_k"] = {"claim": "the deficit to end-to-end grows from K=2 to K=4 (K=4 worse than K=2, and worse "
                                        "than end-to-end)",
                               "status": _status([c["verdict"] for c in grow + deficit], B_BETTER) if grow else NOT_MEASURED,
                               "detail": "; ".join(map(sentence, grow + deficit))
                               or "needs the same aux head without MTP at K=2 and K=4"}
    tm = by.get(("K=4 transformer", "K=4 mlp"))
    out["transformer_beats_mlp"] = {"claim": "at K=4 the Transformer aux head beats the MLP aux head",
                                    "status": _status([tm["verdict"]], A_BETTER) if tm else NOT_MEASURED,
                                    "detail": sentence(tm) if tm else "needs K=4 with each aux head, MTP off"}
    k4 = sorted({n for pair in by for n in pair if n.startswith("K=4 ")})
    firsts = [n for n in k4 if n.endswith("MTP first")]
    # the best MTP-first configuration (lowest summed difference to the others), against every other K=4 one
    best = min(firsts, key=lambda n: sum(c["mean_diff"] for (a, _), c in by.items() if a == n), default=None)
    vs = [by[(best, o)] for o in k4 if best and o != best and (best, o) in by]
    verdicts = [c["verdict"] for c in vs]
    out["mtp_first_best"] = {"claim": "MTP at the first boundary only is the best K=4 configuration",
                             "status": _status(verdicts, A_BETTER) if vs else NOT_MEASURED,
                             "detail": "; ".join(map(sentence, vs)) or "needs K=4 with MTP at boundary 1 only and another K=4 configuration"}
    return out
