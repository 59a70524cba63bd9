"""`kvplan capacity --chart FILE`: the sweep as a chart, drawn with matplotlib.

One line per GPU type (per GPU and TP size in a length sweep) in each panel: KV cache
tokens, maximum concurrency and, with `--price GPU=USD/h`, KV cache tokens per dollar
an hour, against the TP size, or against max_model_len in a length sweep. Points that
do not fit are crosses on the axis, in the series' colour. matplotlib is an optional extra
(`pip install 'kvplan[chart]'`), imported here only: never on the RPC path or by the
client.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvplan.gpus import UnknownGpu, lookup_gpu

if TYPE_CHECKING:
    from matplotlib.figure import Figure

FORMATS = (".png", ".svg", ".pdf")


class ChartUnavailable(Exception):
    """matplotlib is not installed, or the file name asks for a format it cannot write."""


def check_chart_path(path: str) -> None:
    """Before the sweep runs: the format is known and matplotlib is importable."""
    if Path(path).suffix.lower() not in FORMATS:
        raise ChartUnavailable(
            f"--chart {path}: name a {', '.join(FORMATS)} file (the format follows the suffix)"
        )
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise ChartUnavailable(
            "--chart needs matplotlib: pip install 'kvplan[chart]' (make install has it)"
        ) from None


def parse_price(text: str) -> tuple[str, float]:
    """`H100=2.49`: a catalog GPU (or alias) and its price in USD per GPU-hour."""
    name, sep, amount = text.partition("=")
    if not sep or not name.strip():
        raise argparse.ArgumentTypeError(f"not GPU=USD/h: {text!r} (e.g. H100=2.49)")
    try:
        usd = float(amount.strip().removesuffix("/h").removeprefix("$"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a price in USD/h: {text!r}") from None
    if not usd > 0:
        raise argparse.ArgumentTypeError(f"a price must be > 0: {text!r}")
    try:
        gpu = lookup_gpu(name.strip()).name
    except UnknownGpu:
        gpu = name.strip()  # a size given with --gpu (96GiB) is priced by that text
    return gpu, usd


def apply_prices(
    rows: Sequence[dict[str, Any]], prices: Mapping[str, float], pipeline_parallel_size: int = 1
) -> None:
    """Add usd_per_hour (the engine's GPUs: TP x PP) and, where it fits,
    kv_tokens_per_usd_hour: the KV cache tokens each dollar an hour buys."""
    for row in rows:
        price = prices.get(row["gpu"])
        if price is None:
            continue
        row["usd_per_hour"] = round(price * row["tp"] * pipeline_parallel_size, 4)
        if row.get("status") == "ok":
            row["kv_tokens_per_usd_hour"] = round(row["kv_cache_tokens"] / row["usd_per_hour"])


def model_title(source: str) -> str:
    """The model's name: the directory of a config path, or the model id."""
    path = Path(source)
    if path.name == "config.json":
        path = path.parent
    return path.name or source


@dataclass(frozen=True)
class Series:
    label: str
    x: list[int]  # positions on the x axis (index of the TP size or length)
    y: list[float]  # the value where it fits
    no_fit_x: list[int]  # positions where it does not fit


def _length_label(value: Any) -> str:
    if value in (-1, None, "auto"):
        return "auto"
    number = int(value)
    # As vLLM reads them back: 32K = 32,768, 32k = 32,000.
    for unit, size in (("M", 1 << 20), ("K", 1 << 10), ("m", 10**6), ("k", 10**3)):
        if number >= size and number % size == 0:
            return f"{number // size}{unit}"
    return f"{number:,}"


def series_of(rows: Sequence[dict[str, Any]], key: str) -> tuple[str, list[str], list[Series]]:
    """The x axis title, its tick labels and one series per GPU (and TP in a length
    sweep) for `key`; rows the config refuses ("error") are left out."""
    length_sweep = len({row.get("requested_max_model_len") for row in rows}) > 1
    if length_sweep:
        ticks = list(dict.fromkeys(_length_label(row["requested_max_model_len"]) for row in rows))
        several_tps = len({row["tp"] for row in rows}) > 1
        x_title = "max_model_len (tokens per request)"
    else:
        ticks = [str(tp) for tp in sorted({row["tp"] for row in rows})]
        several_tps = False
        x_title = "tensor-parallel size (GPUs per engine)"
    by_label: dict[str, Series] = {}
    for row in rows:
        if row.get("status") == "error" or (
            key.startswith("kv_tokens_per") and "usd_per_hour" not in row
        ):
            continue
        label = f"{row['gpu']} TP {row['tp']}" if several_tps else row["gpu"]
        series = by_label.setdefault(label, Series(label, [], [], []))
        tick = _length_label(row["requested_max_model_len"]) if length_sweep else str(row["tp"])
        if row.get("status") == "ok":
            series.x.append(ticks.index(tick))
            series.y.append(float(row[key]))
        else:
            series.no_fit_x.append(ticks.index(tick))
    return x_title, ticks, list(by_label.values())


def _compact(value: float, _position: Any = None) -> str:
    for unit, size in (("M", 1e6), ("k", 1e3)):
        if abs(value) >= size:
            return f"{value / size:g}{unit}"
    return f"{value:g}"


PANELS = (
    ("kv_cache_tokens", "KV cache tokens per engine"),
    ("max_concurrency", "max concurrency (full-length requests)"),
)
PRICE_PANEL = ("kv_tokens_per_usd_hour", "KV cache tokens per USD/h")


def capacity_figure(rows: Sequence[dict[str, Any]], title: str, subtitle: str = "") -> Figure:
    """The chart as a matplotlib Figure (not yet saved): one panel per measure."""
    from matplotlib.figure import Figure  # the Agg canvas, no GUI backend
    from matplotlib.lines import Line2D
    from matplotlib.ticker import FuncFormatter

    panels = list(PANELS)
    if any("kv_tokens_per_usd_hour" in row for row in rows):
        panels.append(PRICE_PANEL)
    figure = Figure(figsize=(4.6 * len(panels), 4.4), dpi=100, layout="constrained")
    axes = figure.subplots(1, len(panels), squeeze=False)[0]
    figure.suptitle(f"{title}\n{subtitle}" if subtitle else title, fontsize=12)
    any_no_fit = False
    # One colour per series across panels, whichever GPUs a panel leaves out (unpriced).
    labels = [series.label for series in series_of(rows, PANELS[0][0])[2]]
    colors = {label: f"C{i % 10}" for i, label in enumerate(labels)}
    for ax, (key, label) in zip(axes, panels, strict=True):
        x_title, ticks, all_series = series_of(rows, key)
        for series in all_series:
            color = colors.get(series.label, "C9")
            # A gap where it does not fit: the line never joins points across it.
            points = dict(zip(series.x, series.y, strict=True))
            xs = sorted({*series.x, *series.no_fit_x})
            ys = [points.get(x, math.nan) for x in xs]
            ax.plot(xs, ys, marker="o", color=color, label=series.label, gid=key)
            if series.no_fit_x:
                any_no_fit = True
                # Crosses on the axis in the series' colour, nudged apart where several
                # series do not fit at one point.
                nudge = 0.08 * (labels.index(series.label) - (len(labels) - 1) / 2)
                ax.plot(
                    [x + nudge for x in series.no_fit_x],
                    [0.0] * len(series.no_fit_x),
                    linestyle="none",
                    marker="x",
                    markersize=9,
                    markeredgewidth=2.5,
                    color=color,
                    gid=f"no-fit:{series.label}",
                    clip_on=False,
                    zorder=5,
                )
        ax.set_xticks(range(len(ticks)), ticks)
        ax.set_xlim(-0.3, len(ticks) - 0.7)
        ax.set_xlabel(x_title)
        ax.set_ylabel(label)
        ax.set_ylim(bottom=0)
        ax.yaxis.set_major_formatter(FuncFormatter(_compact))
        ax.grid(True, alpha=0.3)
    handles, legend_labels = axes[0].get_legend_handles_labels()
    if any_no_fit:
        handles.append(
            Line2D([], [], linestyle="none", marker="x", color="black", markeredgewidth=2.5)
        )
        legend_labels.append("does not fit (on the axis)")
    if handles:
        columns = min(len(legend_labels), 2 * len(panels))
        figure.legend(handles, legend_labels, loc="outside lower center", ncols=columns)
    return figure


def write_chart(rows: Sequence[dict[str, Any]], path: str, title: str, subtitle: str = "") -> None:
    capacity_figure(rows, title, subtitle).savefig(path)
