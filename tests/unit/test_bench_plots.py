"""The benchmarks without their plotting extra: the tables and results of a run are what it
measured, with no figure, and the run ends normally (it used to end in an ImportError)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from ops.bench import common


def test_without_matplotlib_the_plotting_code_runs_and_only_the_results_are_written(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # (an import of it raises ImportError)
    monkeypatch.setattr(common, "RESULTS", tmp_path)
    plt = common.pyplot()
    # what the benchmarks' plotting does
    figure, axes = plt.subplots(figsize=(8, 4))
    axes.bar(["a", "b"], [1.0, 2.0], yerr=[[0.1, 0.1], [0.2, 0.2]], capsize=4)
    axes[0].set_title("x")
    figure.tight_layout()

    json_path, png_path = common.write_results("demo", {"ratio": 1.5}, figure)

    assert json.loads(json_path.read_text()) == {"ratio": 1.5}
    assert not png_path.exists()
