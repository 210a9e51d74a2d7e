"""Every ```python block of README.md and docs/*.md runs.

A block may be preceded (directly, one per line) by markers, HTML comments that the rendered page hides:

    <!-- doc-test: continues -->            runs after the previous python block of the same file, in its
                                            namespace and process (the blocks form one chain)
    <!-- doc-test: setup CODE -->           one line of code run first, for names the prose introduced
                                            (e.g. `input_ids`); it is not shown to the reader
    <!-- doc-test: cpu `OLD` => `NEW` -->   the CPU variant: every OLD in the block becomes NEW (OLD must
                                            occur); for a size, a device count, an accelerator-only setting
    <!-- doc-test: env NAME=VALUE -->       an environment variable for the chain (on its first block)
    <!-- doc-test: script -->               the chain runs as a script in a process of its own, as a user
                                            runs a file (`__name__ == "__main__"`: e.g. grain's workers)
    <!-- doc-test: skip REASON -->          not run, for the stated reason (prefer a CPU variant)

A chain with `env` or `script` runs as a script in a subprocess; any other chain runs in the test's
process (jax already imported and warm). Either way the source is padded with blank lines so that a
traceback's line numbers are the markdown file's.
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
import re
import subprocess
import sys

import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
TIMEOUT = 600
MARKER = re.compile(r"^<!--\s*doc-test:\s*(\w+)\s*(.*?)\s*-->\s*$")
CPU_VARIANT = re.compile(r"^`([^`]+)`\s*=>\s*`([^`]*)`$")
CHAIN_ONLY = ("env", "script")  # directives that describe a whole chain, given on its first block


@dataclasses.dataclass
class Block:
  path: pathlib.Path
  first_line: int  # 1-based line of the block's first code line
  code: list[str]
  markers: list[tuple[str, str]]

  @property
  def where(self) -> str:
    return f"{self.path.relative_to(REPO)}:{self.first_line - 1}"

  def directives(self, name: str) -> list[str]:
    return [arg for kind, arg in self.markers if kind == name]

  def runnable_code(self) -> list[str]:
    """The block with its CPU variants applied."""
    text = "\n".join(self.code)
    for arg in self.directives("cpu"):
      match = CPU_VARIANT.match(arg)
      if not match:
        raise ValueError(f"{self.where}: a cpu marker reads `OLD` => `NEW`; got {arg!r}")
      old, new = match.groups()
      if old not in text:
        raise ValueError(f"{self.where}: the cpu variant's {old!r} is not in the block (stale marker?)")
      text = text.replace(old, new)
    return text.split("\n")


def extract(path: pathlib.Path) -> list[Block]:
  lines = path.read_text().split("\n")
  blocks, i = [], 0
  while i < len(lines):
    if lines[i].strip() == "```python":
      markers, j = [], i - 1
      while j >= 0 and MARKER.match(lines[j]):
        kind, arg = MARKER.match(lines[j]).groups()
        markers.insert(0, (kind, arg))
        j -= 1
      end = lines.index("```", i + 1)
      blocks.append(Block(path, i + 2, lines[i + 1:end], markers))
      i = end
    i += 1
  return blocks


def chains() -> list[list[Block]]:
  found = []
  for path in DOCS:
    for block in extract(path):
      unknown = {kind for kind, _ in block.markers} - {"continues", "setup", "cpu", "env", "script", "skip"}
      if unknown:
        raise ValueError(f"{block.where}: unknown doc-test marker(s) {sorted(unknown)}")
      if block.directives("continues"):
        if not found or found[-1][0].path != path:
          raise ValueError(f"{block.where}: continues, but no earlier python block in {path.name}")
        if any(block.directives(name) for name in CHAIN_ONLY):
          raise ValueError(f"{block.where}: {CHAIN_ONLY} belong on the chain's first block")
        found[-1].append(block)
      else:
        found.append([block])
  return found


def padded_source(chain: list[Block]) -> str:
  """The chain's code at the markdown's own line numbers (blank lines elsewhere)."""
  lines: list[str] = []
  for block in chain:
    if block.directives("skip"):
      continue
    code = block.runnable_code()
    setup = block.directives("setup")
    lines.extend([""] * (block.first_line - 2 - len(lines)))  # up to the fence line
    lines.append("; ".join(setup))  # on the fence line itself
    lines.extend(code)
  return "\n".join(lines) + "\n"


CHAINS = chains()


def test_every_block_is_found():
  """The extraction itself: every ```python fence became a block, and markers parse."""
  fences = sum(path.read_text().split("\n").count("```python") for path in DOCS)
  assert fences == sum(len(chain) for chain in CHAINS) > 0
  for chain in CHAINS:
    for block in chain:
      block.runnable_code()
      for reason in block.directives("skip"):
        assert reason, f"{block.where}: skip needs a stated reason"


@pytest.mark.parametrize("chain", CHAINS, ids=[chain[0].where for chain in CHAINS])
def test_snippet_runs(chain, tmp_path):
  if all(block.directives("skip") for block in chain):
    pytest.skip("; ".join(r for block in chain for r in block.directives("skip")))
  source = padded_source(chain)
  head = chain[0]
  env = dict(kv.split("=", 1) for kv in head.directives("env"))
  if env or head.directives("script"):
    script = tmp_path / (head.path.stem + ".py")
    script.write_text(source)
    result = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True,
                            env={**os.environ, "PYTHONPATH": str(REPO), **env}, timeout=TIMEOUT)
    assert result.returncode == 0, (f"{head.where} failed (line numbers are {head.path.name}'s):\n"
                                    f"{result.stderr[-6000:]}")
  else:
    exec(compile(source, str(head.path), "exec"), {"__name__": "__doc_snippet__"})
