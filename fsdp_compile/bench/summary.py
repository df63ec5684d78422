"""One table over several bench runs (the rows of ``benchmarks/gpu_rows.sh``): each mode of a
run against the same run's FSDP2 + per-block compile, as issue #36 states its targets: step
ratio = mode median / fsdp2-compile median (below 1: faster), and likewise for peak memory,
memory held between steps and the first step's warm-up.

    python -m fsdp_compile.bench.summary OUT 8b=0 70b=124 mixtral=not-started

reads ``OUT/<row>.json`` (the bench's ``--json``, written after each mode, so a run killed in
its last mode keeps the others) with each row's exit status, or why it never started; prints
the table, a line for each mode that did not finish and why, and writes ``OUT/summary.json``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from fsdp_compile.bench.report import attention_summary

BASELINE = "fsdp2-compile"

# What timeout(1) and the kernel say when a row ends early.
_EXIT_MEANINGS = {124: "timed out", 137: "killed (past the time limit's grace, or out of memory)"}


def status_text(status: int | str) -> str:
    """A row's exit status for a reader: "ok", what a known status means, or the text given."""
    if status == 0:
        return "ok"
    if isinstance(status, int):
        return f"exit {status}" + (f", {_EXIT_MEANINGS[status]}" if status in _EXIT_MEANINGS else "")
    return status


def _ratio(value: float | None, base: float | None) -> float | None:
    return value / base if value is not None and base else None


def summary_rows(runs: dict[str, tuple[dict | None, int | str]]) -> list[dict]:
    """One entry per mode of each run, in the run's order: ``runs`` maps a row's name to its
    bench document (None when it wrote none) and exit status. A mode the run listed but did
    not finish, or skipped, is an entry with its reason in ``status`` and no numbers."""
    rows = []
    for name, (document, status) in runs.items():
        if document is None:
            rows.append({"row": name, "mode": "all", "status": f"no results: {status_text(status)}"})
            continue
        results = {r["mode"]: r for r in document["results"]}
        base = results.get(BASELINE, {})
        for mode in document["config"]["modes"].split(","):
            if mode in document["skipped"]:
                rows.append({"row": name, "mode": mode, "status": f"skipped: {document['skipped'][mode]}"})
                continue
            r = results.get(mode)
            if r is None:
                rows.append({"row": name, "mode": mode, "status": f"not finished: {status_text(status)}"})
                continue
            kernels = r.get("profiled_kernels")
            rows.append({
                "row": name,
                "mode": mode,
                "status": "ok",
                "median_step_ms": r["median_step_ms"],
                "step_ratio": _ratio(r["median_step_ms"], base.get("median_step_ms")),
                "peak_mib": r["peak_memory_mib"],
                "peak_ratio": _ratio(r["peak_memory_mib"], base.get("peak_memory_mib")),
                "held_mib": r["held_memory_mib"],
                "held_ratio": _ratio(r["held_memory_mib"], base.get("held_memory_mib")),
                "held_reserved_mib": r["held_reserved_mib"],
                "warmup_s": r["warmup_s"],
                "warmup_ratio": _ratio(r["warmup_s"], base.get("warmup_s")),
                "kernel_launches": kernels["launches"] if kernels else None,
                "attention": attention_summary(r),
            })  # fmt: skip
    return rows


_COLUMNS = (
    ("row", "<9", "row", None),
    ("mode", "<17", "mode", None),
    ("step ms", ">9", "median_step_ms", ".1f"),
    ("step x", ">7", "step_ratio", ".3f"),
    ("peak GiB", ">9", "peak_mib", "gib"),
    ("peak x", ">7", "peak_ratio", ".3f"),
    ("held GiB", ">9", "held_mib", "gib"),
    ("held x", ">7", "held_ratio", ".3f"),
    ("rsvd GiB", ">9", "held_reserved_mib", "gib"),
    ("warm-up s", ">10", "warmup_s", ".1f"),
    ("warm x", ">7", "warmup_ratio", ".2f"),
    ("kernels", ">8", "kernel_launches", "d"),
)


def _cell(value, spec: str | None) -> str:
    if value is None:
        return "-"
    if spec is None:
        return str(value)
    return format(value / 2**10, ".2f") if spec == "gib" else format(value, spec)


def format_summary(rows: list[dict]) -> str:
    """The table: a line per finished mode, its attention last; then the modes that did not
    finish, with their reason."""
    header = "".join(format(title, align) for title, align, _, _ in _COLUMNS) + "  attention (profiled step)"
    lines = [
        f"ratios (x) are each mode's number / {BASELINE}'s in the same run; held = after the last "
        "step (allocated on CUDA, resident set on CPU), rsvd = CUDA reserved then",
        header,
    ]
    for row in rows:
        if row["status"] == "ok":
            cells = (format(_cell(row[key], spec), align) for _, align, key, spec in _COLUMNS)
            lines.append("".join(cells) + "  " + row["attention"])
    lines += [f"{row['row']} {row['mode']}: {row['status']}" for row in rows if row["status"] != "ok"]
    return "\n".join(lines)


def _parsed_status(text: str) -> int | str:
    return int(text) if text.lstrip("-").isdigit() else text


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder", help="where the rows' <name>.json are; summary.json goes here")
    parser.add_argument("rows", nargs="+", help="NAME=STATUS: a row's exit status, or why it did not start")
    args = parser.parse_args(argv)
    runs = {}
    for entry in args.rows:
        name, _, status = entry.partition("=")
        path = Path(args.folder, f"{name}.json")
        runs[name] = (json.loads(path.read_text()) if path.exists() else None, _parsed_status(status))
    found = [doc["machine"] for doc, _ in runs.values() if doc]
    machines = sorted({f"{m['gpu'] or m['cpu']}, torch {m['torch']}" for m in found})
    rows = summary_rows(runs)
    print(f"\nsummary of the rows {', '.join(runs)}; machine: {'; '.join(machines) or 'none reported'}")
    print(format_summary(rows), flush=True)
    Path(args.folder, "summary.json").write_text(json.dumps(rows, indent=2) + "\n")


if __name__ == "__main__":
    main()
