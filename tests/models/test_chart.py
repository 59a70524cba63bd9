"""`kvplan capacity --chart`: the series drawn are the sweep's rows; the PNG decodes."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import matplotlib.image as matplotlib_image  # the [chart] extra: make install has it
import pytest

from kvplan.cli import main
from kvplan.models.chart import capacity_figure

MODELS = Path(__file__).parents[2] / "examples" / "models"


def _lines(figure: Any, gid: str) -> dict[str, tuple[list[float], list[float]]]:
    """label -> (x, y) of every line drawn for `gid` (a row key or no-fit:LABEL)."""
    return {
        line.get_label(): (list(line.get_xdata()), list(line.get_ydata()))
        for ax in figure.axes
        for line in ax.get_lines()
        if line.get_gid() == gid
    }


def test_tp_sweep_chart_with_prices(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    chart = tmp_path / "capacity.png"
    args = ["capacity", "--model", str(MODELS / "llama-3.1-8b"), "--gpu", "H100,L4"]
    # 16K: at 32K one request outgrows what an L4 (22.05 GiB) leaves at TP 1.
    args += ["--tp", "1,2,4", "--max-model-len", "16K", "--price", "H100=2.5", "--json"]
    assert main([*args, "--chart", str(chart)]) == 0
    rows = json.loads(capsys.readouterr().out)
    # An engine of TP 4 costs 4 GPUs: tokens per USD/h = tokens / (price x TP).
    h100_tp4 = rows[2]
    assert (h100_tp4["gpu"], h100_tp4["tp"], h100_tp4["usd_per_hour"]) == ("H100-80GB", 4, 10.0)
    assert h100_tp4["kv_tokens_per_usd_hour"] == round(h100_tp4["kv_cache_tokens"] / 10.0)
    assert "usd_per_hour" not in rows[3]  # L4 is not priced
    # The PNG the command wrote decodes, at the figure's size: three panels, 100 dpi.
    image = matplotlib_image.imread(str(chart))
    assert image.shape[:2] == (440, 1380)

    figure = capacity_figure(rows, "llama-3.1-8b")
    assert figure.get_suptitle() == "llama-3.1-8b"
    tokens = _lines(figure, "kv_cache_tokens")
    assert set(tokens) == {"H100-80GB", "L4-24GB"}
    for gpu, (xs, ys) in tokens.items():
        assert xs == [0, 1, 2]  # TP 1, 2, 4 at evenly spaced ticks
        assert ys == [row["kv_cache_tokens"] for row in rows if row["gpu"] == gpu]
    concurrency = _lines(figure, "max_concurrency")
    assert concurrency["H100-80GB"][1] == [row["max_concurrency"] for row in rows[:3]]
    priced = _lines(figure, "kv_tokens_per_usd_hour")
    assert list(priced) == ["H100-80GB"]
    assert priced["H100-80GB"][1] == [row["kv_tokens_per_usd_hour"] for row in rows[:3]]
    ax = figure.axes[0]
    assert [tick.get_text() for tick in ax.get_xticklabels()] == ["1", "2", "4"]
    assert ax.get_xlabel().startswith("tensor-parallel size")
    assert "tokens" in ax.get_ylabel() and "USD/h" in figure.axes[2].get_ylabel()


def test_length_sweep_chart_marks_points_that_do_not_fit(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    chart = tmp_path / "lengths.png"
    args = ["capacity", "--model", str(MODELS / "qwen3-8b"), "--gpu", "L4", "--tp", "1"]
    args += ["--max-model-len", "8K,32K,auto", "--json", "--chart", str(chart)]
    assert main(args) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [row["status"] for row in rows] == ["ok", "does not fit", "ok"]
    # The longest length that fits where 32K does not: what auto chose.
    assert rows[1]["fits_max_model_len"] == rows[2]["max_model_len"]
    assert 8_192 < rows[2]["max_model_len"] < 32_768
    image = matplotlib_image.imread(str(chart))
    assert image.shape[:2] == (440, 920)  # two panels: no prices
    figure = capacity_figure(rows, "qwen3-8b")
    xs, ys = _lines(figure, "kv_cache_tokens")["L4-24GB"]
    # No line across 32k: it does not fit there; a cross on the axis marks it.
    assert xs == [0, 1, 2] and math.isnan(ys[1])
    assert [ys[0], ys[2]] == [rows[0]["kv_cache_tokens"], rows[2]["kv_cache_tokens"]]
    crosses: Any = [
        line for line in figure.axes[0].get_lines() if line.get_gid() == "no-fit:L4-24GB"
    ]
    assert len(crosses) == 1 and list(crosses[0].get_ydata()) == [0.0]
    assert round(float(crosses[0].get_xdata()[0])) == 1  # at 32k, nudged off its neighbours
    labels = [tick.get_text() for tick in figure.axes[0].get_xticklabels()]
    assert labels == ["8K", "32K", "auto"]
    assert figure.axes[0].get_xlabel().startswith("max_model_len")


def test_chart_and_price_errors_before_the_sweep(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = ["capacity", "--model", str(MODELS / "qwen3-8b"), "--gpu", "L4", "--tp", "1"]
    assert main([*args, "--chart", str(tmp_path / "chart.gif")]) == 2
    assert "name a .png, .svg, .pdf file" in capsys.readouterr().err
    assert main([*args, "--price", "H100=2"]) == 2
    assert "--price H100-80GB: not among --gpu L4" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main([*args, "--price", "H100"])
    assert "not GPU=USD/h" in capsys.readouterr().err


def test_without_matplotlib_only_chart_needs_it(tmp_path: Path) -> None:
    # The [chart] extra is optional: a process where matplotlib cannot be imported
    # plans and sweeps; --chart says what to install before the sweep runs; the server
    # and the client never import it.
    import subprocess
    import sys

    model = str(MODELS / "llama-3.1-8b")
    script = (
        "import sys\n"
        "sys.modules['matplotlib'] = None  # an import of it now raises ImportError\n"
        "import kvplan.server.main, client, kvplan.cli\n"
        "from kvplan.cli import main\n"
        f"sweep = ['capacity', '--model', {model!r}, '--gpu', 'H100', '--tp', '1', '--json']\n"
        "assert main(sweep) == 0\n"
        f"assert main([*sweep, '--chart', {str(tmp_path / 'c.png')!r}]) == 2\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert "--chart needs matplotlib: pip install 'kvplan[chart]'" in done.stderr
    assert not (tmp_path / "c.png").exists()
    clean = "import sys, kvplan.server.main, client, kvplan.cli\n"
    clean += "kvplan.cli.build_parser()\nassert 'matplotlib' not in sys.modules\n"
    assert subprocess.run([sys.executable, "-c", clean]).returncode == 0
