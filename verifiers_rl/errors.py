"""Errors a user acts on. Their message is the whole story (cause and fix), so the command-line tools print it
as one line, and `RLTrainer.train()` raises it as is."""


class ConfigError(ValueError):
    """A config problem the user can fix; the message is the whole story (no traceback is shown)."""


class TrainingError(RuntimeError):
    """The run cannot go on: nothing to train, every rollout failing, a broken environment."""
