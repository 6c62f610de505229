"""stagebuf's benchmark harness: not part of the installed package (needs ``requirements/bench.txt``).

``python -m benchmarks`` (:mod:`benchmarks.bench`) times the micro, writes, engine and nano-vllm workloads;
:mod:`~benchmarks.e2e` runs nano-vllm's engine end to end. Tools: :mod:`~benchmarks.ab`,
:mod:`~benchmarks.compare`, :mod:`~benchmarks.kernels`, :mod:`~benchmarks.engine_profile`, ``render_docs``.
"""
