"""One exception type for every bad input the pipeline can meet.

Stages catch `PipelineError` at the top and print its message as a single line
(what went wrong and where), instead of a traceback from deep inside a library.
"""


class PipelineError(Exception):
    """A bad input or configuration, with a one-line message naming what and where."""


class ResourceShortage(PipelineError):
    """The machine lacks something a stage needs now (free memory), not a bad input: another attempt, later or
    on another worker, may succeed. Its message ends with RESOURCE_MARK, which the work pool looks for in a
    failed run's state to launch it again, as it does a run whose worker died (flows/workpool.py)."""

    def __init__(self, message: str) -> None:
        super().__init__(f"{message} {RESOURCE_MARK}")


RESOURCE_MARK = "(resource shortage: worth another attempt)"
