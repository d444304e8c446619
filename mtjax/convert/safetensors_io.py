"""Hugging Face weight files: one model.safetensors, or shards listed by
model.safetensors.index.json, read and written with the safetensors library's numpy API.

Reading executes nothing (safetensors is a JSON header and raw bytes, unlike the pickles of
pytorch_model.bin, which are refused) and needs no torch. bfloat16 tensors come back as
ml_dtypes' bfloat16, a numpy dtype once ml_dtypes is imported (jax depends on it).
"""
from __future__ import annotations

import json
import os

import ml_dtypes  # noqa: F401  (registers bfloat16 with numpy, so safetensors can return it)
import numpy as np
from safetensors import SafetensorError, safe_open
from safetensors.numpy import save_file

from mtjax.data.errors import DataError, one_line

WEIGHTS = "model.safetensors"
INDEX = "model.safetensors.index.json"
PICKLES = ("pytorch_model.bin", "pytorch_model.bin.index.json", "model.pt")
# safetensors dtypes numpy holds here (ml_dtypes' bfloat16 included); the float8 kinds have no numpy
# type in this numpy, and reading one would fail inside the library, so they are named and refused
READABLE = ("F16", "BF16", "F32", "F64", "I8", "I16", "I32", "I64", "U8", "U16", "U32", "U64", "BOOL", "C64")


def weight_files(hf_dir: str) -> tuple[list[str], dict | None]:
    """(the safetensors files, the index's {tensor: file} map or None for a single file). As
    transformers' from_pretrained, a model.safetensors is read even when an index is beside it."""
    index, single = os.path.join(hf_dir, INDEX), os.path.join(hf_dir, WEIGHTS)
    if os.path.isfile(single):
        return [single], None
    if os.path.isfile(index):
        try:
            with open(index, encoding="utf-8") as f:
                weight_map = json.load(f)["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise DataError(f"{index}: not a safetensors index with a weight_map ({one_line(e)})") from None
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise DataError(f"{index}: weight_map must map tensor names to file names, got {str(weight_map)[:80]}")
        files = sorted(set(weight_map.values()))
        for name in files:
            if os.path.basename(name) != name or not os.path.isfile(os.path.join(hf_dir, name)):
                raise DataError(f"{index}: lists the shard {name}, which is not in {hf_dir}")
        return [os.path.join(hf_dir, n) for n in files], weight_map
    pickles = [p for p in PICKLES if os.path.exists(os.path.join(hf_dir, p))]
    hint = (f"; {pickles[0]} is a pickle, which mtjax does not read: save the model with "
            "save_pretrained(safe_serialization=True)") if pickles else ""
    raise DataError(f"{hf_dir}: no {WEIGHTS} or {INDEX}{hint}")


def read_tensors(hf_dir: str) -> tuple[dict[str, np.ndarray], str]:
    """({name: array} of every tensor in the model's safetensors files, a short name of those
    files for messages). DataError for an unreadable file or an index that does not match."""
    files, weight_map = weight_files(hf_dir)
    tensors, found_in = {}, {}
    for path in files:
        try:
            with safe_open(path, framework="numpy") as f:
                for name in f.keys():
                    if name in tensors:
                        raise DataError(f"{path}: tensor {name} is also in {found_in[name]}")
                    if (dtype := f.get_slice(name).get_dtype()) not in READABLE:
                        raise DataError(f"{path}: {name} has dtype {dtype}; only float weights convert "
                                        f"(F16, BF16, F32, F64)")
                    tensors[name], found_in[name] = f.get_tensor(name), path
        except DataError:
            raise
        except (SafetensorError, OSError, ValueError, TypeError) as e:
            raise DataError(f"{path}: not a readable safetensors file ({one_line(e)})") from None
    if weight_map is not None:
        for name, file in weight_map.items():
            if found_in.get(name) != os.path.join(hf_dir, file):
                raise DataError(f"{os.path.join(hf_dir, INDEX)}: puts {name} in {file}, which does not hold it")
    source = files[0] if len(files) == 1 else os.path.join(hf_dir, INDEX)
    return tensors, source


def write_tensors(path: str, tensors: dict[str, np.ndarray]) -> None:
    """One safetensors file; {"format": "pt"} is the metadata transformers checks for."""
    save_file({name: np.ascontiguousarray(x) for name, x in tensors.items()}, path, metadata={"format": "pt"})
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(path, 0o666 & ~umask)              # safetensors creates it 0600
