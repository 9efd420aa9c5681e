"""The one exception type users see: the CLI prints it as one line (exit code 2), without a traceback."""


class KvboundError(Exception):
    """A user-facing error: bad input, a missing file, an unsupported model."""
