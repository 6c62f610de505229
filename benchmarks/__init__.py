"""stagebuf's benchmark harness: not part of the installed package.

``python -m benchmarks`` times stagebuf against the designs in
:mod:`benchmarks.baselines`; ``workloads`` holds the three workloads (micro,
decode loop, staged-write sweep) and ``bench`` the runner, the targets, the
report and the plot. Needs ``requirements/bench.txt`` (``bash scripts/setup.sh bench``).
"""
