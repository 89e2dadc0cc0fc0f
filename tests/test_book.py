"""The book's configuration: strict, offline, cached, and listing every chapter."""

import re
from pathlib import Path

import nbformat
import yaml

ROOT = Path(__file__).resolve().parent.parent


def load(name):
    return yaml.safe_load((ROOT / name).read_text())


def test_config_is_strict_cached_and_offline():
    config = load("_config.yml")
    assert config["execute"]["execute_notebooks"] == "cache"
    assert config["execute"]["timeout"] >= 600
    assert config["sphinx"]["config"]["nb_execution_raise_on_error"] is True
    assert config["only_build_toc_files"] is True
    for excluded in ("_build", ".venv", "README.md", "results", "params"):
        assert excluded in config["exclude_patterns"]
    launch = config.get("launch_buttons", {})
    assert not launch.get("binderhub_url") and not launch.get("colab_url")
    assert not launch.get("thebe")


def test_glued_commands_keep_their_double_dashes():
    """The book's smartquotes setting, applied by docutils' own transform, must leave a
    command's ``--flags`` as typed (the default setting turns ``--`` into an en dash)."""
    from docutils.utils.smartquotes import smartyPants

    action = load("_config.yml")["sphinx"]["config"]["smartquotes_action"]
    command = "python -m rqlib eval --model smollm2-135m --json out.json"
    assert smartyPants(command, attr=action) == command
    assert smartyPants(command, attr="qDe") != command  # the check can fail


def toc_files(entries):
    for entry in entries:
        if "file" in entry:
            yield entry["file"]
        yield from toc_files(entry.get("chapters", []) + entry.get("sections", []))


def test_toc_lists_the_intro_and_every_chapter_and_each_exists():
    toc = load("_toc.yml")
    files = [toc["root"], *toc_files(toc["parts"])]
    chapters = sorted(
        p.relative_to(ROOT).with_suffix("").as_posix() for p in (ROOT / "notebooks").glob("*.ipynb")
    )
    assert [f for f in files if f.startswith("notebooks/")] == chapters
    for name in files:
        assert any((ROOT / f"{name}{ext}").is_file() for ext in (".md", ".ipynb")), name


def test_every_citation_is_in_the_bibliography():
    bib = (ROOT / "book" / "references.bib").read_text()
    keys = set(re.findall(r"@\w+\{([^,]+),", bib))
    texts = [p.read_text() for p in (ROOT / "book").glob("*.md")]
    for path in (ROOT / "notebooks").glob("*.ipynb"):
        notebook = nbformat.read(path, as_version=4)
        texts += [cell.source for cell in notebook.cells if cell.cell_type == "markdown"]
    cited = {
        key.strip()
        for text in texts
        for group in re.findall(r"\{cite\}`([^`]+)`", text)
        for key in group.split(",")
    }
    assert cited, "no citations found: the pattern is wrong"
    assert cited <= keys, f"cited but not in references.bib: {sorted(cited - keys)}"


def bib_entries():
    bib = (ROOT / "book" / "references.bib").read_text()
    return dict(re.findall(r"@\w+\{([^,]+),(.*?)\n\}", bib, re.S))


def cited_keys():
    texts = [p.read_text() for p in (ROOT / "book").glob("*.md")]
    for path in (ROOT / "notebooks").glob("*.ipynb"):
        notebook = nbformat.read(path, as_version=4)
        texts += [cell.source for cell in notebook.cells if cell.cell_type == "markdown"]
    return {
        key.strip()
        for text in texts
        for group in re.findall(r"\{cite\}`([^`]+)`", text)
        for key in group.split(",")
    }


def test_every_reference_is_cited():
    """The bibliography lists every entry (``:all:``): each must be cited where it is used."""
    uncited = set(bib_entries()) - cited_keys()
    assert not uncited, f"in references.bib but never cited: {sorted(uncited)}"


def test_bibliography_titles_protect_their_capitals():
    """BibTeX styles lower-case titles ("Turboquant"); words with capitals past their first
    letter (TurboQuant, QJL, KV) and proper names must sit in braces."""
    for key, body in bib_entries().items():
        title = re.search(r"title\s*=\s*\{(.*)\},?\n", body).group(1)
        unbraced = re.sub(r"\{[^{}]*\}", "", title)
        loud = [
            word
            for word in re.findall(r"[A-Za-z][A-Za-z0-9.]*", unbraced)
            if re.search(r".[A-Z]", word)
        ]
        assert not loud, f"{key}: protect {loud} with braces in its title"


def test_how_to_cite():
    cff = yaml.safe_load((ROOT / "CITATION.cff").read_text())
    assert cff["cff-version"] == "1.2.0" and cff["title"] and cff["authors"]
    page = (ROOT / "book" / "cite.md").read_text()
    assert "```bibtex" in page and "CITATION.cff" in page
    assert "book/cite" in toc_files(load("_toc.yml")["parts"])


def test_no_control_characters_in_the_prose():
    """A LaTeX command written through a non-raw Python string loses its backslash: ``\\times``
    becomes a tab and ``imes``. The chapters' markdown and the book's pages hold no control
    character (tab, backspace, form feed, bell, vertical tab, carriage return)."""
    control = re.compile(r"[\t\x07\x08\x0b\x0c\r]")
    sources = {p.name: [p.read_text()] for p in (ROOT / "book").glob("*.md")}
    for path in (ROOT / "notebooks").glob("*.ipynb"):
        notebook = nbformat.read(path, as_version=4)
        sources[path.name] = [c.source for c in notebook.cells if c.cell_type == "markdown"]
    found = [
        f"{name}: {text[max(0, m.start() - 20) : m.end() + 20]!r}"
        for name, texts in sources.items()
        for text in texts
        for m in control.finditer(text)
    ]
    assert not found, found
