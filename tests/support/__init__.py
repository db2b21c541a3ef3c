"""What the tests, the simulated Spark and the benchmark harnesses need and a Spark does not: the
simulator (sim, simhub), the generators of test checkpoints and models (testckpt, tinymodel) and the
harnesses (ckpt_bench, bench_ceiling, bench_vs_vllm). None of it is in the host wheel; the
generators' commands are ``python -m tests.support checkpoint generate|model tiny`` (see
:mod:`tests.support.cli`)."""
