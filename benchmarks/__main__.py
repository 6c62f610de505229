"""``python -m benchmarks``: the bench's one entry point (needs ``requirements/bench.txt``)."""

import sys

try:
    import click  # noqa: F401
    import rich  # noqa: F401
except ImportError as e:
    print(
        f"python -m benchmarks needs requirements/bench.txt ({e.name} is missing): "
        "run `bash scripts/setup.sh bench`, then `.venv/bin/python -m benchmarks`",
        file=sys.stderr,
    )
    raise SystemExit(2) from None

from .bench import bench  # noqa: E402

bench.main(prog_name="python -m benchmarks")
