"""Makes the shared helpers of tests/models (train_helpers) importable from every room's tests."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
