"""What the Hopper stages' lesson modules share (stages 09-13: flashlab.wgmma, flashlab.tma,
flashlab.warpspec, flashlab.tma_store, flashlab.lazy_rescale): a warpgroup's shape, the 128-byte
row of the swizzle, the figures' font sizes, and the ratio of two schedules' totals. Their figures
are matplotlib Figures made without pyplot: a notebook cell that ends with one shows it once.
"""
import pandas as pd

WARPGROUP = 128   # threads that issue one wgmma together
WARP = 32
M = 64            # rows of a wgmma: 16 per warp
ROW_BYTES = 128   # bytes of one swizzled row: 64 16-bit elements
TITLE, LABEL, TEXT = 15, 12, 11                              # font sizes: slides


def gain(n_tiles, items, name, before, after) -> pd.Series:
    """before(tiles) / after(tiles), the two schedules' totals for `items` work items of n tiles
    each, per n in n_tiles (flashlab.warpspec.predicted_gain, flashlab.tma_store.store_gain)."""
    out = {n: before((n,) * items) / after((n,) * items) for n in n_tiles}
    return pd.Series(out, name=name).rename_axis("tiles per item")
