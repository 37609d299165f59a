"""Stage 08's autotune (flashlab.autotune): `flashlab tune` under its old name.

    python tools/tune08.py            # on the GPU: measure, record data/tune08.csv
    python tools/tune08.py --apply    # anywhere: rewrite pick() from data/tune08.csv
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from flashlab.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(["tune", *sys.argv[1:]]))
