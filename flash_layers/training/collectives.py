"""Which mesh axes each collective of a compiled program runs over, and how many bytes cross DCN vs ICI.

Reads the compiled HLO text (`compiled.as_text()`). Two shapes of program occur:

* one SPMD program for every device of the mesh: `replica_groups` and
  `source_target_pairs` hold positions in the mesh's flat device order, and a
  collective crosses DCN when its group holds devices of several slices;
* a multi-slice TPU program (libtpu): one program per slice (`num_partitions` =
  devices per slice), positions local to the slice, so every ordinary
  collective stays on the slice's interconnect (ICI), and the cross-slice part
  of a collective is lowered to host-transfer `send`s to the DCN ("megascale")
  runtime, whose `_xla_megascale_target` names the device groups.

Bytes are payload: per chip, the buffer each collective hands over (the
gathered result of an all-gather, the input of a reduce-scatter, the buffer
otherwise; for DCN, the buffers sent). A ring all-reduce puts about twice its
payload on the wire; the payload is what the program decides, so it is what we
compare. Collectives inside loops count once per trip.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections import defaultdict

import numpy as np

ICI_KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute",
             "collective-broadcast", "ragged-all-to-all")
_DTYPE_BYTES = {"pred": 1, "s4": 1, "u4": 1, "s8": 1, "u8": 1, "f8e4m3fn": 1, "f8e5m2": 1, "s16": 2, "u16": 2,
                "f16": 2, "bf16": 2, "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8,
                "c128": 16}


@dataclasses.dataclass(frozen=True)
class Collective:
  """One collective instruction of the program, per chip and per step."""
  kind: str  # an ICI_KINDS entry, or "dcn:<transfer type>" (ALL_REDUCE, ALL_GATHER, ONE_TO_ONE, ...)
  name: str  # the HLO instruction
  payload_bytes: int  # per chip, one execution
  executions: int  # per step (loop trips multiplied out)
  network: str  # "ici" or "dcn"
  axes: tuple[str, ...] | None  # mesh axes its groups span; None when the groups could not be read
  op_name: str = ""  # the jax operation it came from (HLO metadata), for messages
  exact: bool = True  # False inside a loop whose trip count could not be read (counted as one trip)
  group_size: int | None = None  # devices per replica group (2 for a permute pair); None: unread

  @property
  def bytes_per_step(self) -> int:
    return self.payload_bytes * self.executions

  @property
  def sent_bytes_per_step(self) -> float | None:
    """Bytes one chip puts on links per step, by the textbook algorithm of its kind over a group of
    n: a permute sends its buffer; an all-gather, all-to-all or reduce-scatter sends (n-1)/n of its
    payload (the rest is the chip's own share); a ring all-reduce (a reduce-scatter, then an
    all-gather) 2 (n-1)/n. None for DCN transfers and unread groups."""
    n = self.group_size
    if self.network != "ici" or not n:
      return None
    if self.kind == "collective-permute":
      return float(self.bytes_per_step)
    factor = 2 * (n - 1) / n if self.kind == "all-reduce" else (n - 1) / n
    return self.bytes_per_step * factor


# ----------------------------------------------------------------------------
# HLO text -> instructions
# ----------------------------------------------------------------------------

_COMPUTATION = re.compile(r"^(?:ENTRY )?%(?P<name>[^\s(]+) ")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%(?P<name>[^\s=]+) = ")


@dataclasses.dataclass
class _Instr:
  name: str
  shape: str
  opcode: str
  args: str  # between the opcode's parentheses
  attrs: str  # after them

  @property
  def operands(self) -> list[str]:
    return re.findall(r"%([^\s,)]+)", self.args)


def _split_shape(rest: str) -> tuple[str, str]:
  """'(a, b) op(...)' -> ('(a, b)', 'op(...)'); tuple shapes hold spaces, so match brackets."""
  if not rest.startswith("("):
    shape, _, tail = rest.partition(" ")
    return shape, tail
  depth = 0
  for i, ch in enumerate(rest):
    depth += ch in "({["
    depth -= ch in ")}]"
    if depth == 0:
      return rest[:i + 1], rest[i + 2:]
  return rest, ""


def _parse(text: str) -> tuple[dict[str, list[_Instr]], str, int]:
  """Computations -> instructions, the entry computation's name, num_partitions."""
  computations: dict[str, list[_Instr]] = {}
  entry, current = "", None
  header = re.search(r"num_partitions=(\d+)", text.split("\n", 1)[0])
  for line in text.splitlines():
    if not line.startswith(" "):
      match = _COMPUTATION.match(line)
      if match and line.rstrip().endswith("{"):
        current = computations.setdefault(match["name"], [])
        entry = match["name"] if line.startswith("ENTRY") else entry
      continue
    match = _INSTRUCTION.match(line)
    if current is None or not match:
      continue
    shape, tail = _split_shape(line[match.end():])
    opcode, _, rest = tail.partition("(")
    depth, end = 1, len(rest)
    for i, ch in enumerate(rest):
      depth += ch == "("
      depth -= ch == ")"
      if depth == 0:
        end = i
        break
    current.append(_Instr(match["name"], shape, opcode.strip(), rest[:end], rest[end + 1:]))
  return computations, entry, int(header[1]) if header else 1


def _array_bytes(shape: str) -> list[int]:
  return [_DTYPE_BYTES[dtype] * math.prod(int(d) for d in dims.split(",") if d)
          for dtype, dims in re.findall(r"\b([a-z]+[0-9a-z]*)\[([\d,]*)\]", shape) if dtype in _DTYPE_BYTES]


def _payload(instr: _Instr, shapes: dict[str, str]) -> int:
  arrays = _array_bytes(instr.shape)
  kind = instr.opcode.removesuffix("-start")
  if instr.opcode == "send" or instr.opcode == "collective-permute-start":
    return arrays[0] if arrays else 0  # (buffer, context scalars..., token)
  if kind == "reduce-scatter":
    return sum(sum(_array_bytes(shapes.get(o, ""))) for o in instr.operands)
  if instr.opcode == "all-gather-start":
    return sum(arrays[len(arrays) // 2:])  # (operands..., results...)
  return sum(arrays)


# ----------------------------------------------------------------------------
# How many times each computation runs per step
# ----------------------------------------------------------------------------

def _constant(instr: _Instr | None, defs: dict[str, _Instr] | None = None) -> int | None:
  while defs is not None and instr is not None and instr.opcode in ("copy", "bitcast") and instr.operands:
    instr = defs.get(instr.operands[0])
  if instr is None or instr.opcode != "constant" or not re.fullmatch(r"-?\d+", instr.args.strip()):
    return None
  return int(instr.args)


def _trip_count(loop: _Instr, computations: dict[str, list[_Instr]], defs: dict[str, _Instr]) -> int | None:
  """A counted loop `i < N` (or `N > i`) from a constant start: N - start; None if not of that form."""
  cond = re.search(r"condition=%([^\s,]+)", loop.attrs)
  body = computations.get(cond[1], []) if cond else []
  root = body[-1] if body else None
  direction = re.search(r"direction=(\w+)", root.attrs) if root is not None else None
  if root is None or root.opcode != "compare" or len(root.operands) != 2 or not direction \
      or direction[1] not in ("LT", "GT"):
    return None
  local = {i.name: i for i in body}
  counter, limit = root.operands if direction[1] == "LT" else root.operands[::-1]
  index = re.search(r"index=(\d+)", local[counter].attrs) if counter in local else None
  init = defs.get(loop.operands[0]) if loop.operands else None
  limit_value = _constant(local.get(limit))
  if limit_value is None or index is None or init is None or init.opcode != "tuple":
    return None
  start = _constant(defs.get(init.operands[int(index[1])]), defs)
  return None if start is None else max(limit_value - start, 0)


def _executions(computations, entry, defs) -> tuple[dict[str, int], set[str]]:
  """Runs per step of every computation reachable from the entry, and the computations inside
  a loop whose trip count could not be read (counted as one trip)."""
  calls: dict[str, list[tuple[str, int | None]]] = defaultdict(list)
  for name, instrs in computations.items():
    for instr in instrs:
      for key, callee in re.findall(r"\b(body|condition|to_apply|calls|branch_computations|"
                                    r"true_computation|false_computation)=\{?%([^\s,}]+)", instr.attrs):
        factor = 1
        if instr.opcode == "while" and key in ("body", "condition"):
          factor = _trip_count(instr, computations, defs)
        calls[name].append((callee, factor))
      for callee in re.findall(r"branch_computations=\{([^}]*)\}", instr.attrs):
        calls[name].extend((c.strip().lstrip("%"), 1) for c in callee.split(",")[1:])
  order, seen = [], set()

  def visit(name):  # callers before callees
    if name in seen:
      return
    seen.add(name)
    for callee, _ in calls.get(name, ()):
      visit(callee)
    order.append(name)

  visit(entry)
  runs, guessed = defaultdict(int, {entry: 1}), set()
  for name in reversed(order):
    for callee, factor in calls.get(name, ()):
      runs[callee] += runs[name] * (1 if factor is None else factor)
      if factor is None or name in guessed:
        guessed.add(callee)
  return dict(runs), guessed


# ----------------------------------------------------------------------------
# Groups -> devices -> mesh axes
# ----------------------------------------------------------------------------

def _iota_groups(spec: str) -> list[list[int]] | None:
  """'[2,4]<=[8]' or '[2,4]<=[4,2]T(1,0)' (XLA's iota replica groups)."""
  match = re.fullmatch(r"\[([\d,]+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", spec)
  if not match:
    return None
  shape = [int(x) for x in match[1].split(",")]
  ids = np.arange(math.prod(shape)).reshape([int(x) for x in match[2].split(",")])
  if match[3]:
    ids = ids.transpose([int(x) for x in match[3].split(",")])
  return ids.reshape(shape[0], -1).tolist()


def _groups(instr: _Instr, num_ids: int) -> list[list[int]] | None:
  """Replica groups or permute pairs as lists of program-local ids."""
  pairs = re.search(r"source_target_pairs=\{(.*?)\}\}?(?:,|$)", instr.attrs)
  if pairs:
    return [[int(a), int(b)] for a, b in re.findall(r"\{(\d+),(\d+)\}", pairs[0])]
  groups = re.search(r"replica_groups=(\S+?)(?:,\s|$)", instr.attrs)
  if groups is None or groups[1] == "{}":
    return [list(range(num_ids))]
  if groups[1].startswith("["):
    return _iota_groups(groups[1])
  return [[int(x) for x in g.split(",") if x] for g in re.findall(r"\{([\d,]*)\}", groups[1])]


def _megascale_groups(target: str, slices: list[list]) -> list[list] | None:
  """`_xla_megascale_target` as device groups: '{1,2}x{0:3}' (these slices, 1-based, x these
  positions in a slice), '{{a,b},...}' (device ids) or '{{a->b},...}' (device-id pairs)."""
  by_id = {d.id: d for s in slices for d in s}
  product = re.fullmatch(r'"?\{([\d,]+)\}x\{(\d+):(\d+)\}"?', target)
  if product:
    picked = [slices[int(s) - 1] for s in product[1].split(",")]
    return [[s[i] for s in picked] for i in range(int(product[2]), int(product[3]) + 1)]
  groups = [re.findall(r"\d+", g) for g in re.findall(r"\{([\d,>\- ]+)\}", target)]
  if not groups or any(int(i) not in by_id for g in groups for i in g):
    return None
  return [[by_id[int(i)] for i in g] for g in groups]


def _axes(groups: list[list], mesh) -> tuple[str, ...]:
  coords = {d.id: idx for idx, d in np.ndenumerate(mesh.devices)}
  spanned = set()
  for group in groups:
    points = np.asarray([coords[d.id] for d in group])
    spanned.update(i for i in range(points.shape[1]) if len(set(points[:, i])) > 1)
  return tuple(name for i, name in enumerate(mesh.axis_names) if i in spanned)


def collectives(hlo_text: str, mesh) -> list[Collective]:
  """Every collective of the compiled program `hlo_text`, run on `mesh`, with its axes and network."""
  computations, entry, partitions = _parse(hlo_text)
  defs = {i.name: i for instrs in computations.values() for i in instrs}
  shapes = {name: i.shape for name, i in defs.items()}
  runs, guessed = _executions(computations, entry, defs)
  flat = list(mesh.devices.flat)
  by_slice: dict[int, list] = defaultdict(list)
  for d in flat:
    by_slice[getattr(d, "slice_index", 0)].append(d)
  slices = [by_slice[k] for k in sorted(by_slice)]
  # Program-local ids -> devices: the whole mesh, or (one program per slice) the first slice.
  program = flat if partitions == len(flat) else slices[0] if partitions == len(slices[0]) else None
  found = []
  for comp, instrs in computations.items():
    if runs.get(comp, 0) == 0:
      continue
    for instr in instrs:
      op_name = re.search(r'op_name="([^"]*)"', instr.attrs)
      op_name = op_name[1] if op_name else ""
      megascale = re.search(r"_xla_megascale_target=(\"[^\"]*\"|\{\{.*?\}\})", instr.attrs)
      if instr.opcode == "send" and megascale:
        kind = re.search(r'_xla_megascale_transfer_type="(\w+)"', instr.attrs)
        groups = _megascale_groups(megascale[1], slices)
        found.append(Collective(f"dcn:{kind[1] if kind else '?'}", instr.name, _payload(instr, shapes),
                                runs[comp], "dcn", None if groups is None else _axes(groups, mesh), op_name,
                                comp not in guessed))
        continue
      kind = instr.opcode.removesuffix("-start")
      if kind not in ICI_KINDS or instr.opcode.endswith("-done"):
        continue
      local = _groups(instr, partitions)
      if kind == "collective-permute" and local is not None and all(a == b for a, b in local):
        continue  # every device "sends" to itself: a local copy, nothing on a link
      groups = None if local is None or program is None else [[program[i] for i in g] for g in local]
      cross = groups is not None and any(len({getattr(d, "slice_index", 0) for d in g}) > 1 for g in groups)
      network = "dcn" if cross else "ici"
      found.append(Collective(kind, instr.name, _payload(instr, shapes), runs[comp], network,
                              None if groups is None else _axes(groups, mesh), op_name, comp not in guessed,
                              None if local is None else max(len(g) for g in local)))
  return found


def summary(found: list[Collective]) -> dict:
  """Payload bytes per chip per step over DCN and ICI, in all and by the mesh axes spanned."""
  out = {"dcn_bytes_per_step_per_chip": 0, "ici_bytes_per_step_per_chip": 0, "by_axes": {},
         "collectives": len(found), "in_loops_of_unknown_trip_count": sum(not c.exact for c in found)}
  for c in found:
    out[f"{c.network}_bytes_per_step_per_chip"] += c.bytes_per_step
    key = f"{c.network}:{'+'.join(c.axes) if c.axes is not None else '?'}"
    out["by_axes"][key] = out["by_axes"].get(key, 0) + c.bytes_per_step
  out["by_axes"] = dict(sorted(out["by_axes"].items()))
  return out
