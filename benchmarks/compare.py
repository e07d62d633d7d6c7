"""Before / after: two JSON results of the same benchmark side by side (latency.py, throughput.py,
multi_lora.py, serve.py, vision.py's llava or whisper.py's rtf), with the new / old ratio of each figure.

    python benchmarks/compare.py OLD.json NEW.json

``benchmarks/h200_run.sh`` with ``BASELINE_DIR`` runs it after each benchmark it ran in both trees.
"""

from __future__ import annotations

import argparse
import json
import math
from typing import Callable, Optional

Figure = tuple[str, Callable[[dict], Optional[float]]]
"""A column: its name and how to read it from one row."""


def _get(key: str) -> Callable[[dict], Optional[float]]:
    return lambda row: row.get(key)


def _decode_ms(row: dict) -> Optional[float]:
    """Device ms per decode-graph step (multi_lora.py rows)."""
    k = (row.get("steps_by_kind") or {}).get("decode graph")
    return k["gpu_ms"] / k["steps"] if k and k["steps"] else None


def kind_of(report: dict) -> str:
    if "output_throughput" in report:
        return "serve"
    if "llava" in report:
        return "vision"
    rows = report.get("rows") or [{}]
    if "step_ms" in rows[0]:
        return "latency"
    if "num_adapters" in rows[0]:
        return "multi_lora"
    if "rtf" in rows[0]:
        return "whisper"
    return "throughput"


def keyed_rows(report: dict, kind: str) -> dict[str, dict]:
    """Rows by what identifies them across the two runs."""
    if kind == "serve":
        return {f"{report['num_prompts']} requests, rate {report['request_rate']}, "
                f"{report.get('num_clients', 1)} client(s)": report}
    if kind == "latency":
        return {f"batch {r['batch']}": r for r in report["rows"]}
    if kind == "multi_lora":
        return {f"batch {r['batch']}, {r['system'].removeprefix('chorus ')}": r
                for r in report["rows"] if r["system"].startswith("chorus")}
    if kind == "vision":
        return {f"llava, {r['requests']} requests": r for r in report["llava"]["rows"]
                if r["system"].startswith("chorus")}
    if kind == "whisper":
        return {f"{r['model']}, {r['clips']} clips": r for r in report["rows"] if r["system"] == "chorus"}
    return {r["system"]: r for r in report["rows"] if r["system"].startswith("chorus")}


FIGURES: dict[str, list[Figure]] = {
    "latency": [("step ms", _get("step_ms")), ("GPU ms", _get("gpu_ms")),
                ("x floor", _get("step_over_floor"))],
    "throughput": [("out tok/s", _get("output_tok_s")), ("seconds", _get("seconds"))],
    "multi_lora": [("out tok/s", _get("output_tok_s")), ("x base", _get("x_base")),
                   ("decode ms", _decode_ms)],
    "vision": [("out tok/s", _get("output_tok_s")), ("req/s", _get("req_s"))],
    "whisper": [("x real time", _get("rtf")), ("out tok/s", _get("out_tok_s"))],
    "serve": [("out tok/s", _get("output_throughput")), ("TTFT p50 ms", lambda r: r["ttft_ms"].get("p50")),
              ("TPOT p50 ms", lambda r: r["tpot_ms"].get("p50"))],
}


def _fmt(x: Optional[float]) -> str:
    if x is None or math.isnan(x):
        return "-"
    return f"{x:.3f}" if abs(x) < 10 else f"{x:.1f}"


def compare(old: dict, new: dict, labels: tuple[str, str] = ("old", "new")) -> list[str]:
    """The comparison table's lines (rows present in both runs)."""
    kind = kind_of(new)
    if kind_of(old) != kind:
        raise SystemExit(f"not the same benchmark: {kind_of(old)} vs {kind}")
    old_rows, new_rows = keyed_rows(old, kind), keyed_rows(new, kind)
    figures = FIGURES[kind]
    head = "".join(f"{name + ' ' + labels[0]:>18s}{name + ' ' + labels[1]:>18s}{'ratio':>7s}"
                   for name, _ in figures)
    lines = [f"{kind}: {old.get('device', '-')} ({labels[0]}) vs {new.get('device', '-')} ({labels[1]})",
             f"{'':34s}{head}"]
    for key in (k for k in new_rows if k in old_rows):
        cells = ""
        for _, read in figures:
            a, b = read(old_rows[key]), read(new_rows[key])
            ratio = b / a if a and b is not None else None
            cells += f"{_fmt(a):>18s}{_fmt(b):>18s}{_fmt(ratio):>7s}"
        lines.append(f"{key[:34]:34s}{cells}")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("old")
    ap.add_argument("new")
    ap.add_argument("--labels", default="old,new", help="column labels of the two runs")
    args = ap.parse_args()
    with open(args.old, encoding="utf-8") as f:
        old = json.load(f)
    with open(args.new, encoding="utf-8") as f:
        new = json.load(f)
    print("\n".join(compare(old, new, tuple(args.labels.split(",", 1)))))


if __name__ == "__main__":
    main()
