"""Two TPU v5p slices joined by the data-center network: the tpu_pod job, data-parallel across slices.

Intended hardware: 2 x v5p-128 (two v5p:4x4x4 slices, 64 chips each, 128 chips in all), as a
multi-slice job (each slice's hosts on its own ICI, the slices on DCN). Within a slice the mesh
is tpu_pod's (fsdp 16 x sequence 4: parameters ZeRO-3 over fsdp, ring attention over 4 chips);
across slices only data parallelism, so the one collective on DCN is the gradient all-reduce.
Each slice takes 256 rows of 8,192 tokens, as tpu_pod does on its own.

Dry run on any machine with libtpu (compiles for both slices, reports per-chip HBM, FLOPs, and
the bytes each step moves over DCN and ICI):
    python train.py --config configs/tpu_multislice.py --aot_topology v5p:4x4x4 --aot_num_slices 2
On the slices (every host runs the same command; jax.distributed finds its peers from the
environment the multi-slice runtime sets):
    python train.py --config configs/tpu_multislice.py --workdir gs://bucket/run --config.data.dataset=...
"""

import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import tpu_pod  # noqa: E402

sys.path.pop(0)


def get_config():
  c = tpu_pod.get_config()
  c.train.batch_size = 512  # global: 256 rows (2M tokens) per slice
  c.train.learning_rate = 1.4e-4  # tpu_pod's 1e-4 x sqrt(2) for the doubled batch
  # Per slice (64 chips): fsdp 16 x sequence 4, as tpu_pod.
  c.mesh.data = 1
  c.mesh.fsdp = -1
  c.mesh.tensor = 1
  c.mesh.sequence = 4
  # Across slices: data parallel over all of them (-1 = the number of slices); fsdp stays in a slice.
  c.mesh.dcn_data = -1
  c.mesh.dcn_fsdp = 1
  return c
