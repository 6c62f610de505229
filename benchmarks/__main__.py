from .bench import bench

bench.main(prog_name="python -m benchmarks")
