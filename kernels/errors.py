"""The one exception hierarchy of Tandem, on the lowest floor so that every floor raises it.

Every error a user can cause (a bad path, a broken checkpoint, a prompt that is too long) is a
`TandemError` whose message says what is wrong and how to fix it. The CLI prints it as
`error: <message>` and exits with status 2; anything else is a bug and keeps its traceback.
"""

from __future__ import annotations


class TandemError(Exception):
    """Base class: a problem the user can fix, with a message that says how."""


class CheckpointError(TandemError):
    """The model folder is missing, incomplete, corrupt or not in a supported format."""


class UnsupportedModelError(CheckpointError):
    """The checkpoint is a model family (or variant) that Tandem does not implement."""


class ResourceError(TandemError):
    """The machine lacks the memory (or other resource) needed for the request."""


class GenerationError(TandemError):
    """A generation request that cannot be served (e.g. the prompt exceeds the context)."""


class SettingsError(TandemError):
    """A setting that cannot work here: a flag's value against the model or machine, a profile's value, a field of
    the chat app's settings form."""


class KernelError(TandemError, ValueError):
    """The CPU kernels cannot run what was asked (a weight kind, quantization, group size or variant they do not
    support). Also a ValueError: callers of the kernel API that check arguments catch that."""


class StoreError(TandemError):
    """A saved file (a conversation, the settings) cannot be used or written as asked."""


class UsageError(TandemError):
    """A flag or argument on the command line is missing, unknown or out of range."""


class OutputError(TandemError):
    """A result could not be written (standard output or a file): disk full, closed, or not writable."""
