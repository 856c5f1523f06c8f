"""Where the chart is, for the chart's tests."""

from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
CHART = REPO / "charts" / "ppojob-operator"
