"""Throughput of the live log path: LogMux vs raw writes vs Rich, into /dev/null.

4 tasks x N lines of ~60 bytes, cut into 64 KiB chunks at arbitrary byte
boundaries (as `recv(65536)` would), fed from one thread per task.

    python benchmarks/log_throughput.py [--lines N] [--smoke]
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from tfcluster.watch.logmux import LogMux  # noqa: E402

KEYS = ("chief:0", "ps:0", "worker:0", "worker:1")
CHUNK = 65536
RICH_LINES = 20_000


def task_output(key: str, lines: int) -> bytes:
    return "".join(
        f"{key} step {i:>7} loss={1 / (i + 1):.6f} acc=0.{i % 9973:04d} lr=0.001000\n"
        for i in range(lines)).encode()


def progress_output(key: str, lines: int) -> bytes:
    """The slow path: non-ASCII text, `\\r` progress updates, a newline every 10th."""
    return "".join(
        f"{key} step {i:>7} lösś={1 / (i + 1):.6f} ████▌ {i % 100:>3}%\r" + ("\n" if i % 10 == 9 else "")
        for i in range(lines)).encode()


def chunks(data: bytes) -> list[bytes]:
    return [data[i:i + CHUNK] for i in range(0, len(data), CHUNK)]


def run_threads(target, per_task: dict[str, list[bytes]]) -> float:
    threads = [threading.Thread(target=target, args=(key, parts))
               for key, parts in per_task.items()]
    start = time.perf_counter()
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    return time.perf_counter() - start


def bench_logmux(per_task: dict[str, list[bytes]], save_dir: str | None = None) -> float:
    with open(os.devnull, "wb") as devnull:
        mux = LogMux(devnull, list(per_task), color=True, save_dir=save_dir)

        def feed(key: str, parts: list[bytes]) -> None:
            for part in parts:
                mux.feed(key, part)
            mux.close_task(key)

        elapsed = run_threads(feed, per_task)
        mux.close()
    return elapsed


def bench_raw(per_task: dict[str, list[bytes]]) -> float:
    fd = os.open(os.devnull, os.O_WRONLY)
    try:
        def write(key: str, parts: list[bytes]) -> None:
            for part in parts:
                os.write(fd, part)
        return run_threads(write, per_task)
    finally:
        os.close(fd)


def bench_rich(lines: list[str]) -> float:
    from rich.console import Console  # only here: tfcluster.watch.logmux must not need it

    with open(os.devnull, "w") as devnull:
        console = Console(file=devnull)
        start = time.perf_counter()
        for line in lines:
            console.print(line, markup=False, highlight=False)
        return time.perf_counter() - start


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lines", type=int, default=200_000, help="lines per task")
    parser.add_argument("--smoke", action="store_true", help="2k lines per task (for the test suite)")
    args = parser.parse_args(argv)
    n = 2_000 if args.smoke else args.lines
    data = {key: task_output(key, n) for key in KEYS}
    per_task = {key: chunks(blob) for key, blob in data.items()}
    total = n * len(KEYS)
    size = sum(map(len, data.values())) / total

    raw = bench_raw(per_task)
    mux = bench_logmux(per_task)
    with tempfile.TemporaryDirectory() as tmp:
        saved = bench_logmux(per_task, save_dir=tmp)
    progress = {key: chunks(progress_output(key, n)) for key in KEYS}
    slow = bench_logmux(progress)
    rich_lines = [line for blob in data.values() for line in blob.decode().splitlines()][:RICH_LINES]
    rich = bench_rich(rich_lines)

    print(f"{len(KEYS)} tasks x {n} lines ({size:.0f} bytes each) in {CHUNK // 1024} KiB chunks -> /dev/null")
    print(f"  raw os.write          {total / raw:>12,.0f} lines/s")
    print(f"  LogMux                {total / mux:>12,.0f} lines/s")
    print(f"  LogMux + save_dir     {total / saved:>12,.0f} lines/s")
    print(f"  LogMux, \\r + UTF-8   {total / slow:>12,.0f} lines/s (progress bars, non-ASCII)")
    print(f"  Rich Console.print    {len(rich_lines) / rich:>12,.0f} lines/s ({len(rich_lines)} lines)")
    print(f"  LogMux/raw            {raw / mux:>12.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
