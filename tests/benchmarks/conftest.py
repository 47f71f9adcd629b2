import sys
from pathlib import Path

# The benchmark scripts import their shared module (exp_common) by name, as they do when run from benchmarks/.
BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
if str(BENCHMARKS) not in sys.path:
    sys.path.insert(0, str(BENCHMARKS))
