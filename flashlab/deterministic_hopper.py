"""Stage 21 on the CPU: what taking turns at dQ's sums costs when only the producer's dQ thread
waits, modelled block by block on a GPU's SMs (no GPU needed).

kernels/21_deterministic_hopper.cu is stage 20 with one change: before each bulk reduction the
producer's dQ thread waits for its key block's turn at the query block, and passes the turn on
once the reduction is complete in L2. Stage 16 took turns with the whole block waiting; here the
consumers go on multiplying into the second dQ buffer, and wait only when both buffers are queued
behind a turn. The model below runs the blocks of a launch through the SMs in launch order (one
block an SM, as stages 20 and 21 run), each block's consumers taking one unit of time per query
block and its dQ thread `hold` units per turn: the reduction, its completion, and the turn's trip
through L2 to the next block's thread.

    from flashlab import deterministic_hopper as dh
    dh.turn_time(D=64)                      # one turn against one query block's products
    dh.speed_left(N=1024, D=64, causal=False, hold=0.5)  # the model at one config
    dh.sweep_model(holds=(0.25, 0.5, 0.75))  # over the FlashAttention sweep
    dh.fit(measured)                        # the hold that best explains measured ratios
    dh.figure()                             # one wave of key blocks: work, adds and waits
"""
import heapq

import numpy as np
import pandas as pd
from matplotlib.figure import Figure

from .deterministic import turns  # noqa: F401  (stage 16's orders, which stage 21 keeps)
from .wgmma_backward import query_rows  # stage 21 keeps stage 19's query blocks

TITLE, LABEL, TEXT = 15, 12, 11   # font sizes, as the other lessons' figures
BC = 128                          # keys a block (stages 19-21)
SMS = 132                         # the H100's and H200's SMs


def turn_time(D=64, tflops=450.0, sms=SMS, reduce_gbps=150.0, trip_us=0.5, trips=3) -> pd.Series:
    """One turn's time against one query block's products, from assumed rates: a query block is
    five products of 2 BR BC D FLOPs each at an SM's share of `tflops`; a turn is the reduction's
    bytes (BR D floats) at `reduce_gbps` from one SM, plus `trips` trips through L2 of `trip_us`
    each (the reduction's completion coming back, the releasing store going out, the next
    block's polling load seeing it). The ratio is the model's `hold`. Every rate here is an
    assumption to be checked against the measurement, not a measurement."""
    br = query_rows(D)
    flops = 5 * 2 * br * BC * D
    step_us = flops / (tflops * 1e12 / sms) * 1e6
    add_us = br * D * 4 / (reduce_gbps * 1e9) * 1e6
    turn_us = add_us + trips * trip_us
    return pd.Series({"query block's products (us)": step_us, "reduction's bytes (us)": add_us,
                      "trips through L2 (us)": trips * trip_us, "a turn (us)": turn_us,
                      "hold = turn / query block": turn_us / step_us})


def simulate(key_blocks, heads, hold=0.5, causal=False, turns=True, ratio=1, buffers=2,
             sms=SMS, launch_last_first=None, trace=False):
    """One launch: `heads` heads of `key_blocks` key blocks each, launched head by head onto
    `sms` SMs (a block starts when an SM frees, in launch order). A block walks its query blocks
    (all `key_blocks * ratio` without the mask; with it, those from its own keys on); its
    consumers take 1 unit for a query block's products, then wait until one of `buffers` dQ
    buffers is free to hand dQ over (the buffer of `buffers` query blocks before: free once that
    add is done); its dQ thread adds a query block once the consumers have handed it over, its
    previous add is done and (turns) the block before it in turn has passed it on, and holds the
    buffer (and the turn) `hold` units.
    Turns as stage 21 takes them: without the mask in launch order, key block 0 first; with it,
    the blocks launched last first (launch_last_first, default: causal and turns), taking turns as
    they arrive. Returns the launch's time, or with trace=True also [(block, SM, start, [(query
    block, consumers done, add start, add done)])]."""
    last_first = causal and turns if launch_last_first is None else launch_last_first
    nq = key_blocks * ratio
    free_at = [(0.0, s) for s in range(sms)]
    heapq.heapify(free_at)
    end_all, log = 0.0, []
    for h in range(heads):
        passed = [0.0] * nq  # when each query block's last turn was passed
        for j in (range(key_blocks - 1, -1, -1) if last_first else range(key_blocks)):
            start, sm = heapq.heappop(free_at)
            if not turns and not trace and hold <= 1.0:  # its adds keep up: no buffer waits
                end = start + (nq - (j * ratio if causal else 0)) + hold
                heapq.heappush(free_at, (end, sm))
                end_all = max(end_all, end)
                continue
            steps, adds = [], [start] * buffers  # a buffer is free from the block's start
            done = last = start
            for i in range(j * ratio if causal else 0, nq):
                done = max(done + 1.0, adds[-buffers])  # its products, then a free buffer
                begin = max(done, last, passed[i]) if turns else max(done, last)
                last = begin + hold
                adds.append(last)
                if turns:
                    passed[i] = last
                if trace:
                    steps.append((i, done, begin, last))
            end = max(done, last)
            heapq.heappush(free_at, (end, sm))
            end_all = max(end_all, end)
            if trace:
                log.append(((h, j), sm, start, steps))
    return (end_all, log) if trace else end_all


def speed_left(N, D, causal, hold=0.5, B=None, H=None, tokens=16384, sms=SMS) -> float:
    """The model's stage 21 over stage 20 at one config: the same blocks without turns, in stage
    20's launch order (key block 0 first), over stage 21's (B, H: the FlashAttention sweep's,
    B N = tokens and H D = 2048, unless given)."""
    B = B if B is not None else max(1, tokens // N)
    H = H if H is not None else 2048 // D
    key_blocks, ratio = -(-N // BC), BC // query_rows(D)
    before = simulate(key_blocks, B * H, hold, causal, turns=False, ratio=ratio, sms=sms,
                      launch_last_first=False)
    after = simulate(key_blocks, B * H, hold, causal, turns=True, ratio=ratio, sms=sms)
    return before / after


def sweep_model(holds=(0.25, 0.5, 0.75), Ns=(512, 1024, 2048, 4096, 8192, 16384)) -> pd.DataFrame:
    """speed_left over the FlashAttention sweep (fp16: B N = 16k, H D = 2048) for each hold:
    rows (hold, D, causal), columns N, as the measured sweep ratios are laid out."""
    rows = {}
    for hold in holds:
        for D in (64, 128):
            for causal in (False, True):
                rows[(hold, D, causal)] = {N: speed_left(N, D, causal, hold) for N in Ns}
    out = pd.DataFrame(rows).T
    out.index.names = ["hold", "D", "causal"]
    out.columns.name = "N"
    return out


def fit(measured: pd.DataFrame, holds=(0.3, 0.4, 0.5, 0.6, 0.7)) -> pd.Series:
    """The hold of `holds` whose model best matches `measured` (stage 21 over stage 20, rows (D,
    causal), columns N, as the notebook's sweep_ratio gives them) in the mean squared difference,
    that difference's root, and the largest single one."""
    best = None
    for hold in holds:
        diffs = [speed_left(int(N), int(D), bool(c), float(hold)) - measured.loc[(D, c), N]
                 for (D, c) in measured.index for N in measured.columns
                 if pd.notna(measured.loc[(D, c), N])]
        rms = float(np.sqrt(np.mean(np.square(diffs))))
        if best is None or rms < best["rms difference"]:
            best = {"hold": round(float(hold), 2), "rms difference": rms,
                    "largest difference": float(np.max(np.abs(diffs)))}
    return pd.Series(best)


def figure(key_blocks=8, hold=0.5, sms=8):
    """One head of `key_blocks` key blocks on as many SMs, without the mask: when each block's
    consumers work (grey), when its dQ thread adds (blue) and when the consumers wait for a dQ
    buffer (red), without turns (stage 20) and with them (stage 21)."""
    fig = Figure(figsize=(13, 5.6))
    for k, with_turns in enumerate((False, True)):
        end, log = simulate(key_blocks, 1, hold, False, turns=with_turns, sms=sms, trace=True)
        ax = fig.add_subplot(1, 2, k + 1)
        for (_, j), _, start, steps in log:
            prev = start
            for i, done, begin, finish in steps:
                ax.barh(j + 0.2, 1.0, left=prev, height=0.35, color="#bbbbbb", edgecolor="white")
                if done > prev + 1.0 + 1e-9:  # products done, waiting for a buffer
                    ax.barh(j + 0.2, done - prev - 1.0, left=prev + 1.0, height=0.35,
                            color="#d62728")
                ax.barh(j - 0.2, finish - begin, left=begin, height=0.35, color="#1f77b4")
                prev = done
        ax.set_ylim(key_blocks - 0.4, -0.6)
        ax.set_xlim(0, 2 + key_blocks * (1 + hold))
        ax.set_yticks(range(key_blocks))
        ax.set_xlabel("time (query blocks of products)", fontsize=LABEL)
        ax.set_ylabel("key block j", fontsize=LABEL)
        ax.set_title(("turns in launch order (stage 21)" if with_turns else "no turns (stage 20)")
                     + f": done at {end:.1f}", fontsize=TITLE - 2)
    fig.suptitle(f"One head without the mask, adds taking {hold} of a query block's time: "
                 "consumers (grey), dQ thread (blue), consumers waiting for a dQ buffer (red)",
                 fontsize=TITLE - 3)
    fig.tight_layout()
    return fig
