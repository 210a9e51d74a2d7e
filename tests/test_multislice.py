"""Several TPU slices joined by DCN: the hybrid mesh, its config checks, and where a compiled
train step's collectives run.

The slices are libtpu's topology descriptions (`get_topology_desc(..., num_slices=2)`: devices
with `slice_index`), so the meshes and the 2-slice v5e:2x2 dry runs are built on this CPU host.
The HLO reader is also checked on a handwritten program, against counts worked out by hand.
"""

import os
import pathlib
import sys
import types

os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")  # other test processes may hold libtpu

import numpy as np  # noqa: E402
import pytest  # noqa: E402

from flash_layers import parallel  # noqa: E402
from flash_layers.parallel import mesh as mesh_lib  # noqa: E402
from flash_layers.training import collectives as collectives_lib  # noqa: E402
from flash_layers.training import config as config_lib  # noqa: E402

REPO = pathlib.Path(__file__).resolve().parents[1]


def _topology(num_slices: int = 2):
  pytest.importorskip("libtpu")
  from flash_layers.training import aot
  return aot.topology_devices("v5e:2x2", num_slices)


# ----------------------------------------------------------------------------
# The mesh
# ----------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs,shape", [
  ({"tensor": 2, "sequence": 2, "dcn_data": -1}, {"data": 2, "fsdp": 1, "tensor": 2, "sequence": 2}),
  ({"fsdp": 2, "tensor": 2, "dcn_fsdp": 2}, {"data": 1, "fsdp": 4, "tensor": 2, "sequence": 1}),
  ({"data": -1, "dcn_data": 2}, {"data": 8, "fsdp": 1, "tensor": 1, "sequence": 1}),
])
def test_hybrid_mesh_keeps_tensor_and_sequence_inside_a_slice(kwargs, shape):
  devices = _topology()
  mesh = parallel.make_mesh(**kwargs, devices=devices)
  assert dict(mesh.shape) == shape
  dcn_data, dcn_fsdp = kwargs.get("dcn_data", 1) % 3, kwargs.get("dcn_fsdp", 1)  # -1 -> 2 (2 slices)
  for (data, fsdp, _, _), device in np.ndenumerate(mesh.devices):
    # Slice-major: the outer (DCN) part of the data and fsdp indices says the slice.
    outer_data, outer_fsdp = data // (shape["data"] // dcn_data), fsdp // (shape["fsdp"] // dcn_fsdp)
    assert device.slice_index == outer_data * dcn_fsdp + outer_fsdp
  # Every tensor x sequence block (fixed data, fsdp) is on one slice.
  for block in mesh.devices.reshape(shape["data"] * shape["fsdp"], -1):
    assert len({d.slice_index for d in block}) == 1
  assert mesh.devices.size == len(devices) == len({d.id for d in mesh.devices.flat})


def test_hybrid_layout_without_slice_indices_matches_jax():
  """The plain layout (devices without slice_index, e.g. CPU) is the one jax's hybrid mesh builds."""
  from jax.experimental import mesh_utils
  devices = _topology()
  slices = [[d for d in devices if d.slice_index == s] for s in (0, 1)]
  for ici, dcn in [((1, 1, 2, 2), (2, 1, 1, 1)), ((1, 2, 2, 1), (1, 2, 1, 1))]:
    ours = mesh_lib._tile_slices(slices, ici, dcn)
    theirs = mesh_utils.create_hybrid_device_mesh(ici, dcn, devices)
    assert [d.id for d in ours.flat] == [d.id for d in theirs.flat]


@pytest.mark.parametrize("kwargs,words", [
  ({"sequence": 8}, ["make_mesh sequence", "does not fit in one slice of 4 devices", "only data and fsdp"]),
  ({"tensor": 8}, ["make_mesh tensor", "does not fit in one slice"]),
  ({"tensor": 2, "sequence": 2}, ["make_mesh dcn_data*dcn_fsdp", "needs 1 slices but there are 2"]),
  ({"tensor": 2, "dcn_data": 2, "dcn_fsdp": 2}, ["dcn_data=2, dcn_fsdp=2 needs 4 slices but there are 2"]),
  ({"data": -1, "dcn_data": -1, "num_slices": 4}, ["make_mesh num_slices=4", "slice_index says 2 slice(s)"]),
])
def test_hybrid_mesh_errors_name_the_argument(kwargs, words):
  with pytest.raises(ValueError) as info:
    parallel.make_mesh(**kwargs, devices=_topology())
  for word in words:
    assert word in str(info.value)


# ----------------------------------------------------------------------------
# config.mesh
# ----------------------------------------------------------------------------

def _config(**mesh):
  sys.path.insert(0, str(REPO))
  try:
    from configs import tiny
  finally:
    sys.path.remove(str(REPO))
  config = tiny.get_config()
  config.mesh.update(mesh)
  return config


@pytest.mark.parametrize("mesh,message", [
  ({"sequence": 8, "data": 1}, "config.mesh.sequence: 8 does not fit in one slice of 4 devices (2 slices)"),
  ({"tensor": 8, "data": 1}, "config.mesh.tensor: 8 does not fit in one slice"),
  ({"sequence": 2}, "config.mesh.dcn_data*dcn_fsdp: all sizes 1 needs 1 slices but there are 2"),
  ({"dcn_data": 3}, "config.mesh.dcn_data*dcn_fsdp: dcn_data=3 needs 3 slices but there are 2"),
  ({"dcn_data": -1, "dcn_fsdp": -1}, "config.mesh.dcn_fsdp: at most one size may be -1"),
  ({"dcn_fsdp": 0}, "config.mesh.dcn_fsdp: must be a positive integer or -1"),
  ({"dcn_data": -1, "data": 3}, "config.mesh.data*fsdp*tensor*sequence: data=3 needs 3 devices per slice"),
])
def test_config_mesh_across_slices_is_checked_naming_the_field(mesh, message):
  with pytest.raises(ValueError) as info:
    config_lib.validate(_config(**mesh), num_devices=8, num_slices=2, check_data=False)
  assert message in str(info.value)


def test_config_dcn_sizes_resolve():
  sizes = config_lib.mesh_shape(_config(data=1, tensor=2, sequence=2, dcn_data=-1), 8, num_slices=2)
  assert sizes == {"data": 1, "fsdp": 1, "tensor": 2, "sequence": 2, "dcn_data": 2, "dcn_fsdp": 1}
  # One slice: -1 DCN sizes are 1, and today's single-slice configs are unchanged.
  assert config_lib.mesh_shape(_config(dcn_data=-1), 8) == config_lib.mesh_shape(_config(), 8) == {
    "data": 8, "fsdp": 1, "tensor": 1, "sequence": 1, "dcn_data": 1, "dcn_fsdp": 1}


def test_multislice_config_is_valid():
  sys.path.insert(0, str(REPO))
  try:
    from configs import tpu_multislice
  finally:
    sys.path.remove(str(REPO))
  config = tpu_multislice.get_config()
  config_lib.validate(config, num_devices=128, num_slices=2, check_data=False)
  assert config_lib.mesh_shape(config, 128, 2) == {"data": 1, "fsdp": 16, "tensor": 1, "sequence": 4,
                                                   "dcn_data": 2, "dcn_fsdp": 1}


# ----------------------------------------------------------------------------
# Reading collectives out of HLO (a handwritten per-slice program)
# ----------------------------------------------------------------------------

HLO = """HloModule handwritten, num_partitions=4

%add (x: f32[], y: f32[]) -> f32[] {
  %x = f32[] parameter(0)
  %y = f32[] parameter(1)
  ROOT %sum = f32[] add(%x, %y)
}

%cond (p: (s32[], f32[8])) -> pred[] {
  %p = (s32[], f32[8]) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %limit = s32[] constant(3)
  ROOT %lt = pred[] compare(%i, %limit), direction=LT
}

%body (q: (s32[], f32[8])) -> (s32[], f32[8]) {
  %q = (s32[], f32[8]) parameter(0)
  %j = s32[] get-tuple-element(%q), index=0
  %one = s32[] constant(1)
  %next = s32[] add(%j, %one)
  %v = f32[8] get-tuple-element(%q), index=1
  %ring = f32[8] collective-permute(%v), channel_id=1, source_target_pairs={{0,1},{1,0},{2,3},{3,2}}
  ROOT %out = (s32[], f32[8]) tuple(%next, %ring)
}

ENTRY %main (a: f32[8]) -> f32[8] {
  %a = f32[8] parameter(0)
  %zero = s32[] constant(0)
  %start = s32[] copy(%zero)
  %init = (s32[], f32[8]) tuple(%start, %a)
  %loop = (s32[], f32[8]) while(%init), condition=%cond, body=%body
  %heads = f32[8] all-reduce(%a), channel_id=2, replica_groups=[2,2]<=[2,2]T(1,0), to_apply=%add
  %tokens = bf16[16] all-gather(%a), channel_id=3, replica_groups={{0,1},{2,3}}, dimensions={0}
  %copy = f32[8] collective-permute(%a), channel_id=5, source_target_pairs={{0,0},{1,1},{2,2},{3,3}}
  %token = token[] after-all()
  %send = (f32[2,8], u32[], token[]) send(%a, %token), channel_id=4, is_host_transfer=true, @MEGASCALE
  ROOT %r = f32[8] get-tuple-element(%loop), index=1
}
""".replace("@MEGASCALE", 'frontend_attributes={_xla_megascale_target="{1,2}x{0:3}",'
            '_xla_megascale_transfer_type="ALL_REDUCE"}')


def _fake_mesh():
  """2 slices x 4 devices, mesh (data 2, fsdp 1, tensor 2, sequence 2), slice-major like make_mesh."""
  devices = [types.SimpleNamespace(id=100 * (s + 1) + i, slice_index=s) for s in range(2) for i in range(4)]
  grid = np.empty(8, dtype=object)
  grid[:] = devices
  return types.SimpleNamespace(devices=grid.reshape(2, 1, 2, 2), axis_names=parallel.AXES)


def test_collectives_of_a_per_slice_program():
  found = {c.name: c for c in collectives_lib.collectives(HLO, _fake_mesh())}
  assert set(found) == {"ring", "heads", "tokens", "send"}  # not "copy": every device sends to itself
  ring, heads, tokens, send = found["ring"], found["heads"], found["tokens"], found["send"]
  assert (ring.kind, ring.network, ring.axes, ring.executions, ring.payload_bytes) == (
    "collective-permute", "ici", ("sequence",), 3, 32)  # 3 loop trips of f32[8]
  assert (heads.network, heads.axes, heads.payload_bytes) == ("ici", ("tensor",), 32)  # groups {0,2},{1,3}
  assert (tokens.network, tokens.axes, tokens.payload_bytes) == ("ici", ("sequence",), 32)  # bf16[16]
  assert (send.kind, send.network, send.axes, send.payload_bytes) == ("dcn:ALL_REDUCE", "dcn", ("data",), 64)
  summary = collectives_lib.summary(list(found.values()))
  assert summary["dcn_bytes_per_step_per_chip"] == 64
  assert summary["ici_bytes_per_step_per_chip"] == 3 * 32 + 32 + 32
  assert summary["by_axes"] == {"dcn:data": 64, "ici:sequence": 128, "ici:tensor": 32}


def test_collectives_of_a_global_program_crossing_slices():
  """One program for all 8 devices: a group holding devices of both slices is DCN traffic."""
  text = HLO.replace("num_partitions=4", "num_partitions=8").replace(
    "replica_groups={{0,1},{2,3}}", "replica_groups={{0,4},{1,5},{2,6},{3,7}}")
  found = {c.name: c for c in collectives_lib.collectives(text, _fake_mesh())}
  assert (found["tokens"].network, found["tokens"].axes) == ("dcn", ("data",))
  assert (found["ring"].network, found["heads"].network) == ("ici", "ici")


# ----------------------------------------------------------------------------
# The 2-slice dry run (v5e:2x2 x 2, a tiny model)
# ----------------------------------------------------------------------------

@pytest.fixture(scope="module", params=["dcn_data", "dcn_fsdp"])
def dry_run(request):
  pytest.importorskip("libtpu")
  from flash_layers.training import aot
  per_slice = {"data": 1, "fsdp": 1, "tensor": 2, "sequence": 2, request.param: -1}
  config = _config(**per_slice)
  config.model.context_parallel = "ring"  # the checks below follow the ring's permutes
  compiled, mesh, abstract = aot.compile_train_step(config, "v5e:2x2", num_slices=2)
  report = aot.compiled_report(config, "v5e:2x2", 2, compiled, mesh, abstract)
  return request.param, mesh, report, collectives_lib.collectives(compiled.as_text(), mesh)


@pytest.mark.aot
def test_two_slice_dry_run_report(dry_run):
  across, mesh, report, _ = dry_run
  dcn_axis = across.removeprefix("dcn_")
  assert report["slices"] == 2 and report["chips"] == 8
  assert report["mesh"] == {"data": 1, "fsdp": 1, "tensor": 2, "sequence": 2, dcn_axis: 2}
  assert report["flops_per_step_per_chip"] > 0 and report["per_chip_bytes"]["arguments"] > 0
  traffic = report["collective_bytes_per_step_per_chip"]
  assert traffic["dcn_bytes_per_step_per_chip"] > 0 and traffic["ici_bytes_per_step_per_chip"] > 0
  assert traffic["in_loops_of_unknown_trip_count"] == 0


@pytest.mark.aot
def test_two_slice_dry_run_keeps_ring_and_tensor_collectives_on_ici(dry_run):
  across, mesh, _, found = dry_run
  assert all(c.axes is not None for c in found), [c for c in found if c.axes is None]
  ring = [c for c in found if c.kind == "collective-permute" and c.axes == ("sequence",)]
  tensor = [c for c in found if c.axes and "tensor" in c.axes]
  assert ring and tensor  # the checks below are about something
  assert {c.executions for c in ring} == {2}  # one permute per ring step (sequence=2), in the loop
  assert all(c.network == "ici" for c in ring)
  # No grouped collective and no ring step over tensor or sequence crosses DCN.
  dcn = [c for c in found if c.network == "dcn"]
  assert dcn
  for c in dcn:
    assert c.kind.startswith("dcn:"), c  # the compiled program is per slice; DCN goes through sends
    if c.kind != "dcn:ONE_TO_ONE":
      assert c.axes == (across.removeprefix("dcn_"),), c
  for c in found:
    if c.axes and set(c.axes) & {"tensor", "sequence"} and c.kind != "dcn:ONE_TO_ONE":
      assert c.network == "ici", c
  if across == "dcn_data":
    # Data parallel across slices: the gradient all-reduce is the only DCN traffic.
    assert {(c.kind, c.axes) for c in dcn} == {("dcn:ALL_REDUCE", ("data",))}
  else:
    # fsdp across slices: every DCN transfer moves along fsdp (the sharded parameters' gathers and
    # reductions; the embedding lookups' reshards also change the tensor/sequence shard they land on).
    assert all("fsdp" in c.axes and "data" not in c.axes for c in dcn)
