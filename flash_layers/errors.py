"""`UserError`: the base of every error that means "what you gave us is wrong", not "we have a bug".

A bad config value (`ConfigError`), a malformed data file (`DataError`), a checkpoint that does not fit
(`CheckpointError`) or is not there (`NoCheckpointError`), an impl asked for what it cannot do
(`UnsupportedError`) all derive from it. Their messages name the
field, flag or file (and line), so the command-line programs print the message alone, on one line,
and exit with status 2 (`flash_layers.training.cli`); any other exception keeps its traceback.
Library callers catch the concrete classes, which also derive from ValueError or FileNotFoundError.
"""


class UserError(Exception):
  """A mistake in the user's input; the message names the field, flag or file and says what is allowed."""
