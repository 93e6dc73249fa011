"""The one error type a user sees, and the signal a stopped process raises.

Every failure caused by input (a file, a name, a prompt, a template) raises `FuselaneError` with a message
that fits on one line; the CLI prints it and exits with code 1, never a traceback.
"""


class FuselaneError(Exception):
    """A user-facing failure: the message names what is wrong and, where it helps, what to do."""


class GgufError(FuselaneError):
    """A GGUF file that cannot be read: missing, not GGUF, truncated, inconsistent or hostile."""


class ModelError(FuselaneError):
    """A checkpoint that reads as GGUF but is not a model fuselane can run (architecture, tensors, shapes)."""


class Terminated(BaseException):
    """SIGTERM, raised where the process is so that `finally` blocks (a pull's temporary files) still run.

    A BaseException, like KeyboardInterrupt: no `except Exception` may swallow a request to stop."""
