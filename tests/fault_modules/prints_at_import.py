"""A module that prints at import without a newline."""

import sys
from pathlib import Path

sys.stdout.write("loading...")
sys.stdout.flush()
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from scale_workloads import train  # noqa: E402,F401
