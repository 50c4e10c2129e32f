"""User-facing errors.

A :class:`PipelineError` carries one line that names the offending file, column or value.
Job entry points (``pipeline.cli``) print that line and exit non-zero; nothing else of
the traceback is shown unless ``PIPELINE_DEBUG=1``.
"""


class PipelineError(Exception):
    """An error caused by bad input or configuration, explained in one line."""

    exit_code = 2

    def __init__(self, message: str):
        super().__init__(" ".join(str(message).split()))  # always a single line


class BadInputError(PipelineError):
    """Missing/unreadable input path, or data that does not match its schema."""


class ConfigError(PipelineError):
    """An invalid configuration value."""
