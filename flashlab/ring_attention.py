"""Notebook 98's figures: ring attention's score matrix, step by step and rank by rank, and the
model of when the ring hides its communication, against the recorded runs (flashlab.ring's
step_work, step_model and model_vs_runs are the numbers; this module draws them).

    from flashlab import ring_attention as ra
    ra.blocks(world=4)          # no mask: the step each block is computed at; causal: who computes what
    ra.scaling()                # predicted efficiency for 2-64 GPUs, NVLink and InfiniBand, and the runs
"""
import numpy as np
from matplotlib.figure import Figure
from matplotlib.patches import Patch, Polygon, Rectangle

from . import ring

STEP_COLORS = ["#c6dbef", "#9ecae1", "#6baed6", "#4292c6", "#2171b5", "#08519c", "#08306b",
               "#041a3a"]
LENGTH_COLORS = ["#2171b5", "#d94801", "#238b45"]
RANK_COLORS = ["#fdae6b", "#a1d99b", "#9ecae1", "#bcbddc", "#fc9272", "#d9d9d9", "#c7e9c0",
               "#fdd0a2"]


def _cell(ax, x, y, size, color, part):
    """A block of the score matrix: whole, or its lower-left triangle (a diagonal block under the
    mask: only keys at or before each query)."""
    if part == "whole":
        ax.add_patch(Rectangle((x, y), size, size, fc=color, ec="white", lw=1.2))
    else:
        ax.add_patch(Polygon([(x, y + size), (x, y), (x + size, y)], closed=True, fc=color,
                             ec="white", lw=1.2))
        ax.add_patch(Rectangle((x, y), size, size, fc="none", ec="0.85", lw=0.8))


def blocks(world=4) -> Figure:
    """Three views of the N x N score matrix split over `world` ranks (queries down, keys across):
    without the mask, each block labelled with the ring step that computes it (rank r holds rank
    (r - s) mod world's keys at step s); with the mask, which rank computes each block under a
    contiguous split and under the zig-zag one, and each rank's share of the scores."""
    fig = Figure(figsize=(13.5, 5.2))
    axes = fig.subplots(1, 3)
    # 1: no mask, a block per (rank, source), coloured by step
    ax = axes[0]
    for r in range(world):
        for src in range(world):
            s = (r - src) % world
            y = world - 1 - r
            _cell(ax, src, y, 1, STEP_COLORS[s % len(STEP_COLORS)], "whole")
            ax.text(src + 0.5, y + 0.5, f"step {s}", ha="center", va="center", fontsize=8,
                    color="white" if s >= 3 else "black")
        ax.text(-0.15, world - 0.5 - r, f"rank {r}", ha="right", va="center", fontsize=8.5)
    ax.set_title("no mask: rank r meets rank (r - s) mod W's\nkeys and values at step s",
                 fontsize=9.5)
    # 2 and 3: causal, who computes which block
    for ax, split in zip(axes[1:], ("contiguous", "zigzag")):
        parts = world if split == "contiguous" else 2 * world
        size = world / parts
        share = np.zeros(world)
        zigzag = split == "zigzag"
        for i in range(parts):          # query chunk
            for j in range(i + 1):      # key chunk at or before it
                rank = ring.chunk_owner(i, world, zigzag)
                part = "triangle" if i == j else "whole"
                share[rank] += 0.5 if i == j else 1.0
                _cell(ax, j * size, world - (i + 1) * size, size, RANK_COLORS[rank % 8], part)
        for i in range(parts):
            ax.text(-0.15, world - (i + 0.5) * size, f"r{ring.chunk_owner(i, world, zigzag)}", ha="right",
                    va="center", fontsize=7.5)
        busiest, mean = share.max(), share.mean()
        ax.set_title(f"causal, {'contiguous' if split == 'contiguous' else 'zig-zag'} split\n"
                     f"scores per rank {_shares(share)}; busiest / mean {busiest / mean:.2f}\n"
                     f"the ring's steps keep {ring.balance(world, True, split):.0%} of its time "
                     "busy", fontsize=9.5)
    for ax in axes:
        ax.set_xlim(-0.9, world + 0.05)
        ax.set_ylim(-0.05, world + 0.05)
        ax.set_aspect("equal")
        ax.axis("off")
        ax.text(world / 2, -0.02, "keys →", ha="center", va="top", fontsize=8)
    fig.legend(handles=[Patch(fc=RANK_COLORS[r], label=f"rank {r}") for r in range(world)],
               loc="lower center", ncol=world, fontsize=8.5, frameon=False)
    fig.suptitle(f"The score matrix over W = {world} ranks (queries ↓, keys →)", fontsize=11)
    fig.tight_layout(rect=(0, 0.06, 1, 0.95))
    return fig


def _shares(share):
    total = share.sum()
    return " : ".join(f"{x / total:.0%}" for x in share)


def scaling(tflops=None, lengths=(131072, 1048576), gpus=(2, 4, 8, 16, 32, 64), causal=True,
            training=True, rows=None) -> Figure:
    """step_model's efficiency (the share of a ring step its local attention fills) for 2-64 GPUs,
    at each sequence length, over NVLink (within a machine) and one InfiniBand NDR port a GPU
    (between machines), with the last recorded ring run's efficiency beside it (the markers: its
    local attention's rows, both lengths). `tflops`: the
    local attention's rate; by default the rate the last recorded ring run's local attention
    reached on one GPU, for its pass and mask (or 500 without a record)."""
    runs = ring.model_vs_runs(rows)
    rate = tflops
    if rate is None:
        rate = recorded_rate(causal, training, rows) or 500.0
    fig = Figure(figsize=(9.5, 4.4))
    ax = fig.subplots()
    styles = {"nvlink4": "-", "ib_ndr": "--"}
    names = {"nvlink4": "NVLink (450 GB/s each way)", "ib_ndr": "InfiniBand NDR (50 GB/s)"}
    for i, N in enumerate(lengths):
        for link, gbs in ring.LINKS_GBS.items():
            eff = [ring.step_model(N, g, rate, gbs, causal=causal, training=training)["efficiency"]
                   for g in gpus]
            ax.plot(gpus, eff, styles[link], color=LENGTH_COLORS[i % 3], marker="o", ms=3.5,
                    label=f"{N // 1024}k tokens, {names[link]}")
        need = ring.tokens_to_hide(rate, ring.LINKS_GBS["ib_ndr"], causal, training)
        ax.axvline(N / need, color=LENGTH_COLORS[i % 3], lw=0.8, ls=":")
    if runs is not None and not runs.empty:
        mine = runs[(runs["causal"] == causal) & (runs["pass"] == ("training" if training
                                                                    else "forward"))]
        from . import tables
        last = tables.last_ring_run(rows)
        for impl, grp in mine[mine["impl"].isin(last["impl"])].groupby("impl"):
            ax.scatter(grp["gpus"], grp["efficiency"], marker="x", s=55, zorder=5, color="0.15",
                       label=f"measured, {impl.split(':', 1)[-1]} ({', '.join(f'{n // 1024}k' for n in grp['N'])})")
    ax.set_xscale("log", base=2)
    ax.set_xticks(list(gpus), [str(g) for g in gpus])
    ax.set_ylim(0, 1.05)
    ax.set_xlabel("GPUs in the ring")
    ax.set_ylabel("efficiency: compute / step time")
    ax.set_title(f"When the ring hides its transfers: {'causal ' if causal else ''}"
                 f"{'training step' if training else 'forward'}, D = 128, 16 heads, local "
                 f"attention at {rate:.0f} TFLOP/s\n(dotted: the most GPUs InfiniBand can feed "
                 "at each length)", fontsize=9.5)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7.5, loc="lower left")
    fig.tight_layout()
    return fig


def recorded_rate(causal, training, rows=None):
    """TFLOP/s one GPU reached on the whole sequence in the last recorded ring run, for this pass
    and mask, at the longest length it timed one GPU at (ring.single_tflops), or None."""
    from . import tables
    run = tables.last_ring_run(rows)
    if run.empty:
        return None
    run = run[(run["causal"] == causal) & (run["pass"] == ("training" if training else "forward"))
              & run["single_ms"].notna()]
    return None if run.empty else float(ring.single_tflops(run.sort_values("N").iloc[-1]))
