"""The one error type of meshnet: a stable code a program can branch on, a sentence a
person can act on, and the context (stage, session, ...) that locates it."""

from __future__ import annotations


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
