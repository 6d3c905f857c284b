"""Top-k knowledge distillation: the loss restricted to the teacher's top-k tokens plus one bucket
for the rest of the vocabulary, computed in chunks of positions so that the student's full
``[batch, seq, vocab]`` float32 logits never exist at once. The targets (ids, log-probabilities
``log p_i`` and the tail's log-mass ``log p_R``, at temperature ``T``) are
:func:`zgcore.data.logit_store.teacher_targets`, read from the top-k logit store or computed
online by the same function.

**Loss** (nats/token at ``T = 1``): ``T**2`` times the mean over positions of the KL divergence
between teacher and student over ``k + 1`` outcomes — each top-k token, and one bucket "any
other token":

    KL_k = sum_{i in K} p_i (log p_i - log q_i) + p_R (log p_R - log q_R)

with ``q = softmax(z_student / T)`` over the whole vocabulary and ``log q_R`` the log-sum-exp of
``log q`` over the tokens outside ``K``. By the data-processing inequality ``KL_k <= KL`` (the
full-vocabulary KD of :func:`zgcore.training.distill.kd_loss`), with equality when the student's
tail is proportional to the teacher's; at ``k = vocab - 1`` it is the full KL. The bucket keeps
the student's total mass on the teacher's top k honest (without it, a student that puts the tail
mass anywhere pays nothing for it). KD: Hinton et al. 2015, "Distilling the Knowledge in a
Neural Network"; compressed top-k teacher logits stored offline as in DistillKit (arcee-ai).
"""
from __future__ import annotations

from collections.abc import Callable

import torch
from torch.utils.checkpoint import checkpoint

# student logits computed at a time: positions per chunk = CHUNK_BYTES // (4 * vocab)
CHUNK_BYTES = 32 << 20


def bucket_kl(student_logits: torch.Tensor, ids: torch.Tensor, logp: torch.Tensor, rest: torch.Tensor,
              temperature: float) -> torch.Tensor:
    """Sum over positions of ``KL_k`` (the module's formula) — not yet times ``T**2``, not a mean.

    Args:
        student_logits: ``[..., vocab]`` (computed in float32). ids: int64 ``[..., k]``.
        logp: float32 ``[..., k]``. rest: float32 ``[...]``. temperature: ``T`` > 0.

    Returns:
        A scalar float32 tensor (nats, summed over positions).
    """
    logq = torch.log_softmax(student_logits.float() / temperature, -1)
    logq_k = logq.gather(-1, ids)
    logq_rest = torch.logsumexp(logq.scatter(-1, ids, float("-inf")), -1)
    p = logp.exp()
    p_rest = rest.exp()
    return (p * (logp - logq_k)).sum() + (p_rest * (rest - logq_rest)).sum()


def topk_kd_loss(hidden: torch.Tensor, head: Callable[[torch.Tensor], torch.Tensor], ids: torch.Tensor,
                 logp: torch.Tensor, rest: torch.Tensor, temperature: float, chunk: int | None = None) -> torch.Tensor:
    """``T**2`` times the mean over positions of ``KL_k``, with the student's logits made
    ``chunk`` positions at a time from its final hidden states.

    Each chunk's logits, log-softmax and loss are computed under activation checkpointing
    (:func:`torch.utils.checkpoint.checkpoint`): the forward keeps no chunk's logits, and the
    backward recomputes them one chunk at a time, so at most one chunk's ``[chunk, vocab]``
    float32 logits (and their gradient) exist at once instead of ``[batch * seq, vocab]``.

    Args:
        hidden: the student's final hidden states (after its final norm) ``[B, S, H]``.
        head: hidden ``[n, H]`` -> logits ``[n, vocab]`` (LM head, then the family's logit
            scaling / soft-capping: :meth:`zgcore.models.families.FamilyAdapter.finish_logits`).
        ids, logp, rest: targets ``[B, S, k]``, ``[B, S, k]``, ``[B, S]`` (as :func:`zgcore.data.logit_store.unpack`).
        temperature: ``T`` > 0. chunk: positions per chunk (None: ``CHUNK_BYTES // (4 * vocab)``,
            at least 1; >= ``B * S``: one chunk, no checkpointing).

    Returns:
        A scalar float32 tensor (nats/token at ``T = 1``).
    """
    n = hidden.shape[0] * hidden.shape[1]
    h = hidden.reshape(n, hidden.shape[-1])
    ids, logp, rest = ids.reshape(n, -1), logp.reshape(n, -1), rest.reshape(n)
    if chunk is None:
        with torch.no_grad():
            vocab = head(h[:1]).shape[-1]
        chunk = max(1, CHUNK_BYTES // (4 * vocab))

    def part(hc, ic, lc, rc):
        return bucket_kl(head(hc), ic, lc, rc, temperature)

    if chunk >= n:
        total = part(h, ids, logp, rest)
    else:
        total = sum(checkpoint(part, h[a: a + chunk], ids[a: a + chunk], logp[a: a + chunk], rest[a: a + chunk],
                               use_reentrant=False) for a in range(0, n, chunk))
    return total / n * temperature ** 2
