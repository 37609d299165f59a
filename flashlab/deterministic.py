"""Stage 16 on the CPU: why atomics make dQ's last bits vary, and what taking turns costs, drawn
and modelled (no GPU needed).

kernels/16_deterministic.cu is stage 15 with one change: at each query block's fp32 dQ sum, the
key blocks of a head take turns, each waiting on a counter for the one before it. Which order
they take turns in decides what the waiting costs: a block that waits holds its place on an SM
and does nothing. The functions here model one head's key blocks walking down their query blocks
at one pace, one query block per step.

    from flashlab import deterministic
    deterministic.orders_demo()                 # one sum, added up in different orders
    deterministic.turns(nq=6, causal=True)      # each block's turn at each query block
    deterministic.idle(nq=64, causal=True, hold=0.25)  # what the waits cost, in each order
    deterministic.figure()                      # arrival and turn, in both orders
"""
import numpy as np
import pandas as pd
from matplotlib.figure import Figure

TITLE, LABEL, TEXT = 15, 12, 11   # font sizes, as the other lessons' figures


def orders_demo(parts=64, rows=1000, orders=8, seed=0) -> pd.Series:
    """One row's dQ sum is `parts` fp32 partial sums (one per key block). Added in `orders`
    random orders, as atomics land: how many rows of `rows` come out with more than one value,
    the most distinct values one row takes, and the largest difference relative to the sum's
    size. In float64 there is one value (the float32 differences are rounding)."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((rows, parts)).astype(np.float32)
    sums = np.empty((orders, rows), dtype=np.float32)
    for o in range(orders):
        perm = rng.permutation(parts)
        acc = np.zeros(rows, dtype=np.float32)
        for p in perm:
            acc = acc + x[:, p]  # one fp32 add at a time, as an atomic does
        sums[o] = acc
    distinct = np.array([len(set(sums[:, r].tolist())) for r in range(rows)])
    return pd.Series({"rows whose sum varies": int((distinct > 1).sum()),
                      "most values one row takes": int(distinct.max()),
                      "largest difference / |row|": float((sums.max(0) - sums.min(0)).max()
                                                          / np.abs(x).sum(1).mean())})


def turns(nq=6, causal=True, order=None) -> pd.DataFrame:
    """Each key block's turn at each query block (rows: key blocks j, columns: query blocks i;
    blank where a block does not visit). order "ascending": j = 0 first (stage 16 without a
    mask); "descending": the block that starts at i first, then i - 1, ... (stage 16 causal).
    Default: the order stage 16 takes for the mask."""
    order = order or ("descending" if causal else "ascending")
    t = pd.DataFrame(index=pd.Index(range(nq), name="key block j"),
                     columns=pd.Index(range(nq), name="query block i"), dtype=object)
    for j in range(nq):
        for i in range(j if causal else 0, nq):
            t.loc[j, i] = i - j if order == "descending" else j
    return t.fillna("")


def _walk(nq, causal, order, hold=0.0):
    """When each key block passes the turn at each query block: every block starts at time 0,
    computes a query block in 1 unit, then waits for the block ahead of it in turn to pass, adds
    its share and waits for its adds to land (`hold` units, holding the turn), passes the turn
    and goes on to its next query block. Returns ({(j, i): time the turn passes}, visits)."""
    visits = {j: list(range(j if causal else 0, nq)) for j in range(nq)}
    ahead = {}
    for i in range(nq):
        seq = sorted((j for j in range(nq) if i in visits[j]),
                     key=lambda j: (i - j) if order == "descending" else j)
        ahead.update({(b, i): a for a, b in zip(seq, seq[1:])})
    passed = {}

    def at(j, n):  # the time block j passes the turn at its n-th query block
        i = visits[j][n]
        if (j, i) not in passed:
            ready = (at(j, n - 1) if n else 0.0) + 1.0
            a = ahead.get((j, i))
            if a is not None:
                ready = max(ready, at(a, visits[a].index(i)))
            passed[(j, i)] = ready + hold
        return passed[(j, i)]

    for j in range(nq):
        at(j, len(visits[j]) - 1)
    return passed, visits


def idle(nq=64, causal=True, hold=0.0) -> pd.DataFrame:
    """The model's cost of the turns for one head of `nq` key blocks (and as many query blocks),
    in both orders (_walk; `hold`: the add and its fence, as a share of a query block's work):
    the units of work, the units the blocks spend waiting for their turn or their adds (holding
    their place on an SM), and work / (work + waiting): the speed left when every place on the
    SMs is taken, as at large N."""
    rows = {}
    for order in ("ascending", "descending"):
        passed, visits = _walk(nq, causal, order, hold)
        work = sum(len(v) for v in visits.values())
        busy = sum(max(passed[(j, i)] for i in visits[j]) for j in range(nq))
        rows[order] = {"work": work, "waiting": busy - work, "speed left": work / busy}
    return pd.DataFrame(rows).T.rename_axis("turn order" + (", causal" if causal else ""))


def figure(nq=8):
    """Causal, one head: the time at which each key block passes the turn at each query block
    (_walk, adds taking no time), with turns in launch order (ascending) and in arrival order
    (descending, stage 16)."""
    fig = Figure(figsize=(12, 5.4))
    for k, order in enumerate(("ascending", "descending")):
        done, visits = _walk(nq, True, order)
        grid = np.full((nq, nq), np.nan)
        for (j, i), s in done.items():
            grid[j, i] = s
        done = {key: int(round(s)) for key, s in done.items()}
        ax = fig.add_subplot(1, 2, k + 1)
        ax.imshow(grid, cmap="Blues", vmin=0, vmax=2 * nq)
        for (j, i), s in done.items():
            first = i == visits[j][0]
            ax.text(i, j, str(s), ha="center", va="center", fontsize=TEXT,
                    weight="bold" if first else "normal")
        busy = sum(max(done[(j, i)] for i in visits[j]) for j in range(nq))
        work = sum(len(v) for v in visits.values())
        ax.set_title(f"turns {order}: {busy - work} block-steps waiting", fontsize=TITLE - 2)
        ax.set_xlabel("query block i", fontsize=LABEL)
        ax.set_ylabel("key block j", fontsize=LABEL)
        ax.set_xticks(range(nq))
        ax.set_yticks(range(nq))
    fig.suptitle("The step at which key block j adds its share of dQ_i (causal; bold: its first)",
                 fontsize=TITLE)
    fig.tight_layout()
    return fig
