"""Reading the JSON records a run or a bench writes, plain or gzip-compressed (results/ keeps the large
ones as .json.gz). No torch import: `diff` and `check` read records before anything else."""
from __future__ import annotations

import gzip
from pathlib import Path


def read_text(path: str | Path) -> str:
    """The file's text; a name ending in .gz is read through gzip."""
    p = Path(path)
    if p.suffix == ".gz":
        with gzip.open(p, "rt", encoding="utf-8") as f:
            return f.read()
    return p.read_text()
