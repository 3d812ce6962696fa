#!/usr/bin/env python3
"""The README's table of architectures, written from engine_c/architectures.tsv (the one
source of truth: the engine is built from it, `meshnet inspect` asks the engine).

    tools/arch_table.py            print the table
    tools/arch_table.py --write    put it in README.md between its markers
    tools/arch_table.py --check    exit 1 when README.md's table is not the TSV's
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TSV = ROOT / "engine_c" / "architectures.tsv"
README = ROOT / "README.md"
BEGIN, END = "<!-- architectures:begin -->", "<!-- architectures:end -->"
STATUSES = ("splits", "whole", "not-text")


@dataclass(frozen=True)
class Line:
    arch: str
    status: str
    reason: str


def read_table(path: Path = TSV) -> list[Line]:
    lines = []
    for n, raw in enumerate(path.read_text().splitlines(), 1):
        if not raw or raw.startswith("#"):
            continue
        fields = raw.split("\t")
        if len(fields) not in (2, 3) or fields[1] not in STATUSES:
            raise ValueError(f"{path}:{n}: expected 'arch<TAB>status<TAB>reason' with a status of {STATUSES}: {raw!r}")
        reason = fields[2] if len(fields) == 3 else ""
        if fields[1] != "splits" and not reason:
            raise ValueError(f"{path}:{n}: '{fields[0]}' does not split and gives no reason")
        lines.append(Line(fields[0], fields[1], reason))
    return lines


def markdown(lines: list[Line]) -> str:
    splits = [l.arch for l in lines if l.status == "splits"]
    text_gen = [l for l in lines if l.status != "not-text"]
    out = [f"**{len(splits)} of the {len(text_gen)} text-generation architectures of the pin split**, "
           "each with logits max |diff| exactly 0 against the whole model, on a generated random-weight "
           f"model (2 and 3 stages, batched, token by token: `tests/engine/test_architectures.py`). "
           f"{len(lines) - len(text_gen)} more are not text generation.",
           "",
           "Split: " + ", ".join(f"`{a}`" for a in splits) + ".",
           "",
           "| architecture | runs | why not split |",
           "| --- | --- | --- |"]
    for l in lines:
        if l.status != "splits":
            out.append(f"| `{l.arch}` | {'whole only' if l.status == 'whole' else 'not text generation'} | {l.reason} |")
    return "\n".join(out)


def with_table(readme: str, table: str) -> str:
    if BEGIN not in readme or END not in readme:
        raise ValueError(f"README.md has no {BEGIN} ... {END} markers")
    head, rest = readme.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    return f"{head}{BEGIN}\n{table}\n{END}{tail}"


def main() -> int:
    table = markdown(read_table())
    if "--write" in sys.argv:
        README.write_text(with_table(README.read_text(), table))
    elif "--check" in sys.argv:
        if with_table(README.read_text(), table) != README.read_text():
            print("README.md's table of architectures is not engine_c/architectures.tsv's: run tools/arch_table.py --write",
                  file=sys.stderr)
            return 1
    else:
        print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
