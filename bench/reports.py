"""Where benchmark reports go: under `out/` (git-ignored) unless `--out` says otherwise, so running a
benchmark never leaves files in the checkout."""

from __future__ import annotations

import json
from pathlib import Path

OUT_DIR = Path("out")


def default_report(name: str) -> str:
    """The default `--out` of benchmark `name`: out/bench-NAME.json."""
    return str(OUT_DIR / f"bench-{name}.json")


def write_report(path: str | Path, report: dict) -> Path:
    """Write `report` as JSON to `path`, creating its folder."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2, default=str))
    return path
