"""Which mode a notebook runs in, and whose numbers it shows.

A notebook about one stage runs LIVE when this machine can build and run that stage (a GPU of
the compute capability the stage needs, and nvcc); otherwise it REPLAYS the numbers recorded in
data/, and says why in one line. Either way every number it shows comes from one GPU,
flashlab.tables.gpu_shown(stage): banner() names it, and the helpers below ask for it.
"""
import contextlib
from typing import NamedTuple

from .. import tables
from ..env import environment
from ..stages import stage as _stage
from ..tables import NotRecorded

_VIEW = {"stage": None}  # the stage of the notebook being run (banner() sets it)


def stage():
    """The stage this notebook is about (None for a notebook about no one stage)."""
    return _VIEW["stage"]


def live() -> bool:
    return tables.live(stage())


def gpu():
    """The GPU whose numbers this notebook shows."""
    return tables.gpu_shown(stage())


def banner(stage_key=None):
    """Start a notebook: decide whether it runs live or replays (for `stage_key`'s notebook, by
    what that stage needs), and print one line saying which, on which GPU, and why."""
    st = _stage(stage_key) if stage_key is not None else None
    _VIEW["stage"] = st
    if tables.live(st):
        env = environment()
        print(f"LIVE on {env['gpu']} (compute capability {env['compute_capability']}), torch "
              f"{env['torch']}, CUDA {env['cuda']}, commit {env['commit']}.\n"
              f"Measurements below are taken now and written to {tables.RESULTS.path()}.")
        for dt, why in (st.unavailable_dtypes() if st is not None else {}).items():
            print(f"{why}: {dt} is not run here.")  # stage 04 on a T4: bf16
        return
    why = st.unavailable() if st is not None else "no CUDA GPU here"
    print(f"REPLAY ({why}): the numbers below were recorded in {tables.RESULTS.path()}, "
          f"measured on {tables.provenance(gpu=gpu())}.")


def not_recorded(name, what="", flags="") -> NotRecorded:
    """The error for numbers of `name` (a stage or baseline) not recorded on this notebook's GPU:
    "05_mma: not recorded yet on <gpu>: run `flashlab run --stage 05`"."""
    return tables.not_recorded(name, what, flags, gpu=gpu())


def _missing(err, missing_ok, fallback):
    """What a helper with `missing_ok` does about NotRecorded `err`: raise it, or print it and
    give `fallback` (the cell-wide alternative is unless_missing)."""
    if not missing_ok:
        raise err
    print(err)
    return fallback


@contextlib.contextmanager
def unless_missing():
    """`with nb.unless_missing():` runs a cell's measured part, or, where a stage has not been
    recorded yet, prints what to run instead of a traceback."""
    try:
        yield
    except NotRecorded as err:
        print(err)


class GPU(NamedTuple):
    """The GPU a notebook's numbers are about (see the_gpu)."""
    name: str
    cc: str     # compute capability, "9.0"
    sms: int
    roof: dict  # its ceilings as flashlab.peaks measured them: {metric: value} ({} if none)

    def __str__(self):
        roof = ", ".join(f"{k} = {v:.1f}" for k, v in self.roof.items()) or "none recorded"
        return f"{self.name}: compute capability {self.cc}, {self.sms} SMs; measured ceilings: {roof}"


def the_gpu() -> GPU:
    """The GPU this notebook shows: compute capability, SMs (an H100's 132 for a name
    flashlab.tiling does not know) and its own measured ceilings (never another GPU's)."""
    from .. import tiling
    name = gpu()
    if live():
        cc = environment()["compute_capability"]
    else:
        rows = tables.recorded(gpu=name)
        if rows.empty:
            raise NotRecorded("nothing recorded yet: run `flashlab run` on a GPU")
        cc = rows.sort_values("time")["compute_capability"].iloc[-1]
    return GPU(name, str(cc), tiling.sm_count(name) or 132, tables.peaks(name))
