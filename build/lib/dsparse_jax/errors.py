"""The error a user can fix: a bad config value, a missing or unreadable file, an unusable
workdir, an incompatible checkpoint, a bad mesh. Every command (launch/, the harness, the
benchmarks) prints it as one line, `error: <message>`, and exits with status 2
(config/cli.py); anything else is a bug and keeps its traceback (status 1). The message
names the field or the path.
"""


class UserError(Exception):
    """A problem with the user's input; the message names the field (config.x.y) or path."""
