"""The one exception type that means "the user asked for something wrong".

Entry points turn it into a single line on stderr and exit code 2, never a traceback.
"""


class UserError(Exception):
    """Bad input: the message names the problem and the fix."""


def from_worker(message: str) -> str:
    """The message a UserError was raised with in a DataLoader worker: torch re-raises it in
    the rank with the worker's traceback as its message ("Caught UserError in DataLoader
    worker process 0. Original Traceback ... UserError: <message>")."""
    if "Original Traceback" not in message:
        return message
    return message.rstrip().splitlines()[-1].split("UserError: ", 1)[-1]


def storage_missing(url: str, err: ImportError) -> str:
    """Why fsspec cannot open `url` and the fix, when fsspec knows its store but the store's
    package is not installed: "fsspec cannot open gs:// URLs here (...): pip install gcsfs"
    (the package named by fsspec's own registry)."""
    from fsspec.registry import known_implementations

    scheme = url.split("://")[0]
    package = known_implementations.get(scheme, {}).get("class", "").split(".")[0]
    fix = f"pip install {package}" if package else "install the fsspec extra for it"
    return f"fsspec cannot open {scheme}:// URLs here ({err}): {fix}"
