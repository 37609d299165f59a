"""Stage 11 on the CPU: warp specialization's register budgets, the claiming of work items by a
persistent grid, and the producer/consumer schedule against stage 10's, from the kernel's own
numbers (no GPU needed).

kernels/11_warpspec.cu gives the copies to a warpgroup of their own (the producer), moves
registers to the computing warpgroups (the consumers) with `setmaxnreg`, and runs a persistent
grid that claims work items from a counter. tests/test_hopper.py keeps the lines of
11_warpspec.cu (and 10_tma.cu, for stage 10's schedule) each function here follows.

    from flashlab import warpspec
    warpspec.register_budget(consumers=2)          # registers per warpgroup, before and after
    warpspec.claim_figure(heads=4, tiles=8, blocks=8)
    warpspec.warpspec_timeline(tiles=(3, 3, 3))    # stage 10 above stage 11, one SM
"""
import heapq
import math
from typing import NamedTuple

import matplotlib
import matplotlib.lines
import numpy as np
import pandas as pd
from matplotlib.figure import Figure
from matplotlib.patches import Patch, Rectangle

from .hopper_common import LABEL, TEXT, TITLE, WARPGROUP, gain
from .tiling import SM_LIMITS


REGS_PER_SM = SM_LIMITS["9.0"][0]  # 32-bit registers in an SM's register file (65 536)
MAX_REGS_THREAD = 255    # the most a thread may hold
REG_UNIT = 8             # registers are allocated (and setmaxnreg counts) in multiples of 8
SETMAXNREG_RANGE = (24, 256)


def entry_registers(threads, regs_per_sm=REGS_PER_SM, blocks=1) -> int:
    """The registers a thread may hold when a kernel starts under `__launch_bounds__(threads,
    blocks)`: `blocks` blocks of `threads` must fit the register file, so 65 536 / blocks /
    threads, rounded down to a multiple of 8 and at most 255. ptxas compiles the whole kernel for
    this cap (it reports it as the kernel's registers); setmaxnreg moves it per warpgroup at run
    time."""
    if threads <= 0 or threads % WARPGROUP:
        raise ValueError("threads is a positive multiple of 128 (whole warpgroups)")
    if blocks < 1:
        raise ValueError("at least one block an SM")
    return min(MAX_REGS_THREAD, regs_per_sm // blocks // threads // REG_UNIT * REG_UNIT)


def producer_registers(consumers, blocks=1) -> int:
    """11_warpspec.cu's `static constexpr int PRODUCER_REGS = CONSUMERS == 3 || BLOCKS == 2 ? 32 :
    40;`: what its producer keeps after setmaxnreg.dec. 40 is what its loop needs at D = 128
    without spilling; with three consumers, or two blocks an SM, it gives up all but 32, so that
    each consumer gets 160 (or 104)."""
    if consumers < 1:
        raise ValueError("at least one consumer warpgroup")
    return 32 if consumers == 3 or blocks == 2 else 40


def consumer_registers(consumers, producer_regs=None, regs_per_sm=REGS_PER_SM, blocks=1) -> int:
    """11_warpspec.cu's split: `static constexpr int CONSUMER_REGS = (ENTRY_REGS * (1 +
    CONSUMERS) - PRODUCER_REGS) / CONSUMERS / 8 * 8;` -- setmaxnreg moves registers within the
    block's pool, what it was given at launch: ENTRY_REGS (entry_registers) for each of the
    128 thread positions of each warpgroup. The producer keeps PRODUCER_REGS and the consumers
    share the rest, each a multiple of 8 (setmaxnreg's unit)."""
    if consumers < 1:
        raise ValueError("at least one consumer warpgroup")
    pool = entry_registers(WARPGROUP * (1 + consumers), regs_per_sm, blocks) * (1 + consumers)
    producer_regs = (producer_registers(consumers, blocks) if producer_regs is None
                     else producer_regs)
    lo, hi = SETMAXNREG_RANGE
    if producer_regs % REG_UNIT or not lo <= producer_regs <= hi:
        raise ValueError(f"setmaxnreg takes a multiple of 8 from {lo} to {hi}, not {producer_regs}")
    regs = (pool - producer_regs) // consumers // REG_UNIT * REG_UNIT
    return min(regs, hi)


def accumulator_registers(D=128, BC=128) -> dict:
    """The registers a consumer thread's accumulators take in 11_warpspec.cu (stage 10's math):
    O (m64nD, fp32) `float o[D / 2]`, S (m64nBC) `float s[BC / 2]` and P packed to 16 bits as
    the A fragments of P V, `uint32_t p[KS][4]` with KS = BC / 16. Addresses, indices, the
    running max and sum come on top."""
    return {"O": D // 2, "S": BC // 2, "P": BC // 16 * 4}


def register_budget(consumers=2, producer_regs=None, regs_per_sm=REGS_PER_SM,
                    blocks=1) -> pd.DataFrame:
    """One row per warpgroup of one of 11_warpspec.cu's blocks (warpgroup 0 the producer, 1.. the
    consumers), `blocks` blocks an SM: threads, registers a thread at entry (entry_registers),
    after setmaxnreg (producer_regs, or consumer_registers), and the registers the warpgroup holds
    before and after. setmaxnreg only moves registers within the block: after <= entry in all."""
    threads = WARPGROUP * (1 + consumers)
    at_entry = entry_registers(threads, regs_per_sm, blocks)
    producer_regs = (producer_registers(consumers, blocks) if producer_regs is None
                     else producer_regs)
    cons = consumer_registers(consumers, producer_regs, regs_per_sm, blocks)
    rows = [dict(warpgroup=0, role="producer", threads=WARPGROUP, entry=at_entry,
                 after=producer_regs)]
    rows += [dict(warpgroup=w, role="consumer", threads=WARPGROUP, entry=at_entry, after=cons)
             for w in range(1, consumers + 1)]
    df = pd.DataFrame(rows)
    df["entry_total"] = df.threads * df.entry
    df["after_total"] = df.threads * df.after
    assert df.after_total.sum() <= df.entry_total.sum() <= regs_per_sm // blocks
    return df.set_index("warpgroup")


ROLE_COLORS = {"producer": "#fdae6b", "consumer": ("#6baed6", "#4292c6", "#2171b5", "#08519c")}


def register_figure(consumer_options=(2, 3), producer_regs=None, D=128, BC=128):
    """The SM's 65 536 registers as a bar, split by warpgroup (128 threads each), for each number
    of consumers in `consumer_options`: at entry (every warpgroup at the launch bound's cap) and
    after setmaxnreg (the producer down to `producer_regs`, default producer_registers: 40 for two
    consumers, 32 for three; the consumers up). Inside each
    consumer's share, hatched: the accumulators of stage 10's math at (D, BC) --
    accumulator_registers -- which must fit a thread's registers with room to spare."""
    need = sum(accumulator_registers(D, BC).values())
    bars = []
    for c in consumer_options:
        b = register_budget(c, producer_regs)
        kept = int(b.after.iloc[0])
        threads = WARPGROUP * (1 + c)
        bars.append((f"{c} consumers, at launch\n{threads} threads: "
                     f"{int(b.entry.iloc[0])} each", b, "entry"))
        bars.append((f"{c} consumers, after\nsetmaxnreg: {kept} | "
                     f"{int(b.after.iloc[1])}", b, "after"))
    fig = Figure(figsize=(16, 1.5 + 1.45 * len(bars)), layout="constrained")
    ax = fig.subplots()
    for y, (label, b, when) in enumerate(bars):
        x = 0
        for w, r in b.iterrows():
            per, total = int(r[when]), int(r[f"{when}_total"])
            fc = (ROLE_COLORS["producer"] if r.role == "producer"
                  else ROLE_COLORS["consumer"][(w - 1) % 4])
            ax.add_patch(Rectangle((x, y - 0.38), total, 0.76, fc=fc, ec="k", lw=1.2,
                                   alpha=0.45 if when == "entry" else 1.0))
            if r.role == "consumer":
                fits = need <= per
                ax.add_patch(Rectangle((x, y - 0.38), WARPGROUP * min(need, per), 0.3,
                                       fill=False, ec="k" if fits else "tab:red", lw=0.8,
                                       hatch="//"))
                left = per - need
                ax.text(x + WARPGROUP * min(need, per) / 2, y - 0.23,
                        f"accumulators {need}: {left} left" if fits else
                        f"accumulators {need} > {per}", ha="center", va="center", fontsize=9.5,
                        color="k" if fits else "tab:red",
                        bbox=dict(fc="white", ec="none", pad=0.6, alpha=0.9))
            name = "producer" if r.role == "producer" else f"consumer {w}"
            txt = f"wg {w}: {name}\n{per} × 128 = {total:,}".replace(",", " ")
            small = total < 9000
            ax.text(x + total / 2, y + 0.16 if not small else y, txt if not small else
                    f"wg {w}\n{per}/thread", ha="center", va="center", fontsize=TEXT - (2 if small
                                                                                    else 0),
                    color="white" if when == "after" and r.role == "consumer" and w > 1
                    else "black")
            x += total
        free = REGS_PER_SM - x
        if free > 0:
            ax.add_patch(Rectangle((x, y - 0.38), free, 0.76, fc="white", ec="0.5", lw=1,
                                   hatch=".."))
            if free > 2500:
                ax.text(x + free / 2, y, f"free\n{free:,}".replace(",", " "), ha="center",
                        va="center", fontsize=TEXT - 1, color="0.3")
    ax.set_yticks(range(len(bars)), [b[0] for b in bars], fontsize=TEXT)
    ax.set_ylim(len(bars) - 0.45, -0.55)
    ax.set_xlim(0, REGS_PER_SM)
    ax.set_xticks(range(0, REGS_PER_SM + 1, 8192),
                  [f"{v:,}".replace(",", " ") for v in range(0, REGS_PER_SM + 1, 8192)],
                  fontsize=TEXT)
    ax.set_xlabel("registers of one SM (one block per SM)", fontsize=LABEL)
    parts = accumulator_registers(D, BC)
    handles = [Patch(fc=ROLE_COLORS["producer"], ec="k", label="producer: issues the copies"),
               Patch(fc=ROLE_COLORS["consumer"][0], ec="k", label="consumers: the math"),
               Patch(fc="white", ec="k", hatch="//",
                     label=f"a consumer thread's accumulators at D = {D}: O {parts['O']} + S "
                           f"{parts['S']} + P {parts['P']} = {need} registers (red: do not fit)"),
               Patch(fc="white", ec="0.5", hatch="..", label="not allocated")]
    ax.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=2,
              fontsize=TEXT, frameon=False)
    ax.set_title("setmaxnreg: the SM's 65 536 registers, split by warpgroup (128 threads "
                 "each)\nlight: at launch, every warpgroup at __launch_bounds__(threads, 1)'s cap; "
                 "solid: after setmaxnreg.dec / .inc", fontsize=TITLE)
    return fig


# ---------------------------------------------------------------- stage 11: claiming work items

CLAIM_POLICIES = ("static", "counter", "hardware")


def item_tiles(item, tiles, causal, longest_first=True, rows=128, keys=128, n=None) -> int:
    """The key tiles (of `keys` keys) work item `item` reads, its query tiles `rows` rows each, in
    a sequence of n keys (default tiles x rows). 11_warpspec.cu's work_tile gives it query tile
    qt = item % tiles of its head, taken from the last under the causal mask; a causal item reads the key tiles up to its last row,
    ceil(min(n, q0 + rows) / keys), and without the mask every item reads all ceil(n / keys).
    With rows = keys, causal query tile t reads key tiles 0..t. longest_first=False numbers the
    tiles in order instead (short ones first)."""
    if rows < 1 or keys < 1:
        raise ValueError("rows and keys are at least 1")
    n = tiles * rows if n is None else n
    if not (tiles - 1) * rows < n <= tiles * rows:
        raise ValueError(f"{tiles} query tiles of {rows} rows do not cover a sequence of {n}")
    if not causal:
        return math.ceil(n / keys)
    qt = item % tiles
    q0 = (tiles - 1 - qt if longest_first else qt) * rows
    return math.ceil(min(n, q0 + rows) / keys)


def claim_schedule(heads=4, tiles=8, blocks=8, causal=True, policy="counter", longest_first=True,
                   per_item=0.0, ahead=2, rows=128, keys=128, n=None) -> pd.DataFrame:
    """Which block (SM) computes which work item, and when, for `heads` (batch x head) of `tiles`
    query tiles each, an item taking item_tiles() time units (+ `per_item`; rows, keys and n as
    there). Policies:

    * "static": a persistent grid without a counter, block b taking items b, b + G, b + 2G, ...
      (G = the grid's blocks);
    * "counter": 11_warpspec.cu. Block b's first item is its own (`int ring = 0, item =
      blockIdx.x;`); its producer claims the next one once it has issued the current item's
      copies (`item = gridDim.x + atomicAdd(next_item, 1);`). It issues the last of them when a
      buffer of the K/V ring frees up, `ahead` key tiles before the item ends (the ring's depth),
      so the claim comes at max(start, end - ahead) and the claimed item starts when the current
      one ends; claims are served in the order they are made;
    * "hardware": one block per item as in stage 10, the block scheduler starting block i on the
      first SM to free up (items in order).

    A row per item: head, qt (the query tile work_tile gives it), cost, block, claimed (time),
    start, end."""
    if policy not in CLAIM_POLICIES:
        raise ValueError(f"policy is one of {CLAIM_POLICIES}, not {policy!r}")
    if heads < 1 or tiles < 1 or blocks < 1 or per_item < 0 or ahead < 0:
        raise ValueError("heads, tiles and blocks are at least 1; per_item and ahead >= 0")
    items = heads * tiles
    cost = [item_tiles(i, tiles, causal, longest_first, rows, keys, n) + per_item
            for i in range(items)]
    grid = min(blocks, items)
    start, end, claimed = np.zeros(items), np.zeros(items), np.zeros(items)
    block = np.zeros(items, dtype=int)
    if policy == "static":
        for b in range(grid):
            t = 0.0
            for i in range(b, items, grid):
                start[i], end[i], block[i] = t, t + cost[i], b
                t = end[i]
    elif policy == "hardware":
        free = [(0.0, b) for b in range(grid)]
        for i in range(items):
            t, b = heapq.heappop(free)
            claimed[i], start[i], end[i], block[i] = t, t, t + cost[i], b
            heapq.heappush(free, (end[i], b))
    else:
        counter = grid
        events = []                 # (when the block claims, block, the item it is on): in that order
        for b in range(grid):
            start[b], end[b], block[b] = 0.0, cost[b], b
            heapq.heappush(events, (max(0.0, end[b] - ahead), b, b))
        while events:
            t, b, cur = heapq.heappop(events)
            if counter >= items:
                continue                    # the block read -1: no items left, it stops
            i, counter = counter, counter + 1
            claimed[i] = t
            start[i], end[i], block[i] = end[cur], end[cur] + cost[i], b
            heapq.heappush(events, (max(start[i], end[i] - ahead), b, i))
    qt = [(tiles - 1 - i % tiles if causal and longest_first else i % tiles) for i in range(items)]
    return pd.DataFrame(dict(item=range(items), head=[i // tiles for i in range(items)], qt=qt,
                             cost=cost, block=block, claimed=claimed, start=start,
                             end=end)).set_index("item")


def claim_makespans(configs, blocks=132, causal=True) -> pd.DataFrame:
    """For each (heads, tiles) or (heads, tiles, rows, keys, n) in `configs` (claim_schedule's
    arguments): when the last item ends under each policy, in units of one key tile's work,
    beside the lower bound (all the work spread evenly over the blocks) and each policy's excess
    over it."""
    out = []
    for heads, tiles, *shape in configs:
        shape = dict(zip(("rows", "keys", "n"), shape))
        sched = {p: claim_schedule(heads, tiles, blocks, causal, p, **shape)
                 for p in CLAIM_POLICIES}
        grid = min(blocks, heads * tiles)
        bound = sched["counter"].cost.sum() / grid
        row = dict(heads=heads, tiles=tiles, items=heads * tiles, even_split=bound)
        for p, s in sched.items():
            row[p] = s.end.max()
        for p in CLAIM_POLICIES:
            row[f"{p} over even"] = row[p] / bound - 1
        out.append(row)
    return pd.DataFrame(out).set_index(["heads", "tiles"])


def claim_figure(heads=4, tiles=8, blocks=8, causal=True):
    """claim_schedule as Gantt charts, a panel per way of handing out the same causal items: a
    row per block (SM), a bar per item labelled with its key tiles (its time), coloured by head;
    a dashed line where all the work spread evenly would end. Panels: the static assignment, the
    counter with query tiles in order (short first), the counter with work_tile's order
    (longest first: what stage 11 does), and stage 10's one block per item."""
    panels = [("static", True, "persistent grid, static: block b takes items b, b + G, b + 2G, …"),
              ("counter", False, "counter, query tiles in order (short ones first)"),
              ("counter", True, "counter, longest first (11_warpspec.cu's work_tile)"),
              ("hardware", True, "one block per item (stage 10): the block scheduler fills the "
                                 "first free SM")]
    scheds = [claim_schedule(heads, tiles, blocks, causal, p, lf) for p, lf, _ in panels]
    span = max(s.end.max() for s in scheds)
    fig = Figure(figsize=(16, 2.4 + 0.3 * blocks * len(panels)), layout="constrained")
    axes = fig.subplots(len(panels), 1, sharex=True)
    cmap = matplotlib.colormaps["Pastel1" if heads <= 9 else "tab20"]
    for ax, s, (_, _, title) in zip(axes, scheds, panels):
        bound = s.cost.sum() / min(blocks, len(s))
        for i, r in s.iterrows():
            ax.broken_barh([(r.start, r.cost)], (r.block - 0.4, 0.8),
                           fc=cmap(int(r["head"]) % cmap.N), ec="0.25", lw=0.8)
            if r.cost >= 0.6:
                ax.text(r.start + r.cost / 2, r.block, f"{r.cost:g}", ha="center", va="center",
                        fontsize=TEXT - 1)
        ax.axvline(bound, color="k", ls="--", lw=1.2)
        last = s.end.max()
        ax.axvline(last, color="tab:red", lw=2)
        ax.set_title(f"{title}: done at {last:g} ({last / bound - 1:+.0%} over the even split, "
                     f"{bound:.3g})", fontsize=LABEL, loc="left")
        ax.set_yticks(range(blocks), [f"SM {b}" for b in range(blocks)], fontsize=9)
        ax.set_ylim(blocks - 0.5, -0.5)
        ax.grid(axis="x", alpha=0.3)
    axes[-1].set_xlim(0, span * 1.02)
    axes[-1].set_xlabel("time, in key tiles of work (a bar's number: the key tiles its item reads)",
                        fontsize=LABEL)
    axes[-1].tick_params(axis="x", labelsize=TEXT)
    handles = [Patch(fc=cmap(h % cmap.N), ec="0.25", label=f"head {h}") for h in range(heads)]
    handles += [matplotlib.lines.Line2D([], [], color="k", ls="--", label="all work spread evenly"),
                matplotlib.lines.Line2D([], [], color="tab:red", lw=2, label="last item done")]
    fig.legend(handles=handles, loc="outside lower center", ncol=min(len(handles), 8),
               fontsize=TEXT, frameon=False)
    fig.suptitle(f"Handing out {heads * tiles} causal work items ({heads} heads × {tiles} query "
                 f"tiles; query tile t reads t + 1 key tiles) to {blocks} SMs", fontsize=TITLE)
    return fig


# ---------------------------------------------------------------- stage 11: producer and consumers

class _CopyEngine:
    """Copies in issue order: each starts arriving `latency` after its issue and then streams its
    bytes (a time) behind the copies issued before it (they share the link), as in
    flashlab.tma.ring_schedule."""

    def __init__(self, latency):
        self.latency, self.link, self.rows = latency, 0.0, []

    def issue(self, when, duration, **what):
        start = max(when + self.latency, self.link)
        self.link = start + duration
        self.rows.append(dict(issue=when, start=start, arrive=self.link, **what))
        return self.link


def _check_times(**times):
    for name, v in times.items():
        if v < 0:
            raise ValueError(f"{name} is a time >= 0, not {v}")


class Schedule(NamedTuple):
    """What elected_schedule and warpspec_schedule return: `work`, a row per interval a lane
    spends (lane, kind, item, tile, start, end; kinds: launch, S, softmax, PV, store, wait),
    `copies`, a row per copy (what, item, tile, buffer, issue, start, arrive, release), and
    `total`, when the last item's O is stored."""
    work: pd.DataFrame
    copies: pd.DataFrame
    total: float


def elected_schedule(tiles=(4, 4, 4), stages=3, load=1.0, latency=1.0, mma=0.75, softmax=0.75,
                     q_load=0.5, store=0.5, launch=0.5, issue=0.05, warpgroups=2) -> Schedule:
    """Stage 10 on one SM, one block at a time (its shared memory at D = 128 leaves room for one):
    a block per work item, item k of tiles[k] K/V tiles. A block starts (`launch`: the block is
    placed, its barriers initialised), its elected thread (thread 0, in warpgroup 0) issues Q
    (`q_load` of bytes) and the first stages - 1 tiles (K and V together, `load`), each
    taking it `issue`. Each warpgroup, per tile: waits for full (Q too, before tile 0), S = Q Kᵀ
    (mma / 2), softmax, P V (mma / 2; the next S waits for it). Right after issuing S(j), the
    elected thread waits on empty for the buffer of tile j - 2 and issues tile j + AHEAD
    (AHEAD = stages - 2) unless it came with Q (10_tma.cu's ring, as flashlab.tma.ring_schedule),
    so its warpgroup resumes only when both S and the issue are done; a buffer is released when
    every warpgroup's S of the next tile has retired (the last one when its P V has). After its
    last tile a warpgroup stores its rows of O (`store`); the block ends when both have, and the
    next block starts."""
    _check_times(load=load, latency=latency, mma=mma, softmax=softmax, q_load=q_load,
                 store=store, launch=launch, issue=issue)
    if stages < 3:
        raise ValueError("stage 10 needs stages >= 3 (AHEAD = stages - 2 >= 1)")
    if not tiles or min(tiles) < 1 or warpgroups < 1:
        raise ValueError("every item has at least one tile; at least one warpgroup")
    ahead = stages - 2
    eng = _CopyEngine(latency)
    work, copies = [], []
    t_block = 0.0
    for k, n in enumerate(tiles):
        for w in range(warpgroups):
            work.append(dict(lane=f"wg {w}", kind="launch", item=k, tile=-1, start=t_block,
                             end=t_block + launch))
        t = t_block + launch                              # the elected thread's clock
        t += issue
        q_arrive = eng.issue(t, q_load, what="Q", item=k, tile=-1, buffer=0)
        arrive, release = {}, {}
        for j in range(min(stages - 1, n)):
            t += issue
            arrive[j] = eng.issue(t, load, what="KV", item=k, tile=j, buffer=j % stages)
        free = [t_block + launch] * warpgroups
        for j in range(n):
            s_done = []
            for w in range(warpgroups):
                ready = max(arrive[j], q_arrive if j == 0 else 0.0)
                st = max(free[w], ready)
                if st > free[w]:
                    work.append(dict(lane=f"wg {w}", kind="wait", item=k, tile=j, start=free[w],
                                     end=st))
                s_end = st + mma / 2
                resume = s_end
                nxt = j + ahead
                if w == 0 and stages - 1 <= nxt < n:      # the elected thread, after issuing S(j)
                    when = max(st, t)
                    if nxt >= stages:
                        when = max(when, release[nxt - stages])
                    if when > st:
                        work.append(dict(lane="elected", kind="wait", item=k, tile=nxt, start=st,
                                         end=when))
                    t = when + issue
                    arrive[nxt] = eng.issue(t, load, what="KV", item=k, tile=nxt,
                                            buffer=nxt % stages)
                    resume = max(s_end, t)
                work.append(dict(lane=f"wg {w}", kind="S", item=k, tile=j, start=st, end=s_end))
                if resume > s_end:
                    work.append(dict(lane=f"wg {w}", kind="wait", item=k, tile=j, start=s_end,
                                     end=resume))
                work.append(dict(lane=f"wg {w}", kind="softmax", item=k, tile=j, start=resume,
                                 end=resume + softmax))
                pv_end = resume + softmax + mma / 2
                work.append(dict(lane=f"wg {w}", kind="PV", item=k, tile=j,
                                 start=resume + softmax, end=pv_end))
                free[w] = pv_end
                s_done.append(resume)
            if j:
                release[j - 1] = max(s_done)
        release[n - 1] = max(free)
        for w in range(warpgroups):
            work.append(dict(lane=f"wg {w}", kind="store", item=k, tile=n, start=free[w],
                             end=free[w] + store))
        for row in eng.rows[len(copies):]:
            row["release"] = (release[row["tile"]] if row["tile"] >= 0
                              else max(free))     # Q: the block's end
        copies = list(eng.rows)
        t_block = max(free) + store
    return Schedule(pd.DataFrame(work), pd.DataFrame(copies), t_block)


def warpspec_schedule(tiles=(4, 4, 4), stages=2, load=1.0, latency=1.0, mma=0.75, softmax=0.75,
                      q_load=0.5, store=0.5, launch=0.5, issue=0.05, consumers=2) -> Schedule:
    """Stage 11 on one SM: one persistent block computes the work items one after another
    (tiles[k] K/V tiles each). It starts once (`launch`). The producer's one thread walks the
    items in 11_warpspec.cu's order: for item `it`, it waits until Q buffer it % 2 is free (item
    it - 2's last S has retired: `if (it >= 2) mbar_wait(q_empty + 8 * slot, ((it >> 1) - 1) &
    1);`), issues Q, then K_0, then K_j with V_{j-1} (`if (j > 0) load(Vs, v_full, v_empty,
    maps.v, j - 1);`), then the last V -- K and V of a tile load / 2 each, on rings of `stages`
    buffers with barriers of their own, each copy waiting for its buffer's release and taking
    the thread issue / 2. Each consumer, per tile: waits for K_j, S (mma / 2), then releases K_j
    and V_{j-1} (`mbar_arrive(k_empty + 8 * buf);`: its S and the P V before it have retired),
    softmax, waits for V_j, P V (mma / 2); after an item's last tile it stores O from its
    registers (`store`) and waits for the next item's Q. A buffer is free once every consumer
    has released it; Q's once every consumer's last S of the item has retired."""
    _check_times(load=load, latency=latency, mma=mma, softmax=softmax, q_load=q_load,
                 store=store, launch=launch, issue=issue)
    if stages < 2:
        raise ValueError("stage 11 needs stages >= 2 (the producer loads K_j with V_{j-1})")
    if not tiles or min(tiles) < 1 or consumers < 1:
        raise ValueError("every item has at least one tile; at least one consumer")
    eng = _CopyEngine(latency)
    base = [int(b) for b in np.concatenate([[0], np.cumsum(tiles)])]  # ring position of tile 0
    positions = [(k, j) for k, n in enumerate(tiles) for j in range(n)]
    q_arrive, q_release = {}, {}
    arrive = {"K": {}, "V": {}}
    release = {"K": {}, "V": {}}
    work = [dict(lane=lane, kind="launch", item=0, tile=-1, start=0.0, end=launch)
            for lane in ["producer"] + [f"consumer {c + 1}" for c in range(consumers)]]
    free = [launch] * consumers
    state = {"done": -1, "t": launch}              # positions consumed; the producer's clock

    def consume(r):
        """The consumers' work on ring position r (its copies are issued)."""
        k, j = positions[r]
        n = tiles[k]
        s_end, pv_end = [], []
        for c in range(consumers):
            lane = f"consumer {c + 1}"
            if j == 0 and q_arrive[k] > free[c]:
                work.append(dict(lane=lane, kind="wait", item=k, tile=-1, start=free[c],
                                 end=q_arrive[k]))
                free[c] = q_arrive[k]
            st = max(free[c], arrive["K"][r])
            if st > free[c]:
                work.append(dict(lane=lane, kind="wait", item=k, tile=j, start=free[c], end=st))
            sm = st + mma / 2
            work.append(dict(lane=lane, kind="S", item=k, tile=j, start=st, end=sm))
            work.append(dict(lane=lane, kind="softmax", item=k, tile=j, start=sm,
                             end=sm + softmax))
            pv = max(sm + softmax, arrive["V"][r])
            if pv > sm + softmax:
                work.append(dict(lane=lane, kind="wait", item=k, tile=j, start=sm + softmax,
                                 end=pv))
            work.append(dict(lane=lane, kind="PV", item=k, tile=j, start=pv, end=pv + mma / 2))
            free[c] = pv + mma / 2
            s_end.append(sm)
            pv_end.append(free[c])
            if j == n - 1:
                work.append(dict(lane=lane, kind="store", item=k, tile=n, start=free[c],
                                 end=free[c] + store))
                free[c] += store
        release["K"][r] = max(s_end)
        if j > 0:
            release["V"][r - 1] = max(s_end)
        if j == n - 1:
            q_release[k] = max(s_end)
            release["V"][r] = max(pv_end)

    def consume_upto(r):
        while state["done"] < r:
            nxt = state["done"] + 1
            k, _ = positions[nxt]
            if k not in q_arrive or nxt not in arrive["K"] or nxt not in arrive["V"]:
                raise RuntimeError("model deadlock: a consumer needs a copy not issued yet")
            consume(nxt)
            state["done"] = nxt

    def wait_until(when, k, tile):
        if when > state["t"]:
            work.append(dict(lane="producer", kind="wait", item=k, tile=tile, start=state["t"],
                             end=when))
            state["t"] = when

    def copy(kind, r):
        k, j = positions[r]
        if r >= stages:                            # the buffer's last tile must be released
            old = r - stages
            last_of_item = positions[old][1] == tiles[positions[old][0]] - 1
            consume_upto(old if kind == "K" or last_of_item else old + 1)
            wait_until(release[kind][old], k, j)
        state["t"] += issue / 2
        arrive[kind][r] = eng.issue(state["t"], load / 2, what=kind, item=k, tile=j,
                                    buffer=r % stages)

    for k, n in enumerate(tiles):
        if k >= 2:                                 # Q buffer k % 2 held item k - 2's Q
            consume_upto(base[k - 1] - 1)
            wait_until(q_release[k - 2], k, -1)
        state["t"] += issue / 2
        q_arrive[k] = eng.issue(state["t"], q_load, what="Q", item=k, tile=-1, buffer=k % 2)
        for j in range(n):
            copy("K", base[k] + j)
            if j > 0:
                copy("V", base[k] + j - 1)
        copy("V", base[k] + n - 1)
    consume_upto(len(positions) - 1)
    rows = []
    for row in eng.rows:
        k, j = row["item"], row["tile"]
        rel = q_release[k] if row["what"] == "Q" else release[row["what"]][base[k] + j]
        rows.append(dict(row, release=rel))
    return Schedule(pd.DataFrame(work), pd.DataFrame(rows), max(free))


def predicted_gain(n_tiles=(4, 8, 16, 32, 64, 128), items=6, **times) -> pd.Series:
    """Stage 10's time over stage 11's, per number of K/V tiles in a work item, from
    elected_schedule and warpspec_schedule with the same times (keyword arguments of both), for
    `items` items of that many tiles on one SM (stage 10 at 3 buffers, stage 11 at 2, as both
    kernels pick at D = 128)."""
    return gain(n_tiles, items, "stage 10 time / stage 11 time",
                lambda tiles: elected_schedule(tiles=tiles, stages=3, **times).total,
                lambda tiles: warpspec_schedule(tiles=tiles, stages=2, **times).total)


ITEM_COLORS = ("#3182bd", "#e6550d", "#31a354", "#756bb1", "#636363")


def _lighter(color, amount=0.55):
    r, g, b = matplotlib.colors.to_rgb(color)
    return (r + (1 - r) * amount, g + (1 - g) * amount, b + (1 - b) * amount)


def _draw_work(ax, work, lanes, h=0.7):
    """A schedule's intervals on lanes {lane: y}: S and P V dark, softmax light, the store
    hatched (all in the item's colour), waits red, a block's start grey."""
    for _, r in work.iterrows():
        if r.lane not in lanes or r.end - r.start <= 1e-9:
            continue
        y = lanes[r.lane]
        c = ITEM_COLORS[int(r["item"]) % len(ITEM_COLORS)]
        span = [(r.start, r.end - r.start)]
        if r.kind in ("S", "PV"):
            ax.broken_barh(span, (y - h / 2, h), fc=c, ec="white", lw=0.6)
            if r.end - r.start > 0.3:
                ax.text((r.start + r.end) / 2, y, f"{r.kind}{int(r.tile)}", ha="center",
                        va="center", fontsize=8.5, color="white")
        elif r.kind == "softmax":
            ax.broken_barh(span, (y - h / 2, h), fc=_lighter(c), ec="white", lw=0.6)
            if r.end - r.start > 0.5:
                ax.text((r.start + r.end) / 2, y, "exp", ha="center", va="center", fontsize=8.5)
        elif r.kind == "store":
            ax.broken_barh(span, (y - h / 2, h), fc="white", ec=c, lw=1, hatch="///")
        elif r.kind == "launch":
            ax.broken_barh(span, (y - h / 2, h), fc="0.8", ec="0.5", lw=0.6)
        elif r.kind == "wait":
            ax.broken_barh(span, (y - 0.09, 0.18), fc="tab:red", lw=0)


def _draw_copies(ax, copies, issuer_y, land_y, h=0.6):
    """Each copy: a marker where it is issued (on the issuer's lane) and its bytes arriving (on
    the landing lane, between start and arrive), labelled and coloured by item."""
    for n, r in enumerate(copies.itertuples()):
        c = ITEM_COLORS[int(r.item) % len(ITEM_COLORS)]
        name = "Q" if r.what == "Q" else f"{r.what}{int(r.tile)}"
        ax.plot([r.issue], [issuer_y], marker="v", color=c, ms=8, mec="k", mew=0.5)
        ax.broken_barh([(r.start, r.arrive - r.start)], (land_y - h / 2, h), fc=c, ec="k",
                       lw=0.6, alpha=0.85)
        ax.text((r.start + r.arrive) / 2, land_y + (-0.5 if n % 2 else 0.5), name,
                ha="center", va="center", fontsize=8.5, color=c, fontweight="bold")


def warpspec_timeline(tiles=(3, 3, 3), load=0.5, latency=1.0, mma=1.0, softmax=1.0, q_load=0.25,
                      store=0.25, launch=0.5, issue=0.05):
    """elected_schedule (stage 10, 3 buffers, one block per item) above warpspec_schedule (stage
    11, 2 buffers of K and 2 of V, one persistent block) for the same items and times, on one
    time axis. Lanes: who issues the copies (a ▼ per copy, red while it waits for a buffer), the
    copies' bytes landing, stage 11's two Q buffers (held from Q's issue to its release), and the
    computing warpgroups: S and P V dark, the softmax light, O's store hatched, red while
    waiting for data; items by colour."""
    times = dict(load=load, latency=latency, mma=mma, softmax=softmax, q_load=q_load,
                 store=store, launch=launch, issue=issue)
    ten = elected_schedule(tiles=tiles, stages=3, **times)
    eleven = warpspec_schedule(tiles=tiles, stages=2, **times)
    end = max(ten.total, eleven.total)
    fig = Figure(figsize=(16, 9.5), layout="constrained")
    top, bottom = fig.subplots(2, 1, sharex=True, height_ratios=[4, 6])
    lanes10 = {"elected": 0, "copies": 1, "wg 0": 2, "wg 1": 3}
    _draw_copies(top, ten.copies, 0, 1)
    _draw_work(top, ten.work, lanes10)
    for item, start in ten.work[ten.work.kind == "launch"].groupby("item").start.min().items():
        top.axvline(start, color="0.4", ls=":", lw=1)
        top.text(start + 0.05, -0.65, f"block {item} starts", fontsize=9.5, color="0.3",
                 va="bottom")
    top.set_yticks(list(lanes10.values()), ["elected thread\n(in warpgroup 0)", "copies land",
                                            "warpgroup 0", "warpgroup 1"], fontsize=TEXT)
    top.set_ylim(3.6, -0.8)
    top.set_title(f"Stage 10: a block per item, one thread of warpgroup 0 issues the copies — "
                  f"{len(tiles)} items in {ten.total:.3g}", fontsize=LABEL + 1, loc="left")
    lanes11 = {"producer": 0, "copies": 1, "Q 0": 2, "Q 1": 3, "consumer 1": 4, "consumer 2": 5}
    _draw_copies(bottom, eleven.copies, 0, 1)
    _draw_work(bottom, eleven.work, lanes11)
    for r in eleven.copies[eleven.copies.what == "Q"].itertuples():
        c = ITEM_COLORS[int(r.item) % len(ITEM_COLORS)]
        y = 2 + int(r.buffer)
        bottom.broken_barh([(r.issue, r.release - r.issue)], (y - 0.3, 0.6), fc=_lighter(c, 0.7),
                           ec=c, lw=1)
        bottom.broken_barh([(r.start, r.arrive - r.start)], (y - 0.3, 0.6), fc=c, lw=0)
        bottom.text(r.arrive + 0.1, y, f"item {int(r.item)}'s Q", fontsize=9.5, va="center",
                    color=c)
    bottom.set_yticks(list(lanes11.values()), ["producer\n(one thread)", "copies land",
                                               "Q buffer 0", "Q buffer 1", "consumer 1",
                                               "consumer 2"], fontsize=TEXT)
    bottom.set_ylim(5.6, -0.8)
    bottom.set_title(f"Stage 11: one persistent block; the producer warpgroup issues, two "
                     f"consumer warpgroups compute — {len(tiles)} items in {eleven.total:.3g}",
                     fontsize=LABEL + 1, loc="left")
    bottom.set_xlim(-0.02 * end, end * 1.02)
    bottom.set_xlabel("time", fontsize=LABEL)
    bottom.tick_params(axis="x", labelsize=TEXT)
    for ax in (top, bottom):
        ax.grid(axis="x", alpha=0.3)
    handles = [Patch(fc="0.3", label="S = Q Kᵀ, P V (tensor cores)"),
               Patch(fc="0.8", label="softmax (exp)"),
               Patch(fc="white", ec="0.3", hatch="///", label="store O"),
               Patch(fc="tab:red", label="waiting"),
               Patch(fc="0.8", ec="0.5", label="block start"),
               *[Patch(fc=ITEM_COLORS[k % len(ITEM_COLORS)], label=f"item {k}")
                 for k in range(len(tiles))]]
    fig.legend(handles=handles, loc="outside lower center", ncol=len(handles), fontsize=TEXT,
               frameon=False)
    fig.suptitle(f"{len(tiles)} work items of {'/'.join(map(str, tiles))} K/V tiles on one SM: "
                 f"copy latency {latency:g}, K+V bytes {load:g}, a tile's math {mma:g} + softmax "
                 f"{softmax:g} per warpgroup", fontsize=TITLE)
    return fig
