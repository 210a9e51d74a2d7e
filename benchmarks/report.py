"""Turn benchmark rows into a markdown table, a JSON file and log-log plots."""

from __future__ import annotations

import json
import math
import os
from typing import Any

_MIB = 2 ** 20


def _fmt(value: Any, spec: str) -> str:
  if value is None or (isinstance(value, float) and not math.isfinite(value)):
    return ""
  return format(value, spec)


def _blocks(row: dict[str, Any]) -> str:
  if row.get("blocks_visited") is None:
    return ""
  text = f"{row['blocks_visited']}/{row['blocks_total']}"
  if row.get("blocks_over_ideal"):
    text += f" ({row['blocks_over_ideal']:.2f}x ideal"
    if row.get("blocks_over_lower_bound"):
      text += f", {row['blocks_over_lower_bound']:.2f}x dense"
    text += ")"
  return text


def markdown(rows: list[dict[str, Any]]) -> str:
  """One table; accelerator rows show TFLOP/s, CPU rows GFLOP/s."""
  accelerated = any(r.get("target", "cpu") not in ("cpu",) for r in rows)
  rate = "TFLOP/s" if accelerated else "GFLOP/s"
  header = ["impl", "mask", "dtype", "pass", "len", "time ms", "CPU ms", rate, "temp MiB", "GFLOP",
            "blocks visited/total", "status"]
  lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
  for r in rows:
    time_ms = r["time_s"] * 1e3 if r.get("time_s") else None
    cpu_ms = r["cpu_s"] * 1e3 if r.get("cpu_s") else None
    achieved = r.get("gflops_per_s")
    if achieved is not None and accelerated:
      achieved /= 1e3
    temp = r["temp_bytes"] / _MIB if "temp_bytes" in r else None
    status = r["status"] + (f": {r['reason']}" if r.get("reason") else "")
    cells = [r["impl"], r["mask"], r["dtype"], r["pass"], str(r["seq_len"]), _fmt(time_ms, ".1f"),
             _fmt(cpu_ms, ".1f"),
             _fmt(achieved, ".2f" if accelerated else ".1f"), _fmt(temp, ".1f"),
             _fmt(r.get("flops", 0) / 1e9, ".2f"), _blocks(r), status.replace("|", "/")]
    lines.append("| " + " | ".join(cells) + " |")
  return "\n".join(lines)


def write_json(rows: list[dict[str, Any]], path: str) -> None:
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  with open(path, "w") as f:
    json.dump(rows, f, indent=1)


def plot(rows: list[dict[str, Any]], out_dir: str, *, prefix: str = "") -> list[str]:
  """Per (dtype, pass): wall time, CPU time, memory vs length, log-log; a subplot per mask, a line per impl.

  Returns the PNG paths written. Memory is plotted for every compiled cell, times only for run cells.
  """
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  os.makedirs(out_dir, exist_ok=True)
  paths = []
  groups = sorted({(r["dtype"], r["pass"]) for r in rows})
  masks = list(dict.fromkeys(r["mask"] for r in rows))
  impls = list(dict.fromkeys(r["impl"] for r in rows))
  metrics = (("time", "time_s", "median wall time (s)"), ("cpu-time", "cpu_s", "median CPU time (s)"),
             ("memory", "temp_bytes", "compiled temp memory (MiB)"))
  for dtype, pass_ in groups:
    for name, field, label in metrics:
      fig, axes = plt.subplots(1, len(masks), figsize=(3.2 * len(masks), 2.8), squeeze=False,
                               sharey=True)
      drawn = False
      for ax, mask in zip(axes[0], masks, strict=True):
        for impl in impls:
          points = sorted((r["seq_len"], r[field]) for r in rows
                          if (r["impl"], r["mask"], r["dtype"], r["pass"]) == (impl, mask, dtype, pass_)
                          and r.get(field))
          if not points:
            continue
          xs, ys = zip(*points, strict=True)
          if field == "temp_bytes":
            ys = [y / _MIB for y in ys]
          ax.plot(xs, ys, marker="o", markersize=3, label=impl)
          drawn = True
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_title(mask, fontsize=9)
        ax.set_xlabel("sequence length", fontsize=8)
        ax.tick_params(labelsize=7)
        ax.grid(True, which="major", alpha=0.3)
      if not drawn:
        plt.close(fig)
        continue
      axes[0][0].set_ylabel(label, fontsize=8)
      handles, labels = [], []
      for ax in axes[0]:
        for h, lab in zip(*ax.get_legend_handles_labels(), strict=True):
          if lab not in labels:
            handles.append(h)
            labels.append(lab)
      fig.legend(handles, labels, loc="upper center", ncol=len(labels), fontsize=8, frameon=False)
      fig.suptitle(f"{name}: {dtype}, {pass_}", fontsize=9, y=0.02, va="bottom")
      fig.tight_layout(rect=(0, 0.05, 1, 0.9))
      path = os.path.join(out_dir, f"{prefix}{name}-{dtype}-{pass_.replace('+', '_')}.png")
      fig.savefig(path, dpi=80)
      plt.close(fig)
      paths.append(path)
  return paths


def pivot(rows: list[dict[str, Any]], field: str, *, mask: str, dtype: str, pass_: str,
          scale: float = 1.0, spec: str = ".1f") -> str:
  """A compact table: one line per impl, one column per length, `field` * scale in the cells.

  A cell that did not run shows its status ("not run", "unsupported", ...) in short.
  """
  sel = [r for r in rows if (r["mask"], r["dtype"], r["pass"]) == (mask, dtype, pass_)]
  lengths = sorted({r["seq_len"] for r in sel})
  impls = list(dict.fromkeys(r["impl"] for r in sel))
  by_cell = {(r["impl"], r["seq_len"]): r for r in sel}
  lines = ["| impl | " + " | ".join(str(n) for n in lengths) + " |", "|---|" + "---|" * len(lengths)]
  for impl in impls:
    cells = []
    for n in lengths:
      r = by_cell.get((impl, n))
      value = None if r is None else r.get(field)
      if value is not None:
        cells.append(format(value * scale, spec))
      else:
        cells.append("" if r is None else {"not run": "-", "unsupported": "n/a"}.get(r["status"],
                                                                                     r["status"]))
    lines.append(f"| {impl} | " + " | ".join(cells) + " |")
  return "\n".join(lines)


def summary(rows: list[dict[str, Any]]) -> str:
  """Per (dtype, pass, mask): time (ms) and compiled temp memory (MiB) by impl and length."""
  parts = []
  for dtype, pass_ in sorted({(r["dtype"], r["pass"]) for r in rows}):
    for mask in dict.fromkeys(r["mask"] for r in rows):
      if any(r.get("time_s") for r in rows):
        parts.append(f"**{mask}, {dtype}, {pass_}: median time (ms)**\n\n"
                     + pivot(rows, "time_s", mask=mask, dtype=dtype, pass_=pass_, scale=1e3))
      if any(r.get("cpu_s") for r in rows):
        parts.append(f"**{mask}, {dtype}, {pass_}: median process CPU time (ms)**\n\n"
                     + pivot(rows, "cpu_s", mask=mask, dtype=dtype, pass_=pass_, scale=1e3))
      parts.append(f"**{mask}, {dtype}, {pass_}: compiled temp memory (MiB)**\n\n"
                   + pivot(rows, "temp_bytes", mask=mask, dtype=dtype, pass_=pass_, scale=1 / _MIB))
  return "\n\n".join(parts)


def targets(rows: list[dict[str, Any]], impls=("xla_chunked", "flash_pallas")) -> str:
  """The benchmark targets, read off the rows.

  * memory: reference temp / impl temp at the longest length (target >= 50x), and the growth
    of the impl's temp per doubling of length up to it (2x = linear, 4x = quadratic);
  * packed documents: flash_pallas blocks visited over the ideal (target <= 1.25x).
  """
  cells = {(r["impl"], r["seq_len"], r["mask"], r["dtype"], r["pass"]): r for r in rows}
  lines = ["| impl | mask | dtype | pass | len | temp MiB | reference temp MiB | reference / impl | "
           "growth per doubling (2 = linear) |", "|" + "---|" * 9]
  for (impl, n, mask, dtype, pass_), r in sorted(cells.items()):
    if impl not in impls or r.get("temp_bytes") is None:
      continue
    longest = max(m for (i, m, *rest) in cells if i == impl and tuple(rest) == (mask, dtype, pass_)
                  and cells[(i, m, *rest)].get("temp_bytes") is not None)
    if n != longest:
      continue
    ref = cells.get(("reference", n, mask, dtype, pass_), {}).get("temp_bytes")
    shorter = [m for (i, m, *rest), c in cells.items() if i == impl and m < n
               and tuple(rest) == (mask, dtype, pass_) and c.get("temp_bytes")]
    growth = None
    if shorter and r["temp_bytes"]:
      m = max(shorter)  # growth per doubling from the next shorter compiled length
      growth = (r["temp_bytes"] / cells[(impl, m, mask, dtype, pass_)]["temp_bytes"]) ** (
          1 / math.log2(n / m))
    lines.append("| " + " | ".join([
        impl, mask, dtype, pass_, str(n), f"{r['temp_bytes'] / _MIB:.1f}",
        _fmt(ref / _MIB if ref else None, ".0f"),
        _fmt(ref / r["temp_bytes"] if ref and r["temp_bytes"] else None, ".0f"),
        _fmt(growth, ".2f")]) + " |")
  blocks = ["| len | dtype | pass | blocks visited | ideal (tiles with a visible pair) | visited / ideal | "
            "dense lower bound | visited / lower bound |", "|" + "---|" * 8]
  for (impl, n, mask, dtype, pass_), r in sorted(cells.items()):
    if impl == "flash_pallas" and mask == "packed" and pass_ == "fwd" and r.get("blocks_ideal"):
      blocks.append(f"| {n} | {dtype} | {pass_} | {r['blocks_visited']} | {r['blocks_ideal']} | "
                    f"{r['blocks_over_ideal']:.2f} | {r.get('blocks_lower_bound', '')} | "
                    f"{_fmt(r.get('blocks_over_lower_bound'), '.2f')} |")
  return ("**Memory at the longest compiled length**\n\n" + "\n".join(lines)
          + "\n\n**flash_pallas blocks on packed documents**\n\n" + "\n".join(blocks))
