"""The fenced code blocks of the README and docs/, as tests read them."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOCS = (ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")))
_FENCE = re.compile(r"^```(\w*)\n(.*?)^```\n", re.M | re.S)


@dataclass(frozen=True)
class Block:
    doc: str  # path from the repository's root
    language: str
    text: str
    before: str  # the paragraph just before the block

    @property
    def first_line(self) -> str:
        return self.text.splitlines()[0]


def blocks(language: str | None = None) -> list[Block]:
    found = []
    for path in DOCS:
        source = path.read_text()
        for match in _FENCE.finditer(source):
            before = source[: match.start()].rstrip().rsplit("\n\n", 1)[-1]
            block = Block(str(path.relative_to(ROOT)), match.group(1), match.group(2), before)
            if language is None or block.language == language:
                found.append(block)
    return found


def block_starting(doc: str, first_line: str) -> Block:
    (block,) = [b for b in blocks() if b.doc == doc and b.first_line.startswith(first_line)]
    return block
