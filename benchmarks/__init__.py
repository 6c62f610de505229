"""stagebuf's benchmark harness: not part of the installed package (needs ``requirements/bench.txt``).

``python -m benchmarks`` (:mod:`benchmarks.bench`) times every workload: :mod:`~benchmarks.micro`,
:mod:`~benchmarks.writes`, :mod:`~benchmarks.engine` (vLLM's MRV2 input path, with :mod:`~benchmarks.vs_vllm`)
and :mod:`~benchmarks.nanovllm_engine`; :mod:`~benchmarks.e2e` runs nano-vllm's engine end to end. Shared:
:mod:`~benchmarks.harness` (tiers, clocks, a case's form), :mod:`~benchmarks.fetch` (the peers' released code,
loaded by :mod:`~benchmarks.vllm_mrv2` and :mod:`~benchmarks.nanovllm_pkg`), :mod:`~benchmarks.baselines`,
:mod:`~benchmarks.targets` and :mod:`~benchmarks.report` (every table). Tools: :mod:`~benchmarks.ab` and
:mod:`~benchmarks.compare` (is a change slower?), :mod:`~benchmarks.kernels`,
:mod:`~benchmarks.engine_profile`, :mod:`~benchmarks.render_docs`.
"""
