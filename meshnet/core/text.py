"""Text at meshnet's edges: what a person types or a client sends must be UTF-8 before it
reaches the tokenizer, and a refusal names the byte that is not."""

from __future__ import annotations

from meshnet.core import errors
from meshnet.core.errors import MeshnetError


def utf8_or_error(text: str, what: str) -> bytes:
    """The text's UTF-8 bytes; text holding undecodable bytes (a command-line argument in
    another encoding arrives with them as surrogates) is refused with the offending byte."""
    try:
        return text.encode()
    except UnicodeEncodeError as e:
        bad = text[e.start]
        if not "\udc80" <= bad <= "\udcff":   # a lone surrogate (JSON's "\ud800"), not an undecodable byte
            raise MeshnetError(errors.INVALID_ARGUMENT, f"{what} holds a lone surrogate U+{ord(bad):04X} at character "
                               f"{e.start}, which is no Unicode text; give it in UTF-8") from None
        offset = len(text[:e.start].encode(errors="surrogatepass"))
        byte = ord(bad) - 0xdc00
        raise MeshnetError(errors.INVALID_ARGUMENT, f"{what} is not valid UTF-8 (byte 0x{byte:02x} at offset {offset}); "
                           "give it in UTF-8") from None
