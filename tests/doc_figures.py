"""The figures a reference doc states, and the files it cites for them (read by tests/test_docs.py).

A doc is cut into passages: each table row, paragraph and list item (fenced code blocks are examples and
are left out). A passage cites the result files (`<bench>_<gpu>_<date>_<commit>.<ext>` of bench/results/)
and the code (`tests/…py`, `taehv_slurm/…py`, `bench/…py`: a bound a test asserts, a constant) it names; a
row of a table without a `result file` column cites what the paragraph above the table cites, and `the
same` in that column is the row above's.

A figure is a number with a unit of measure (s, min, m:ss, %, clips/s, GiB, TFLOP/s, 4.5×, log windows)
in prose; in a table's figure columns (all but the first and `command`, `result file`, `commit`, `GPU`)
every number is one, but shapes (2×2). A figure is found when a number in a cited file, scaled as its unit
allows (a fraction as %, GB as GiB, s as ms, s as min), rounds to it as written: 3.308 backs "3.3 s", not
"3.0 s"; a whole number in a file backs only a figure written without decimals. In "before → after"
cells the figures before the arrow may be in the row above's files (the step before). A percentage or a
ratio written beside the two figures it is computed from (62.21 against 62.39 clips/s: −0.29 %) is
checked by computing it.
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from tests.helpers import REPO

RESULTS = REPO / "bench" / "results"
RESULT_FILE = re.compile(r"[a-z0-9_]+_(?:cpu|(?:\d+x)?[a-z]+\d+)_\d{4}-\d{2}-\d{2}_[0-9a-f]{7,}(?:-dirty)?"
                         r"\.(?:json\.gz|json|txt)")
SOURCE_FILE = re.compile(r"(?:tests|taehv_slurm|bench)/[\w/]+\.py")
# A number as the docs write it: 10 000, 1 989, 61.5, −0.28 (a minus sign or a hyphen before it)
NUMBER = r"[−-]?(?:\d{1,3}(?:[  ]\d{3})+(?![\d.])|\d+(?:\.\d+)?)"
UNIT = r"(?:clips/s|TFLOP/s|TFLOP|TB/s|GiB|GB|MB|ms|µs|min|s|h|%|log windows?)(?![\w/])"
# numbers joined by –, /, ',' , 'and', 'against' … before one unit ("0.50 / 1.87 s", "47.3 / 24.3 clips/s"),
# a ratio (4.5×, not the 4 of "4 × H200"), a time as m:ss
FIGURE = re.compile(rf"(?<![\w.×/:-])(?<!× )(?:[~≈]\s?)?({NUMBER}(?:\s?(?:–|/|,|and|or|against|to)\s?"
                    rf"{NUMBER})*)(?:\s?({UNIT})|(×)(?!\s?\d))|(?<![\w:])(\d+:\d\d)(?![\d:])")
# How a file's number may be written in the doc, by the doc's unit: a fraction as a percentage, bytes or GB
# as GiB, seconds as ms or µs (and ms as s), seconds as minutes or hours.
SCALES = {"%": (1, 100), "GiB": (1, 1e9 / 2**30, 1 / 2**30), "ms": (1, 1e3), "µs": (1, 1e6, 1e3),
          "s": (1, 1e-3), "min": (1, 1 / 60), "h": (1, 1 / 3600), "TB/s": (1, 1e-12), "GB": (1, 1e-9),
          "MB": (1, 1e-6)}
LABEL_COLUMNS = ("command", "result file", "commit", "gpu")


@dataclass(frozen=True)
class Figure:
    written: str  # one number, as written
    unit: str  # "" for a bare number in a table cell
    before_arrow: bool = False  # left of "→": the state before the row's change


@dataclass
class Passage:
    """A table row, a paragraph or a list item of `doc`, from line `line`."""

    doc: str
    line: int
    text: str
    figures: list[Figure]
    files: list[str] = field(default_factory=list)  # result files it cites
    sources: list[str] = field(default_factory=list)  # code it cites
    earlier: list[str] = field(default_factory=list)  # the row above's result files (before → after)

    def where(self) -> str:
        return f"{self.doc}:{self.line}"


def value(number: str) -> float:
    return float(number.replace("−", "-").replace(" ", "").replace(" ", ""))


def figures_in(text: str, before_arrow: bool = False) -> list[Figure]:
    """Every figure of prose `text`, one number each."""
    found = []
    for m in FIGURE.finditer(_plain(text)):
        if m.group(4):
            minutes, seconds = m.group(4).split(":")
            found.append(Figure(str(60 * int(minutes) + int(seconds)), "s", before_arrow))
        else:
            unit = m.group(2) or m.group(3)
            found += [Figure(n, unit, before_arrow) for n in re.findall(NUMBER, m.group(1))]
    return found


def cell_figures(cell: str) -> list[Figure]:
    """Every number of a table cell (with its unit where one follows it), but shapes (2×2, 12×480×720)."""
    found = []
    for i, part in enumerate(re.split(r"\s→\s", _plain(cell), maxsplit=1)):
        part = re.sub(r"\d+(?:\s?×\s?\d+)+", " ", part)
        with_units = figures_in(part, before_arrow=i == 0 and "→" in cell)
        bare = [Figure(n, "", i == 0 and "→" in cell) for n in re.findall(rf"(?<![\w.]){NUMBER}(?!\w)", part)]
        for figure in with_units:  # a number with its unit replaces the same number bare
            if (same := Figure(figure.written, "", figure.before_arrow)) in bare:
                bare.remove(same)
        found += with_units + bare
    return found


def cited(text: str) -> tuple[list[str], list[str]]:
    return (list(dict.fromkeys(RESULT_FILE.findall(text))),
            [s for s in dict.fromkeys(SOURCE_FILE.findall(text)) if (REPO / s).is_file()])


def passages(path: Path) -> Iterator[Passage]:
    """Every passage of the markdown file `path`: each table row, paragraph and list item."""
    doc = str(path.relative_to(REPO))
    above: list[str] = []  # the files the last paragraph cited (for a table without a result file column)
    for line, block in _blocks(path.read_text().splitlines()):
        if block[0].startswith("|"):
            yield from _table_rows(doc, line, block, above)
            continue
        text = " ".join(t.strip() for t in block)
        files, sources = cited(text)
        above = files or above
        yield Passage(doc, line, text, figures_in(text), files, sources)


def _blocks(lines: list[str]) -> Iterator[tuple[int, list[str]]]:
    """(first line, lines) of each table, paragraph and list item, outside fenced code blocks."""
    block: list[str] = []
    first, fenced = 0, False
    for number, line in enumerate([*lines, ""], start=1):
        table = line.startswith("|")
        ends = (not line.strip() or line.startswith(("#", "- ", "```"))
                or bool(block) and table != block[0].startswith("|"))
        if ends and block:
            yield first, block
            block = []
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced and line.strip() and not line.startswith("#"):
            first = first if block else number
            block.append(line)


def _table_rows(doc: str, first: int, rows: list[str], above: list[str]) -> Iterator[Passage]:
    def cells(line: str) -> list[str]:
        return [c.strip() for c in line.strip().strip("|").split("|")]

    header = [_plain(c).strip().lower() for c in cells(rows[0])]
    file_column = next((i for i, h in enumerate(header) if h.startswith("result file")), None)
    figure_columns = [i for i, h in enumerate(header) if i > 0 and not h.startswith(LABEL_COLUMNS)]
    previous = above
    for number, line in enumerate(rows[2:], start=first + 2):
        row = cells(line)
        files, sources = cited(line)
        if file_column is not None:
            own, _ = cited(row[file_column])
            files = [*previous, *own] if row[file_column].startswith("the same") else own
        else:
            files = files or above
        figures = [f for i in figure_columns if i < len(row) for f in cell_figures(row[i])]
        yield Passage(doc, number, line, figures, files, sources, earlier=previous)
        previous = files


def _plain(text: str) -> str:
    """Without code spans (names, commands, commits), links' targets and bold marks."""
    return re.sub(r"\]\([^)]*\)", "]", re.sub(r"`[^`]*`", " ", text)).replace("**", "")


@functools.cache
def file_numbers(name: str) -> tuple[tuple[float, bool], ...]:
    """(number, written whole) of every number in file `name`: a result file's (a JSON's numbers and those in
    its strings; a text's), or a source file's text."""
    path = REPO / name if "/" in name else RESULTS / name
    if name.endswith(".gz") or not path.is_file():
        return ()
    text = path.read_text()
    written = re.compile(r"-?\d+(?:\.\d+)?(?:e-?\d+)?")
    if not name.endswith(".json"):
        numbers = written.findall(text.replace("_", ""))
        return tuple((float(n), "." not in n and "e" not in n) for n in numbers)
    found: list[tuple[float, bool]] = []

    def walk(node: object) -> None:
        if isinstance(node, bool) or node is None:
            return
        if isinstance(node, int | float):
            found.append((float(node), isinstance(node, int)))
        elif isinstance(node, str):
            found.extend((float(n), "." not in n and "e" not in n) for n in written.findall(node))
        elif isinstance(node, dict):
            for key, item in node.items():
                walk(key)
                walk(item)
        elif isinstance(node, list):
            for item in node:
                walk(item)

    walk(json.loads(text))
    return tuple(found)


def rounds_to(written: str, candidates: list[tuple[float, bool]], scales: tuple[float, ...]) -> bool:
    """Some candidate, scaled, rounds to the number as written; a whole candidate only to a whole figure,
    unscaled."""
    target = abs(value(written))
    decimals = len(written.split(".")[1]) if "." in written else 0
    half = 0.5 * 10**-decimals + 1e-9
    return any(abs(abs(v * k) - target) <= half for v, whole in candidates for k in scales
               if not (whole and decimals and k == 1))


def computed(figure: Figure, beside: list[Figure]) -> bool:
    """A percentage or a ratio computed from two other figures written beside it: a/b, a/b − 1."""
    others = [abs(value(f.written)) for f in beside if f != figure and value(f.written) != 0]
    ratios = [a / b for i, a in enumerate(others) for j, b in enumerate(others) if i != j]
    if figure.unit in ("%", ""):
        return rounds_to(figure.written, [(100 * r, False) for r in ratios] + [(100 * (r - 1), False)
                                                                                for r in ratios], (1,))
    return figure.unit == "×" and rounds_to(figure.written, [(r, False) for r in ratios], (1,))


def unfound(passage: Passage) -> list[str]:
    """The figures of `passage` found in none of the files it cites, nor computed from figures beside them."""
    pool = [n for name in [*passage.files, *passage.sources] for n in file_numbers(name)]
    earlier = [n for name in passage.earlier for n in file_numbers(name)]
    missing = []
    for figure in passage.figures:
        scales = SCALES.get(figure.unit, (1,))
        candidates = pool + earlier if figure.before_arrow else pool
        if not (rounds_to(figure.written, candidates, scales) or computed(figure, passage.figures)):
            missing.append(f"{figure.written} {figure.unit}".strip())
    return missing
