"""What train.py and eval.py share as command-line programs.

`run(main)` is absl's `app.run` with one difference: a mistake in what the user gave (a `UserError`:
a config field or value, a flag, a data file, a missing checkpoint) is printed as one line,
`<program>: error: <message>`, and the exit status is 2. Every other exception is a bug and keeps
its traceback. ml_collections raises KeyError/AttributeError for an override of a field that does
not exist (`--config.train.bogus=1`); those become a UserError naming the override and the fields
that do exist.

The platform default (the CPU, with libtpu quiet, on a host without an accelerator) is set by
`import flash_layers` itself: see `flash_layers.host`.
"""

from __future__ import annotations

import difflib
import os
import sys
from collections.abc import Callable

from absl import app, flags
from ml_collections import config_dict
from ml_collections.config_flags.config_flags import is_config_flag  # documented for external use

from flash_layers.errors import UserError

EXIT_USER_ERROR = 2


def run(main: Callable[[list[str]], None]) -> None:
  try:
    app.run(main, flags_parser=_parse_flags)
  except UserError as e:
    program = os.path.basename(sys.argv[0]) if sys.argv else "flash_layers"
    message = " ".join(line.strip() for line in str(e).splitlines() if line.strip())
    sys.stderr.write(f"{program}: error: {message}\n")
    sys.exit(EXIT_USER_ERROR)


# ----------------------------------------------------------------------------
# Flags
# ----------------------------------------------------------------------------

def _parse_flags(argv: list[str]) -> list[str]:
  try:
    remaining = flags.FLAGS(argv)
  except flags.Error as e:
    if "Traceback" in str(e):  # a config file that raised: a bug in it, so show where
      sys.stderr.write(f"FATAL Flags parsing error:\n{e}\n")
      sys.exit(1)
    raise UserError(str(e)) from None
  except (KeyError, AttributeError, IndexError, OSError):
    problem = _missing_config_file(argv) or _unknown_override(argv)
    if problem is None:
      raise
    raise UserError(problem) from None
  problem = _missing_config_file(argv)
  if problem:
    raise UserError(problem)
  return remaining


def _config_flag_names() -> list[str]:
  return [name for name in flags.FLAGS if is_config_flag(flags.FLAGS[name])]


def _flag_argument(argv: list[str], name: str) -> str | None:
  """The value given to --name (as --name=value or --name value), or None."""
  for i, arg in enumerate(argv[1:], 1):
    for dashes in ("--", "-"):
      if arg.startswith(f"{dashes}{name}="):
        return arg[len(dashes) + len(name) + 1:]
      if arg == f"{dashes}{name}" and i + 1 < len(argv):
        return argv[i + 1]
  return None


def _missing_config_file(argv: list[str]) -> str | None:
  for name in _config_flag_names():
    value = _flag_argument(argv, name)
    if value is not None and not os.path.isfile(value.split(":", 1)[0]):
      return f"--{name} {value}: no such file (a config file such as configs/tiny.py)"
  return None


def _unknown_override(argv: list[str]) -> str | None:
  """The first --config.a.b=... whose path is not a field of the config file, described; else None."""
  for name in _config_flag_names():
    value = _flag_argument(argv, name)
    overrides = [arg.split("=", 1)[0][len(dashes) + len(name) + 1:]
                 for arg in argv[1:] for dashes in ("--", "-") if arg.startswith(f"{dashes}{name}.")]
    if value is None or not overrides:
      continue
    # Load the file again (the failed parse kept nothing): if the file itself is broken, that
    # error propagates with its traceback, as it should.
    config = flags.FLAGS[name].parser.parse(value)
    for path in overrides:
      node, where = config, name
      for part in path.split("."):
        if not isinstance(node, config_dict.ConfigDict):
          return f"--{name}.{path}: {where} is {node!r} ({type(node).__name__}), not a group of fields"
        if part not in node:
          close = difflib.get_close_matches(part, list(node.keys()), n=1)
          hint = f" (did you mean {where}.{close[0]}?)" if close else ""
          return (f"--{name}.{path}: {where} has no field {part!r}{hint}; its fields are "
                  f"{', '.join(sorted(node.keys()))}")
        node, where = node[part], f"{where}.{part}"
  return None
