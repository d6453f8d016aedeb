"""The one exception type that means "the user's input is wrong": the CLI prints it as one line, exit 2."""


class UserError(Exception):
    """Bad flags, missing files or refused on-disk state. Printed without a traceback; exit code 2."""

    exit_code = 2
