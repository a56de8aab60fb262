"""Reading and writing mlx-lm checkpoints: config, safetensors headers, byte-range tensor reads."""

from __future__ import annotations

import json
import math
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Mapping, Sequence

import mlx.core as mx
import numpy as np

from . import demo
from .device import on_metal
from ..proto.errors import UserError

INDEX_FILE = "model.safetensors.index.json"
# Shards of model-0000i-of-0000n.safetensors are cut past this many bytes unless told otherwise.
DEFAULT_SHARD_BYTES = 5 << 30


class CheckpointError(UserError):
    """A checkpoint that cannot be used, with the reason in the message."""


# safetensors dtype -> (numpy dtype used to hold the raw bytes, mlx dtype, bytes per element)
_DTYPES: dict[str, tuple[np.dtype, mx.Dtype, int]] = {
    "F32": (np.dtype(np.float32), mx.float32, 4),
    "F16": (np.dtype(np.float16), mx.float16, 2),
    "BF16": (np.dtype(np.uint16), mx.bfloat16, 2),
    "F64": (np.dtype(np.float64), mx.float64, 8),
    "I64": (np.dtype(np.int64), mx.int64, 8),
    "I32": (np.dtype(np.int32), mx.int32, 4),
    "I16": (np.dtype(np.int16), mx.int16, 2),
    "I8": (np.dtype(np.int8), mx.int8, 1),
    "U64": (np.dtype(np.uint64), mx.uint64, 8),
    "U32": (np.dtype(np.uint32), mx.uint32, 4),
    "U16": (np.dtype(np.uint16), mx.uint16, 2),
    "U8": (np.dtype(np.uint8), mx.uint8, 1),
    "BOOL": (np.dtype(np.bool_), mx.bool_, 1),
    # fp8 arrives as raw bytes; the model's sanitize converts it.
    "F8_E4M3": (np.dtype(np.uint8), mx.uint8, 1),
    "F8_E5M2": (np.dtype(np.uint8), mx.uint8, 1),
}
_MX_TO_ST = {
    mx.float32: "F32",
    mx.float16: "F16",
    mx.bfloat16: "BF16",
    mx.float64: "F64",
    mx.int64: "I64",
    mx.int32: "I32",
    mx.int16: "I16",
    mx.int8: "I8",
    mx.uint64: "U64",
    mx.uint32: "U32",
    mx.uint16: "U16",
    mx.uint8: "U8",
    mx.bool_: "BOOL",
}


# What a checkpoint needs of a repo: its config, the safetensors and their index, the tokenizer's
# files (sentencepiece, tiktoken, vocab and merges, chat templates). Anything else a repo holds
# (other formats, images, READMEs, code, which load_tokenizer never runs) is not fetched.
CHECKPOINT_FILES = (
    "*.json",
    "model*.safetensors",
    "mtp.safetensors",  # MTP layers kept beside the model's weights (node/mtp.py)
    "tokenizer.model",
    "*.tiktoken",
    "tiktoken.model",
    "*.txt",
    "*.jinja",
)
# What describing a model for planning needs: its config, and the index for the checkpoint's size.
CONFIG_FILES = ("config.json", INDEX_FILE)


def resolve_model_path(
    spec: str | os.PathLike,
    files: Sequence[str] = CHECKPOINT_FILES,
    *,
    download: bool = True,
    **fetch,
) -> Path:
    """Turn a `--model` argument into a checkpoint directory: a folder, "demo" (the embedded model),
    or a Hugging Face repo id (`org/name[@revision]`), whose `files` are fetched into the Hugging
    Face cache first (`fetch`: node.hub.fetch's report and cancel). `download=False` (a node: only
    the coordinator downloads) takes folders alone."""
    from . import hub

    if str(spec) == "demo":
        return demo.MODEL_DIR
    path = Path(spec).expanduser()
    repo = hub.parse_repo_id(str(spec)) if download and not path.exists() else None
    if repo is not None:
        return hub.fetch(repo, files, **fetch)
    if not path.exists():
        raise CheckpointError(f"model path {path} does not exist")
    if not path.is_dir():
        raise CheckpointError(
            f"model path {path} is not a directory (expected a checkpoint folder)"
        )
    return path


def config_folder(spec: str | os.PathLike) -> Path:
    """The folder holding a model's config.json (and its safetensors index, where it has one): a
    repo's two files are fetched alone, and quietly (a few KB), never its weights."""
    return resolve_model_path(spec, CONFIG_FILES, report=lambda transfer: None)


def index_bytes(path: Path) -> int | None:
    """The checkpoint's bytes as its safetensors index states them (metadata.total_size): known
    before its weights are (a repo's config and index are fetched first)."""
    try:
        total = json.loads((path / INDEX_FILE).read_text())["metadata"]["total_size"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return int(total) if isinstance(total, (int, float)) and total > 0 else None


def read_config(path: Path) -> dict:
    """Read and check `config.json` of a checkpoint directory."""
    return parse_config(path / "config.json", _config_bytes(path))


def _config_bytes(path: Path) -> bytes:
    cfg_path = path / "config.json"
    if not cfg_path.is_file():
        raise CheckpointError(f"{path} is not a model checkpoint: no config.json")
    return cfg_path.read_bytes()


def parse_config(cfg_path: Path, raw: bytes) -> dict:
    """Check the bytes of a `config.json`: a JSON object naming its model_type."""
    try:
        config = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{cfg_path} is malformed: {exc}") from exc
    if not isinstance(config, dict):
        raise CheckpointError(f"{cfg_path} is malformed: expected a JSON object")
    if "model_type" not in config:
        raise CheckpointError(f"{cfg_path} is malformed: no model_type")
    return config


def model_classes(config: dict, where: Path | str = "config.json"):
    """The mlx-lm (Model, ModelArgs) classes for a config, or a clear error."""
    from mlx_lm.utils import _get_classes

    try:
        return _get_classes(config)
    except ValueError as exc:
        raise CheckpointError(
            f"{where}: unknown architecture model_type={config.get('model_type')!r} "
            "(not an mlx-lm model)"
        ) from exc


# Families whose checkpoints no test here can make, so the cluster's answers on them were never
# checked against stock mlx-lm: refused with the reason rather than guessed at.
UNVERIFIED = {
    "prism_hadamard_qwen35": "its Hadamard-rotated 2-bit pack (a module manifest and packed weights, "
    "made by its own packing tool) cannot be built by the family sweep, so the "
    "cluster was never checked against stock mlx-lm on it",
}


def check_runnable(config: dict, where: Path | str = "config.json") -> None:
    """Refuse, in one line, a family that cannot run on this machine's MLX backend: one that calls
    mlx-lm's hand-written Metal kernels (`mlx_lm.kernels`, e.g. muse_spark) off Metal, or one never
    checked against stock (UNVERIFIED). Describing a model for the planner runs its MoE blocks once,
    so `plan` asks too."""
    import inspect

    import mlx.core as mx

    model_type = config.get("model_type")
    if model_type in UNVERIFIED:
        raise CheckpointError(
            f"{where}: model_type={model_type!r} is not supported: {UNVERIFIED[model_type]}"
        )
    model_cls, _ = model_classes(config, where)
    module = inspect.getmodule(model_cls)
    kernels = sorted(
        {
            name
            for name, v in vars(module).items()
            if (getattr(v, "__module__", "") or "").startswith("mlx_lm.kernels")
        }
    )
    if kernels and not on_metal():
        raise CheckpointError(
            f"{where}: model_type={config.get('model_type')!r} calls mlx-lm's Metal-only kernels "
            f"({', '.join(kernels)}); it runs only on Apple silicon with Metal"
        )


def load_tokenizer(path: Path):
    """mlx-lm's tokenizer of a checkpoint folder; files it cannot read are the checkpoint's problem
    (transformers also validates config.json here), so any failure is one line naming the folder."""
    from mlx_lm.tokenizer_utils import load

    try:
        return load(Path(path))
    except Exception as exc:  # noqa: BLE001 - a third-party loader: every failure means unusable files
        raise CheckpointError(
            f"{path}: cannot load the tokenizer ({type(exc).__name__}: {exc})"
        ) from exc


def model_args(config: dict, where: Path | str = "config.json"):
    """Instantiate the ModelArgs of a config; a config missing fields is a clear error."""
    _, args_cls = model_classes(config, where)
    try:
        return args_cls.from_dict(config)
    except (TypeError, ValueError, KeyError) as exc:
        raise CheckpointError(f"{where} is malformed: {exc}") from exc


@dataclass(frozen=True)
class TensorInfo:
    """Where one tensor lives: its file and absolute byte range, dtype and shape."""

    key: str
    file: Path
    dtype: str  # safetensors dtype name, e.g. "BF16"
    shape: tuple[int, ...]
    start: int  # absolute offset in the file, bytes
    end: int  # exclusive, bytes
    # A node's cached shard (node/cache.py) keeps only some experts of a stacked (E * per, ...) tensor:
    # `held` lists them in file order, each `per` leading rows; None: every row is in the file.
    held: tuple[int, ...] | None = None
    per: int = 1

    @property
    def nbytes(self) -> int:
        return self.end - self.start

    @property
    def itemsize(self) -> int:
        return _DTYPES[self.dtype][2]

    @property
    def mx_dtype(self) -> mx.Dtype:
        return _DTYPES[self.dtype][1]

    def row_bytes(self) -> int:
        """Bytes of one slice along the leading axis."""
        return math.prod(self.shape[1:]) * self.itemsize


def read_header(file: Path) -> dict[str, TensorInfo]:
    """Parse one safetensors header and check its byte ranges against the file."""
    return _read_header(file)[1]


def _read_header(file: Path) -> tuple[bytes, dict[str, TensorInfo]]:
    """(the header's bytes, its tensors): the bytes are the checkpoint's fingerprint's input."""
    size = file.stat().st_size
    with open(file, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise CheckpointError(f"{file} is not a safetensors file: shorter than its header")
        (n,) = struct.unpack("<Q", head)
        if n > size - 8 or n > 100 << 20:
            raise CheckpointError(f"{file}: header length {n} does not fit a file of {size} bytes")
        raw = f.read(n)
        try:
            header = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise CheckpointError(f"{file}: header is not valid JSON ({exc})") from exc
    base = 8 + n
    out: dict[str, TensorInfo] = {}
    spans = []
    for key, meta in header.items():
        if key == "__metadata__":
            continue
        try:
            dtype, shape, (lo, hi) = meta["dtype"], tuple(meta["shape"]), meta["data_offsets"]
        except (KeyError, TypeError, ValueError) as exc:
            raise CheckpointError(f"{file}: tensor {key!r} has a malformed header entry") from exc
        if dtype not in _DTYPES:
            raise CheckpointError(f"{file}: tensor {key!r} has unsupported dtype {dtype}")
        want = math.prod(shape) * _DTYPES[dtype][2]
        if hi - lo != want or lo < 0:
            raise CheckpointError(
                f"{file}: byte range of {key!r} ({lo}..{hi}, {hi - lo} bytes) does not match its "
                f"header ({dtype} {list(shape)} = {want} bytes)"
            )
        if base + hi > size:
            raise CheckpointError(
                f"{file}: byte range of {key!r} ends at {base + hi} past the end of the file ({size} bytes)"
            )
        spans.append((lo, hi, key))
        out[key] = TensorInfo(key, file, dtype, shape, base + lo, base + hi)
    spans.sort()
    for (lo1, hi1, k1), (lo2, _, k2) in zip(spans, spans[1:]):
        if lo2 < hi1:
            raise CheckpointError(f"{file}: byte ranges of {k1!r} and {k2!r} overlap")
    return raw, out


class Checkpoint:
    """A checkpoint directory: its config and the location of every tensor, nothing loaded.
    Its config.json and safetensors headers are read here, once (`config_bytes`, `headers`)."""

    def __init__(self, path: Path):
        self.path = path
        self.config_bytes = _config_bytes(path)
        self.config = parse_config(path / "config.json", self.config_bytes)
        files = sorted(path.glob("model*.safetensors"))
        if not files:
            raise CheckpointError(f"{path} is not a model checkpoint: no model*.safetensors files")
        index = path / INDEX_FILE
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError, TypeError) as exc:
                raise CheckpointError(f"{index} is malformed: {exc}") from exc
            missing = sorted({f for f in weight_map.values() if not (path / f).is_file()})
            if missing:
                raise CheckpointError(f"{index} names files that are missing: {', '.join(missing)}")
        self.tensors: dict[str, TensorInfo] = {}
        self.headers: dict[str, bytes] = {}  # file name -> its safetensors header
        for f in files:
            self.headers[f.name], infos = _read_header(f)
            for key, info in infos.items():
                if key in self.tensors:
                    raise CheckpointError(
                        f"tensor {key!r} appears in both {self.tensors[key].file.name} and {f.name}"
                    )
                self.tensors[key] = info

    @classmethod
    def open(cls, spec: str | os.PathLike, download: bool = True) -> "Checkpoint":
        return cls(resolve_model_path(spec, download=download))

    def total_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors.values())


def _read_bytes(info: TensorInfo, start: int, nbytes: int) -> bytearray:
    buf = bytearray(nbytes)
    with open(info.file, "rb", buffering=0) as f:
        f.seek(start)
        view = memoryview(buf)
        got = 0
        while got < nbytes:
            n = f.readinto(view[got:])
            if not n:
                raise CheckpointError(
                    f"{info.file}: short read of {info.key!r} at byte {start + got}"
                )
            got += n
    return buf


def read_tensor(info: TensorInfo, rows: Iterable[int] | None = None) -> mx.array:
    """Read a tensor, or only some slices along its leading axis, by byte range.

    Nothing outside the requested rows is read, so a node holding a few experts of a stacked
    `(E, ...)` tensor reads only their bytes.
    """
    np_dtype, mx_dtype, _ = _DTYPES[info.dtype]
    if rows is None and info.held is not None:
        raise CheckpointError(
            f"{info.key!r}: this cached shard holds only experts {list(info.held)}, not the whole tensor"
        )
    if rows is None:
        raw = _read_bytes(info, info.start, info.nbytes)
        shape = info.shape
    else:
        rows = list(rows)
        if not info.shape:
            raise CheckpointError(f"{info.key!r} is a scalar; it has no rows")
        n = info.shape[0]
        bad = [r for r in rows if not 0 <= r < n]
        if bad:
            raise CheckpointError(f"{info.key!r}: rows {bad} out of range 0..{n - 1}")
        rb = info.row_bytes()
        rows = _physical_rows(info, rows)
        raw = bytearray(rb * len(rows))
        # Adjacent rows are read in one call.
        i = 0
        while i < len(rows):
            j = i
            while j + 1 < len(rows) and rows[j + 1] == rows[j] + 1:
                j += 1
            chunk = _read_bytes(info, info.start + rows[i] * rb, rb * (j - i + 1))
            raw[i * rb : (j + 1) * rb] = chunk
            i = j + 1
        shape = (len(rows),) + info.shape[1:]
    arr = np.frombuffer(raw, dtype=np_dtype).reshape(shape)
    out = mx.array(arr)
    if mx_dtype != out.dtype:
        out = out.view(mx_dtype)
    return out


def _physical_rows(info: TensorInfo, rows: list[int]) -> list[int]:
    """Rows of the tensor as the file stores them: a cached shard keeps only its experts' rows."""
    if info.held is None:
        return rows
    where = {e: i for i, e in enumerate(info.held)}
    out = []
    for r in rows:
        e, within = divmod(r, info.per)
        if e not in where:
            raise CheckpointError(
                f"{info.key!r}: expert {e} is not in this cached shard (it holds {list(info.held)})"
            )
        out.append(where[e] * info.per + within)
    return out


def write_checkpoint(
    out: Path,
    tensors: Mapping[str, mx.array],
    config: dict,
    *,
    max_shard_bytes: int = DEFAULT_SHARD_BYTES,
    metadata: dict[str, str] | None = None,
) -> list[Path]:
    """Write tensors as `model.safetensors`, or `model-0000i-of-0000n.safetensors` plus an index
    once they pass `max_shard_bytes`, and `config.json`. Returns the files written."""
    out.mkdir(parents=True, exist_ok=True)
    for old in list(out.glob("model*.safetensors")) + [out / INDEX_FILE]:
        old.unlink(missing_ok=True)
    shards: list[dict[str, mx.array]] = []
    size = 0
    for key in sorted(tensors):
        v = tensors[key]
        if v.dtype not in _MX_TO_ST:
            raise CheckpointError(f"cannot write {key!r}: dtype {v.dtype} has no safetensors name")
        if not shards or size + v.nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][key] = v
        size += v.nbytes
    meta = {"format": "mlx", **(metadata or {})}
    files = []
    if len(shards) == 1:
        files.append(out / "model.safetensors")
        mx.save_safetensors(str(files[0]), shards[0], metadata=meta)
    else:
        weight_map = {}
        for i, shard in enumerate(shards):
            name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            mx.save_safetensors(str(out / name), shard, metadata=meta)
            files.append(out / name)
            weight_map.update({k: name for k in shard})
        index = {
            "metadata": {"total_size": sum(v.nbytes for v in tensors.values())},
            "weight_map": dict(sorted(weight_map.items())),
        }
        (out / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
    (out / "config.json").write_text(json.dumps(dict(sorted(config.items())), indent=2) + "\n")
    return files
