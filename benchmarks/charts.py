"""Charts of a benchmark report (the JSON that ``./dev bench --json PATH`` writes).

- ``./dev bench --plot PATH`` draws the run it just made as one PNG.
- ``python -m benchmarks.charts`` redraws the charts of the docs (``docs/assets/bench-*.svg``)
  from the committed report ``docs/assets/bench-reference.json``; the test suite checks that
  the committed SVGs are what this draws, byte for byte.
- ``python -m benchmarks.charts REPORT --engine PNG`` draws ``./dev bench --engine``'s report
  (its ``--json``): each method's fastest update against the density, per engine and link.

Two charts per report: the time of one round per method against the density (both axes
logarithmic; a bar from the fastest to the slowest round where the report has them), and the
peak extra memory per changed element, for the methods that allocate anything.
"""

from __future__ import annotations

import argparse
import io
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
REFERENCE = ROOT / "docs" / "assets" / "bench-reference.json"
ASSETS = ROOT / "docs" / "assets"

# One colour and marker per method, the same in every chart.
STYLE: dict[str, tuple[str, str]] = {
    "baseline": ("#c0392b", "o"),
    "patchctx": ("#e67e22", "s"),
    "patchctx+routes": ("#2471a3", "D"),
    "lower-bound": ("#7f8c8d", "v"),
    "dense-reload": ("#27ae60", "^"),
}
RECORDING = "route recording (1st round)"


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")  # no display, no GUI toolkit
    import matplotlib.pyplot as plt

    plt.rcParams.update(
        {
            "svg.fonttype": "none",  # text stays text: small files, the page's own font
            "svg.hashsalt": "patchctx",  # stable element ids, so a redraw is byte-identical
            "font.size": 9,
            "axes.spines.top": False,
            "axes.spines.right": False,
        }
    )
    return plt


def _series(
    rows: Iterable[Mapping[str, Any]], dtype: str, method: str, value: str
) -> list[Mapping[str, Any]]:
    """The rows of one method and dtype that have `value`, by increasing density."""
    picked = [
        row
        for row in rows
        if row["dtype"] == dtype and row["method"] == method and row.get(value) is not None
    ]
    return sorted(picked, key=lambda row: float(row["density"]))


def _densities(rows: Iterable[Mapping[str, Any]], dtype: str) -> list[float]:
    return [100 * float(row["density"]) for row in rows if row["dtype"] == dtype]


def _dtypes(rows: Iterable[Mapping[str, Any]]) -> list[str]:
    return list(dict.fromkeys(row["dtype"] for row in rows))


def _log_axes(axes: Any, densities: Iterable[float]) -> None:
    """Both axes logarithmic, ticks as plain numbers, one x tick per density measured."""
    from matplotlib.ticker import FuncFormatter, NullLocator

    axes.set_xscale("log")
    axes.set_yscale("log")
    ticks = sorted(set(densities))
    axes.set_xticks(ticks, [f"{tick:.3g}%" for tick in ticks])
    axes.xaxis.set_minor_locator(NullLocator())
    axes.yaxis.set_major_formatter(FuncFormatter(lambda value, _: f"{value:g}"))
    axes.set_xlabel("changed elements")
    axes.grid(True, which="major", alpha=0.3)


def _time_panel(axes: Any, rows: list[Mapping[str, Any]], dtype: str) -> None:
    for method, (colour, marker) in STYLE.items():
        series = _series(rows, dtype, method, "median_ms")
        if not series:
            continue
        x = [100 * float(row["density"]) for row in series]
        y = [float(row["median_ms"]) for row in series]
        axes.plot(x, y, color=colour, marker=marker, markersize=4, linewidth=1.4, label=method)
        if all(row.get("min_ms") is not None for row in series):
            low = [m - float(row["min_ms"]) for m, row in zip(y, series, strict=True)]
            high = [float(row["max_ms"]) - m for m, row in zip(y, series, strict=True)]
            axes.errorbar(x, y, yerr=[low, high], fmt="none", ecolor=colour, capsize=2, lw=0.8)
    _log_axes(axes, _densities(rows, dtype))
    axes.set_title(f"{dtype}: time of one round")
    axes.set_ylabel("ms (log scale)")


def _memory_panel(axes: Any, rows: list[Mapping[str, Any]], dtype: str) -> None:
    for method, (colour, marker) in STYLE.items():
        series = [
            row
            for row in _series(rows, dtype, method, "bytes_per_changed_element")
            if float(row["bytes_per_changed_element"]) > 0  # nothing allocated: no point
        ]
        if not series:
            continue
        x = [100 * float(row["density"]) for row in series]
        y = [float(row["bytes_per_changed_element"]) for row in series]
        axes.plot(x, y, color=colour, marker=marker, markersize=4, linewidth=1.4, label=method)
    _log_axes(axes, _densities(rows, dtype))
    axes.set_title(f"{dtype}: peak extra memory")
    axes.set_ylabel("bytes per changed element (log)")


def _figure(report: Mapping[str, Any], panel: Any, rows_of_panels: int = 1) -> Any:
    plt = _pyplot()
    rows = [row for row in report["rows"] if row["method"] != RECORDING]
    dtypes = _dtypes(rows)
    figure, axes = plt.subplots(
        rows_of_panels,
        len(dtypes),
        figsize=(4.0 * len(dtypes), 3.3 * rows_of_panels),
        squeeze=False,
        layout="constrained",
    )
    for column, dtype in enumerate(dtypes):
        panel(axes[:, column], rows, dtype)
    handles, labels = axes[0][0].get_legend_handles_labels()
    figure.legend(handles, labels, loc="outside lower center", ncols=len(labels), frameon=False)
    return figure


def time_chart(report: Mapping[str, Any]) -> Any:
    """Median time of a round per method and density (min-max bars), one panel per dtype."""
    return _figure(report, lambda axes, rows, dtype: _time_panel(axes[0], rows, dtype))


def memory_chart(report: Mapping[str, Any]) -> Any:
    """Peak extra memory per changed element per method and density, one panel per dtype."""
    return _figure(report, lambda axes, rows, dtype: _memory_panel(axes[0], rows, dtype))


def bench_png(report: Mapping[str, Any], path: Path) -> None:
    """Both charts in one PNG: times on top, memory below (``./dev bench --plot``)."""

    def both(axes: Any, rows: list[Mapping[str, Any]], dtype: str) -> None:
        _time_panel(axes[0], rows, dtype)
        _memory_panel(axes[1], rows, dtype)

    figure = _figure(report, both, rows_of_panels=2)
    settings = report["settings"]
    figure.suptitle(
        f"patchctx benchmark: hidden {settings['hidden']}, {settings['device']}, "
        f"{settings['repeats']} rounds"
    )
    figure.savefig(path, dpi=120)
    _pyplot().close(figure)


ENGINE_STYLE: dict[str, tuple[str, str]] = {
    "patchctx": ("#e67e22", "s"),
    "patchctx sparse": ("#2471a3", "D"),
    "patchctx dense": ("#8e44ad", "o"),
    "vllm reload": ("#27ae60", "^"),
}


def engine_png(report: Mapping[str, Any], path: Path) -> None:
    """``./dev bench --engine``'s report as one PNG: the fastest update per method against
    the density, one panel per engine (TP) and link, both axes logarithmic."""
    plt = _pyplot()
    rows = [row for row in report["rows"] if "failed" not in row]
    panels = list(dict.fromkeys((row["tp"], row["link"]) for row in rows))
    figure, axes = plt.subplots(
        1, len(panels), figsize=(3.6 * len(panels), 3.4), squeeze=False, layout="constrained"
    )
    for panel, (tp, link) in zip(axes[0], panels, strict=True):
        mine = [row for row in rows if (row["tp"], row["link"]) == (tp, link)]
        for method, (colour, marker) in ENGINE_STYLE.items():
            series = sorted(
                (row for row in mine if row["method"] == method), key=lambda r: r["density"]
            )
            panel.plot(
                [100 * row["density"] for row in series],
                [row["total_ms"][0] for row in series],
                color=colour,
                marker=marker,
                label=method,
            )
        _log_axes(panel, [100 * row["density"] for row in mine])
        name = "shm" if link <= 0 else f"{link * 8 / 1e9:g} Gb/s (simulated)"
        panel.set_title(f"TP={tp}, {name}")
        panel.set_xlabel("density (%)")
        panel.set_ylabel("update, end to end (ms, fastest)")
    axes[0][0].legend(fontsize=7)
    figure.suptitle(f"patchctx against vLLM's reload: {report['model']}", fontsize=8)
    figure.savefig(path, dpi=120)
    plt.close(figure)


def svg_bytes(figure: Any) -> bytes:
    """`figure` as an SVG whose bytes depend on the data only (no date, stable ids)."""
    buffer = io.BytesIO()
    figure.savefig(buffer, format="svg", metadata={"Date": None, "Creator": None})
    _pyplot().close(figure)
    return buffer.getvalue()


def docs_charts(report: Mapping[str, Any]) -> dict[str, bytes]:
    """File name -> SVG, the charts of the docs' Routes and performance page."""
    return {
        "bench-time.svg": svg_bytes(time_chart(report)),
        "bench-memory.svg": svg_bytes(memory_chart(report)),
    }


def main(argv: list[str] | None = None) -> int:
    cli = argparse.ArgumentParser(
        description="Redraw the docs' benchmark charts from a benchmark report.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    cli.add_argument("report", nargs="?", type=Path, default=REFERENCE, help="the JSON report")
    cli.add_argument("--out", type=Path, default=ASSETS, help="folder for the SVG files")
    cli.add_argument(
        "--engine",
        type=Path,
        metavar="PNG",
        help="the report is ./dev bench --engine's (--json): draw it here instead",
    )
    args = cli.parse_args(argv)
    import json

    report = json.loads(args.report.read_text())
    if args.engine is not None:
        engine_png(report, args.engine)
        print(f"wrote {args.engine}")
        return 0
    for name, data in docs_charts(report).items():
        (args.out / name).write_bytes(data)
        print(f"wrote {args.out / name}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
