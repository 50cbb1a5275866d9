"""psclient's exceptions: one class per psd status code (psd/status.h).

Every failed call raises a subclass of :class:`Error`; ``.code`` is psd's code name
("DEADLINE_EXCEEDED", ...), ``.code_value`` its number and ``.message`` the text the daemon (or
libpsclient) gave. What to do about each code is psd's contract (README "The client library"):
DeadlineExceeded -> retry the wait, Unavailable -> back off (the next call reconnects),
InvalidArgument -> fix the request, OutOfRange -> training is over, Aborted -> the cluster restored
a checkpoint: pull the variables again.
"""


class Error(Exception):
    """A psd status that is not OK. Subclasses name the code."""

    code = "UNKNOWN"
    code_value = -1

    def __init__(self, message="", code=None):
        super().__init__(message)
        self.message = message
        if code is not None:
            self.code = code

    def __str__(self):
        return f"{self.code}: {self.message}"


class InvalidArgument(Error, ValueError):
    """Fix the request; retrying will not help (also a ValueError)."""
    code, code_value = "INVALID_ARGUMENT", 1


class NotFound(Error):
    """Unknown variable or slot."""
    code, code_value = "NOT_FOUND", 2


class AlreadyExists(Error):
    """The name exists with a different definition (dtype, shape, trainability)."""
    code, code_value = "ALREADY_EXISTS", 3


class FailedPrecondition(Error):
    """Out of order: e.g. a call on a closed Client, a checkpoint without --checkpoint-dir."""
    code, code_value = "FAILED_PRECONDITION", 4


class DeadlineExceeded(Error):
    """A wait ran past its deadline; nothing was lost; retry."""
    code, code_value = "DEADLINE_EXCEEDED", 5


class Unavailable(Error):
    """The daemon is not reachable or not ready; back off and retry."""
    code, code_value = "UNAVAILABLE", 6


class Cancelled(Error):
    """The daemon is shutting down."""
    code, code_value = "CANCELLED", 7


class OutOfRange(Error):
    """The token queue is closed: training is over."""
    code, code_value = "OUT_OF_RANGE", 8


class ResourceExhausted(Error):
    """A frame too big (psd --max-frame-bytes), too many connections, the model too big."""
    code, code_value = "RESOURCE_EXHAUSTED", 9


class Internal(Error):
    """A bug (please report it)."""
    code, code_value = "INTERNAL", 10


class Unimplemented(Error):
    """Not supported by this build or daemon (e.g. CUDA memory in a CPU-only libpsclient)."""
    code, code_value = "UNIMPLEMENTED", 11


class Unauthenticated(Error):
    """Missing or wrong credentials (psd --auth-token-file, TLS client certificates)."""
    code, code_value = "UNAUTHENTICATED", 12


class Aborted(Error):
    """The cluster restored a checkpoint: re-read the step and the values, go on."""
    code, code_value = "ABORTED", 13


ERRORS = (InvalidArgument, NotFound, AlreadyExists, FailedPrecondition, DeadlineExceeded, Unavailable,
          Cancelled, OutOfRange, ResourceExhausted, Internal, Unimplemented, Unauthenticated, Aborted)
_BY_VALUE = {cls.code_value: cls for cls in ERRORS}


def error_for(code_value, message):
    """The exception for psd code number `code_value` (a plain Error for a code this psclient does not know)."""
    cls = _BY_VALUE.get(code_value)
    if cls is None:
        return Error(message, code=f"CODE_{code_value}")
    return cls(message)
