"""End-to-end benchmark grid: `python bench/bench_e2e.py --out DIR [--quick]` (same as `dpara-rt bench`)."""
import sys

from dpara_rt.tools.bench_e2e import main

if __name__ == "__main__":
    sys.exit(main())
