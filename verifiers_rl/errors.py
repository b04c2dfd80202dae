"""Errors every stage shares. A user acts on `ConfigError` and `TrainingError`: their message is the whole story
(cause and fix), so the command-line tools print it as one line and `RLTrainer.train()` raises it as is. The
server errors sit here, below the client, the launcher and the weight senders, so nothing imports the client to
raise or catch one."""


class ConfigError(ValueError):
    """A config problem the user can fix; the message is the whole story (no traceback is shown)."""


class TrainingError(RuntimeError):
    """The run cannot go on: nothing to train, every rollout failing, a broken environment."""


class ServerError(RuntimeError):
    """The inference server failed, or never came up; the message carries its log tail when known."""


class ServerLost(ServerError):
    """The server died (or, connected, stopped answering) and could not be replaced; the message says why and how
    to resume."""
