"""Where a chapter's numbers came from: model and weights, corpus, tokens, device, code,
commit and versions.

Every chapter calls :func:`provenance` once, shows the result (it renders as a table in the
book) and stores :meth:`Provenance.to_dict` next to its results. Nothing here is guessed: a
field that cannot be determined says so in words (for example ``"no commit yet"``).

Two fields say which code produced the numbers:

- ``code``: :func:`code_fingerprint`, a sha256 over the content of the library files that
  compute numbers: every layer below ``rqlib.book`` (base, core, spec, kernels, hf, study,
  with the shipped allocation tables; not the book helpers nor the command line). It does not
  change when only results, prose or the book's configuration change, so runs made before such
  a commit still count as made at the current code (:func:`rqlib.book.results.collect` with
  ``current_code_only``). A chapter's own code is fingerprinted by :func:`chapter_fingerprint`
  when its results are saved.
- ``commit``: the git commit, with ``-dirty`` when the files that produce numbers
  (:data:`CODE_PATHS`: those library layers, the chapters, the data) differ from it (new files
  there count). Results written by a run (``results/``) do not make the tree dirty.
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import html
import importlib.metadata
import platform
import subprocess
from dataclasses import asdict, dataclass, field
from pathlib import Path

from rqlib.base.paths import CHECKOUT, PACKAGE_ROOT

#: Packages whose versions every chapter records.
RECORDED_PACKAGES = ("rqlib", "torch", "triton", "transformers", "numpy", "scipy")
#: The library layers that compute numbers (everything below rqlib.book).
CODE_LAYERS = ("base", "core", "spec", "kernels", "hf", "study")
#: The library files whose content :func:`code_fingerprint` hashes (relative to rqlib/).
CODE_PATTERNS = (
    "__init__.py",
    *(f"{layer}/**/*.py" for layer in CODE_LAYERS),
    "study/allocations/*.json",
)
#: The paths (relative to the checkout) whose uncommitted changes mark a run ``-dirty``.
CODE_PATHS = (*(f"rqlib/{layer}" for layer in CODE_LAYERS), "notebooks", "data")


@dataclass(frozen=True)
class Provenance:
    """The facts a reader needs to rerun a chapter and get the same numbers."""

    model: str
    corpus: str
    corpus_sha256: str
    tokens: int
    device: str
    commit: str
    versions: dict[str, str] = field(default_factory=dict)
    created_utc: str = ""
    weights: str = "not recorded"
    code: str = "not recorded"

    def to_dict(self) -> dict[str, object]:
        """A JSON-serializable copy (what :func:`rqlib.book.results.save_result` stores)."""
        return asdict(self)

    def _rows(self) -> list[tuple[str, str]]:
        versions = ", ".join(f"{name} {version}" for name, version in self.versions.items())
        return [
            ("model", self.model),
            ("weights", self.weights),
            ("corpus", self.corpus),
            ("corpus sha256", self.corpus_sha256),
            ("tokens", f"{self.tokens:,}"),
            ("device", self.device),
            ("code (sha256 of rqlib)", self.code),
            ("commit", self.commit),
            ("versions", versions),
            ("executed (UTC)", self.created_utc),
        ]

    def __str__(self) -> str:
        width = max(len(name) for name, _ in self._rows())
        return "\n".join(f"{name:<{width}}  {value}" for name, value in self._rows())

    def _repr_html_(self) -> str:
        rows = "".join(
            f"<tr><th style='text-align:left'>{html.escape(name)}</th>"
            f"<td style='text-align:left'><code>{html.escape(value)}</code></td></tr>"
            for name, value in self._rows()
        )
        return f"<table class='rqlib-provenance'><caption>Provenance</caption>{rows}</table>"

    def _repr_markdown_(self) -> str:
        lines = ["| provenance | |", "| --- | --- |"]
        lines += [f"| {name} | `{value}` |" for name, value in self._rows()]
        return "\n".join(lines)


def sha256_of_text(text: str) -> str:
    """The sha256 hex digest of ``text`` encoded as UTF-8."""
    if not isinstance(text, str):
        raise TypeError(f"text must be a str, got {type(text).__name__}")
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def describe_device(device: object | None = None) -> str:
    """A human-readable device description: the GPU's name on CUDA, the CPU otherwise.

    ``device`` may be ``None`` (the device torch would use by default: CUDA when present),
    a ``torch.device`` or a string such as ``"cpu"`` or ``"cuda:0"``.
    """
    import torch

    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(device)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device {device} was requested but CUDA is not available")
        return f"{device} ({torch.cuda.get_device_name(device)})"
    if device.type == "cpu":
        cores = torch.get_num_threads()
        threads = f"{cores} torch thread{'' if cores == 1 else 's'}"
        return f"cpu ({platform.processor() or platform.machine()}, {threads})"
    return str(device)


def git_commit(repo: Path | None = None, paths: tuple[str, ...] | None = None) -> str:
    """The commit the working tree is at, with ``-dirty`` when files differ from it: tracked
    files anywhere, or, with ``paths``, tracked or new (not ignored) files under those paths.

    Returns ``"no commit yet"`` in a repository without commits and ``"not a git checkout"``
    when ``repo`` is not inside one (or git is not installed).
    """
    repo = CHECKOUT if repo is None else Path(repo)

    def git(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            ["git", *args], cwd=repo, capture_output=True, text=True, check=False, timeout=30
        )

    try:
        inside = git("rev-parse", "--is-inside-work-tree")
    except FileNotFoundError:
        return "not a git checkout (git is not installed)"
    if inside.returncode != 0:
        return "not a git checkout"
    head = git("rev-parse", "--verify", "--quiet", "HEAD")
    if head.returncode != 0:
        return "no commit yet"
    if paths is None:
        dirty = git("status", "--porcelain", "--untracked-files=no").stdout.strip()
    else:
        dirty = git("status", "--porcelain", "--untracked-files=normal", "--", *paths)
        dirty = dirty.stdout.strip()
    return head.stdout.strip() + ("-dirty" if dirty else "")


def code_fingerprint(package: Path | None = None) -> str:
    """A sha256 (16 hex digits) over the relative paths and contents of the library's files
    that compute numbers (:data:`CODE_PATTERNS` under ``package``, default the running rqlib).
    """
    package = PACKAGE_ROOT if package is None else Path(package)
    files = sorted(
        {
            path
            for pattern in CODE_PATTERNS
            for path in package.glob(pattern)
            if path.is_file() and "__pycache__" not in path.parts
        }
    )
    if not files:
        raise FileNotFoundError(f"no library files under {package}")
    digest = hashlib.sha256()
    for path in files:
        digest.update(path.relative_to(package).as_posix().encode() + b"\0")
        digest.update(hashlib.sha256(path.read_bytes()).digest())
    return digest.hexdigest()[:16]


def chapter_fingerprint(notebook: Path) -> str:
    """A sha256 (16 hex digits) over the code cells of a chapter, its ``parameters`` cell left
    out (the parameters of a run are recorded separately); ``"no notebook"`` if it is absent."""
    notebook = Path(notebook)
    if not notebook.is_file():
        return "no notebook"
    import json

    cells = json.loads(notebook.read_text(encoding="utf-8"))["cells"]
    digest = hashlib.sha256()
    for cell in cells:
        tags = cell.get("metadata", {}).get("tags", [])
        if cell["cell_type"] != "code" or {"parameters", "injected-parameters"} & set(tags):
            continue
        source = cell["source"]
        digest.update(("".join(source) if isinstance(source, list) else source).encode())
        digest.update(b"\0")
    return digest.hexdigest()[:16]


def package_versions(packages: tuple[str, ...] = RECORDED_PACKAGES) -> dict[str, str]:
    """Installed versions of ``packages`` (``"not installed"`` for a missing one), plus Python."""
    versions = {"python": platform.python_version()}
    for name in packages:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = "not installed"
    return versions


def provenance(
    *,
    model: str,
    corpus: str,
    tokens: int,
    corpus_sha256: str | None = None,
    corpus_text: str | None = None,
    device: object | None = None,
    weights: str | None = None,
) -> Provenance:
    """Record where a chapter's numbers come from.

    Args:
        model: the model's name (e.g. ``"smollm2-135m"``), or a sentence such as
            ``"none (synthetic vectors)"`` for a chapter that uses none.
        corpus: the corpus's name or source (e.g. ``Corpus.source``), or
            ``"none (synthetic vectors)"``. No absolute machine path: results are committed.
        tokens: how many tokens (or synthetic vectors) the chapter's numbers are computed on.
        corpus_sha256: the corpus's sha256 when already known (e.g. from ``rqlib.base.corpora``).
        corpus_text: the corpus text, hashed here when ``corpus_sha256`` is not given.
        device: where the computation ran (see :func:`describe_device`).
        weights: what the model's weights are; default
            :func:`rqlib.hf.models.describe_weights` of ``model`` (pass
            ``describe_weights(name, model.dtype)`` to record the dtype it was loaded in), or
            ``"not applicable"`` when ``model`` starts with ``"none"``.

    Exactly one of ``corpus_sha256`` and ``corpus_text`` may be given; with neither, the
    sha256 field says ``"not applicable"`` (use that only for synthetic data).
    """
    for name, value in (("model", model), ("corpus", corpus)):
        if not isinstance(value, str) or not value.strip():
            raise ValueError(f"{name} must be a non-empty string, got {value!r}")
    if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 0:
        raise ValueError(f"tokens must be a non-negative int, got {tokens!r}")
    if corpus_sha256 is not None and corpus_text is not None:
        raise ValueError("give corpus_sha256 or corpus_text, not both")
    if Path(corpus).is_absolute():
        raise ValueError(
            f"corpus must not be an absolute machine path (results are committed), got "
            f"{corpus!r}; pass Corpus.source"
        )
    if corpus_text is not None:
        digest = sha256_of_text(corpus_text)
    elif corpus_sha256 is not None:
        if len(corpus_sha256) != 64 or any(c not in "0123456789abcdef" for c in corpus_sha256):
            raise ValueError(
                f"corpus_sha256 must be 64 lowercase hex digits, got {corpus_sha256!r}"
            )
        digest = corpus_sha256
    else:
        digest = "not applicable"
    if weights is None:
        from rqlib.hf.models import describe_weights

        weights = "not applicable" if model.startswith("none") else describe_weights(model)
    return Provenance(
        model=model,
        corpus=corpus,
        corpus_sha256=digest,
        tokens=tokens,
        device=describe_device(device),
        commit=git_commit(paths=CODE_PATHS),
        versions=package_versions(),
        created_utc=_dt.datetime.now(_dt.UTC).strftime("%Y-%m-%d %H:%M:%S"),
        weights=weights,
        code=code_fingerprint(),
    )
