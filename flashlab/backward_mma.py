"""Stage 15 on the CPU: the backward's five products as mma.sync tiles, drawn and counted from
the kernel's loops (no GPU needed).

kernels/15_backward_mma.cu's bwd_kernel keeps stage 14's Algorithm 2 (a block per key block, dK
and dV on chip, dQ added with fp32 atomics) and moves its products onto mma.sync.m16n8k16. Warp w
owns 16 keys of the block, so it computes the transposed tiles S^T and dP^T; P^T and dS^T then
feed dV and dK as A fragments straight from the accumulators. dQ needs dS by query rows across
every warp's keys, so dS^T goes through shared memory. The counts below follow the kernel's
loops (its BwdTiles constants: 4 warps, BC = BR = 64, S^T taken SUB = 64 queries at a time at
D = 64 and 32 at D = 128); tests hold them to the ldmatrix count in the compiled SASS.

    from flashlab import backward_mma
    backward_mma.figure()              # who owns what: a warp's 16 keys, its five products
    backward_mma.products(D=64)        # each product's shape per warp, A and B, and how read
    backward_mma.counts(D=64)          # mma, ldmatrix and wavefronts per warp and query block
    backward_mma.predict(sms=132)      # the bound shared memory and the tensor pipe set
"""
import pandas as pd
from matplotlib.figure import Figure
from matplotlib.patches import Rectangle

from .backward import CLOCK_GHZ  # stage 14's lesson owns the clock the bounds are taken at

WARPS, BC, BR = 4, 64, 64           # BwdTiles<D, 4>: warps, keys and queries of a block
MMA_FLOPS = 2 * 16 * 8 * 16         # one mma.sync.m16n8k16
TITLE, LABEL, TEXT = 15, 12, 11     # font sizes, as the other lessons' figures


def sub(D=64) -> int:
    """Queries of S^T and dP^T taken at once (BwdTiles::SUB): 2·SUB/8·4 accumulator floats a lane
    for the two, beside dK and dV's D/8·4 each, under 255 registers."""
    return 32 if D > 64 else 64


def products(D=64) -> pd.DataFrame:
    """The five products as one warp computes them for one query block: the tile it produces
    (rows x columns x the reduced dimension), where A and B come from, and how they are read."""
    rows = [
        ("S^T = K_w Q_i^T", f"16 x {BR} x {D}", "K_w rows (shared)", "ldmatrix",
         "Q_i rows (shared)", "ldmatrix"),
        ("dP^T = V_w dO_i^T", f"16 x {BR} x {D}", "V_w rows (shared)", "ldmatrix",
         "dO_i rows (shared)", "ldmatrix"),
        ("dV_w += P^T dO_i", f"16 x {D} x {BR}", "P^T (accumulators)", "registers",
         "dO_i rows (shared)", "ldmatrix.trans"),
        ("dK_w += dS^T Q_i", f"16 x {D} x {BR}", "dS^T (accumulators)", "registers",
         "Q_i rows (shared)", "ldmatrix.trans"),
        ("dQ_i += dS K_j", f"16 x {D} x {BC}", "dS^T tile (shared)", "ldmatrix.trans",
         "K_j rows (shared)", "ldmatrix.trans"),
    ]
    return pd.DataFrame(rows, columns=["product", "tile (m x n x k)", "A", "A read by", "B",
                                       "B read by"]).set_index("product")


def counts(D=64) -> pd.DataFrame:
    """Per warp and query block, each loop of bwd_kernel: mma.sync, ldmatrix.x4 (4 wavefronts
    each: the tiles are swizzled, so none conflicts), the LDS of the rows' log-sum-exps and Δs
    (as compiled: one per accumulator element and value, a broadcast wavefront each) and the
    32-bit STS of dS^T (one wavefront each); FLOPs and FLOPs per wavefront."""
    s = sub(D)
    subs, kd, nq, kq, nd, kk = BR // s, D // 16, s // 8, s // 16, D // 8, BC // 16
    loops = {
        "S^T, dP^T": {"mma": subs * kd * nq * 2, "ldmatrix.x4": subs * kd * (2 + nq),
                      "LDS": subs * 8 * nq, "STS": 0},
        "dV, dK": {"mma": subs * kq * nd * 2, "ldmatrix.x4": subs * kq * nd,
                   "LDS": 0, "STS": subs * kq * 4},
        "dQ": {"mma": (D // 64) * kk * 8, "ldmatrix.x4": kk + (D // 64) * kk * 4,
               "LDS": 0, "STS": 0},
    }
    t = pd.DataFrame(loops).T
    t.loc["a query block, in all"] = t.sum()
    t["wavefronts"] = 4 * t["ldmatrix.x4"] + t["LDS"] + t["STS"]
    t["FLOPs"] = t["mma"] * MMA_FLOPS
    t["FLOPs per wavefront"] = t["FLOPs"] / t["wavefronts"]
    return t.rename_axis(f"per warp and query block, D = {D}")


def predict(sms=132, D=64, mma_per_clock=0.5, clock_ghz=CLOCK_GHZ) -> pd.Series:
    """The bound on bwd_kernel from counts(): an SM serves one shared-memory wavefront a clock and
    retires `mma_per_clock` m16n8k16 a clock (0.5: 2 048 FLOPs a clock, the A100's tensor-core
    rate, which mma.sync does not much exceed on Hopper: its full rate needs wgmma, notebook 09).
    The larger clock count binds; TFLOP/s as FlashAttention counts them (the kernel does exactly
    the five products)."""
    c = counts(D).loc["a query block, in all"]
    clocks = {"shared memory": c["wavefronts"], "tensor pipe": c["mma"] / mma_per_clock}
    binds = max(clocks, key=clocks.get)
    tflops = c["FLOPs"] / clocks[binds] * sms * clock_ghz * 1e9 / 1e12
    return pd.Series({"shared-memory clocks": clocks["shared memory"],
                      "tensor-pipe clocks": clocks["tensor pipe"], "binds": binds,
                      "tensor pipe busy at most": clocks["tensor pipe"] / clocks[binds],
                      "TFLOP/s bound": tflops}, name=f"D = {D}")


def launch_wavefronts(B=4, H=16, N=1024, D=64, causal=False) -> int:
    """Shared-memory wavefronts of one bwd_kernel launch's loads and stores, to set beside Nsight
    Compute's smem_wavefronts: counts()' per warp and query block, times the warps, the (key
    block, query block) pairs of each head and the heads. The tiles' copies in by cp.async are
    left out (a few per cent more)."""
    blocks = -(-N // BC)
    pairs = blocks * (blocks + 1) // 2 if causal else blocks * blocks
    return int(B * H * pairs * WARPS * counts(D).loc["a query block, in all", "wavefronts"])


def figure(D=64):
    """One thread block of bwd_kernel: its 64 keys split among 4 warps (rows), a query block
    (columns); warp 1's S^T tile, and the five products with their operands."""
    fig = Figure(figsize=(12, 5.2))
    ax = fig.add_axes([0.02, 0.06, 0.46, 0.84])
    ax.set_xlim(-14, BR + 2)
    ax.set_ylim(BC + 2, -8)
    ax.axis("off")
    colors = ["#c6dbef", "#6baed6", "#9ecae1", "#deebf7"]
    for w in range(WARPS):
        ax.add_patch(Rectangle((0, 16 * w), BR, 16, facecolor=colors[w], edgecolor="k", lw=0.8))
        ax.text(-1, 16 * w + 8, f"warp {w}\nkeys {16 * w}–{16 * w + 15}", ha="right", va="center",
                fontsize=TEXT)
    for n in range(BR // 8):
        ax.add_patch(Rectangle((8 * n, 16), 8, 16, fill=False, edgecolor="#08306b", lw=0.6))
    ax.text(BR / 2, -2, f"query block i: {BR} queries (columns)", ha="center", fontsize=LABEL)
    ax.text(BR / 2, BC + 1.5, "warp 1's S^T: 8 accumulator tiles of 16 keys x 8 queries",
            ha="center", va="top", fontsize=TEXT)
    ax.set_title("A block: 64 keys, 4 warps of 16 keys each", fontsize=TITLE)
    tx = fig.add_axes([0.5, 0.06, 0.49, 0.84])
    tx.axis("off")
    tx.set_title("Each warp, each query block", fontsize=TITLE)
    lines = [("S^T = K_w Q_i^T,  dP^T = V_w dO_i^T", "A: K_w, V_w by ldmatrix; B: Q_i, dO_i rows"),
             ("P^T, dS^T in the accumulators", "exp2 against the lse; dS = P (dP - Δ)"),
             ("dV_w += P^T dO_i,  dK_w += dS^T Q_i", "A: the accumulators, packed to 16 bits;"
              " B: ldmatrix.trans"),
             ("dS^T to shared memory, barrier", "every warp's keys, for dQ"),
             ("dQ_i += dS K_j  (warp w: queries 16w..)", "A: dS^T tile by ldmatrix.trans;"
              " B: K_j by ldmatrix.trans; fp32 atomics")]
    for i, (head, note) in enumerate(lines):
        y = 0.9 - 0.19 * i
        tx.text(0.0, y, f"{i + 1}. {head}", fontsize=LABEL, weight="bold", transform=tx.transAxes)
        tx.text(0.04, y - 0.075, note, fontsize=TEXT, transform=tx.transAxes)
    return fig
