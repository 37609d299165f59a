"""A stage inside a real model (flashlab.model): the SDPA-shaped adapter refuses what a kernel
cannot compute, and a GPT-2 built from its config runs through transformers' attention
interface. On CPU a float64 reference stands in for the kernel; on a GPU the stages run."""
import math
from types import SimpleNamespace

import pytest
import torch

import flashlab as fl
from flashlab import model
from flashlab.reference import reference

transformers = pytest.importorskip("transformers")


def stand_in(q, k, v, causal=False, scale=None):
    return reference(q, k, v, causal=causal, scale=scale).to(q.dtype)


class StridedStandIn:
    """Looks like a built stage that reads strided rows (registry: row_strides), writes `out`."""
    stage = SimpleNamespace(slug="strided", row_strides=True)

    def __init__(self):
        self.seen = []

    def __call__(self, q, k, v, causal=False, scale=None, out=None):
        self.seen.append((q.stride(), out.stride()))
        out.copy_(reference(q, k, v, causal=causal, scale=scale))
        return out


def qkv(B=2, H=4, N=16, D=32, strided=False):
    if strided:  # what a model hands over: (B, H, N, D) views of (B, N, H, D)
        return [torch.randn(B, N, H, D).transpose(1, 2) for _ in range(3)]
    return [torch.randn(B, H, N, D) for _ in range(3)]


def test_the_adapter_matches_sdpa_and_copies_strided_inputs():
    ad = model.SDPA(stand_in, name="reference")
    q, k, v = qkv(strided=True)
    for causal in (False, True):
        got = ad(q, k, v, is_causal=causal, scale=1 / math.sqrt(q.shape[-1]))
        want = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)
        assert torch.allclose(got, want, atol=1e-5)
    assert ad.copies == 6
    ad(*qkv())
    assert ad.copies == 6  # contiguous inputs are not copied


def test_a_stage_with_row_strides_reads_the_models_views_in_place():
    attn = StridedStandIn()
    ad = model.SDPA(attn)
    assert ad.name == "strided" and ad.row_strides
    q, k, v = qkv(strided=True)
    got = ad(q, k, v, is_causal=True)
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert torch.allclose(got, want, atol=1e-5)
    assert ad.copies == 0
    assert attn.seen[0][0] == q.stride()                       # the view itself reached the kernel
    assert got.transpose(1, 2).is_contiguous()                 # written as (B, N, H, D): the model
    k_odd = torch.randn(2, 16, 4, 33)[..., :32].transpose(1, 2)  # rows 33 floats apart: unreadable
    ad(q, k_odd, v)
    assert ad.copies == 1                                      # so that one is copied
    ad(q, k_odd, v)
    assert ad.copies == 2                                      # every time: only passes are kept
    q2, _, _ = qkv(strided=True)
    ad(q2, k, v)
    assert ad.copies == 2 and attn.seen[-1][0] == q2.stride()  # a view like one that passed


@pytest.mark.parametrize("kwargs, words", [
    (dict(attn_mask=torch.ones(16, 16, dtype=torch.bool)), "no attention mask"),
    (dict(dropout_p=0.1), "no dropout"),
    (dict(enable_gqa=True), "as many key/value heads"),
])
def test_the_adapter_refuses_what_a_kernel_cannot_compute(kwargs, words):
    with pytest.raises(ValueError, match=words):
        model.SDPA(stand_in)(*qkv(), **kwargs)


def test_decoding_with_a_kv_cache_is_refused():
    q, k, v = qkv()
    with pytest.raises(ValueError, match="as many keys as queries"):
        model.SDPA(stand_in)(q[:, :, :1], k, v)


def test_a_name_transformers_would_take_for_its_own_flash_kernel_is_refused():
    with pytest.raises(ValueError, match="flash"):
        model.register(model.SDPA(stand_in), name="flashlab_x")


def test_gpt2_from_its_config_runs_on_the_adapter():
    name = model.register(model.SDPA(stand_in, name="reference"))
    assert name == "fl_reference"
    base = model.gpt2("sdpa", n_layer=2)
    ours = model.gpt2(name, n_layer=2)
    ours.load_state_dict(base.state_dict())
    tokens = torch.randint(0, base.config.vocab_size, (2, 24))
    diff = model.compare_logits(base, ours, tokens)
    assert diff["max_abs_diff"] < 1e-4 * max(1.0, diff["max_abs_logit"])
    assert model.register.adapters[name].copies > 0  # transformers passes strided views
    strided = model.register(model.SDPA(StridedStandIn()))
    again = model.gpt2(strided, n_layer=2)
    again.load_state_dict(base.state_dict())
    assert model.compare_logits(base, again, tokens)["max_abs_diff"] < 1e-4 * max(1.0, diff["max_abs_logit"])
    assert model.register.adapters[strided].copies == 0  # read in place, no copy
    with pytest.raises(ValueError, match="padding mask"):
        with torch.no_grad():
            ours(tokens, attention_mask=torch.tensor([[1] * 24, [1] * 20 + [0] * 4]), use_cache=False)


@pytest.mark.gpu
@pytest.mark.parametrize("slug", [st.slug for st in fl.stages() if st.fast])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_gpt2_on_a_stage_agrees_with_sdpa_as_closely_as_eager_does(slug, dtype):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from flashlab.stages import stage
    why = stage(slug).unavailable()
    if why:
        pytest.skip(why)
    name = model.register(slug)
    base = model.gpt2("sdpa").cuda().to(dtype)
    eager = model.gpt2("eager").cuda().to(dtype)
    ours = model.gpt2(name).cuda().to(dtype)
    eager.load_state_dict(base.state_dict())
    ours.load_state_dict(base.state_dict())
    tokens = torch.randint(0, base.config.vocab_size, (4, 512), device="cuda")
    own = model.compare_logits(base, eager, tokens)["max_abs_diff"]
    adapter = model.register.adapters[name]
    adapter.copies = 0
    got = model.compare_logits(base, ours, tokens)["max_abs_diff"]
    print(f"{slug} {dtype}: max|Δlogit| {got:.4g} against SDPA; eager's own {own:.4g}; "
          f"{adapter.copies} input copies")
    assert got <= 2 * own + 1e-3, f"{slug} {dtype}: {got:.3g} against SDPA; eager's own {own:.3g}"
    if stage(slug).row_strides:  # transformers' views read in place
        assert adapter.copies == 0, adapter
    else:                         # q, k, v copied in each of the 4 layers
        assert adapter.copies == 3 * 4, adapter


def test_training_a_model_on_a_stage_is_refused_not_silently_detached():
    """A GPT-2 whose attention is a built stage, run with grad mode on (its weights require grad,
    so q, k, v do): a ValueError naming the stage, raised before any kernel, not logits with no
    gradient through attention. Under no_grad the call goes on (to validate's CUDA rule here)."""
    from flashlab.runtime import Attention

    class Untouchable:
        def __getattr__(self, name):
            raise AssertionError(f"the module's {name} was reached")

    name = model.register(model.SDPA(Attention(fl.stage("05_mma"), Untouchable())))
    gpt = model.gpt2(name, n_layer=1).half()  # a dtype the stage takes: the device is what's wrong
    tokens = torch.randint(0, gpt.config.vocab_size, (1, 8))
    with pytest.raises(ValueError, match="05_mma: .*require.* grad.*no backward"):
        gpt(tokens, use_cache=False)
    with torch.no_grad(), pytest.raises(ValueError, match="CUDA"):
        gpt(tokens, use_cache=False)
