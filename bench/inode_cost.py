"""What a new directory and a new file cost on this machine's file system, and how much more
they cost right after many inodes were freed.

    python bench/inode_cost.py [--dir /tmp] [--pairs 1000] [--freed 10000] [--settle 35]

Each job of the embedded worker makes a few inodes (bench/e2e.py's docstring names them).
On ext4 without a journal, the kernel's allocator skips inodes freed within the last
~30 s (vm.dirty_expire_centisecs) so that an unwritten deletion cannot be undone by a
crash, and reads their inode table to tell: right after a big tree was removed, each new
inode costs several times more CPU. Rows (CPU of this process per directory + file in it,
median of --repeat samples): before anything was freed in this invocation, right after
freeing --freed inodes (directories), and --settle seconds after that.

Prints a Markdown table; asserts nothing.
"""

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time


def pairs_cost(parent: str, pairs: int) -> float:
    """CPU microseconds per mkdir + create of a file in it, in a new directory under `parent`."""
    base = tempfile.mkdtemp(dir=parent, prefix="inode-cost-")
    try:
        started = time.process_time()
        for i in range(pairs):
            directory = os.path.join(base, str(i))
            os.mkdir(directory, 0o700)
            os.close(os.open(os.path.join(directory, "f"), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
        return (time.process_time() - started) / pairs * 1e6
    finally:
        shutil.rmtree(base, ignore_errors=True)


def free(parent: str, count: int) -> None:
    base = tempfile.mkdtemp(dir=parent, prefix="inode-freed-")
    for i in range(count):
        os.mkdir(os.path.join(base, str(i)))
    shutil.rmtree(base)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dir", default=tempfile.gettempdir(), help="where to make them (default: the temp dir)")
    parser.add_argument("--pairs", type=int, default=1000)
    parser.add_argument("--freed", type=int, default=10000)
    parser.add_argument("--settle", type=float, default=35.0)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    rows = []
    # Each sample frees its own pairs as it ends: the first is taken before, the rest follow it.
    quiet = [pairs_cost(args.dir, args.pairs)]
    free(args.dir, args.freed)
    right_after = [pairs_cost(args.dir, args.pairs) for _ in range(args.repeat)]
    time.sleep(args.settle)
    settled = [pairs_cost(args.dir, args.pairs)]
    rows = [("first sample of this invocation", quiet), (f"right after freeing {args.freed:,}", right_after),
            (f"{args.settle:.0f} s after that", settled)]
    print(f"`{' '.join(['python', 'bench/inode_cost.py', *sys.argv[1:]])}` — {args.dir}, {args.pairs:,} pairs a sample")
    print()
    print("| when | CPU µs per new directory + file (samples) | median |")
    print("| --- | --- | ---: |")
    for label, samples in rows:
        print(f"| {label} | {' / '.join(f'{s:.0f}' for s in samples)} | {statistics.median(samples):.0f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
