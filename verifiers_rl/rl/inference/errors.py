"""Errors shared by every part of inference (client, launcher, weight senders): they sit below all of them, so
nothing has to import the client to raise or catch one."""


class ServerError(RuntimeError):
    """The inference server failed, or never came up; the message carries its log tail when known."""


class ServerLost(ServerError):
    """The server died (or, connected, stopped answering) and could not be replaced; the message says why and how
    to resume."""
