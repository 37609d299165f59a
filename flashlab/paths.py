"""Where flashlab keeps things. FLASHLAB_DATA points data/ somewhere else (tests do); which files
lie there is flashlab.tables' business."""
import os
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


def write_atomic(path: Path, text: str) -> None:
    """Write `text` to `path` through a temporary file beside it and os.replace: a reader (another
    process, a parallel test worker filling the same cache) finds the old file or the new one,
    never half of one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)
