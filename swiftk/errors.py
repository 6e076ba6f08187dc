"""The one exception type users catch. Subclasses ValueError so bad-argument errors read naturally."""


class SwiftkError(ValueError):
    """Bad input, unsupported model or file, or a failed integrity check; the message names the problem."""
