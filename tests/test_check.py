"""fl.check on the CPU with pure-PyTorch attention functions: a correct one passes, and each kind
of broken one fails. Also the float64 reference and rel_err."""
import math
from types import SimpleNamespace

import pytest
import torch

import flashlab as fl
from flashlab.check import FP32_TOL, SHAPES, STRIDED_SHAPES, CheckResult, case_inputs


def _attention(q, k, v, causal=False, scale=None):
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    s = (q @ k.transpose(-2, -1)) * scale
    if causal:
        n = q.shape[-2]
        s = s.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
    return torch.softmax(s, dim=-1) @ v


def _into(out, o):
    if out is None:
        return o
    out.copy_(o)
    return out


def correct(q, k, v, causal=False, out=None):
    return _into(out, _attention(q, k, v, causal))


def last_row_unwritten(q, k, v, causal=False, out=None):
    out = torch.empty_like(q) if out is None else out  # check() passes out poisoned with NaN
    out[..., :-1, :] = _attention(q, k, v, causal)[..., :-1, :]
    return out


def ignores_causal(q, k, v, causal=False, out=None):
    return _into(out, _attention(q, k, v, causal=False))


def wrong_scale(q, k, v, causal=False, out=None):
    return _into(out, _attention(q, k, v, causal, scale=1.0 / q.shape[-1]))


def rounded_to_fp16(q, k, v, causal=False, out=None):
    return _into(out, fl.reference(q, k, v, causal).half().to(q.dtype))


def returns_fresh_tensor(q, k, v, causal=False, out=None):
    return _attention(q, k, v, causal)  # ignores out but returns the right answer


@pytest.mark.parametrize("seed", [0, 1])
def test_correct_attention_passes(seed):
    result = fl.check(correct, device="cpu", dtype="fp32", seed=seed)
    assert result.passed, str(result)
    assert {c.N for c in result.cases} >= {1, 17, 1000, 4096}
    assert {c.causal for c in result.cases} == {False, True}
    assert all(c.dtype == "fp32" and c.tol == FP32_TOL for c in result.cases)
    assert len(result.cases) == len(SHAPES) * 2
    assert result.max_rel_err < 1e-5
    assert result.failures() == []
    assert result.name == "correct"
    assert str(result).startswith("correct: PASS")


def test_returned_tensor_is_what_is_checked():
    assert fl.check(returns_fresh_tensor, device="cpu", dtype="fp32", seed=0).passed


@pytest.mark.parametrize("fn,failing", [
    (last_row_unwritten, lambda c: True),                       # every shape has a last row
    (ignores_causal, lambda c: c.causal and c.N > 1),           # N = 1 has nothing to mask
    (wrong_scale, lambda c: c.N > 1),                           # one key: softmax is 1 anyway
    (rounded_to_fp16, lambda c: True),
], ids=["last_row_unwritten", "ignores_causal", "wrong_scale", "rounded_to_fp16"])
def test_broken_attention_fails(fn, failing):
    result = fl.check(fn, device="cpu", dtype="fp32", seed=0)
    assert not result.passed, str(result)
    assert str(result).startswith(f"{fn.__name__}: FAIL")
    assert [c.passed for c in result.cases] == [not failing(c) for c in result.cases], str(result)
    assert all(not c.passed for c in result.failures())


def test_poison_makes_the_error_infinite():
    result = fl.check(last_row_unwritten, device="cpu", dtype="fp32", seed=0)
    assert all(c.rel_err == math.inf for c in result.cases)
    assert result.max_rel_err == math.inf
    assert "FAIL" in str(result)


def test_fp16_rounding_is_caught_by_the_fp32_tolerance():
    result = fl.check(rounded_to_fp16, device="cpu", dtype="fp32", seed=0)
    for c in result.cases:
        assert FP32_TOL < c.rel_err < 1e-2, str(result)


def test_check_options():
    result = fl.check(correct, device="cpu", dtype="fp32", head_dims=(8, 40), shapes=((1, 1, 5),),
                      causal=(True,), name="mine", seed=3)
    assert result.name == "mine"
    assert [(c.N, c.D, c.causal) for c in result.cases] == [(5, 8, True), (5, 40, True)]
    assert result.passed
    rows = result.rows()
    assert len(rows) == 2 and rows[0]["passed"] is True and rows[0]["N"] == 5


def test_empty_result_does_not_pass():
    empty = CheckResult("nothing")
    assert not empty.passed
    assert math.isnan(empty.max_rel_err)


# --- the reference --------------------------------------------------------------------------------

@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("shape", [(1, 1, 1, 8), (2, 3, 17, 16), (1, 2, 100, 64)])
def test_reference_matches_torch_softmax(shape, causal):
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(*shape, generator=gen) for _ in range(3))
    ref = fl.reference(q, k, v, causal=causal)
    assert ref.dtype == torch.float64 and ref.shape == q.shape
    qd, kd, vd = q.double(), k.double(), v.double()
    s = qd @ kd.transpose(-2, -1) / math.sqrt(shape[-1])
    if causal:
        n = shape[2]
        s = s + torch.full((n, n), float("-inf"), dtype=torch.float64).triu(1)
    expect = torch.softmax(s, dim=-1) @ vd
    torch.testing.assert_close(ref, expect, rtol=1e-12, atol=1e-12)
    sdpa = torch.nn.functional.scaled_dot_product_attention(qd, kd, vd, is_causal=causal)
    torch.testing.assert_close(ref, sdpa, rtol=1e-10, atol=1e-10)


def test_reference_scale_and_slicing():
    gen = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(2, 3, 33, 16, generator=gen) for _ in range(3))
    whole = fl.reference(q, k, v, causal=True)
    sliced = fl.reference(q, k, v, causal=True, max_bytes=1)  # one head at a time
    # float64 rounding only: a batched matmul may block its sums differently from one head's
    torch.testing.assert_close(whole, sliced, rtol=1e-13, atol=1e-15)
    scaled = fl.reference(q, k, v, scale=0.5)
    expect = torch.nn.functional.scaled_dot_product_attention(q.double(), k.double(), v.double(),
                                                              scale=0.5)
    torch.testing.assert_close(scaled, expect, rtol=1e-10, atol=1e-10)


def test_naive_attention_keeps_the_dtype():
    q = torch.randn(1, 2, 9, 8)
    o = fl.naive_attention(q, q, q, causal=True)
    assert o.dtype == torch.float32
    assert fl.rel_err(o, fl.reference(q, q, q, causal=True)) < 1e-5


def test_rel_err():
    ref = torch.randn(2, 3, 4, 5, dtype=torch.float64)
    assert fl.rel_err(ref.clone(), ref) == 0.0
    assert fl.rel_err(ref.float(), ref) < 1e-7
    assert fl.rel_err(2 * ref, ref) == pytest.approx(1.0)
    bad = ref.clone()
    bad[0, 0, 0, 0] = float("nan")
    assert fl.rel_err(bad, ref) == math.inf
    bad[0, 0, 0, 0] = float("inf")
    assert fl.rel_err(bad, ref) == math.inf
    assert fl.rel_err(torch.full_like(ref, float("nan")).float(), ref) == math.inf


# --- the layout a model passes (stages with row_strides) ---------------------------------------------

class _Strided:
    """A callable that looks like a built stage which reads strided rows."""

    def __init__(self, fn):
        self.fn, self.__name__ = fn, fn.__name__
        self.stage = SimpleNamespace(slug=fn.__name__, dtypes=("fp32",), head_dims=(16,),
                                     causal=True, row_strides=True)

    def __call__(self, *args, **kwargs):
        return self.fn(*args, **kwargs)


def rows_as_if_contiguous(q, k, v, causal=False, out=None):
    """Reads every tensor as if its rows were D apart, as a kernel that ignores the strides."""
    dense = lambda t: t.as_strided(t.shape, torch.empty(t.shape).stride())  # noqa: E731
    return _into(out, _attention(dense(q), dense(k), dense(v), causal))


def test_a_stage_with_row_strides_is_also_checked_in_the_models_layout():
    result = fl.check(_Strided(correct), device="cpu", dtype="fp32", seed=0)
    assert result.passed, str(result)
    bnhd = [c for c in result.cases if c.layout == "bnhd"]
    assert {(c.B, c.H, c.N) for c in bnhd} == set(STRIDED_SHAPES)
    assert all(c.B > 1 and c.H > 1 for c in bnhd)  # batch and head strides both matter
    assert "bnhd" in str(result) and {r["layout"] for r in result.rows()} == {"contiguous", "bnhd"}
    plain = fl.check(correct, device="cpu", dtype="fp32", seed=0)  # no stage: contiguous only
    assert {c.layout for c in plain.cases} == {"contiguous"}


@pytest.mark.parametrize("fn", [rows_as_if_contiguous, returns_fresh_tensor])
def test_ignoring_the_strides_or_the_given_output_fails_the_models_layout(fn):
    result = fl.check(_Strided(fn), device="cpu", dtype="fp32", seed=0)
    assert not result.passed
    assert [c.passed for c in result.cases] == [c.layout == "contiguous" for c in result.cases], \
        str(result)


def test_the_models_layout():
    q, k, v, out = case_inputs(2, 3, 5, 8, torch.float32, "bnhd", device="cpu")
    assert q.shape == k.shape == v.shape == out.shape == (2, 3, 5, 8)
    assert q.stride() == (5 * 3 * 3 * 8, 8, 3 * 3 * 8, 1)  # rows 3·H·D apart
    assert out.stride() == (5 * 3 * 8, 8, 3 * 8, 1) and out.isnan().all()
    assert k.data_ptr() - q.data_ptr() == 3 * 8 * 4  # k follows q in each row of the projection
    with pytest.raises(ValueError, match="unknown layout"):
        case_inputs(1, 1, 1, 8, torch.float32, "bhnd_t", device="cpu")
