"""rqlib.book.provenance: what every chapter states about where its numbers came from."""

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
