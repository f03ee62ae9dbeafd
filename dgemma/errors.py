"""Errors dgemma raises for bad input: each message names the config field, flag or file at fault."""


class ConfigError(ValueError):
  """A config value (or a flag standing for one) is invalid; the message names the field."""


class CheckpointError(ValueError):
  """A checkpoint cannot be read as asked (missing, corrupt, or not the kind expected); the message names
  the path, and the step where there is one."""


class TrainingDiverged(RuntimeError):
  """Training produced a non-finite loss, gradient norm or state; the message names the step."""


class TrainingInterrupted(RuntimeError):
  """SIGINT or SIGTERM stopped training after a step that was saved; the message names the step and where."""

  def __init__(self, message: str, signum: int):
    super().__init__(message)
    self.exit_code = 128 + signum  # the shell's status of a process ended by that signal


class DataError(ValueError):
  """A data file cannot be read as asked (not UTF-8, not JSON, no documents); the message names the file
  and line."""
