"""Structured output for `meshnet serve`: OpenAI's `response_format` (json_object, and
json_schema) and llama-server's raw `grammar` field, as the GBNF grammar the tail's
sampler takes (core/sampling.py's grammar). A schema's grammar is llama.cpp's own
(common/json-schema-to-grammar, through the engine), as llama-server builds it."""

from __future__ import annotations

import json

from meshnet.core import errors
from meshnet.core.errors import MeshnetError
from meshnet.core.sampling import MAX_GRAMMAR_BYTES
from meshnet.engine.binding import json_schema_grammar

# OpenAI's json_object: the answer is a JSON object, of any keys
JSON_OBJECT_SCHEMA = {"type": "object"}


def _refused(message: str, field: str) -> MeshnetError:
    return MeshnetError(errors.INVALID_ARGUMENT, message, field=field)


def answer_schema(response_format) -> dict | None:
    """The JSON schema a response_format holds an answer to (None: free text), checked as
    grammar_of checks it."""
    kind = response_format.type if response_format is not None else "text"
    if kind == "text":
        return None
    grammar_of(response_format, None)   # (refused here as it would be without tools)
    if kind == "json_object":
        return JSON_OBJECT_SCHEMA
    return response_format.json_schema.schema_ if response_format.json_schema.schema_ is not None else {}


def grammar_of(response_format, grammar: str | None) -> str:
    """The grammar a request asks its answer to follow ("": none). response_format is the
    request's (openai.ResponseFormat, or None). A request that gives no valid one:
    INVALID_ARGUMENT, naming the field (a 400)."""
    kind = response_format.type if response_format is not None else "text"
    if grammar is not None:
        if kind != "text":
            raise _refused("grammar and a response_format of json_object or json_schema cannot both be given: "
                           "each fixes the answer's form", "grammar")
        if not grammar.strip():
            raise _refused("grammar is empty: give GBNF text with a rule named root", "grammar")
        return grammar
    if kind == "text":
        return ""
    if kind == "json_object":
        schema = JSON_OBJECT_SCHEMA
    elif kind == "json_schema":
        spec = response_format.json_schema
        if spec is None:
            raise _refused('response_format.json_schema is required for the type json_schema: {"name": ..., '
                           '"schema": {...}}', "response_format.json_schema")
        schema = spec.schema_ if spec.schema_ is not None else {}   # none: any JSON value
    else:
        raise _refused(f"response_format.type must be text, json_object or json_schema, not {kind!r}",
                       "response_format.type")
    try:
        grammar = json_schema_grammar(json.dumps(schema))
    except MeshnetError as e:
        raise _refused(f"response_format.json_schema.schema: {e.message}", "response_format.json_schema.schema") from None
    if len(grammar.encode()) > MAX_GRAMMAR_BYTES:   # the one limit of a grammar, however it is given
        raise _refused(f"response_format.json_schema.schema: its grammar is {len(grammar.encode())} bytes, over the "
                       f"{MAX_GRAMMAR_BYTES}-byte limit of a grammar", "response_format.json_schema.schema")
    return grammar
