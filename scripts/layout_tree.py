"""The package's layout as docs/ARCHITECTURE.md ("Layout") shows it, generated from the
tree: every folder and module of ``kvpool/``, each with the first sentence of its
docstring (shortened to one line; a folder's to two).

    python scripts/layout_tree.py            print the tree
    python scripts/layout_tree.py --check    exit 1 when the doc's block differs
    python scripts/layout_tree.py --write    rewrite the doc's block

The block sits between ``<!-- layout:begin -->`` and ``<!-- layout:end -->``;
``tests/test_structure.py`` runs ``--check``, so a moved, added or deleted module shows
up in the doc in the same commit."""

from __future__ import annotations

import ast
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "kvpool"
DOC = ROOT / "docs" / "ARCHITECTURE.md"
BEGIN, END = "<!-- layout:begin -->", "<!-- layout:end -->"
NAME_WIDTH = 30
WIDTH = 108


def summary(path: Path) -> str:
    """The first sentence of ``path``'s docstring (a package: its ``__init__``'s)."""
    source = path / "__init__.py" if path.is_dir() else path
    if not source.exists():
        return ""
    doc = ast.get_docstring(ast.parse(source.read_text())) or ""
    text = " ".join(doc.split("\n\n")[0].split())
    for end in (". ", ".) ", "; "):
        if end in text:
            text = text[: text.index(end) + len(end) - 1]
            break
    return text.rstrip(".:")


def _entry(name: str, text: str, depth: int, most: int = 1) -> list[str]:
    indent = "  " * depth
    room = WIDTH - NAME_WIDTH
    lines = textwrap.wrap(text, room) or [""]
    if len(lines) > most:
        lines = lines[: most - 1] + [textwrap.shorten(" ".join(lines[most - 1:]), room,
                                                      placeholder=" ...")]
    first = f"{indent}{name}".ljust(NAME_WIDTH - 1) + " "
    if len(first) > NAME_WIDTH:  # a long name: the text starts on the next line
        return [first.rstrip()] + [" " * NAME_WIDTH + line for line in lines]
    return [(first + lines[0]).rstrip()] + [" " * NAME_WIDTH + line for line in lines[1:]]


def tree(folder: Path = PACKAGE, depth: int = 0) -> list[str]:
    out: list[str] = []
    if depth == 0:
        out += _entry(f"{folder.name}/", summary(folder), 0, 2)
    children = sorted(p for p in folder.iterdir()
                      if p.name != "__pycache__" and not p.name.startswith("."))
    for p in children:
        if p.is_dir() and (p / "__init__.py").exists():
            out += _entry(f"{p.name}/", summary(p), depth + 1, 2)
            out += tree(p, depth + 1)
        elif p.is_dir():
            names = sorted(q.name for q in p.iterdir() if q.is_file())
            out += _entry(f"{p.name}/", "native sources: " + " ".join(names), depth + 1)
        elif p.suffix == ".py" and p.name != "__init__.py":
            out += _entry(p.name, summary(p), depth + 1)
    return out


def block() -> str:
    return "\n".join([BEGIN, "```", *tree(), "```", END])


def main() -> int:
    doc = DOC.read_text()
    if "--check" in sys.argv or "--write" in sys.argv:
        if BEGIN not in doc or END not in doc:
            print(f"{DOC.name}: no {BEGIN} ... {END} block")
            return 1
        start, end = doc.index(BEGIN), doc.index(END) + len(END)
        if "--write" in sys.argv:
            DOC.write_text(doc[:start] + block() + doc[end:])
            return 0
        if doc[start:end] != block():
            print(f"{DOC.name}'s layout differs from the tree: "
                  "run python scripts/layout_tree.py --write")
            return 1
        return 0
    print(block())
    return 0


if __name__ == "__main__":
    sys.exit(main())
