"""The one exception type that means "the user asked for something wrong".

Entry points turn it into a single line on stderr and exit code 2, never a traceback.
"""

from __future__ import annotations


class UserError(Exception):
    """Bad input: the message names the problem and the fix."""


def from_worker(message: str) -> str:
    """The message a UserError was raised with in a DataLoader worker: torch re-raises it in
    the rank with the worker's traceback as its message ("Caught UserError in DataLoader
    worker process 0. Original Traceback ... UserError: <message>")."""
    if "Original Traceback" not in message:
        return message
    return message.rstrip().splitlines()[-1].split("UserError: ", 1)[-1]
