"""Reading gpt-oss safetensors checkpoints (HF layout), single-file or sharded, memory-mapped.

Every tensor is checked against the shape and dtype the config implies before the model sees it,
so a bad checkpoint fails with a message that names the tensor and the file.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from inference.config import ModelConfig

log = logging.getLogger(__name__)


class CheckpointError(RuntimeError):
    """A checkpoint file is missing, truncated, or holds an unexpected tensor."""


def checkpoint_folder_problem(model_dir: str | Path) -> str | None:
    """Why `model_dir` is not a Hugging Face checkpoint folder (missing, or no config.json), or None."""
    model_dir = Path(model_dir)
    if (model_dir / "config.json").is_file():
        return None
    if not model_dir.exists():
        return f"{model_dir} does not exist"
    if not model_dir.is_dir():
        return f"{model_dir} is a file, not a checkpoint folder (config.json and *.safetensors)"
    message = f"{model_dir} is not a Hugging Face checkpoint folder (no config.json there)"
    if (model_dir / "original" / "config.json").is_file():
        message += (
            "; it holds only original/, the reference layout this server does not read: download the "
            'whole repository (config.json, model-*.safetensors), not just --include "original/*"'
        )
    return message


FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@dataclass(frozen=True)
class TensorSpec:
    shape: tuple[int, ...]
    float: bool  # any float dtype accepted (cast on load); else uint8


def expected_tensors(config: ModelConfig) -> dict[str, TensorSpec]:
    """Name -> expected shape/dtype for every tensor of a gpt-oss checkpoint with this config."""
    c = config
    h, i, e = c.hidden_size, c.intermediate_size, c.num_local_experts
    q_dim, kv_dim = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
    f = lambda *shape: TensorSpec(tuple(shape), True)  # noqa: E731
    u8 = lambda *shape: TensorSpec(tuple(shape), False)  # noqa: E731
    specs = {
        "model.embed_tokens.weight": f(c.vocab_size, h),
        "model.norm.weight": f(h),
        "lm_head.weight": f(c.vocab_size, h),
    }
    for layer in range(c.num_hidden_layers):
        p = f"model.layers.{layer}."
        specs.update(
            {
                p + "input_layernorm.weight": f(h),
                p + "post_attention_layernorm.weight": f(h),
                p + "self_attn.q_proj.weight": f(q_dim, h),
                p + "self_attn.q_proj.bias": f(q_dim),
                p + "self_attn.k_proj.weight": f(kv_dim, h),
                p + "self_attn.k_proj.bias": f(kv_dim),
                p + "self_attn.v_proj.weight": f(kv_dim, h),
                p + "self_attn.v_proj.bias": f(kv_dim),
                p + "self_attn.o_proj.weight": f(h, q_dim),
                p + "self_attn.o_proj.bias": f(h),
                p + "self_attn.sinks": f(c.num_attention_heads),
                p + "mlp.router.weight": f(e, h),
                p + "mlp.router.bias": f(e),
                p + "mlp.experts.gate_up_proj_bias": f(e, 2 * i),
                p + "mlp.experts.down_proj_bias": f(e, h),
            }
        )
        if c.quantized_experts:
            specs.update(
                {
                    p + "mlp.experts.gate_up_proj_blocks": u8(e, 2 * i, h // 32, 16),
                    p + "mlp.experts.gate_up_proj_scales": u8(e, 2 * i, h // 32),
                    p + "mlp.experts.down_proj_blocks": u8(e, h, i // 32, 16),
                    p + "mlp.experts.down_proj_scales": u8(e, h, i // 32),
                }
            )
        else:
            specs.update(
                {
                    p + "mlp.experts.gate_up_proj": f(e, h, 2 * i),
                    p + "mlp.experts.down_proj": f(e, i, h),
                }
            )
    return specs


class CheckpointReader:
    """Lazy, memory-mapped access to a checkpoint's tensors by name.

    `get(name)` returns a CPU tensor backed by the file mapping (no copy until it is moved or
    cast), after checking shape and dtype.
    """

    def __init__(self, model_dir: str | Path, config: ModelConfig):
        self.model_dir = Path(model_dir)
        self.specs = expected_tensors(config)
        self.location = self._locate_tensors()
        missing = [name for name in self.specs if name not in self.location]
        if missing and any(name == "embedding.weight" or name.startswith("block.") for name in self.location):
            raise CheckpointError(
                f"checkpoint {self.model_dir} is in the original gpt-oss layout (the repository's original/ "
                f"folder, tensors such as 'embedding.weight', 'block.0.attn.qkv.weight'); this server reads "
                f"the Hugging Face layout: point it at the folder with config.json and model-*.safetensors "
                f'(download the repository without --include "original/*")'
            )
        if missing:
            more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
            raise CheckpointError(f"checkpoint {self.model_dir} is missing tensor '{missing[0]}'{more}")
        self._handles: dict[Path, object] = {}

    def _locate_tensors(self) -> dict[str, Path]:
        index = self.model_dir / "model.safetensors.index.json"
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError, TypeError) as e:
                raise CheckpointError(f"{index} is not a valid safetensors index: {e}") from None
            if not isinstance(weight_map, dict) or not all(isinstance(f, str) for f in weight_map.values()):
                raise CheckpointError(
                    f"{index} is not a valid safetensors index: 'weight_map' must map tensor names to shard file names"
                )
            files = {name: self.model_dir / fname for name, fname in weight_map.items()}
            for path in set(files.values()):
                if not path.is_file():
                    raise CheckpointError(f"shard {path} named in {index.name} does not exist")
            # Trust the files over the index: a tensor the index places in a shard must be there.
            return files
        files = sorted(self.model_dir.glob("*.safetensors"))
        if not files:
            raise CheckpointError(f"no *.safetensors files in {self.model_dir}")
        location = {}
        for path in files:
            for name in self._open(path).keys():
                location[name] = path
        return location

    def _open(self, path: Path):
        handle = getattr(self, "_handles", {}).get(path)
        if handle is None:
            try:
                handle = safe_open(str(path), framework="pt", device="cpu")
            except Exception as e:  # safetensors raises its own error types for corrupt headers
                raise CheckpointError(f"cannot read safetensors file {path}: {e}") from None
            if hasattr(self, "_handles"):
                self._handles[path] = handle
        return handle

    def get(self, name: str) -> torch.Tensor:
        path = self.location[name]
        handle = self._open(path)
        try:
            tensor = handle.get_tensor(name)
        except Exception as e:
            raise CheckpointError(
                f"cannot read tensor '{name}' from {path} (truncated or corrupt file?): {e}"
            ) from None
        self._check_shape(name, path, tuple(tensor.shape))
        self._check_dtype(name, path, tensor.dtype)
        return tensor

    def get_slice(self, name: str, dim: int, start: int, stop: int) -> torch.Tensor:
        """Rows [start, stop) of tensor `name` along `dim`, reading only those bytes of the file
        (a tensor-parallel rank's shard); checked like `get`, against the whole tensor's shape."""
        path = self.location[name]
        handle = self._open(path)
        try:
            part = handle.get_slice(name)
            self._check_shape(name, path, tuple(part.get_shape()))
            tensor = part[(slice(None),) * dim + (slice(start, stop),)]
        except CheckpointError:
            raise
        except Exception as e:
            raise CheckpointError(
                f"cannot read tensor '{name}' from {path} (truncated or corrupt file?): {e}"
            ) from None
        self._check_dtype(name, path, tensor.dtype)
        return tensor.contiguous()

    def _check_shape(self, name: str, path: Path, shape: tuple[int, ...]) -> None:
        spec = self.specs.get(name)
        if spec is not None and shape != spec.shape:
            raise CheckpointError(f"tensor '{name}' in {path} has shape {shape}, expected {spec.shape}")

    def _check_dtype(self, name: str, path: Path, dtype: torch.dtype) -> None:
        spec = self.specs.get(name)
        if spec is not None and not (dtype in FLOAT_DTYPES if spec.float else dtype == torch.uint8):
            want = "a float dtype" if spec.float else "uint8"
            raise CheckpointError(f"tensor '{name}' in {path} has dtype {dtype}, expected {want}")

    def total_bytes(self) -> int:
        return sum(p.stat().st_size for p in set(self.location.values()))
