"""The one error type the command line turns into a one-line message (exit status 2).

Raise it for anything the user can fix: bad input, a corrupt or mismatched store, a missing
file. The message says what to do. Everything else is a bug and keeps its traceback.
"""


class UserError(Exception):
    """An error caused by input, with a message that says how to fix it."""
