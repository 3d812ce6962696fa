"""The one error type of meshnet: a stable code a program can branch on, a sentence a
person can act on, and the context (stage, session, ...) that locates it."""

from __future__ import annotations


# The CLI's exit status says which kind of problem it was, from the same code.
EXIT_STATUS = {
    **dict.fromkeys(("not_gguf", "truncated_gguf", "model_not_found", "model_checksum", "unknown_model", "model_load",
                     "unsupported_arch", "bad_range", "engine_missing", "engine_mismatch"), 3),   # the model or engine
    **dict.fromkeys(("route_incomplete", "stage_lost", "unreachable", "deadline_exceeded", "busy",
                     "shutting_down", "worker_exited", "address_in_use", "timeout"), 4),         # the workers, the network
    **dict.fromkeys(("context_full", "bad_token", "bad_width", "invalid_argument", "too_many_sessions",
                     "unknown_session", "cancelled", "bad_payload"), 5),                        # the request
    "bad_address": 2,                                                                            # the command line
}


def exit_status(code: str) -> int:
    """1 for anything not listed; 2 is click's, for a bad command line."""
    return EXIT_STATUS.get(code, 1)


class MeshnetError(Exception):
    def __init__(self, code: str, message: str, **context):
        super().__init__(message)
        self.code = code
        self.message = message
        self.context = context

    def to_dict(self) -> dict:
        return {"code": self.code, "message": self.message, **self.context}

    def __str__(self) -> str:
        return f"[{self.code}] {self.message}"
