"""Top-k distillation: the targets, their stored record, and the loss restricted to the top k plus
one bucket, against a float64 reference computed by hand from the full softmax; chunked = unchunked."""
import math

import pytest
import torch

from zgcore.data import logit_store as ls
from zgcore.training import distill as zdistill
from zgcore.training.memory import measure_peak
from zgcore.training.topk import topk_kd_loss


def reference_kl(student: torch.Tensor, teacher: torch.Tensor, k: int, temperature: float) -> float:
    """T^2 x mean over positions of KL over {top-k tokens of the teacher, everything else}, in
    float64 from the full softmax of both, position by position."""
    s, t = student.double().reshape(-1, student.shape[-1]), teacher.double().reshape(-1, teacher.shape[-1])
    total = 0.0
    for i in range(len(s)):
        p, q = torch.softmax(t[i] / temperature, 0), torch.softmax(s[i] / temperature, 0)
        top = torch.argsort(t[i], descending=True)[:k]
        pk, qk = p[top], q[top]
        pr, qr = 1 - pk.sum(), 1 - qk.sum()
        total += float((pk * (pk / qk).log()).sum() + pr * math.log(pr / qr))
    return total / len(s) * temperature ** 2


@pytest.mark.parametrize("k,temperature", [(1, 1.0), (7, 1.0), (7, 2.5), (31, 0.7)])
def test_the_loss_is_the_kl_over_the_top_k_and_one_bucket_from_the_full_softmax(k, temperature):
    g = torch.Generator().manual_seed(k)
    teacher = torch.randn(2, 5, 40, generator=g) * 3
    student = torch.randn(2, 5, 40, generator=g) * 3
    ids, logp, rest = ls.teacher_targets(teacher, k, temperature)
    # the targets themselves, against float64
    p = torch.softmax(teacher.double() / temperature, -1)
    assert torch.equal(ids, torch.topk(teacher, k, -1).indices)
    assert torch.allclose(logp.double(), p.gather(-1, ids).log(), atol=1e-5)
    assert torch.allclose(rest.double(), (1 - p.gather(-1, ids).sum(-1)).log(), atol=1e-5)
    got = topk_kd_loss(student, lambda h: h, ids, logp, rest, temperature).item()
    assert got == pytest.approx(reference_kl(student, teacher, k, temperature), rel=1e-5, abs=1e-6)
    assert topk_kd_loss(teacher, lambda h: h, ids, logp, rest, temperature).item() == pytest.approx(0, abs=1e-5)


def test_with_all_but_one_token_kept_it_is_the_full_vocabulary_kd():
    g = torch.Generator().manual_seed(3)
    teacher, student = torch.randn(1, 4, 12, generator=g), torch.randn(1, 4, 12, generator=g)
    targets = ls.teacher_targets(teacher, 11, 1.3)
    full = zdistill.kd_loss(student, teacher, 1.3).item()
    assert topk_kd_loss(student, lambda h: h, *targets, 1.3).item() == pytest.approx(full, rel=1e-5)
    # fewer tokens see less: KL_k <= KL (data processing)
    assert topk_kd_loss(student, lambda h: h, *ls.teacher_targets(teacher, 3, 1.3), 1.3).item() < full


def test_a_tail_with_no_mass_is_floored_and_the_loss_stays_finite():
    teacher = torch.full((1, 2, 6), -200.0)
    teacher[..., :2] = 0.0  # the top 2 hold all the mass float32 can hold
    ids, logp, rest = ls.teacher_targets(teacher, 2, 1.0)
    assert torch.isfinite(rest).all() and float(rest.max()) <= -190
    student = torch.randn(1, 2, 6, requires_grad=True)
    loss = topk_kd_loss(student, lambda h: h, ids, logp, rest, 1.0)
    loss.backward()
    assert math.isfinite(loss.item()) and torch.isfinite(student.grad).all()


def test_bad_k_is_refused_naming_the_vocabulary():
    with pytest.raises(ValueError, match="1..9"):
        ls.teacher_targets(torch.zeros(1, 1, 10), 10, 1.0)


def test_the_record_gives_back_the_same_bits():
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 2 ** 20, (3, 4, 5), generator=g)
    logp, rest = torch.randn(3, 4, 5, generator=g), torch.randn(3, 4, generator=g)
    rec = ls.pack(ids, logp, rest)
    assert rec.dtype == torch.float32 and rec.shape == (3, 4, ls.record_width(5)) and torch.isfinite(rec).all()
    i2, l2, r2 = ls.unpack(rec, 5)
    assert torch.equal(i2, ids) and torch.equal(l2, logp) and torch.equal(r2, rest)
    assert ls.bytes_per_token(8) == 68 and ls.bytes_per_token(64) == 516
    with pytest.raises(ValueError, match="columns"):
        ls.unpack(rec, 4)


def _head_case(seed=0, b=2, s=7, h=8, v=300):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(b, s, h, generator=g, requires_grad=True)
    head = torch.nn.Linear(h, v, bias=False)
    with torch.no_grad():
        head.weight.copy_(torch.randn(v, h, generator=g))
    teacher = torch.randn(b, s, v, generator=g) * 2
    return hidden, head, ls.teacher_targets(teacher, 16, 1.0)


def test_chunked_equals_unchunked_in_value_and_gradients():
    grads = []
    for chunk in (None, 10 ** 6, 3, 1):  # default (one chunk here), one chunk, uneven chunks, one position each
        hidden, head, targets = _head_case()
        loss = topk_kd_loss(hidden, head, *targets, 1.0, chunk=chunk)
        loss.backward()
        grads.append((loss.detach(), hidden.grad.clone(), head.weight.grad.clone()))
    for loss, gh, gw in grads[1:]:
        assert torch.allclose(loss, grads[0][0], rtol=1e-6)
        assert torch.allclose(gh, grads[0][1], rtol=1e-5, atol=1e-7)
        assert torch.allclose(gw, grads[0][2], rtol=1e-5, atol=1e-7)


def test_chunks_keep_only_one_chunks_logits_for_the_backward():
    """Measured: the bytes autograd keeps for the backward. Unchunked, the whole [B*S, vocab]
    float32 logits (and their log-softmax) are kept; in chunks, only the chunks' inputs."""
    hidden, head, targets = _head_case(b=2, s=16, v=2000)
    logits_bytes = 2 * 16 * 2000 * 4
    params = [hidden, head.weight]
    whole = measure_peak(params, lambda: topk_kd_loss(hidden, head, *targets, 1.0, chunk=10 ** 6).backward())
    chunked = measure_peak(params, lambda: topk_kd_loss(hidden, head, *targets, 1.0, chunk=4).backward())
    whole, chunked = whole["saved_peak_bytes"], chunked["saved_peak_bytes"]
    print(f"autograd-saved bytes: unchunked {whole}, chunks of 4 positions {chunked}; logits {logits_bytes}")
    assert whole >= logits_bytes and chunked < logits_bytes / 8
