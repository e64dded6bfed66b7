"""One exception type for every bad input the pipeline can meet.

Stages catch `PipelineError` at the top and print its message as a single line
(what went wrong and where), instead of a traceback from deep inside a library.
"""


class PipelineError(Exception):
    """A bad input or configuration, with a one-line message naming what and where."""
