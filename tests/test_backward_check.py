"""The backward pass's correctness harness, on the CPU: the float64 reference gradients and
log-sum-exp are right (gradcheck), FlashAttention-2's Algorithm 2 as flashlab.reference models it
passes check_backward, and the check fails a backward that drops Δ, one that leaves a row
unwritten, and a log-sum-exp off by a constant: a check that cannot fail is a defect."""
import math

import pytest
import torch

from flashlab.check import check_backward, check_lse, check_repeatable
from flashlab.reference import (blocked_backward, naive_attention, reference, reference_backward,
                                reference_lse)

SHAPES = ((1, 1, 1), (2, 3, 17), (1, 2, 130))


def test_the_reference_gradients_are_autograds_own_in_float64():
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, 7, 8, dtype=torch.float64, requires_grad=True) for _ in range(3))
    for causal in (False, True):
        assert torch.autograd.gradcheck(
            lambda a, b, c: naive_attention(a, b, c, causal), (q, k, v))
        do = torch.randn(1, 2, 7, 8, dtype=torch.float64)
        o = naive_attention(q, k, v, causal)
        want = torch.autograd.grad(o, (q, k, v), do)
        got = reference_backward(q.detach(), k.detach(), v.detach(), do, causal)
        for g, w in zip(got, want):
            assert torch.allclose(g, w)


def test_the_reference_lse_is_the_log_of_the_softmaxs_denominator():
    torch.manual_seed(1)
    q, k = torch.randn(2, 3, 9, 16), torch.randn(2, 3, 9, 16)
    s = (q.double() @ k.double().transpose(-2, -1)) / 4.0
    assert torch.allclose(reference_lse(q, k), torch.logsumexp(s, -1))
    masked = s.masked_fill(torch.ones(9, 9, dtype=torch.bool).triu(1), -math.inf)
    lse = reference_lse(q, k, causal=True)
    assert torch.allclose(lse, torch.logsumexp(masked, -1))
    assert torch.allclose(lse[..., 0], s[..., 0, 0])  # row 0 sees key 0 alone


def _algorithm2(q, k, v, o, lse, do, causal, dq, dk, dv, **kw):
    for out, g in zip((dq, dk, dv), blocked_backward(q, k, v, o, lse, do, causal, **kw)):
        out.copy_(g)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_flashattention2s_algorithm_2_passes(dtype):
    res = check_backward(_algorithm2, dtype=dtype, head_dims=(64,), shapes=SHAPES,
                               device="cpu", name="algorithm 2")
    assert res.passed, str(res)
    assert {c.what for c in res.cases} == {"dq", "dk", "dv"}


def test_algorithm_2_with_tiles_that_divide_nothing():
    """Ragged in both directions: 17-key tiles over 130 keys, 48-row blocks."""
    res = check_backward(lambda *a: _algorithm2(*a, BR=48, BC=17), dtype="fp32",
                               head_dims=(32,), shapes=((1, 2, 130),), device="cpu")
    assert res.passed, str(res)


def test_the_check_fails_a_backward_without_delta():
    def no_delta(q, k, v, o, lse, do, causal, dq, dk, dv):
        _algorithm2(q, k, v, torch.zeros_like(o), lse, do, causal, dq, dk, dv)  # Δ = 0
    res = check_backward(no_delta, dtype="fp32", head_dims=(32,), shapes=((2, 3, 17),),
                               device="cpu")
    assert not res.passed
    failed = {c.what for c in res.failures()}
    assert failed == {"dq", "dk"}  # dV = Pᵀ dO needs no Δ


def test_the_check_fails_an_unwritten_row():
    def last_row_missing(q, k, v, o, lse, do, causal, dq, dk, dv):
        _algorithm2(q, k, v, o, lse, do, causal, dq, dk, dv)
        dv[:, :, -1] = math.nan  # as the poison left it
    res = check_backward(last_row_missing, dtype="fp32", head_dims=(32,),
                               shapes=((1, 1, 17),), device="cpu")
    assert [c.what for c in res.failures()] == ["dv", "dv"]
    assert all(math.isinf(c.rel_err) for c in res.failures())


def test_check_lse_passes_the_truth_and_fails_a_shifted_lse():
    def attn(q, k, v, causal=False, out=None, return_lse=False, shift=0.0):
        out.copy_(reference(q, k, v, causal).to(q.dtype))
        return out, reference_lse(q, k, causal).float() + shift
    assert check_lse(attn, dtype="fp32", head_dims=(32,), shapes=SHAPES, device="cpu").passed
    wrong = lambda *a, **kw: attn(*a, shift=math.log(2), **kw)  # noqa: E731  (log2 for ln)
    assert not check_lse(wrong, dtype="fp32", head_dims=(32,), shapes=SHAPES,
                               device="cpu").passed


def test_a_backward_that_gives_the_same_bits_passes_the_repeat_check():
    res = check_repeatable(_algorithm2, dtype="fp32", head_dims=(32,), shapes=((1, 2, 130),),
                           device="cpu", name="algorithm 2")
    assert res.passed, str(res)
    assert {c.what for c in res.cases} == {"dq", "dk", "dv"} and {c.layout for c in res.cases} == {"repeat"}


def test_the_repeat_check_fails_a_backward_whose_last_bits_vary():
    """Sums taken in a different order each run (as atomics land): right within any tolerance,
    and not the same bits."""
    calls = []

    def shuffled(q, k, v, o, lse, do, causal, dq, dk, dv):
        _algorithm2(q, k, v, o, lse, do, causal, dq, dk, dv)
        calls.append(1)
        dq.add_(torch.finfo(dq.dtype).eps * dq.abs().max() * (len(calls) % 2))  # the last bits move

    res = check_repeatable(shuffled, dtype="fp32", head_dims=(32,), shapes=((1, 2, 130),),
                           causal=(False,), device="cpu")
    assert not res.passed
    (bad,) = res.failures()
    assert bad.what == "dq" and 0 < bad.rel_err < 1e-5


def test_a_stage_is_checked_for_everything_it_promises():
    """flashlab check and the backward's measurement run the same checks, from the registry."""
    import flashlab as fl
    from flashlab.check import promised_checks
    assert promised_checks(fl.stage("16")) == [check_lse, check_backward, check_repeatable]
    assert promised_checks(fl.stage("15")) == [check_lse, check_backward]
    assert promised_checks(fl.stage("05")) == [check_lse]
    assert promised_checks(fl.stage("02")) == []
