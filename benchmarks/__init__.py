"""The qsa benchmark suite: named scenarios, workload generators, baselines, timing and the runner.

Run ``qsa bench --help`` (or ``python -m benchmarks.run --help`` from the checkout root).
"""
