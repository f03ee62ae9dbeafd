"""Errors dgemma raises for bad input: each message names the config field, flag or file at fault."""


class ConfigError(ValueError):
  """A config value (or a flag standing for one) is invalid; the message names the field."""


class CheckpointError(ValueError):
  """A checkpoint cannot be read as asked (missing, corrupt, or not the kind expected); the message names
  the path, and the step where there is one."""


class TrainingDiverged(RuntimeError):
  """Training produced a non-finite loss, gradient norm or state; the message names the step."""


class DataError(ValueError):
  """A data file cannot be read as asked (not UTF-8, not JSON, no documents); the message names the file
  and line."""
