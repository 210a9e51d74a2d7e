"""Test-wide settings: CPU only, quiet libtpu, float64 references available."""

import os

# Set before jax is imported: tests run on the CPU; libtpu (installed for TPU
# ahead-of-time compiles) must not try to claim a TPU or print warnings.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TPU_ACCELERATOR_TYPE", "v5litepod-4")
os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")
# pytest -n 2 runs tests in two processes; each may load libtpu for AOT compiles.
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
