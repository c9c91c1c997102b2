"""Kept for old invocations: the offline comparison is now ``tandem bench compare``
(server/bench_compare.py; ``make bench``). Arguments are passed through.

    python benchmarks/offline_throughput.py --quick
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from server.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(["bench", "compare", *sys.argv[1:]]))
