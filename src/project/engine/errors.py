"""The one exception type that means "the user asked for something wrong".

Entry points turn it into a single line on stderr and exit code 2, never a traceback.
"""


class UserError(Exception):
    """Bad input: the message names the problem and the fix."""
