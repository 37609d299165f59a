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


class DifferentiableStridedStandIn(StridedStandIn):
    """A strided stage with a backward pass, on the CPU: autograd's own attention in float64.
    With autograd recording it is called without `out` (its output is a tensor of the graph)."""

    def __call__(self, q, k, v, causal=False, scale=None, out=None):
        self.seen.append(out is None)
        o = torch.nn.functional.scaled_dot_product_attention(
            q.double(), k.double(), v.double(), is_causal=causal, scale=scale).to(q.dtype)
        if out is None:
            return o
        return out.copy_(o)


def test_a_model_trains_through_a_stage_with_a_backward_pass():
    """train() on the CPU: the same GPT-2, batches and order for every implementation; the
    adapter calls the stage without `out` while training, and the losses follow SDPA's (fp32)."""
    attn = DifferentiableStridedStandIn()
    name = model.register(model.SDPA(attn), name="fl_cpu_trained")
    # lr 1e-2: four steps learn the bytes' frequencies, so the loss falls whatever four windows
    # of the corpus (the project's own text, which every commit changes) the seed picks
    kw = dict(steps=4, batch=2, seq=32, n_layer=1, n_head=1, n_embd=64, dtype="fp32",
              device="cpu", time_steps=False, lr=1e-2)
    mine, theirs = model.train(name, **kw), model.train("sdpa", **kw)
    assert attn.seen and all(attn.seen)  # every call without out: autograd owns the output
    assert len(mine["loss"]) == 4 and mine["loss"][-1] < mine["loss"][0] - 0.1, mine["loss"]
    assert max(abs(a - b) for a, b in zip(mine["loss"], theirs["loss"])) < 1e-4
    with torch.no_grad():  # inference: the output is written into the model's layout
        model.gpt2(name, n_layer=1, n_head=1, n_embd=64, vocab_size=256)(
            torch.randint(0, 256, (1, 8)), use_cache=False)
    assert attn.seen[-1] is False


def test_models_trained_in_turn_train_as_each_alone():
    """train_in_turn: a step of each model in turn, each the same losses as train() alone."""
    kw = dict(steps=3, batch=2, seq=32, n_layer=1, n_head=1, n_embd=64, dtype="fp32",
              device="cpu", lr=1e-2)
    alone = model.train("sdpa", time_steps=False, **kw)
    together = model.train_in_turn([("sdpa", None), ("eager", None)], **kw)
    assert len(together) == 2 and together[0]["loss"] == pytest.approx(alone["loss"], abs=1e-6)
    assert together[1]["loss"] == pytest.approx(alone["loss"], abs=1e-4)  # eager attention


def test_a_trainer_stepped_by_hand_trains_as_train_does():
    """model.trainer: the GPT-2, optimizer and batches train() sets up, stepped by its caller
    (tools/training_profile.py puts a profiler around some steps): the same losses."""
    kw = dict(steps=3, batch=2, seq=32, n_layer=1, n_head=1, n_embd=64, dtype="fp32",
              device="cpu", time_steps=False, lr=1e-2)
    run = model.trainer("sdpa", **kw)
    by_hand = [run.step(i) for i in range(3)]
    assert [ms for _, ms in by_hand] == [None] * 3  # time_steps=False, or no GPU: untimed
    assert [loss for loss, _ in by_hand] == pytest.approx(model.train("sdpa", **kw)["loss"], abs=1e-6)


def test_a_registered_stage_trains_a_model_made_as_the_readme_says():
    """README's recipe, on the CPU with a stand-in: AutoModelForCausalLM.from_config with the
    registered name runs every attention layer on it, forward and backward; a config with
    attention dropout (GPT2Config's default) is refused with a ValueError naming dropout."""
    from transformers import AutoModelForCausalLM, GPT2Config
    attn = DifferentiableStridedStandIn()
    name = model.register(model.SDPA(attn), name="fl_readme_recipe")
    small = dict(n_layer=1, n_head=1, n_embd=64, vocab_size=256, n_positions=32)
    m = AutoModelForCausalLM.from_config(GPT2Config(attn_pdrop=0.0, **small),
                                         attn_implementation=name).train()
    x = torch.randint(0, 256, (2, 16))
    m(x, labels=x, use_cache=False).loss.backward()
    assert attn.seen and all(attn.seen)  # called, and recorded by autograd
    assert all(p.grad is not None for p in m.parameters() if p.requires_grad)
    dropped = AutoModelForCausalLM.from_config(GPT2Config(**small), attn_implementation=name).train()
    with pytest.raises(ValueError, match="dropout"):
        dropped(x, labels=x, use_cache=False)


def test_the_training_corpus_is_shipped_text_in_seeded_windows():
    a, b = model.corpus(64, 5, seed=1), model.corpus(64, 5, seed=1)
    assert a.shape == (5, 65) and torch.equal(a, b) and int(a.max()) < 256
    assert not torch.equal(a, model.corpus(64, 5, seed=2))


def _training_rows(curves, steps=50, seq=256, ms=10.0):
    """Rows of data/training.csv: curves {(impl, run) or (impl, seed, run): offset of its loss
    from a common line}."""
    rows = []
    for key, off in curves.items():
        impl, seed, run = key if len(key) == 3 else (key[0], 0, key[1])
        rows += [dict(impl=impl, run=run, step=i, loss=5.0 - 0.01 * i + off, step_ms=ms + run,
                      tokens_per_s=1.0, dtype="bf16", steps=steps, batch=16, seq=seq, n_layer=4,
                      n_head=4, n_embd=256, lr=1e-3, seed=seed, gpu="G", time="t")
                 for i in range(steps)]
    return rows


# Three seeds: SDPA's three backends a little apart at each (its largest gap 0.003, at seed 2), a
# stage close to them but for one seed's burst, and the control 0.01 above at every seed.
SEEDED = {**{("sdpa_flash", s, 0): 0.0 for s in range(3)},
          ("sdpa_cudnn", 0, 0): 0.002, ("sdpa_cudnn", 1, 0): 0.001, ("sdpa_cudnn", 2, 0): -0.002,
          **{("sdpa_efficient", s, 0): 0.001 for s in range(3)},
          ("14_backward", 0, 0): 0.001, ("14_backward", 1, 0): 0.0, ("14_backward", 2, 0): 0.02,
          **{("wrong_no_delta", s, 0): 0.01 for s in range(3)}}


def test_a_stage_is_judged_within_the_spread_of_sdpas_own_curves_over_seeds():
    """gap at a seed: the mean of its largest differences from SDPA's curves of that seed;
    distance: the median over seeds; noise: SDPA's largest gap with itself at any seed. One
    seed's burst does not move the verdict; a backward wrong at every seed (the control) is
    outside. A longer run length is the loss comparison, a shorter one times a step."""
    import pandas as pd

    from flashlab import tables
    rows = pd.DataFrame(_training_rows(SEEDED)
                        + _training_rows({("sdpa_flash", 0): 9.0, ("14_backward", 0): 9.0},
                                         steps=5, seq=4096, ms=40.0))
    gaps = tables.training_gaps(rows)
    own = gaps[gaps["impl"] == tables.SELF].set_index("seed")["gap"]
    assert own.tolist() == pytest.approx([0.002, 0.001, 0.003])
    mine = gaps[gaps["impl"] == "14_backward"].set_index("seed")["gap"]
    assert mine.tolist() == pytest.approx([0.002 / 3, 0.002 / 3, 0.061 / 3])
    m = tables.training_match(rows).set_index("impl")
    assert list(m.index) == ["sdpa_flash", "sdpa_cudnn", "sdpa_efficient", "14_backward",
                             "wrong_no_delta"]
    assert m["noise"].tolist() == pytest.approx([0.003] * 5)
    assert m.loc["14_backward", "distance"] == pytest.approx(0.002 / 3)
    # seed by seed: its gaps over SDPA's own at each seed, 1/3, 2/3 and 6.8: the median 2/3
    assert m.loc["14_backward", "per_seed"] == pytest.approx(2 / 3)
    assert m.loc["14_backward", "within"] and not m.loc["wrong_no_delta", "within"]
    assert m.loc["wrong_no_delta", "distance"] == pytest.approx(0.028 / 3)
    assert m.loc["wrong_no_delta", "shift"] == pytest.approx(0.01 - 0.004 / 9)
    assert m.loc["14_backward", "shift_max"] == pytest.approx(0.02 + 0.001 / 3)
    assert m.loc["sdpa_flash", "seeds"] == 3 and m.loc["sdpa_flash", "runs"] == 3
    assert m["within"][list(tables.SDPA_TRAINED)].all()
    assert tables.training_rows(rows)["seq"].unique().tolist() == [256]
    t = tables.training_step_times(rows)
    assert t.loc["14_backward", "seq 4096, d 256, 4 layers, batch 16"] == 40.0
    assert t.loc["sdpa_flash", "seq 256, d 256, 4 layers, batch 16"] == 10.0
    assert tables.training_match(rows.iloc[:0]).empty


def test_smoothed_losses_are_a_trailing_mean():
    from flashlab import tables
    assert tables.smoothed_loss([1.0, 3.0, 5.0], window=2).tolist() == [1.0, 2.0, 4.0]


def test_the_training_figure_draws_recorded_curves(empty_data_dir, tmp_path):
    import pandas as pd

    from flashlab import plots, tables
    with pytest.raises(tables.NotRecorded, match="train_compare"):
        plots.training()
    tables.TRAINING.upsert(pd.DataFrame(_training_rows(SEEDED)))
    fig = plots.training()
    assert "G" in fig._suptitle.get_text() and "3 seeds" in fig._suptitle.get_text()
    assert len(fig.axes[0].lines) == 5  # the first seed's curves
    ticks = [t.get_text() for t in fig.axes[1].get_yticklabels()]
    assert ticks[0] == tables.SELF and "wrong_no_delta" in ticks
    assert plots.save_training(outdir=tmp_path).exists()


def test_the_readme_training_table_on_synthetic_rows(empty_data_dir):
    import pandas as pd

    from flashlab import readme, tables
    assert "Not measured yet" in readme.training_table()
    tables.TRAINING.upsert(pd.DataFrame(
        _training_rows(SEEDED) + _training_rows({("sdpa_flash", 0): 0.0}, steps=5, seq=4096, ms=40.0)))
    table = readme.training_table()
    assert "| wrong_no_delta | 3 × 1 | 9.33e-03 | **no** | 4.50 | +9.6e-03 | 10.0 | – |" in table, table
    assert "| 14_backward | 3 × 1 | 6.67e-04 | yes | 0.67 | +6.6e-03 | 10.0 | – |" in table, table
    assert "| sdpa_flash | 3 × 1 |" in table and "| 10.0 | 40.0 |" in table, table
    assert "(3.00e-03:" in table and "**G**" in table and "from 3 seeds" in table


def test_the_comparison_records_each_training_as_it_ends(empty_data_dir, monkeypatch):
    """Every seed of every implementation, the control among them, recorded as each training
    ends (a run killed keeps what it trained); the configuration's old rows on this GPU go at its
    first write, other configurations' stay."""
    import pandas as pd

    from flashlab import tables
    from flashlab.env import environment
    gpu = environment()["gpu"]
    old = pd.DataFrame(_training_rows({("sdpa_flash", 7, 2): 0.0}, steps=4, seq=512)
                       + _training_rows({("sdpa_flash", 0, 0): 0.0}, steps=4, seq=64)).assign(gpu=gpu)
    tables.TRAINING.upsert(old)
    seen = []

    def train(name, backend=None, seed=0, **kw):
        seen.append((name, backend, seed, len(tables.TRAINING.load())))
        return {"loss": [1.0 + seed] * kw["steps"], "step_ms": 1.0, "tokens_per_s": 1.0}

    monkeypatch.setattr(model, "train", train)
    df, match = model.training_comparison(stages=[], seeds=2, steps=4, batch=16, n_layer=4,
                                          n_embd=256, timed=None, log=lambda *a: None)
    names = [s[0] for s in seen]
    assert names == ["sdpa", "sdpa", "sdpa", tables.CONTROL] * 2
    assert [s[2] for s in seen] == [0] * 4 + [1] * 4
    assert [s[3] for s in seen] == [8] + [4 + 4 * i for i in range(1, 8)]  # seq 64 stays, 512 goes
    rec = tables.TRAINING.load()
    assert set(rec[rec["seq"] == 512]["seed"]) == {0, 1} and len(rec) == 4 * 8 + 4
    assert list(match["impl"]) == [*tables.SDPA_TRAINED, tables.CONTROL]


@pytest.mark.parametrize("causal", [False, True])
def test_the_control_leaves_delta_out_of_ds(causal):
    """The negative control: SDPA's output and dV; dQ and dK wrong by exactly the Δ term, in
    float64 against autograd's own gradients."""
    from flashlab import tables
    name = model.control()
    assert name == tables.CONTROL
    attn = model.register.adapters[name]
    gen = torch.Generator().manual_seed(0)
    q, k, v, do = (torch.randn(2, 3, 33, 16, dtype=torch.float64, generator=gen) for _ in range(4))
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    out = attn(q, k, v, is_causal=causal)
    mine = torch.autograd.grad(out, (q, k, v), do)
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)
    true = torch.autograd.grad(ref, (q, k, v), do)
    torch.testing.assert_close(out, ref)
    scale = 16 ** -0.5
    s = q @ k.transpose(-1, -2) * scale
    if causal:
        s = s.masked_fill(torch.ones(33, 33, dtype=torch.bool).triu(1), float("-inf"))
    pd_ = torch.softmax(s, -1) * (do * ref).sum(-1, keepdim=True)  # P ∘ Δ
    torch.testing.assert_close(mine[0] - scale * pd_ @ k, true[0])
    torch.testing.assert_close(mine[1] - scale * pd_.transpose(-1, -2) @ q, true[1])
    torch.testing.assert_close(mine[2], true[2])
    assert (mine[0] - true[0]).abs().max() > 1e-2  # a wrong gradient, not a rounding
