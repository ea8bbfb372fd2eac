"""Long-run check: 10,000 inferences on one engine; prints the CPU line (cpu_info.py), then resident memory, open
file descriptors and OS threads every 1,000, and the growth after warm-up (the bound docs/reliability.md states:
RSS growth < 5 MiB, no fd or thread growth).

    .venv/bin/python benchmarks/longrun.py [--runs 10000] [--plan kiln|tuned]
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from cpu_info import cpu_line  # noqa: E402  (benchmarks/, the script's folder)


def rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2 ** 20


def os_threads() -> int:
    with open("/proc/self/status") as f:
        return int(next(line for line in f if line.startswith("Threads:")).split()[1])


def main(argv=None) -> int:
    import kiln
    from tests.reliability.test_concurrency import cnn

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", type=int, default=10000)
    p.add_argument("--plan", choices=["kiln", "tuned"], default="kiln")
    args = p.parse_args(argv)
    print(cpu_line(), flush=True)
    engine = kiln.build(cnn(), autotune=args.plan == "tuned", avg_timing=1, min_timing=1)
    ctx = engine.create_execution_context()
    rng = np.random.default_rng(0)
    feeds = [{"x": rng.standard_normal((1, 3, 16, 16)).astype(np.float32)} for _ in range(8)]
    for f in feeds * 25:   # warm-up: allocator pools, library thread pools
        ctx.execute(f)
    base = (rss_mib(), len(os.listdir("/proc/self/fd")), os_threads())
    print(f"plan={args.plan} layers={len(engine.plan.layers)}; after warm-up: RSS {base[0]:.1f} MiB, "
          f"fds {base[1]}, threads {base[2]}")
    print(f"{'runs':>7} {'RSS MiB':>9} {'fds':>5} {'threads':>8}")
    for i in range(1, args.runs + 1):
        ctx.execute(feeds[i % len(feeds)])
        if i % 1000 == 0:
            print(f"{i:>7} {rss_mib():>9.1f} {len(os.listdir('/proc/self/fd')):>5} {os_threads():>8}")
    end = (rss_mib(), len(os.listdir("/proc/self/fd")), os_threads())
    grew = end[0] - base[0]
    print(f"growth after warm-up: RSS {grew:+.2f} MiB, fds {end[1] - base[1]:+d}, threads {end[2] - base[2]:+d}")
    ok = grew < 5.0 and end[1] <= base[1] and end[2] <= base[2]
    print("PASS" if ok else "FAIL", "(bound: RSS growth < 5 MiB, no fd or thread growth)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
