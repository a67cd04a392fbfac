"""The reference docs say what holds now, and say it truly: checked against the code and the result files.

- no words of history in README.md, docs/*.md or bench/results/README.md ("used to", "no longer", "fixed
  in", "since the", "lent", "session", …): a reference states what holds; git keeps what changed;
- docs/configuration.md's tables name every key of the cluster and train configs and no other, and the keys
  a config file must name are those the code requires (docs/errors.md says the same);
- every figure of README.md and docs/benchmarks.md is found, to its stated precision, in a file the same
  passage cites (a result file of bench/results/, or the test whose bound it quotes), or is computed from
  such figures (`DERIVED`, each with its formula); a table row of docs/benchmarks.md names its result
  file, whose commit is the row's, and a result file recorded from a tree with uncommitted changes is
  said to be so where it is cited (tests/doc_figures.py reads the docs and the files).
"""

from __future__ import annotations

import dataclasses
import re
import typing
from pathlib import Path

import pytest

from taehv_slurm.common.config import ClusterConfig, TrainConfig
from tests.doc_figures import (
    RESULT_FILE,
    Figure,
    Passage,
    cited,
    figures_in,
    file_numbers,
    passages,
    rounds_to,
    unfound,
    value,
)
from tests.helpers import REPO

REFERENCE_DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md")), REPO / "bench/results/README.md"]
FIGURE_DOCS = [REPO / "README.md", REPO / "docs/benchmarks.md"]
HISTORY = re.compile(r"\b(used to|no longer|fixed (?:in|since)|since (?:the|this|then)|has since|lent|"
                     r"sessions?|last turn|not run again|before the fix|so far|any ?more|formerly|previously|"
                     r"old name|now that)\b", re.I)

# Figures computed from a cited file's own numbers: (doc, figure as written, formula over numbers written as
# the file has them, what it is). The formula's numbers must be in the passage's files, and it must round to
# the figure.
DERIVED = [
    ("docs/benchmarks.md", "0.3", "100 * (56.77 / 56.61 - 1)",
     "pad_first_conv: the smallest gain of a pair of alternating runs"),
    ("docs/benchmarks.md", "1.1", "100 * (56.95 / 56.34 - 1)",
     "pad_first_conv: the largest gain of a pair of alternating runs"),
    ("docs/benchmarks.md", "4.9", "100 * ((62.85 + 63.10) / (59.91 + 60.13) - 1)",
     "triton_head: the mean of the new runs against the old ones'"),
    ("docs/benchmarks.md", "1.2", "100 * ((64.07 + 63.49 + 63.48) / (62.72 + 63.46 + 62.67) - 1)",
     "triton_relu_grad: the mean of the new runs against the old ones'"),
    ("docs/benchmarks.md", "4.0", "3 * 2 * 24 * 64 * 240 * 360 / 199.0e-6 / 1e12",
     "the ReLU-gradient kernel's bandwidth: 3 passes of a bf16 24×64×240×360 activation in 199.0 µs"),
    ("docs/benchmarks.md", "1.5", "100 * (64.033 / 63.086 - 1)",
     "copy_overlap through the user's command: the run with it against the run without (the rounded 64.0 "
     "and 63.1 beside it give 1.4)"),
    ("docs/benchmarks.md", "11.6", "51.6 - 40",
     "a cold start through the command, precompiled, against the goal of 40 s"),
    ("docs/benchmarks.md", "740", "2 * 42.52 / 114.959 * 1000",
     "the teacher's convolutions: a call's FLOPs (2 clips of 42.52 TFLOP) over their 114.959 ms"),
    ("docs/benchmarks.md", "17.4", "2 / 114.959 * 1000", "the teacher's clips/s were its convolutions all"),
    ("docs/benchmarks.md", "45.1", "160.102 - 114.959", "the teacher's kernels other than its convolutions"),
    ("docs/benchmarks.md", "99", "131.830763697 - 32.616453218",
     "coordinate-descent tuning: the teacher's first call with it against without"),
    ("docs/benchmarks.md", "1.8",
     "(131.830763697 - 32.616453218) / (1 / 12.7241554 - 1 / 12.9216044) / 12.9216044 / 3600",
     "coordinate-descent tuning: hours of teacher time (at its clips/s) its longer compile takes to repay"),
]


def prose(path: Path) -> list[tuple[int, str]]:
    """(line number, line) of `path` outside fenced code blocks (examples: program output, commands)."""
    lines, fenced = [], False
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced:
            lines.append((number, line))
    return lines


def history_words(text: str) -> list[str]:
    return [m.group(0) for m in HISTORY.finditer(text)]


def test_no_reference_doc_speaks_of_history() -> None:
    assert history_words("The plan used to guess; fixed in abc1234, no longer") == [
        "used to", "fixed in", "no longer"]  # the check finds what it looks for
    found = [f"{doc.relative_to(REPO)}:{n}: {words}" for doc in REFERENCE_DOCS for n, line in prose(doc)
             if (words := history_words(line))]
    assert not found, "say what holds now (git keeps what changed):\n" + "\n".join(found)


# ----------------------------------------------------------------------------- configuration.md's keys


def config_keys(cls: type, prefix: str = "") -> set[str]:
    """Every key of a config dataclass, sections dotted (data.frames)."""
    keys = set()
    for f in dataclasses.fields(cls):
        kind = typing.get_type_hints(cls)[f.name]
        nested = dataclasses.is_dataclass(kind)
        keys |= config_keys(kind, f"{prefix}{f.name}.") if nested else {prefix + f.name}
    return keys


def documented(section: str) -> dict[str, str]:
    """key → its default as the table under `section` of docs/configuration.md gives it. A cell's bare names
    follow the section of the dotted name before them (`divergence.window`, `max_in_window`)."""
    text = (REPO / "docs/configuration.md").read_text().split(f"## {section}")[1].split("\n## ")[0]
    found = {}
    for row in re.findall(r"^\| (`.*?) \| (.*?) \|", text, re.M):
        names, defaults = re.findall(r"`([\w.]+)`", row[0]), [d.strip() for d in row[1].split(", ")]
        section_of = ""
        for i, name in enumerate(names):
            section_of = name.rsplit(".", 1)[0] + "." if "." in name else section_of
            key = name if "." in name else section_of + name
            found[key] = defaults[i] if len(defaults) == len(names) else row[1]
    return found


def must_name(text: str, what: str) -> list[str]:
    """The keys `text` says a `what` file must name ("A train YAML must name `a`, `b` and `c`")."""
    said = re.search(rf"{what} (?:YAML |file )?must name ((?:`[\w.]+`(?:,\s+|\s+and\s+)?)+)", text)
    assert said, f"no sentence says what a {what} file must name"
    return re.findall(r"`([\w.]+)`", said.group(1))


@pytest.mark.parametrize("cls, section", [(ClusterConfig, "Cluster config"), (TrainConfig, "Train config")])
def test_configuration_md_names_every_key_and_what_a_file_must_name(cls: type, section: str) -> None:
    table = documented(section)
    assert sorted(config_keys(cls) - set(table)) == [], f"keys of {cls.__name__} missing from the table"
    assert sorted(set(table) - config_keys(cls)) == [], f"keys in the table that {cls.__name__} lacks"
    what = section.split()[0].lower()
    text = (REPO / "docs/configuration.md").read_text().split(f"## {section}")[1].split("\n## ")[0]
    assert must_name(text, f"A {what}") == list(cls.REQUIRED_KEYS)
    assert [table[k] for k in cls.REQUIRED_KEYS] == ["—"] * len(cls.REQUIRED_KEYS)  # no default: required
    errors = (REPO / "docs/errors.md").read_text()
    assert must_name(errors, f"{'A' if what == 'train' else 'a'} {what}") == list(cls.REQUIRED_KEYS)


# ------------------------------------------------------------------------- figures and their result files


def figure_passages() -> list[Passage]:
    return [p for doc in FIGURE_DOCS for p in passages(doc)]


def derived_for(passage: Passage, written: str) -> tuple[str, ...] | None:
    return next((d for d in DERIVED if d[0] == passage.doc and d[1] == written.split()[0].lstrip("+−-")
                 and all(rounds_to(n, [x for f in passage.files for x in file_numbers(f)], (1,))
                         for n in re.findall(r"\d+\.\d+", d[2]))), None)


def test_every_figure_is_found_in_the_file_its_passage_cites() -> None:
    problems, used = [], set()
    for passage in figure_passages():
        if "not kept" in passage.text:
            problems.append(f"{passage.where()}: a figure whose run was not kept (remove it or run it again)")
        elif passage.figures and not (passage.files or passage.sources):
            problems.append(f"{passage.where()}: figures {[f.written for f in passage.figures]} cite no file")
        for missing in unfound(passage) if passage.files or passage.sources else []:
            derived = derived_for(passage, missing)
            if derived is None:
                cites = passage.files + passage.sources
                problems.append(f"{passage.where()}: {missing} is in none of {cites}")
                continue
            used.add(derived)
            assert rounds_to(missing.split()[0], [(eval(derived[2]), False)], (1,)), derived  # noqa: S307
    assert not problems, "\n".join(problems)
    assert used == set(DERIVED), f"DERIVED entries that back no figure: {set(DERIVED) - used}"


def test_each_row_of_benchmarks_md_names_its_result_file_and_commit() -> None:
    rows = [p for p in passages(REPO / "docs/benchmarks.md") if p.text.startswith("|") and p.figures]
    assert len(rows) > 30  # the tables are read
    for row in rows:
        assert row.files, f"{row.where()}: no result file"
        commit = row.text.rstrip(" |").rsplit("|", 1)[-1].strip()
        if re.fullmatch(r"[0-9a-f]{7}", commit):
            commits = {f.rsplit("_", 1)[1].split(".")[0] for f in row.files if RESULT_FILE.fullmatch(f)}
            assert commit in commits, f"{row.where()}: commit {commit} is not its result file's"


def test_a_result_file_from_a_tree_with_uncommitted_changes_is_cited_as_such() -> None:
    dirty = {p.name for p in (REPO / "bench/results").glob("*.json") if '"dirty": true' in p.read_text()}
    for passage in (p for doc in REFERENCE_DOCS for p in passages(doc)):
        for name in set(cited(passage.text)[0]) & dirty:  # where the passage names it
            assert "uncommitted" in passage.text, f"{passage.where()}: {name} ran with uncommitted changes"


def test_a_ratio_is_a_figure_and_a_shape_or_a_count_is_not() -> None:
    assert figures_in("the teacher costs ~4.5× a student step on 4 × H200, 2×2 tiles, 12 × 480 × 720") == [
        Figure("4.5", "×")]


def test_the_figure_check_finds_a_wrong_figure() -> None:
    """A figure one digit off, against a file the check otherwise accepts: the check can fail."""
    right = next(p for p in figure_passages() if "submit_checks_cpu" in "".join(p.files))
    assert right.figures and not unfound(right)
    wrong = dataclasses.replace(right, figures=[dataclasses.replace(right.figures[0], written=str(
        round(value(right.figures[0].written) + 0.1, 2)))])
    assert unfound(wrong), wrong.figures


def test_every_result_file_is_indexed_and_backs_a_figure() -> None:
    results = REPO / "bench" / "results"
    files = {p.name for p in results.iterdir() if p.name != "README.md"}
    named = re.compile(r"`([\w.-]+\.(?:json|txt|gz))`")
    index = set(named.findall((results / "README.md").read_text()))
    figures = set(named.findall((REPO / "docs" / "benchmarks.md").read_text()))
    assert files - index == set(), "in bench/results/ but not in its README.md"
    assert files - figures == set(), "in bench/results/ but backing no figure of docs/benchmarks.md"
    assert (index | figures) - files == set(), "named, but not in bench/results/"
    # <bench>_<gpu>_<date>_<commit>: gpu 'cpu', 'h200', '4xh200', ...
    scheme = re.compile(r"[a-z0-9_]+_(cpu|(\d+x)?[a-z]+\d+)_\d{4}-\d{2}-\d{2}_[0-9a-f]{7,}(-dirty)?\.[a-z.]+")
    assert [f for f in files if not scheme.fullmatch(f)] == []
