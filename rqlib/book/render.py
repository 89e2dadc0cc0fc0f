"""A papermill output of a chapter as one HTML page a reader can read, without the book build.

A chapter's prose quotes its numbers through myst-nb glue roles (``{glue:text}`fp_ppl:.2f```)
and places its figures with ``{glue:figure}`` directives; only the book build (Sphinx) fills
them in. :func:`render_notebook` does the same for a single executed notebook: it reads the
glued values from the notebook's outputs, replaces every glue role by its value (formatted by
myst-nb's own ``format_plain_text``, so the page shows what the book would show), every
``{glue:figure}`` by its image and numbered caption, every ``{numref}`` by that number, and
turns the MyST admonitions (notes, exercises, folded solutions) into quotes and folded
``<details>``, then writes a standalone page (markdown-it, which myst-parser brings; math stays
as TeX). A glue name the run did not produce (a section a parameter switched off) becomes
"(not computed in this run)", never a raw role. ``python -m rqlib render out.ipynb`` is the
command line.
"""

from __future__ import annotations

import base64
import html
import re
from pathlib import Path
from typing import Any

from rqlib.base.files import atomic_write_text, check_writable

__all__ = ["MISSING", "glued_values", "render_markdown", "render_notebook", "rendered_html"]

#: What replaces a glue name the run did not produce.
MISSING = "(not computed in this run)"

_ROLE = re.compile(r"\{(glue(?::\w*)?|numref|cite|doc|ref|eq|math)\}`([^`]*)`")
_FENCE = re.compile(r"^(?P<fence>`{3,}|:{3,})\{(?P<name>[\w:-]+)\}[ \t]*(?P<arg>.*)$")
_IMAGE_TYPES = ("image/png", "image/svg+xml", "image/jpeg")


def glued_values(notebook) -> dict[str, dict[str, Any]]:
    """Every value the notebook glued: name -> its mime bundle (prefixes of ``display=False``
    glues removed), read from the outputs as myst-nb reads them."""
    found = {}
    for cell in notebook.cells:
        for output in cell.get("outputs", []) if cell.cell_type == "code" else []:
            record = output.get("metadata", {}).get("scrapbook")
            if not record:
                continue
            prefix = len(record.get("mime_prefix", ""))
            found[record["name"]] = {k[prefix:]: v for k, v in output.get("data", {}).items()}
    return found


def _text(bundle: dict[str, Any] | None, spec: str) -> str:
    from myst_nb.core.variables import format_plain_text

    if bundle is None or "text/plain" not in bundle:
        return MISSING
    try:
        return format_plain_text(bundle["text/plain"], spec)
    except (TypeError, ValueError):
        return bundle["text/plain"]


def _image(bundle: dict[str, Any] | None, alt: str) -> str:
    if bundle is None:
        return f"<p><em>{html.escape(alt)}: {MISSING}</em></p>"
    for mime in _IMAGE_TYPES:
        if mime in bundle:
            data = bundle[mime]
            if mime == "image/svg+xml":
                data = base64.b64encode(data.encode()).decode()
            return f'<img src="data:{mime};base64,{data.strip()}" alt="{html.escape(alt)}">'
    return f"<p><em>{html.escape(alt)}: not an image</em></p>"


def _blocks(source: str) -> list[tuple[str, str, str, dict[str, str], str] | str]:
    """Split MyST markdown into plain text and top-level directives
    ``(name, argument, fence, options, body)`` (nested directives stay in the body)."""
    lines, out, plain, i = source.splitlines(), [], [], 0
    while i < len(lines):
        match = _FENCE.match(lines[i])
        if not match:
            plain.append(lines[i])
            i += 1
            continue
        fence, end = match["fence"], i + 1
        while end < len(lines) and lines[end].rstrip() != fence:
            end += 1
        body = lines[i + 1 : end]
        options = {}
        while body and body[0].startswith(":") and not body[0].startswith(fence[:1] * 3):
            key, _, value = body.pop(0)[1:].partition(":")
            options[key.strip()] = value.strip()
        if plain:
            out.append("\n".join(plain))
            plain = []
        out.append((match["name"], match["arg"].strip(), fence, options, "\n".join(body).strip()))
        i = end + 1
    if plain:
        out.append("\n".join(plain))
    return out


def render_markdown(source: str, glued: dict[str, dict[str, Any]], figures: dict[str, str]) -> str:
    """One markdown cell with its glue roles, figures, numbered references and admonitions
    replaced (``figures``: figure label -> its number, e.g. ``"4.1"``)."""

    def role(match: re.Match) -> str:
        kind, content = match.groups()
        if kind.startswith("glue"):
            name, _, spec = content.partition(":")
            return _text(glued.get(name), spec)
        if kind == "numref":
            label = re.sub(r"^.*<(.+)>$", r"\1", content)
            return f"Fig. {figures.get(label, '?')}"
        if kind == "cite":
            return "[" + ", ".join(c.strip() for c in content.split(",")) + "]"
        if kind == "math":
            return f"${content}$"
        return re.sub(r"^(.*?)\s*<.+>$", r"\1", content)  # doc / ref: the link text

    parts = []
    for block in _blocks(source):
        if isinstance(block, str):
            parts.append(_ROLE.sub(role, block))
            continue
        name, argument, _, options, body = block
        body = render_markdown(body, glued, figures)
        if name == "glue:figure":
            label = options.get("name", argument)
            number = figures.get(label, "?")
            parts.append(
                f"<figure>{_image(glued.get(argument), f'Fig. {number}')}</figure>\n\n"
                f"**Fig. {number}.** {body}"
            )
        elif name in ("glue", "glue:", "glue:text", "glue:md"):
            parts.append(_text(glued.get(argument), ""))
        else:
            title = argument or name.capitalize()
            title = _ROLE.sub(role, title)
            if "dropdown" in options.get("class", ""):
                parts.append(
                    f"<details><summary>{html.escape(title)}</summary>\n\n{body}\n\n</details>"
                )
            else:
                parts.append(f"> **{title}**\n>\n" + "\n".join(f"> {x}" for x in body.split("\n")))
    return "\n\n".join(parts)


def figure_numbers(notebook, chapter: int | None) -> dict[str, str]:
    """Figure label -> its number, in the order the ``{glue:figure}`` directives appear
    (``"4.2"`` with a chapter number, ``"2"`` without)."""
    labels = []
    for cell in notebook.cells:
        if cell.cell_type == "markdown":
            for block in _blocks(cell.source):
                if not isinstance(block, str) and block[0] == "glue:figure":
                    labels.append(block[3].get("name", block[1]))
    prefix = f"{chapter}." if chapter is not None else ""
    return {label: f"{prefix}{i}" for i, label in enumerate(labels, 1)}


#: The tags of cells the book removes, or whose input or outputs it removes.
_REMOVED = {"cell": ("remove-cell", "remove_cell"), "input": ("remove-input", "remove_input")}
_REMOVED["output"] = ("remove-output", "remove_output")

_STYLE = """body { max-width: 60rem; margin: 2rem auto; padding: 0 1rem; font-family: sans-serif;
line-height: 1.5 } pre { background: #f6f8fa; padding: .5rem; overflow-x: auto }
img { max-width: 100% } table { border-collapse: collapse } td, th { padding: .2rem .5rem }
blockquote { border-left: 4px solid #8ab; margin-left: 0; padding-left: 1rem }
details { border: 1px solid #ccc; padding: .5rem; margin: 1rem 0 }"""


def _markdown(text: str) -> str:
    from markdown_it import MarkdownIt
    from mdit_py_plugins.dollarmath import dollarmath_plugin

    parser = MarkdownIt("commonmark", {"html": True}).enable("table")
    return parser.use(dollarmath_plugin).render(text)


def _output_html(output) -> str:
    """One output of a code cell as HTML: text in ``<pre>``, images inline, HTML as it is."""
    if output.output_type == "stream":
        return f"<pre>{html.escape(output.text)}</pre>" if output.name == "stdout" else ""
    if output.output_type == "error":
        return f"<pre>{html.escape(chr(10).join(output.traceback))}</pre>"
    data = output.get("data", {})
    for mime in _IMAGE_TYPES:
        if mime in data:
            return _image(data, "figure")
    if "text/html" in data:
        return "".join(data["text/html"])
    if "text/markdown" in data:
        return _markdown("".join(data["text/markdown"]))
    if "text/plain" in data:
        return f"<pre>{html.escape(''.join(data['text/plain']))}</pre>"
    return ""


def rendered_html(notebook, *, chapter: int | None = None) -> str:
    """The HTML page of an executed chapter, as the book shows it: markdown rendered as
    :func:`render_markdown` says, code and outputs in order, without the cells the book
    removes (``remove-cell``: the cells that display a figure the page already places at its
    ``{glue:figure}``) and without glue records (their values stand in the prose)."""
    glued = glued_values(notebook)
    figures = figure_numbers(notebook, chapter)
    title, parts = "", []
    for cell in notebook.cells:
        tags = set(cell.metadata.get("tags", []))
        if tags & set(_REMOVED["cell"]):
            continue
        if cell.cell_type == "markdown":
            text = render_markdown(cell.source, glued, figures)
            title = title or next(iter(re.findall(r"^# (.+)$", text, re.M)), "")
            parts.append(_markdown(text))
            continue
        if cell.cell_type != "code":
            continue
        if not tags & set(_REMOVED["input"]):
            parts.append(f"<pre><code>{html.escape(cell.source)}</code></pre>")
        if not tags & set(_REMOVED["output"]):
            shown = [o for o in cell.outputs if "scrapbook" not in o.get("metadata", {})]
            parts.extend(_output_html(output) for output in shown)
    head = f"<title>{html.escape(title)}</title><style>{_STYLE}</style>"
    body = "\n".join(part for part in parts if part)
    page = f'<html><head><meta charset="utf-8">{head}</head>\n<body>\n{body}\n</body></html>'
    return f"<!DOCTYPE html>\n{page}\n"


def render_notebook(source: Path | str, output: Path | str | None = None, *, force: bool = False):
    """Write the HTML page of the executed notebook ``source`` to ``output`` (default: the
    same name with ``.html``), atomically; an existing output is replaced only with
    ``force``. Returns the output path. Errors name the file they are about."""
    import nbformat

    source = Path(source)
    output = Path(output) if output is not None else source.with_suffix(".html")
    if not source.is_file():
        raise FileNotFoundError(f"{source}: no such notebook")
    if output.resolve() == source.resolve():
        raise ValueError(f"{output}: the output would replace the notebook it renders")
    check_writable(output, overwrite=force)
    try:
        notebook = nbformat.read(source, as_version=4)
    except Exception as error:  # nbformat raises many kinds for a file that is not a notebook
        raise ValueError(f"{source}: not a Jupyter notebook ({error})") from None
    if not any(cell.get("outputs") for cell in notebook.cells if cell.cell_type == "code"):
        raise ValueError(f"{source}: has no outputs; render a notebook papermill executed")
    match = re.match(r"0*(\d+)_", source.name)
    chapter = int(match[1]) if match else _chapter_of(notebook)
    return atomic_write_text(output, rendered_html(notebook, chapter=chapter), overwrite=force)


def _chapter_of(notebook) -> int | None:
    """The chapter number from the ``Chapter("04_perplexity", ...)`` call of its code."""
    for cell in notebook.cells:
        if cell.cell_type == "code":
            found = re.search(r'Chapter\(\s*"0*(\d+)_', cell.source)
            if found:
                return int(found[1])
    return None
