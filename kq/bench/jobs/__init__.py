"""The maintainers' benchmark jobs, run from the repository root as ``python -m kq.bench.jobs JOB [ARGS]``.

Jobs: ``sweep_route_shed`` and ``sweep_topk`` (the Pallas kernels' launch
parameters, bits checked, kernel time), ``launches`` (kernel launches for
compute-sanitizer and Nsight Compute), ``moe_overhead`` (the JAX MoE layer on
an arena against the resident layer), and the decode, study and look-ahead jobs
(``python -m kq.bench.jobs`` lists them). ``kq/bench/jobs/gpu_job.sh`` runs the GPU
test suite, ``kq check``, memcheck and these on a CUDA machine in one call.
``kq bench`` is the user-facing benchmark; these are the maintainers'. Both take
their run header, JSON writer and medians from :mod:`kq.bench.common`.
"""
