"""The benchmarks are scripts in bench/, not a package: put that folder on the import path."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "bench"))
