"""rqlib.book.provenance: what every chapter states about where its numbers came from.

Random text and values (``rng``) only make each run's inputs fresh; the checks are exact (hashes
of different inputs differ: a SHA-256 collision is the only chance failure).
"""

import hashlib
import shutil
import subprocess

import pytest
import torch

from rqlib.book.provenance import git_commit, package_versions, provenance, sha256_of_text


def test_provenance_fields_and_renderings(rng):
    text = "".join(chr(97 + int(i)) for i in torch.randint(0, 26, (50,), generator=rng))
    prov = provenance(model="tiny", corpus="letters", corpus_text=text, tokens=50, device="cpu")
    assert prov.corpus_sha256 == hashlib.sha256(text.encode()).hexdigest()
    assert prov.tokens == 50 and prov.device.startswith("cpu")
    assert prov.versions["torch"] != "not installed"
    for rendering in (str(prov), prov._repr_html_(), prov._repr_markdown_()):
        for value in ("tiny", "letters", prov.corpus_sha256, prov.commit):
            assert value in rendering
    assert prov.to_dict()["model"] == "tiny"


def test_sha256_given_or_not_applicable():
    digest = sha256_of_text("abc")
    assert provenance(model="m", corpus="c", tokens=1, corpus_sha256=digest).corpus_sha256 == digest
    assert provenance(model="m", corpus="c", tokens=0).corpus_sha256 == "not applicable"


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"model": ""}, "model"),
        ({"corpus": "  "}, "corpus"),
        ({"tokens": -1}, "tokens"),
        ({"tokens": 1.5}, "tokens"),
        ({"corpus_sha256": "xyz"}, "corpus_sha256"),
        ({"corpus_sha256": "0" * 64, "corpus_text": "a"}, "not both"),
    ],
)
def test_bad_input_is_refused(kwargs, match):
    arguments = {"model": "m", "corpus": "c", "tokens": 1}
    arguments.update(kwargs)
    with pytest.raises(ValueError, match=match):
        provenance(**arguments)


@pytest.mark.skipif(shutil.which("git") is None, reason="git is not installed")
def test_git_commit_states(tmp_path):
    assert git_commit(tmp_path) == "not a git checkout"

    def git(*args):
        subprocess.run(["git", *args], cwd=tmp_path, check=True, capture_output=True)

    git("init", "-q")
    assert git_commit(tmp_path) == "no commit yet"
    (tmp_path / "f").write_text("1")
    git("add", "f")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "m")
    head = subprocess.run(
        ["git", "rev-parse", "HEAD"], cwd=tmp_path, capture_output=True, text=True
    ).stdout.strip()
    assert git_commit(tmp_path) == head
    (tmp_path / "f").write_text("2")
    assert git_commit(tmp_path) == head + "-dirty"


def test_missing_package_is_named():
    assert package_versions(("surely-not-a-package-rq",))["surely-not-a-package-rq"] == (
        "not installed"
    )


def test_weights_are_described_for_the_packaged_models_and_hub_ids():
    from rqlib.hf.models import PACKAGED_MODELS, describe_weights

    assert "Q4_1 GGUF" in describe_weights("smollm2-135m")
    assert "Q4_K_M GGUF" in describe_weights("gemma3-270m")
    assert describe_weights("smollm2-135m", torch.bfloat16).endswith("loaded as bfloat16")
    plain = PACKAGED_MODELS["smollm2-135m"].weights
    assert describe_weights("smollm2-135m", torch.float32) == plain
    assert describe_weights("org/model", "torch.float16") == (
        "org/model checkpoint as published, loaded as float16"
    )
    prov = provenance(model="smollm2-135m", corpus="c", tokens=1)
    assert prov.weights == PACKAGED_MODELS["smollm2-135m"].weights
    assert ("weights", prov.weights) in prov._rows() and prov.weights in str(prov)
    assert provenance(model="none (synthetic)", corpus="c", tokens=1).weights == "not applicable"
    assert provenance(model="m", corpus="c", tokens=1, weights="mine").weights == "mine"


def test_code_fingerprint_follows_the_code_that_computes_numbers(tmp_path, rng):
    from rqlib.base.paths import PACKAGE_ROOT
    from rqlib.book.provenance import code_fingerprint

    package = tmp_path / "rqlib"
    shutil.copytree(PACKAGE_ROOT, package, ignore=shutil.ignore_patterns("__pycache__"))
    original = code_fingerprint(package)
    assert original == code_fingerprint(PACKAGE_ROOT) and len(original) == 16
    token = "".join(chr(97 + int(i)) for i in torch.randint(0, 26, (12,), generator=rng))
    # the book helpers and the command line do not compute numbers: not fingerprinted
    (package / "cli.py").write_text((package / "cli.py").read_text() + f"\n# {token}\n")
    (package / "book" / "x.py").write_text(f"# {token}\n")
    assert code_fingerprint(package) == original
    for changed in ("core/codebooks.py", "study/allocations/smollm2-135m.json"):
        path = package / changed
        saved = path.read_bytes()
        path.write_bytes(saved + b" ")
        assert code_fingerprint(package) != original, changed
        path.write_bytes(saved)
    (package / "hf" / "new_module.py").write_text(f"X = '{token}'\n")  # a new file counts
    assert code_fingerprint(package) != original


def test_chapter_fingerprint_hashes_code_cells_but_not_parameters(tmp_path, rng):
    import nbformat

    from rqlib.book.provenance import chapter_fingerprint

    def chapter(parameters: str, code: str, prose: str):
        notebook = nbformat.v4.new_notebook()
        notebook.cells = [
            nbformat.v4.new_markdown_cell(prose),
            nbformat.v4.new_code_cell(parameters, metadata={"tags": ["parameters"]}),
            nbformat.v4.new_code_cell(code),
        ]
        path = tmp_path / "chapter.ipynb"
        nbformat.write(notebook, path)
        return chapter_fingerprint(path)

    value = int(torch.randint(0, 1000, (1,), generator=rng))
    first = chapter("bits = 3", f"print({value})", "# Prose")
    assert chapter("bits = 4", f"print({value})", "# Other prose") == first
    assert chapter("bits = 3", f"print({value + 1})", "# Prose") != first
    assert chapter_fingerprint(tmp_path / "missing.ipynb") == "no notebook"


@pytest.mark.skipif(shutil.which("git") is None, reason="git is not installed")
def test_only_changes_to_the_given_paths_make_a_commit_dirty(tmp_path):
    def git(*args):
        subprocess.run(["git", *args], cwd=tmp_path, check=True, capture_output=True)

    git("init", "-q")
    (tmp_path / "code").mkdir()
    (tmp_path / "results").mkdir()
    (tmp_path / "code" / "a.py").write_text("1")
    (tmp_path / "results" / "r.json").write_text("1")
    git("add", ".")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "m")
    paths = ("code",)
    assert not git_commit(tmp_path, paths).endswith("-dirty")
    (tmp_path / "results" / "r.json").write_text("2")  # a run wrote its results
    assert not git_commit(tmp_path, paths).endswith("-dirty")
    assert git_commit(tmp_path).endswith("-dirty")  # the whole tree is dirty
    (tmp_path / "code" / "b.py").write_text("new")  # an untracked module changes the code
    assert git_commit(tmp_path, paths).endswith("-dirty")


def test_an_absolute_corpus_path_is_refused():
    with pytest.raises(ValueError, match="absolute machine path"):
        provenance(model="m", corpus="/home/someone/wiki.test.raw", tokens=1)
