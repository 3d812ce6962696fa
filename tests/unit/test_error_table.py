"""The one table of error codes (meshnet/core/errors.py) against the engine's header: every
meshnet_status the C ABI can return is a code here, named as the header names it."""

import re
from pathlib import Path

from meshnet.core import errors

HEADER = Path(__file__).resolve().parents[2] / "engine_c" / "meshnet_engine.h"
# where the header's name and the code differ, and why: the code names it as a user meets it
RENAMED = {"DECODE": errors.DECODE_FAILED,        # llama.cpp failed to decode
           "BAD_VALUE": errors.BAD_PAYLOAD,       # a residual or logit that is not finite
           "NO_TEMPLATE": errors.NO_CHAT_TEMPLATE}


def header_statuses() -> dict[str, int]:
    text = HEADER.read_text()
    body = text[text.index("typedef enum {"):text.index("} meshnet_status;")]
    return {name: int(value) for name, value in re.findall(r"MESHNET_ERR_(\w+)\s*=\s*(\d+)", body)}


def test_every_engine_status_of_the_header_is_a_code_of_the_table():
    statuses = header_statuses()
    assert len(statuses) >= 18
    assert set(errors.BY_ENGINE_STATUS) == set(statuses.values())
    for name, value in statuses.items():
        assert errors.BY_ENGINE_STATUS[value] == RENAMED.get(name, name.lower()), name


def test_every_code_has_an_http_status_of_its_own_kind():
    assert errors.http_status(errors.BUSY) == 429 and errors.http_status(errors.STAGE_LOST) == 503
    assert errors.http_status(errors.CONTEXT_FULL) == 400
    assert errors.http_status(errors.INTERNAL) == 500 and errors.http_status("a code from the wire") == 500
    assert set(errors.HTTP_STATUS) <= set(errors.CODES)
    assert set(errors.HTTP_STATUS.values()) <= {400, 429, 503}
