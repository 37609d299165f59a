"""Where flashlab keeps things. FLASHLAB_DATA points data/ somewhere else (tests do); which files
lie there is flashlab.tables' business."""
import os
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
KERNELS = ROOT / "kernels"
NOTEBOOKS = ROOT / "notebooks"


def data_dir() -> Path:
    return Path(os.environ.get("FLASHLAB_DATA", ROOT / "data"))


def figures_dir() -> Path:
    return data_dir() / "figures"


def runs_dir() -> Path:
    return data_dir() / "runs"


_INCLUDED_STAGE = re.compile(r'^\s*#include\s+"(\d\d_\w+\.cu)"', re.M)


def kernel_inputs(source, folder=None) -> list:
    """Every file a stage's build reads, in a fixed order: its .cu file, the stage files it
    includes whole (`#include "13_lazy_rescale.cu"`: a later stage reusing an earlier one's
    kernel), theirs in turn, then the shared headers (*.h, *.cuh) of `folder` (default: the .cu's
    own). A digest of a build hashes all of them, so that a change to an included stage rebuilds
    the stage that includes it."""
    source = Path(source)
    folder = Path(folder) if folder is not None else source.parent
    files, todo = [], [source]
    while todo:
        path = todo.pop(0)
        if path in files or not path.exists():
            continue
        files.append(path)
        todo += [folder / name for name in _INCLUDED_STAGE.findall(path.read_text())]
    return files + sorted(folder.glob("*.h")) + sorted(folder.glob("*.cuh"))


def write_atomic(path: Path, text: str) -> None:
    """Write `text` to `path` through a temporary file beside it and os.replace: a reader (another
    process, a parallel test worker filling the same cache) finds the old file or the new one,
    never half of one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)
