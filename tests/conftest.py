"""Test-wide settings: CPU only, quiet libtpu, float64 references available."""

import os

# Set before jax is imported: tests run on the CPU; libtpu (installed for TPU
# ahead-of-time compiles) must not try to claim a TPU or print warnings.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TPU_ACCELERATOR_TYPE", "v5litepod-4")
os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")
