"""The one exception type that the command line turns into a single line and a non-zero exit."""


class XtrainError(Exception):
    """A problem with the user's input or environment, stated in one line that names it.

    Anything else that escapes a rank is a bug and is reported as such."""
