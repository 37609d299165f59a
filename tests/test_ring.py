"""Ring attention (flashlab.ring): the merge of partial outputs, the zig-zag split, the ring on
CPU processes with the gloo backend (float64 reference as local attention) against float64
attention on the whole sequence, forward and backward, and wrong local attentions it must catch;
on a GPU, the ring's arithmetic with a stage as local attention (ring.simulate)."""
import math

import pytest
import torch

import flashlab as fl
from flashlab import ring
from flashlab.stages import last_backward
from flashlab.reference import reference, reference_backward, reference_lse, rel_err, grad_err


def _inputs(shape=(2, 3, 48, 16), seed=0, dtype=torch.float64, device="cpu"):
    gen = torch.Generator(device).manual_seed(seed)
    return [torch.randn(*shape, generator=gen, dtype=dtype, device=device) for _ in range(4)]


def test_merging_two_key_sets_is_attention_over_their_union():
    q, k, v, _ = _inputs()
    o_a, lse_a = ring._ref_forward(q, k[:, :, :20], v[:, :, :20], False, 0.25)
    o_b, lse_b = ring._ref_forward(q, k[:, :, 20:], v[:, :, 20:], False, 0.25)
    o, lse = ring.merge(o_a, lse_a, o_b, lse_b)
    o_all, lse_all = ring._ref_forward(q, k, v, False, 0.25)
    assert float((o - o_all).abs().max()) < 1e-13 and float((lse - lse_all).abs().max()) < 1e-13


def test_a_part_without_keys_has_no_weight_and_no_part_gives_zeros_not_nan():
    o_a = torch.randn(1, 1, 4, 8, dtype=torch.float64)
    lse_a = torch.randn(1, 1, 4, dtype=torch.float64)
    none = torch.full_like(lse_a, -math.inf)
    o, lse = ring.merge(o_a, lse_a, torch.zeros_like(o_a), none)
    assert torch.equal(o, o_a) and torch.equal(lse, lse_a)
    o, lse = ring.merge(torch.zeros_like(o_a), none, torch.zeros_like(o_a), none)
    assert torch.equal(o, torch.zeros_like(o_a)) and bool(torch.isneginf(lse).all())


def test_fp16_parts_merge_in_fp32():
    o_a, o_b = (torch.randn(1, 2, 8, 16).half() for _ in range(2))
    lse_a, lse_b = torch.randn(1, 2, 8), torch.randn(1, 2, 8)
    o, lse = ring.merge(o_a, lse_a, o_b, lse_b)
    assert o.dtype == torch.float32 and lse.dtype == torch.float32


@pytest.mark.parametrize("N", [24, 23, 9])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_the_shards_put_back_together_are_the_sequence(world, causal, N):
    x = torch.arange(1, 2 * N * 3 + 1).reshape(2, 1, N, 3)
    parts = [ring.shard(x, world, r, causal) for r in range(world)]
    assert torch.equal(ring.unshard(parts, causal, length=N), x)
    parts_of = 2 * world if causal else world
    assert all(p.shape[2] == -(-N // parts_of) * parts_of // world for p in parts)
    pad = sum(int((p == 0).all(dim=(0, 1, 3)).sum()) for p in parts)
    assert pad == -(-N // parts_of) * parts_of - N  # zeros at the end only, as many as needed


def test_a_causal_shard_is_chunks_r_and_2w_minus_1_minus_r():
    x = torch.arange(16).reshape(1, 1, 16, 1)
    rows = ring.shard(x, 4, 1, causal=True).flatten().tolist()
    assert rows == [2, 3, 12, 13]  # chunks 1 and 6 of 8, two rows each


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_each_chunk_is_in_the_shard_of_the_rank_chunk_owner_names(world, causal):
    """chunk_owner is the one statement of the split (the figures of notebook 98 draw from it):
    every chunk's rows are in its owner's shard, in order."""
    parts = 2 * world if causal else world
    x = torch.arange(2 * parts).reshape(1, 1, 2 * parts, 1)  # two rows a chunk
    for r in range(world):
        mine = [c for c in range(parts) if ring.chunk_owner(c, world, causal) == r]
        want = [row for c in mine for row in (2 * c, 2 * c + 1)]
        assert ring.shard(x, world, r, causal).flatten().tolist() == want
    with pytest.raises(ValueError, match="chunks 0 to"):
        ring.chunk_owner(parts, world, causal)


def test_a_split_that_cannot_be_made_is_a_clear_value_error():
    x = torch.zeros(1, 1, 7, 4)
    with pytest.raises(ValueError, match="shorter than that"):
        ring.shard(x, 4, 0, causal=True)
    with pytest.raises(ValueError, match="shorter than that"):
        ring.check(4, True, shape=(1, 1, 7, 4))
    with pytest.raises(ValueError, match="whole number of ranks"):
        ring.shard(x, 0, 0, causal=False)
    q = torch.zeros(1, 1, 6, 4)
    with pytest.raises(ValueError, match="length 7"):
        ring.ring_attention(q, q, q, length=7)
    with pytest.raises(ValueError, match="length 0"):
        ring.ring_attention(q, q, q, length=0)
    q = torch.zeros(1, 1, 5, 4)
    with pytest.raises(ValueError, match="odd"):
        ring.ring_attention(q, q, q, causal=True)
    with pytest.raises(ValueError, match="one shape"):
        ring.ring_attention(q, q[:, :, :4], q)


def test_a_stage_without_the_log_sum_exp_cannot_be_the_local_attention_nor_train_without_a_backward():
    class Stage:
        slug, lse, has_backward = "a_stage_without_lse", False, False

    class Built:
        stage = Stage()

    with pytest.raises(ValueError, match="log-sum-exps, which this stage"):
        ring.stage_local(Built())
    Built.stage.lse = True  # a forward-only stage (05-13): the forward runs, training refuses
    local = ring.stage_local(Built())
    with pytest.raises(ValueError, match="has no backward pass"):
        local.backward(*[None] * 8)


@pytest.mark.parametrize("N", [48, 47, 41, 5])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_the_ring_simulated_in_one_process_is_float64_attention(world, causal, N):
    """Ragged lengths too: padded at the end, behind the causal mask or outside the real keys
    (N = 5 over 4 ranks without the mask: the last rank's block is padding only)."""
    if N < (2 * world if causal else world):
        pytest.skip("fewer rows than chunks")
    q, k, v, do = _inputs((2, 3, N, 16), seed=N)
    got = ring.simulate(ring.reference_local(), q, k, v, do, world, causal)
    want = [reference(q, k, v, causal), reference_lse(q, k, causal),
            *reference_backward(q, k, v, do, causal)]
    for name, g, w in zip(("o", "lse", "dq", "dk", "dv"), got, want):
        assert float((g - w).abs().max()) < 1e-12, (name, world, causal)


@pytest.mark.parametrize("src", [0, 2])
def test_a_zig_zag_step_hands_its_local_attention_views_of_the_shard_not_copies(src):
    """Between ranks a causal step pairs one chunk with another: each pair is one chunk-sized
    problem on views of the shards' halves (src < rank and src > rank, rank 1 of 3), forward
    and backward, so that the step copies nothing beside the local attention's own work."""
    seen = []

    def forward(q, k, v, causal, scale):
        seen.append((q, k, v))
        return ring.reference_local().forward(q, k, v, causal, scale)

    def backward(q, k, v, o, lse, do, causal, scale):
        seen.append((q, k, v, o, lse, do))
        return ring.reference_local().backward(q, k, v, o, lse, do, causal, scale)

    local = ring.Local("recording", forward, backward)
    q, k, v, do = _inputs((1, 2, 32, 8), seed=src)
    o, lse = ring.reference_local().forward(q, k, v, False, 0.35)
    owners = {t.untyped_storage().data_ptr() for t in (q, k, v, o, lse, do)}
    parts = ring._local_forward(local, q, k, v, 1, src, 3, True, 0.35)
    g_q, g_kv = ring._local_backward(local, q, k, v, o, lse, do, 1, src, 3, True, 0.35)
    assert len(seen) == 4 and len(parts) == len(g_q) == len(g_kv) == 2
    for args in seen:
        assert all(t.shape[2] == 16 for t in args)  # a chunk of the shard's 32 rows
        assert {t.untyped_storage().data_ptr() for t in args} <= owners


# The ring on CPU processes: each spawns and imports torch (about 5 s for 2 ranks, 11 s for 4).
@pytest.mark.parametrize("world,causal,N", [(2, False, 48), (2, True, 47), (4, False, 45),
                                             (4, True, 48)])
def test_the_ring_on_gloo_processes_is_float64_attention_forward_and_backward(world, causal, N):
    errs = ring.check(world, causal, shape=(1, 2, N, 16))
    assert sorted(errs) == list(range(world))
    worst = {name: max(e[name] for e in errs.values()) for name in errs[0]}
    assert all(e < 1e-12 for e in worst.values()), worst


@pytest.mark.parametrize("local,caught", [("wrong_lse", "lse"), ("no_delta", "dq")])
def test_the_gloo_check_catches_a_wrong_local_attention(local, caught):
    """A local attention whose log-sum-exp is off (the merge's weights stay right: every block's
    is off alike, but the lse handed back is wrong) or whose backward leaves Δ out must fail."""
    errs = ring.check(2, True, shape=(1, 2, 48, 16), local=local)
    assert max(e[caught] for e in errs.values()) > 1e-2


# --- on a GPU: a stage as the local attention -------------------------------------------------------

RING_STAGES = [st.slug for st in fl.stages() if st.lse and st.has_backward]


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("slug", RING_STAGES)
def test_a_stage_as_the_rings_local_attention_is_as_right_as_the_stage(built, slug, world, causal):
    """The ring's output and gradients with a stage as local attention (fp16, N = 1000, split
    across `world` simulated ranks, padded to whole chunks) are within twice the stage's own
    error on the whole sequence, plus a hair (the merge rounds once more), against float64."""
    from conftest import attn_for
    attn = attn_for(built, slug)
    q, k, v, do = _inputs((2, 3, 1000, 64), seed=1, dtype=torch.float16, device="cuda")
    got = ring.simulate(ring.stage_local(attn), q, k, v, do, world, causal)
    leaves = [t.detach().requires_grad_(True) for t in (q, k, v)]
    with torch.enable_grad():
        o = attn(*leaves, causal=causal)
        whole = [o, *torch.autograd.grad(o, leaves, do)]
    want = [reference(q, k, v, causal), *reference_backward(q, k, v, do, causal)]
    for name, g, w, own in zip(("o", "dq", "dk", "dv"), (got[0], *got[2:]), want, whole):
        err, own_err = grad_err(g, w), grad_err(own, w)
        assert err <= 2 * own_err + 1e-4, (name, err, own_err)
    lse = reference_lse(q, k, causal)
    assert rel_err(got[1], lse) < 1e-5


def test_the_paper_model_hides_the_transfer_from_the_token_count_it_names():
    """At tokens_to_hide tokens a GPU, compute equals the transfer (efficiency 1, just); at half
    of them the step waits on the link; the causal mask halves the work and doubles the need."""
    for causal in (False, True):
        for training in (False, True):
            n = ring.tokens_to_hide(600, ring.LINKS_GBS["nvlink4"], causal, training)
            at = ring.step_model(8 * n, 8, 600, ring.LINKS_GBS["nvlink4"], causal=causal,
                                 training=training)
            assert at["efficiency"] == pytest.approx(1.0) and at["hidden"] >= 1 - 1e-9
            short = ring.step_model(4 * n, 8, 600, ring.LINKS_GBS["nvlink4"], causal=causal,
                                    training=training)
            assert short["efficiency"] < 0.99
    assert ring.tokens_to_hide(600, 450, causal=True) == pytest.approx(2 * ring.tokens_to_hide(600, 450))
    # over InfiniBand a GPU needs nine times the tokens it needs over NVLink
    assert ring.tokens_to_hide(600, 50) == pytest.approx(9 * ring.tokens_to_hide(600, 450))


LAST_BACKWARD = last_backward().slug


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("world", [1, 2, 4])
def test_the_ring_across_gpus_is_as_right_as_its_stage(world, causal, dtype):
    """One process per GPU on NCCL, the last stage with a backward pass as local attention, a
    ragged length (padded to whole chunks): each rank's output, log-sum-exp and gradients within
    twice the stage's own error on the whole sequence (one GPU), plus a hair, against float64."""
    if torch.cuda.device_count() < world:
        pytest.skip(f"a ring of {world} GPUs needs {world} GPUs")
    got = ring.check(world, causal, shape=(1, 4, 4001, 128), seed=3, stage=LAST_BACKWARD,
                     dtype=dtype)
    assert sorted(got) == list(range(world))
    for rank, errs in got.items():
        for name, (err, own) in errs.items():
            assert err <= 2 * own + 1e-4, (rank, name, err, own)


def test_the_paper_model_is_set_beside_the_recorded_runs():
    """model_vs_runs reads the ring's rows (tables.ring_rows: one GPU model, the ring's own rows)
    and puts the model's communication and efficiency beside the measured ones; where the ring's
    compute alone is its whole step, nothing is exposed and the ideal share is one GPU's time over
    the GPUs against it."""
    import pandas as pd
    from flashlab import tables
    base = dict(pass_="forward", gpus=2, dtype="fp16", B=1, H=16, N=32768, D=128, causal=False,
                median_ms=12.0, tflops=1.0, single_ms=24.0, efficiency=1.0, compute_ms=12.0,
                comm_ms=0.5, hidden=1.0, runs=10, gpu="G", compute_capability="9.0",
                torch="2", cuda="13", commit="abc", time="2026-01-01T00:00:00Z")
    rows = pd.DataFrame([{**{k: v for k, v in base.items() if k != "pass_"}, "pass": "forward",
                          "impl": "ring:18_dq_layout"},
                         {**{k: v for k, v in base.items() if k != "pass_"}, "pass": "forward",
                          "impl": "context_parallel:sdpa_cudnn", "gpu": "G"},
                         {**{k: v for k, v in base.items() if k != "pass_"}, "pass": "forward",
                          "impl": "ring:18_dq_layout", "gpu": "other", "time": "2025-01-01T00:00:00Z"}])
    assert len(tables.ring_rows(rows)) == 1 and len(tables.ring_rows(rows, impl="")) == 2
    got = ring.model_vs_runs(rows)
    assert len(got) == 1
    r = got.iloc[0]
    assert r["impl"] == "ring:18_dq_layout"  # which local attention, where several are recorded
    assert r["compute_ideal"] == pytest.approx(1.0) and r["exposed_ms"] == 0.0
    assert r["efficiency_paper"] == pytest.approx(1.0)  # 16k tokens a GPU hide a transfer on NVLink
    kv = 16 * 16384 * 128 * 2 * 2 / (ring.LINKS_GBS["nvlink4"] * 1e9) * 1e3
    assert r["comm_ms_paper"] == pytest.approx(kv)
    assert r["link_gbs_measured"] == pytest.approx(16 * 16384 * 128 * 4 / 0.5e6)  # bytes / 0.5 ms
    training = ring.model_vs_runs(rows.assign(**{"pass": "training"})).iloc[0]
    dkv = 16 * 16384 * 128 * 2 * 4 / (ring.LINKS_GBS["nvlink4"] * 1e9) * 1e3  # fp32, home too
    assert training["comm_ms_paper"] == pytest.approx(2 * kv + 2 * dkv)
    # a run that recorded the bytes its rank sent (its dK, dV home in fp16) is read by them
    sent = 16 * 16384 * 128 * 2 * (2 + 2 + 4 + 2)
    counted = ring.model_vs_runs(rows.assign(**{"pass": "training", "comm_bytes": sent})).iloc[0]
    assert counted["link_gbs_measured"] == pytest.approx(sent / 0.5e6)
    assert counted["comm_ms_paper"] == pytest.approx(sent / (ring.LINKS_GBS["nvlink4"] * 1e9) * 1e3)
    assert ring.model_vs_runs(rows.iloc[:0]).empty


def test_the_ring_is_set_beside_the_baselines_of_its_own_run():
    """tables.ring_versus pairs a ring row with the context_parallel rows of the same run (time
    stamp), never another run's; last_ring_run is the newest run's rows; single_tflops counts
    FlashAttention's FLOPs."""
    import pandas as pd
    from flashlab import tables
    base = dict(gpus=2, dtype="fp16", B=1, H=16, N=32768, D=128, causal=False, tflops=1.0,
                single_ms=float("nan"), efficiency=0.9, compute_ms=10.0, comm_ms=0.5, hidden=1.0,
                runs=10, gpu="G", compute_capability="9.0", torch="2", cuda="13", commit="abc")
    new, old = "2026-02-01T00:00:00Z", "2026-01-01T00:00:00Z"
    rows = pd.DataFrame([
        {**base, "pass": "forward", "impl": "ring:20_x", "median_ms": 10.0, "time": new,
         "single_ms": 18.0},
        {**base, "pass": "forward", "impl": "context_parallel:sdpa_cudnn", "median_ms": 11.0, "time": new},
        {**base, "pass": "forward", "impl": "ring:18_y", "median_ms": 20.0, "time": old},
        {**base, "pass": "forward", "impl": "context_parallel:sdpa_cudnn", "median_ms": 5.0, "time": old}])
    v = tables.ring_versus(rows)
    assert list(v["ring"]) == ["18_y", "20_x"]
    assert list(v["vs_sdpa_cudnn"]) == pytest.approx([0.25, 1.1])   # each against its own run
    assert list(tables.last_ring_run(rows)["impl"]) == ["ring:20_x"]
    r = tables.last_ring_run(rows).iloc[0]
    assert ring.single_tflops(r) == pytest.approx(4 * 16 * 32768 ** 2 * 128 / 18e9)
    assert tables.ring_versus(rows.iloc[:0]).empty and tables.last_ring_run(rows.iloc[:0]).empty
