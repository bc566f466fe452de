"""Draw BENCHMARKS.md's summary table as one picture: tokenmill's speed over llama.cpp's per row.

Reads the first markdown table under "## Summary" in BENCHMARKS.md (columns: instruction sets, model,
format, regime, tokenmill, llama.cpp, ratio, ...) and writes a horizontal bar chart of the ratios, a bar per
row in the table's order, blue at or above parity (the line at 1.0), red below.

    python benchmarks/summary_plot.py                      # BENCHMARKS.md -> docs/benchmarks-summary.png
    python benchmarks/summary_plot.py --out /tmp/s.png

Needs matplotlib (not a tokenmill dependency: pip install matplotlib).
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path


def summary_rows(text: str) -> list[dict[str, str]]:
    """The rows of the first table after the "## Summary" heading, as dicts keyed by its header cells."""
    body = text.split("## Summary", 1)[1]
    lines = [ln.strip() for ln in body.splitlines()]
    start = next(i for i, ln in enumerate(lines) if ln.startswith("|"))
    table = []
    for ln in lines[start:]:
        if not ln.startswith("|"):
            break
        table.append([c.strip() for c in ln.strip("|").split("|")])
    header, rows = table[0], table[2:]
    return [dict(zip(header, r)) for r in rows]


def ratio(cell: str) -> float:
    m = re.search(r"([0-9.]+)x", cell.replace("*", ""))
    if not m:
        raise ValueError(f"no ratio like 1.23x in {cell!r}")
    return float(m.group(1))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--benchmarks", type=Path, default=Path(__file__).resolve().parent.parent / "BENCHMARKS.md")
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parent.parent / "docs" / "benchmarks-summary.png")
    args = ap.parse_args()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = summary_rows(args.benchmarks.read_text())
    labels = [f"{r['model']} {r['format']}, {r['regime']} ({r['instruction sets']})" for r in rows]
    values = [ratio(r["ratio"]) for r in rows]
    fig, ax = plt.subplots(figsize=(9, 0.32 * len(rows) + 1.2))
    colors = ["#2a7ab9" if v >= 1.0 else "#c8553d" for v in values]
    ax.barh(range(len(rows)), values, color=colors)
    ax.axvline(1.0, color="black", linewidth=1)
    ax.set_yticks(range(len(rows)), labels, fontsize=8)
    ax.invert_yaxis()
    for i, v in enumerate(values):
        ax.text(v + 0.02, i, f"{v:.2f}x", va="center", fontsize=8)
    ax.set_xlabel("tokenmill / llama.cpp, same file, same threads, paired medians (higher is better)")
    ax.set_title("tokenmill against llama.cpp (BENCHMARKS.md summary)", fontsize=10)
    fig.tight_layout()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.out, dpi=110)
    print(f"wrote {args.out} ({len(rows)} rows)")


if __name__ == "__main__":
    main()
