"""Input validation, on CPU tensors: validate() checks the device last, so every other rule shows
here without a GPU. Every bad input is a ValueError whose message names the problem."""
import dataclasses
import numpy as np
import pytest
import torch

import flashlab as fl
from flashlab import build
from flashlab.inputs import dtype_of, validate
from flashlab.runtime import Attention

SHAPE = (1, 2, 16, 16)  # N == D, so a transpose keeps the shape but not the layout


def t(*shape, dtype=torch.float32):
    return torch.randn(*(shape or SHAPE), dtype=dtype)


def misaligned(shape=SHAPE):
    """A contiguous float tensor whose data starts 4 bytes into its storage."""
    n = int(np.prod(shape))
    return torch.randn(n + 1)[1:].view(shape)


def _bad_calls():
    q = t()
    yield "non-tensor q", (q.numpy(), q, q), {}, "q must be a torch.Tensor"
    yield "non-tensor v", (q, q, [1.0]), {}, "v must be a torch.Tensor, got list"
    yield "non-tensor out", (q, q, q), {"out": 3.0}, "out must be a torch.Tensor"
    yield "rank 3", (q[0], q[0], q[0]), {}, "rank 4"
    yield "rank 5", (q[None], q[None], q[None]), {}, "rank 4"
    yield "k shape", (q, t(1, 2, 17, 16), q), {}, "k has shape"
    yield "v shape", (q, q, t(1, 2, 16, 8)), {}, "v has shape"
    yield "empty N", (t(1, 2, 0, 16),) * 3, {}, "empty"
    yield "empty B", (t(0, 2, 16, 16),) * 3, {}, "empty"
    yield "empty D", (t(1, 2, 16, 0),) * 3, {}, "empty"
    yield "float64", (q.double(),) * 3, {}, "dtype torch.float64; this stage takes"
    yield "int", (q.int(),) * 3, {}, "dtype torch.int32"
    yield "fp16 to an fp32 stage", (q.half(),) * 3, {}, "dtype torch.float16"
    yield "non-contiguous k", (q, q.transpose(2, 3), q), {}, "k is not contiguous"
    yield "misaligned v", (q, q, misaligned()), {}, "v is not 16-byte aligned"
    yield "cpu tensors", (q, q, q), {}, "CUDA"
    yield "out shape", (q, q, q), {"out": t(1, 2, 16, 8)}, "out has shape"
    yield "out dtype", (q, q, q), {"out": q.double()}, "out has dtype"
    yield "out non-contiguous", (q, q, q), {"out": q.transpose(2, 3)}, "out is not contiguous"
    yield "out misaligned", (q, q, q), {"out": misaligned()}, "out is not 16-byte aligned"


BAD = list(_bad_calls())


@pytest.mark.parametrize("what,args,kwargs,words", BAD, ids=[b[0] for b in BAD])
def test_bad_input_is_a_value_error_naming_the_problem(what, args, kwargs, words):
    with pytest.raises(ValueError, match=words) as err:
        validate("03_coarsened", *args, **kwargs)
    assert str(err.value).startswith("03_coarsened: ")  # says who refused


def bnhd(B=2, H=3, N=16, D=64, dtype=torch.float16, pack=3):
    """(B, H, N, D) views of one (B, N, pack, H, D) projection, as transformers passes them."""
    x = torch.randn(B, N, pack, H, D, dtype=dtype)
    return [x[:, :, i].transpose(1, 2) for i in range(pack)]


def _bad_strided_calls():
    q, k, v = bnhd()
    sq, sk, sv = bnhd(N=64)  # N == D: a transpose keeps the shape
    yield "strided head dim", (sq, sk.transpose(2, 3), sv), {}, "k's last dim is strided"
    odd = torch.randn(2, 16, 3 * 64 + 1, dtype=torch.float16)[..., :3 * 64].view(2, 16, 3, 64)
    yield "rows off 16 bytes", (q, k, odd.transpose(1, 2)), {}, "v has strides .*16-byte boundary"
    over = torch.empty(2, 16, 64, dtype=torch.float16)[:, None].expand(2, 3, 16, 64)
    yield "out overlaps itself", (q, k, v), {"out": over}, "several of its elements share memory"
    skewed = torch.empty(2 * 3 * 16 * 64 + 1, dtype=torch.float16)[1:].view(2, 3, 16, 64)
    yield "out misaligned", (q, k, v), {"out": skewed}, "out is not 16-byte aligned"


STRIDED_BAD = list(_bad_strided_calls())


@pytest.mark.parametrize("what,args,kwargs,words", STRIDED_BAD, ids=[b[0] for b in STRIDED_BAD])
def test_strided_rows_a_stage_cannot_read_are_refused(what, args, kwargs, words):
    with pytest.raises(ValueError, match=words):
        validate("08_tuned", *args, dtypes=("fp16",), row_strides=True, **kwargs)


def test_what_a_model_passes_is_read_in_place_by_stages_with_row_strides():
    q, k, v = bnhd()
    out = torch.empty(2, 16, 3, 64, dtype=torch.float16).transpose(1, 2)
    with pytest.raises(ValueError, match="CUDA"):  # every layout rule passed; only the device is left
        validate("08_tuned", q, k, v, dtypes=("fp16",), out=out, row_strides=True)
    with pytest.raises(ValueError, match="q is not contiguous.*contiguous .* tensors only"):
        validate("04_wmma", q, k, v, dtypes=("fp16",))
    assert fl.inputs.strides(q) == (16 * 3 * 3 * 64, 64, 3 * 3 * 64)
    assert fl.inputs.strides(q[:1, :1]) == (0, 0, 3 * 3 * 64)  # size-1 dims: stride unused
    assert [st.slug for st in fl.stages() if st.row_strides][:4] == \
        ["05_mma", "06_swizzle", "07_cp_async", "08_tuned"]


def test_a_view_reaching_past_32_bit_offsets_is_refused():
    base = torch.empty(2**32, dtype=torch.float16, device="meta")  # no memory
    far = (2**31 - 128, 64, 64, 1)  # batch 1 starts 2**31 - 128 elements in
    q = base.as_strided((2, 1, 4, 64), far)  # 512 elements, the last at 2**31 + 127
    with pytest.raises(ValueError, match="reach element 2147483775, which is too many for 32-bit"):
        validate("08_tuned", q, q, q, dtypes=("fp16",), row_strides=True)
    assert fl.inputs.span(base.as_strided((1, 1, 4, 64), far)) == 256
    assert fl.inputs.span(q) == 2**31 + 128


def test_mixed_dtypes_when_both_are_allowed():
    q = t()
    with pytest.raises(ValueError, match=r"k has dtype torch.float16 but q has torch.float32"):
        validate("x", q, q.half(), q, dtypes=("fp32", "fp16"))
    # the same dtypes, each allowed, pass every rule but the device
    with pytest.raises(ValueError, match="CUDA"):
        validate("x", q.half(), q.half(), q.half(), dtypes=("fp32", "fp16"))


def test_too_many_elements_for_32_bit_indexing():
    q = torch.empty(1, 1, 2**16, 2**15, device="meta")  # 2**31 elements, no memory
    with pytest.raises(ValueError, match="32-bit indexing"):
        validate("x", q, q, q)


def test_the_device_is_checked_last():
    """A CPU call that is right in every other way fails only on the device."""
    q = t()
    with pytest.raises(ValueError) as err:
        validate("x", q, q.clone(), q.clone(), out=torch.empty_like(q))
    msg = str(err.value)
    assert "q is on cpu" in msg and "CUDA" in msg and ".cuda()" in msg


def test_dtype_names():
    assert dtype_of("fp32") is torch.float32
    assert dtype_of("fp16") is torch.float16
    assert dtype_of("bf16") is torch.bfloat16
    assert dtype_of(torch.float16) is torch.float16
    with pytest.raises(ValueError, match="fp32, fp16, bf16"):
        dtype_of("fp64")


class _Untouchable:
    """A stand-in for a built module: any use of it is a test failure."""

    def __getattr__(self, name):
        raise AssertionError(f"the module's {name} was reached before validation refused the call")


@pytest.mark.parametrize("slug", [st.slug for st in fl.stages()])
def test_attention_validates_before_reaching_the_kernel(slug):
    attn = Attention(fl.stage(slug), _Untouchable())
    q = t(dtype=dtype_of(fl.stage(slug).dtypes[0]))  # a dtype it takes: the device is what's wrong
    with pytest.raises(ValueError, match="CUDA"):
        attn(q, q, q)
    with pytest.raises(ValueError, match="rank 4"):
        attn(q[0], q[0], q[0], causal=True)
    assert slug in repr(attn)


@pytest.mark.parametrize("slug", [st.slug for st in fl.stages() if st.has_backward])
def test_a_stage_with_a_backward_pass_takes_a_call_autograd_records(slug):
    """Inputs that require grad go on to the checks of the recorded call (here to validate's
    device rule: CPU tensors stand in); an `out` for it is refused, since autograd's output must
    be a tensor of its own graph."""
    attn = Attention(fl.stage(slug), _Untouchable())
    dtype = dtype_of(fl.stage(slug).dtypes[0])
    plain, wants = t(dtype=dtype), t(dtype=dtype).requires_grad_()
    with pytest.raises(ValueError, match="CUDA"):
        attn(wants, plain, plain)
    with pytest.raises(ValueError, match="out= cannot be used while autograd records"):
        attn(wants, plain, plain, out=t(dtype=dtype))


@pytest.mark.parametrize("slug", [st.slug for st in fl.stages() if not st.has_backward])
def test_a_call_autograd_would_record_is_refused_never_detached(slug):
    """A stage without a backward pass: with grad mode on and any of q, k, v, out requiring grad,
    the call is a ValueError naming the stage and what to do, raised before the kernel; under
    torch.no_grad(), torch.inference_mode() or with inputs that need no grad it goes on as before
    (here to validate's device rule: CPU tensors stand in)."""
    attn = Attention(fl.stage(slug), _Untouchable())
    dtype = dtype_of(fl.stage(slug).dtypes[0])
    plain = t(dtype=dtype)
    wants = t(dtype=dtype).requires_grad_()
    for args, kwargs, named in [((wants, plain, plain), {}, "q requires grad"),
                                ((plain, plain, wants), {"causal": True}, "v requires grad"),
                                ((wants, wants, wants), {}, "q, k, v require grad"),
                                ((plain, plain, plain), {"out": wants}, "out requires grad")]:
        with pytest.raises(ValueError, match="no backward") as err:
            attn(*args, **kwargs)
        msg = str(err.value)
        assert slug in msg and named in msg and "torch.no_grad()" in msg
        assert "scaled_dot_product_attention" in msg
    with pytest.raises(ValueError, match="no backward"):  # an op on a leaf: a non-leaf that needs grad
        attn(wants * 2, plain, plain)
    for mode in (torch.no_grad, torch.inference_mode):
        with mode(), pytest.raises(ValueError, match="CUDA"):
            attn(wants, wants, wants)
    with pytest.raises(ValueError, match="CUDA"):
        attn(plain, plain, plain)
    with pytest.raises(ValueError, match="CUDA"):
        attn(wants.detach(), plain, plain)


@pytest.mark.parametrize("slug", [st.slug for st in fl.stages()])
def test_build_without_cuda_is_a_clear_error(slug, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(RuntimeError, match="CUDA"):
        fl.stage(slug).build()


def test_arch_flags():
    assert build.arch_flags("sm_90") == ["-gencode=arch=compute_90,code=sm_90"]
    assert build.arch_flags("sm_86") == ["-gencode=arch=compute_86,code=sm_86"]
    assert build.arch_flags("sm_90a") == ["-gencode=arch=compute_90a,code=sm_90a"]
    with pytest.raises(ValueError, match="not an nvcc architecture"):
        build.arch_flags("90")


def test_each_stage_builds_for_its_own_architecture():
    st = fl.stage("05_mma")
    assert st.arch((9, 0)) == "sm_90" and st.arch((8, 6)) == "sm_86"
    assert st.unavailable((7, 5)) == "05_mma needs compute capability 8.0 or newer; this GPU is 7.5"
    hopper = dataclasses.replace(st, min_cc=(9, 0), arch_specific=True)
    assert hopper.arch((9, 0)) == "sm_90a"
    assert "compute capability 9.0 only" in hopper.unavailable((10, 0))
    assert hopper.unavailable((9, 0), toolkit=False) is None


def test_a_call_like_one_that_passed_skips_the_rules_and_any_other_runs_them(monkeypatch):
    """validate remembers the description of each call that passed: the same tensors' shapes,
    strides, dtypes, devices and alignments again skip the rules; a change to any of them, or
    another stage or rule set, runs them."""
    from flashlab import inputs
    ran, real = [], inputs._description
    monkeypatch.setattr(inputs, "_PASSED", set())
    monkeypatch.setattr(inputs, "_check", lambda who, *args: ran.append(who))
    monkeypatch.setattr(inputs, "_description",  # CPU tensors stand in for CUDA ones here
                        lambda *a: real(*a, cuda_only=False))
    q = t()
    validate("x", q, q, q)
    validate("x", q.clone(), q.clone(), q.clone())  # other memory, same description
    assert ran == ["x"]
    for other in (q.transpose(2, 3), q.half(), t(1, 2, 16, 8), misaligned(), q[:, :1]):
        validate("x", q, q, other)
    validate("y", q, q, q)
    validate("x", q, q, q, dtypes=("fp16",))
    validate("x", q, q, q, row_strides=True)
    validate("x", q, q, q, out=q)
    assert len(ran) == 1 + 5 + 4
    assert real("x", (q, q, q), ("fp32",), False) is None  # not on a GPU: never remembered


def test_every_rule_reads_only_what_the_description_holds():
    """Each refused call differs from an accepted one of the same shape in its description, so
    a remembered pass can never let a refused call through."""
    from flashlab import inputs
    q = t()
    good = inputs._description("03_coarsened", (q, q, q), ("fp32",), False, cuda_only=False)
    for what, args, kwargs, _ in BAD:
        tensors = [*args, kwargs["out"]] if "out" in kwargs else list(args)
        seen = inputs._description("03_coarsened", tensors, ("fp32",), False, cuda_only=False)
        if what != "cpu tensors":  # the device rule is kept out of the cache by cuda_only
            assert seen != good, what


def test_a_new_tensor_in_an_inputs_order():
    """inputs.empty_in_order: dense, the (batch, head, row) dims in the memory order of its model."""
    from flashlab.inputs import empty_in_order
    qkv = torch.empty(2, 7, 3, 4, 8)
    q = qkv[:, :, 0].transpose(1, 2)  # (B, H, N, D) view of a (B, N, 3, H, D) projection
    g = empty_in_order(q)
    assert g.shape == q.shape and g.stride() == (7 * 4 * 8, 8, 4 * 8, 1)
    assert empty_in_order(torch.empty(2, 4, 7, 8)).is_contiguous()
    assert empty_in_order(torch.empty(1, 4, 1, 8, dtype=torch.float16)).dtype == torch.float16


def test_a_backward_reads_o_and_do_from_a_16_byte_boundary():
    """Stages 20 and 21 read O and dO 16 bytes at a time: a contiguous tensor that starts
    elsewhere (a view into a larger buffer) is copied first, the same numbers where they can be
    read; one that starts on a boundary is passed as it is."""
    from flashlab.inputs import aligned
    buf = torch.arange(33, dtype=torch.float16)
    odd = buf[1:].view(2, 16)                          # contiguous, 2 bytes past a boundary
    assert odd.is_contiguous() and odd.data_ptr() % 16 == 2
    fixed = aligned(odd)
    assert fixed.data_ptr() % 16 == 0 and torch.equal(fixed, odd)
    even = buf[:32].view(2, 16)
    assert aligned(even) is even


def test_a_given_gradient_off_a_16_byte_boundary_is_a_value_error():
    """dq, dk and dv a caller hands over are written in place, several elements a store: one that
    does not start on a 16-byte boundary is refused with a ValueError, not a misaligned store."""
    from flashlab.inputs import gradient_problem
    q = torch.zeros(1, 2, 8, 16, dtype=torch.float16)
    assert gradient_problem("20_warpspec_backward", "dq", torch.zeros_like(q), q) is None
    odd = torch.zeros(q.numel() + 1, dtype=torch.float16)[1:].view(q.shape)
    assert "16-byte boundary" in gradient_problem("20_warpspec_backward", "dq", odd, q)
    assert "contiguous" in gradient_problem("20_warpspec_backward", "dk", q.transpose(2, 3), q)
    assert "contiguous" in gradient_problem("20_warpspec_backward", "dv", q.float(), q)
