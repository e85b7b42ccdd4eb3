"""The one exception type for bad user input.

Every problem a user can fix (a malformed dataset row, an impossible setting, a
missing file) is raised as :class:`InputError` with a single-line message that
names the file, row or key and the reason.  The command line turns it into
``error: <message>`` on stderr and exit code 2, before any heavy work starts.
"""


class InputError(ValueError):
    """Bad user input; the message is one line naming where and why."""
