"""Errors as data: every code is defined once, in meshnet.core.errors, with its exit status and
what it means; other modules name codes through its constants. No model, no sockets."""

import ast
from pathlib import Path

import pytest

from meshnet.core import errors
from meshnet.core.errors import CODES, MeshnetError, exit_status

PACKAGE = Path(errors.__file__).resolve().parents[1]

def constants() -> dict[str, str]:
    """The module's code constants: upper-case names whose value is a registered code."""
    return {name: value for name, value in vars(errors).items()
            if name.isupper() and isinstance(value, str) and value in CODES}


def test_every_code_has_an_exit_status_and_a_meaning():
    assert CODES
    for code, (status, meaning) in CODES.items():
        assert status in (1, 2, 3, 4, 5), code
        assert isinstance(meaning, str) and meaning.strip() and "\n" not in meaning, code
        assert exit_status(code) == status
        assert errors.meaning(code) == meaning


def test_every_code_has_one_constant_named_as_the_code_in_upper_case():
    named = constants()
    for code in CODES:
        assert named.get(code.upper()) == code
    assert sorted(named.values()) == sorted(CODES), "two constants with the same value"


@pytest.mark.parametrize("code,status", [
    ("bad_address", 2),
    ("not_gguf", 3), ("bad_range", 3), ("engine_missing", 3), ("model_not_found", 3),
    ("route_incomplete", 4), ("stage_lost", 4), ("deadline_exceeded", 4), ("busy", 4), ("hop_unreachable", 4),
    ("context_full", 5), ("cancelled", 5), ("bad_payload", 5), ("invalid_argument", 5), ("bad_key", 5),
    ("malformed", 1), ("internal", 1), ("closed", 1), ("aborted", 1),
])
def test_known_codes_keep_their_exit_status(code, status):
    assert exit_status(code) == status


def test_a_code_from_the_wire_that_is_not_listed_is_carried_with_exit_status_1():
    error = MeshnetError("from_a_newer_peer", "something new", stage="[0,15)")
    assert error.code == "from_a_newer_peer"
    assert error.to_dict() == {"code": "from_a_newer_peer", "message": "something new", "stage": "[0,15)"}
    assert str(error) == "[from_a_newer_peer] something new"
    assert exit_status("from_a_newer_peer") == 1
    assert errors.meaning("from_a_newer_peer")


def test_the_constants_are_the_plain_wire_strings():
    assert errors.STAGE_LOST == "stage_lost" and type(errors.STAGE_LOST) is str
    assert errors.DUPLICATE_REQUEST == "duplicate_request" and errors.BAD_VERSION == "bad_version"


def test_every_engine_status_maps_to_a_registered_code():
    from meshnet.engine.binding import STATUS_CODES  # reads the header only; the library is not loaded

    assert set(STATUS_CODES.values()) <= set(CODES)


def _literal_codes(path: Path) -> list[str]:
    """`MeshnetError("x", ...)` / `ProtocolError("x", ...)` calls whose code is a string literal."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if not isinstance(node, ast.Call) or not node.args:
            continue
        func = node.func
        name = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else None
        first = node.args[0]
        if name in ("MeshnetError", "ProtocolError") and isinstance(first, ast.Constant) and isinstance(first.value, str):
            found.append(f"{path.relative_to(PACKAGE).as_posix()}:{node.lineno}: {first.value!r}")
    return found


def test_no_module_spells_a_code_as_a_string_literal():
    scanned = sorted(PACKAGE.rglob("*.py"))
    assert {p.relative_to(PACKAGE).as_posix() for p in scanned} >= {"cli/mesh.py", "route/sessions.py"}
    literals = [hit for path in scanned for hit in _literal_codes(path)]
    assert not literals, "use the constants of meshnet.core.errors:\n" + "\n".join(literals)
