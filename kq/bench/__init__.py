"""``kq bench``: the benchmark harnesses behind the CLI, one module per set.

* :mod:`kq.bench.kernels`: every ``route_shed`` backend against its floors (``--sets decode``, ``prefill``);
* :mod:`kq.bench.compiles`: what a new row count costs the JAX kernels' first call (``--sets compile``);
* :mod:`kq.bench.host`: the residency manager's token boundary at real model sizes (``--sets host``);
* :mod:`kq.bench.decode_e2e`: decoding through an arena end to end (``--sets decode-e2e``).
"""
