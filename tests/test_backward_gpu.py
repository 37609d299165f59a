"""GPU tests of the log-sum-exp a forward returns (every stage from 05 on), and of the stages with
a backward pass: their backward on its own, and training through them with autograd, against
float64 (FlashAttention's rule: twice PyTorch's own same-dtype error), on ragged lengths, strided
views and more (batch, head) pairs than a grid's y dimension holds."""
import pytest
import torch

import flashlab as fl
from flashlab.check import STRIDED_SHAPES, check_backward, check_lse, check_repeatable, check_training
from flashlab.reference import reference, reference_backward, rel_err

from conftest import attn_for

pytestmark = pytest.mark.gpu
BACKWARD = [st.slug for st in fl.stages() if st.has_backward]
LSE = [st.slug for st in fl.stages() if st.lse]
DETERMINISTIC = [st.slug for st in fl.stages() if st.deterministic]
# a tensor-core backward that adds dQ with atomics in any order (the repeat check must catch it)
ATOMIC = [st.slug for st in fl.stages() if st.has_backward and not st.deterministic
          and st.backward_sass.get("HMMA")]
DTYPES = ["fp16", "bf16"]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("slug", LSE)
def test_the_log_sum_exp_matches_float64(built, slug, dtype):
    res = check_lse(attn_for(built, slug), dtype=dtype)
    assert res.passed, str(res)


@pytest.mark.parametrize("slug", LSE)
def test_asking_for_the_log_sum_exp_leaves_the_output_as_it_was(built, slug):
    """The forward asked for the log-sum-exp (another instantiation of the kernel, for the stages
    from 05 to 13) writes the same output, bit for bit, as without it."""
    attn = attn_for(built, slug)
    for N, D, causal in ((1000, 64, False), (1000, 128, True), (17, 64, True)):
        q, k, v = (torch.randn(2, 3, N, D, device="cuda", dtype=torch.float16) for _ in range(3))
        with torch.no_grad():
            plain = attn(q, k, v, causal=causal)
            o, lse = attn(q, k, v, causal=causal, return_lse=True)
        assert torch.equal(o, plain), (N, D, causal)
        assert lse.shape == (2, 3, N) and torch.isfinite(lse).all()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("slug", BACKWARD)
def test_backward_matches_float64(built, slug, dtype):
    """N = 1, 17, 1000, 4096 at D = 64 and 128, causal and not, and on the strided views of one
    (B, N, 3, H, D) projection: dq, dk and dv poisoned with NaN before each call."""
    res = check_backward(attn_for(built, slug), dtype=dtype,
                         strided_shapes=STRIDED_SHAPES)
    assert res.passed, str(res)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("slug", BACKWARD)
def test_training_through_a_stage_gives_float64_gradients(built, slug, dtype):
    """q, k, v (and a model's (B, N, 3, H, D) projection) require grad; o.backward(do) fills
    their .grad: the forward's saved log-sum-exp and the backward together."""
    res = check_training(attn_for(built, slug), dtype=dtype,
                         shapes=((1, 1, 1), (2, 3, 17), (1, 2, 1000)))
    assert res.passed, str(res)


@pytest.mark.parametrize("slug", BACKWARD)
def test_more_heads_than_a_grid_dimension_holds(built, slug):
    """B·H = 65 537 (B·H > 65 535, the y-dimension's limit): every (batch, head) gets its own
    gradients. The last heads are compared, where a folded index would go wrong."""
    attn = attn_for(built, slug)
    B, H, N, D = 1, 65537, 17, 64
    g = torch.Generator(device="cuda").manual_seed(5)
    q, k, v, do = (torch.randn(B, H, N, D, device="cuda", dtype=torch.float16, generator=g)
                   for _ in range(4))
    o, lse = attn(q, k, v, return_lse=True)
    dq, dk, dv = attn.backward(q, k, v, o, lse, do)
    tail = slice(H - 64, H)
    want = reference_backward(*(t[:, tail] for t in (q, k, v, do)))
    for got, ref in zip((dq, dk, dv), want):
        assert torch.isfinite(got).all()
        assert rel_err(got[:, tail], ref) < 5e-3


@pytest.mark.parametrize("slug", BACKWARD)
def test_inference_is_unchanged_and_lse_carries_no_gradient(built, slug):
    attn = attn_for(built, slug)
    q, k, v = (torch.randn(2, 3, 77, 64, device="cuda", dtype=torch.float16, requires_grad=True)
               for _ in range(3))
    plain = [t.detach() for t in (q, k, v)]
    want = reference(*plain)
    for mode in (torch.no_grad, torch.inference_mode):
        with mode():
            o = attn(q, k, v)
        assert not o.requires_grad and rel_err(o, want) < 2e-3
    o, lse = attn(q, k, v, return_lse=True)
    assert o.requires_grad and not lse.requires_grad and lse.dtype == torch.float32
    assert o.grad_fn is not None
    with pytest.raises(ValueError, match="out= cannot be used while autograd"):
        attn(q, k, v, out=torch.empty_like(plain[0]))


@pytest.mark.parametrize("slug", BACKWARD)
def test_bad_backward_input_is_a_value_error(built, slug):
    attn = attn_for(built, slug)
    q, k, v, do = (torch.randn(1, 2, 33, 64, device="cuda", dtype=torch.float16) for _ in range(4))
    o, lse = attn(q, k, v, return_lse=True)
    with pytest.raises(ValueError, match="lse must be a float32"):
        attn.backward(q, k, v, o, lse.half(), do)
    with pytest.raises(ValueError, match="do must be"):
        attn.backward(q, k, v, o, lse, do[:, :1])
    with pytest.raises(ValueError, match="dq must be a contiguous"):
        attn.backward(q, k, v, o, lse, do, dq=torch.empty(1, 2, 33, 64, device="cuda"))
    with pytest.raises(ValueError, match="compiled for head dims"):
        q2 = torch.randn(1, 2, 33, 96, device="cuda", dtype=torch.float16)
        attn.backward(q2, q2, q2, q2, lse, q2)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("slug", DETERMINISTIC)
def test_a_deterministic_backward_gives_the_same_bits_on_every_run(built, slug, dtype):
    """Five runs on the same inputs (N = 4096: 64 key blocks add into every row of dQ), D = 64
    and 128, causal and not: dq, dk and dv bit for bit the first run's."""
    res = check_repeatable(attn_for(built, slug), dtype=dtype, runs=5)
    assert res.passed, str(res)


@pytest.mark.parametrize("slug", ATOMIC)
def test_the_repeat_check_catches_atomics_in_any_order(built, slug):
    """The check the deterministic stage passes fails the backward before it, whose dQ atomics
    land in any order: a check that cannot fail would prove nothing."""
    res = check_repeatable(attn_for(built, slug), dtype="fp16", head_dims=(64,), causal=(False,),
                           runs=5)
    assert not res.passed and {c.what for c in res.failures()} == {"dq"}, str(res)


@pytest.mark.parametrize("slug", [st.slug for st in fl.stages() if st.grad_strides])
def test_new_gradients_come_in_the_order_of_a_models_views(built, slug):
    """q, k, v the (B, H, N, D) views of one (B, N, 3, H, D) projection, as a model hands them
    over, and dO the view of a (B, N, H, D) gradient: a stage with grad_strides reads dO where it
    lies and writes each new gradient in its input's order (dense, rows H·D apart), with the
    values of contiguous gradients and against float64."""
    from flashlab.inputs import empty_in_order
    attn = attn_for(built, slug)
    B, H, N, D = 2, 3, 333, 64
    qkv = torch.randn(B, N, 3, H, D, device="cuda", dtype=torch.float16)
    q, k, v = (qkv[:, :, i].transpose(1, 2) for i in range(3))
    o, lse = attn(q, k, v, causal=True, return_lse=True)
    do = torch.randn(B, N, H, D, device="cuda", dtype=torch.float16).transpose(1, 2)  # a model's
    grads = attn.backward(q, k, v, o, lse, do, causal=True)
    want = reference_backward(q, k, v, do, causal=True)
    plain = attn.backward(q.contiguous(), k.contiguous(), v.contiguous(), o, lse, do.contiguous(),
                          causal=True)
    for g, x, w, c in zip(grads, (q, k, v), want, plain):
        assert g.stride() == empty_in_order(x).stride() == (N * H * D, D, H * D, 1)
        assert c.is_contiguous()
        assert rel_err(g, w) < 5e-3 and rel_err(g, c) < 2e-3
