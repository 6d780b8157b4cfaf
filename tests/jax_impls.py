"""The JAX implementations the tests run on this machine (import after ``pytest.importorskip("jax")``).

On a GPU the compiled kernel runs beside the jnp reference; Pallas' interpreter,
slow there and the same program everywhere, runs in CI on the CPU instead.
"""

import jax

ON_GPU = jax.default_backend() == "gpu"
IMPLS = ["reference", "pallas"] if ON_GPU else ["reference", "pallas_interpret"]
KERNEL_IMPL = "pallas" if ON_GPU else "pallas_interpret"
INTERPRET = not ON_GPU
