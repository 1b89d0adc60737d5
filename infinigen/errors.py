"""One exception type for every problem a user can fix; the CLI prints it as one line."""


class InfinigenError(Exception):
    """A clear, user-facing error: bad input, wrong artifact, missing package or device."""


class OutOfMemory(InfinigenError):
    """The device ran out of memory in a run (the message says with what): a smaller batch may run."""
