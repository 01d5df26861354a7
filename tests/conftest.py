import sys
from pathlib import Path

# The tests' shared helpers (golden_replay) live beside them.
sys.path.insert(0, str(Path(__file__).resolve().parent))
