"""Stage 20 on the CPU: who moves the backward's bytes, counted and drawn from the kernels' tile
shapes (no GPU needed).

In kernels/19_wgmma_backward.cu the two warpgroups that multiply also copy every tile in
(cp.async, 16 bytes a thread at a time), load their query rows' log-sum-exps and Δs, and send
dQ out as per-lane fp32 reductions. In kernels/20_warpspec_backward.cu a third warpgroup, the
producer, does all of it: one thread issues the TMA copies of K, V, Q, dO, the log-sum-exps
and Δs, another adds each query block's dQ into the fp32 sum with one bulk reduction from
shared memory. The consumers only multiply and wait on mbarriers.

    from flashlab import warpspec_backward
    warpspec_backward.traffic(D=64)     # per query block: bytes, and the instructions that move them
    warpspec_backward.registers()       # setmaxnreg: the register file split between the roles
    warpspec_backward.figure()          # the roles over three query blocks
"""
import pandas as pd
from matplotlib.figure import Figure
from matplotlib.patches import Rectangle

from .warpspec import consumer_registers, entry_registers  # setmaxnreg's rule, stage 11's
from .wgmma_backward import query_rows  # stage 20 keeps stage 19's query blocks

TITLE, LABEL, TEXT = 15, 12, 11     # font sizes, as the other lessons' figures
CONSUMER_THREADS = 256              # two warpgroups multiply
REGISTERS = 65536                   # 32-bit registers of an SM (sm_90)
PRODUCER_REGS = 24                  # what the producer keeps after setmaxnreg.dec


def traffic(D=64) -> pd.DataFrame:
    """For one block and one query block: what comes in (Q_i, dO_i, their rows' log-sum-exps and
    Δs) and goes out (dQ_i, fp32), in bytes, and the instructions the multiplying warps and the
    producer issue for it in stage 19 and stage 20."""
    BR = query_rows(D)
    tile = BR * D * 2                      # Q_i or dO_i, 16-bit
    rows = BR * 4                          # the log-sum-exps, or the Δs, fp32
    dq = BR * D * 4                        # dQ_i, fp32
    per_thread_copies = 2 * tile // 16 // CONSUMER_THREADS   # cp.async of 16 bytes, Q_i and dO_i
    boxes = 2 * (D // 64)                  # TMA boxes of 64 columns, Q_i and dO_i
    reductions = dq // 8 // CONSUMER_THREADS                 # float2 reductions a thread
    rows_ = [
        ("Q_i and dO_i in", 2 * tile,
         f"{per_thread_copies} cp.async a thread ({per_thread_copies * CONSUMER_THREADS} in all)",
         f"{boxes} TMA box copies, one thread"),
        ("log-sum-exps and Δs in", 2 * rows,
         f"loads and stores by the first {BR} threads, into shared memory",
         "2 bulk copies, the same thread"),
        ("dQ_i out (fp32, added)", dq,
         f"{reductions} float2 reductions a thread ({reductions * CONSUMER_THREADS} in all)",
         "1 bulk reduction, another thread"),
        ("waiting for the tiles", 0, "__syncthreads (both warpgroups)",
         "mbarrier q_full (each warpgroup on its own)"),
    ]
    return pd.DataFrame(rows_, columns=["what", "bytes", "stage 19: the multiplying warps",
                                        "stage 20: the producer"]).set_index("what")


def registers() -> pd.DataFrame:
    """The register file of an SM split by setmaxnreg: stage 19's 256 threads may each hold 255;
    in stage 20 the launch gives 384 threads 168 each, then the producer gives back all but
    PRODUCER_REGS and the two consumer warpgroups take what it gave back, in steps of 8. (Only
    what was given back: the 1 024 registers 384 x 168 leaves of the SM's 65 536 are no one's.)"""
    entry = entry_registers(384, REGISTERS)
    consumer = consumer_registers(CONSUMER_THREADS // 128, PRODUCER_REGS, REGISTERS)
    return pd.DataFrame(
        [("19: two warpgroups", 256, 255, "-", 255),
         ("20: at launch", 384, entry, entry, entry),
         ("20: after setmaxnreg", 384, consumer, PRODUCER_REGS, consumer)],
        columns=["", "threads", "a consumer thread", "a producer thread", "most a thread holds"],
    ).set_index("")


def figure(blocks=3) -> Figure:
    """The roles of stage 20's block over `blocks` query blocks: the loading thread runs ahead by
    the ring's two buffers, the consumers multiply, the dQ thread adds block i's dQ while the
    consumers are on block i + 1."""
    if blocks < 2:
        raise ValueError("draw at least two query blocks: the roles overlap across them")
    fig = Figure(figsize=(11, 3.6))
    ax = fig.add_subplot()
    lanes = [("producer: loads (TMA)", "#4C72B0"), ("consumers: five products", "#DD8452"),
             ("producer: dQ (bulk reduction)", "#55A868")]
    work = 4.0  # a query block's products, in the figure's time units
    for i in range(blocks):
        t0 = 1.0 + i * work
        # buffers 0 and 1 are free at the start; block i's buffer is the one block i - 2
        # hands back once its dV and dK products have read it
        load = (float(i) if i < 2 else 1.0 + (i - 2) * work + work * 0.75, 1.0)
        ax.add_patch(Rectangle((load[0], 2.1), load[1], 0.8, fc=lanes[0][1], ec="white", lw=2))
        ax.text(load[0] + 0.5, 2.5, f"Q, dO {i}", ha="center", va="center", fontsize=TEXT - 1,
                color="white")
        ax.add_patch(Rectangle((t0, 1.1), work * 0.95, 0.8, fc=lanes[1][1], ec="white", lw=2))
        ax.text(t0 + work / 2, 1.5, f"block {i}: S, dP, dV, dK, dQ", ha="center", va="center",
                fontsize=TEXT - 1, color="white")
        ax.add_patch(Rectangle((t0 + work * 0.95, 0.1), 1.2, 0.8, fc=lanes[2][1], ec="white", lw=2))
        ax.text(t0 + work * 0.95 + 0.6, 0.5, f"dQ {i}", ha="center", va="center",
                fontsize=TEXT - 1, color="white")
    ax.set_yticks([2.5, 1.5, 0.5], [name for name, _ in lanes], fontsize=LABEL - 1)
    ax.set_xlim(0, 1.0 + blocks * work + 1.5)
    ax.set_ylim(0, 3.0)
    ax.set_xticks([])
    ax.set_xlabel("time (schematic)", fontsize=LABEL)
    for side in ("top", "right"):
        ax.spines[side].set_visible(False)
    ax.set_title("Stage 20: the producer loads ahead and adds dQ behind; the consumers only "
                 "multiply", fontsize=TITLE - 2)
    fig.tight_layout()
    return fig
