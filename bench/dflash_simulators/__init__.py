"""Simulations of parts that cannot run here (a GPU node's SGLang servers), shared by bench/ and the tests.

Product code never imports this package: it is started as a separate process in place of
``python -m sglang.launch_server`` (``inference.sglang.launch_module``). ``oracle_drafter`` stands in for a
trained drafter whose rejections are chosen (the tests and bench/gpu_check.py), ``overfit_drafter`` for one
trained on a real corpus (overfit on the target's own greedy completions: test_speculative, bench_speculative).
"""
