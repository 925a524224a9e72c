"""The one exception type users see for bad input: printed as a single line by the CLIs."""


class WeaverError(Exception):
    """Bad input or configuration (wrong path, unsupported model, mismatched drafter, ...)."""
