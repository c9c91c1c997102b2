"""Deployment presets: YAML files whose keys are ``EngineArgs`` fields, one to one.

``--config`` takes a path or the name of a preset that ships in the package's ``configs/``
folder (``--config cpu`` or ``--config cpu.yaml``). A nested ``speculative_config:`` mapping holds
``SpeculativeConfig`` fields. Unknown keys and
wrong types are ``ValueError``s that name the key and the type it wants; the frozen configs'
own validators run too, so a preset is checked without the model folder or its weights. Types
are checked by pydantic (strict, on the values as JSON); the messages are ours.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import types
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Union, get_args, get_origin, get_type_hints

import yaml
from pydantic import TypeAdapter, ValidationError

from tandem.engine.config import (
    CacheConfig,
    CUDAGraphConfig,
    EngineArgs,
    ParallelConfig,
    SchedulerConfig,
    SpeculativeConfig,
)

SPEC_KEY = "speculative_config"
# The shipped presets: configs/ beside engine/ in the checkout and in the installed package.
PRESETS_DIR = Path(__file__).resolve().parents[1] / "configs"


def shipped_presets() -> list[str]:
    """Names of the presets that ship with Tandem (``--config NAME``)."""
    return sorted(p.stem for p in PRESETS_DIR.glob("*.yaml"))


def resolve_preset(name: str | os.PathLike[str]) -> Path:
    """The file ``--config name`` means: an existing path as given, else the shipped preset of
    that name (``cpu``, ``cpu.yaml`` or ``configs/cpu.yaml``). Anything else is a one-line
    ``ValueError`` that lists the shipped presets."""
    path = Path(name)
    if path.is_file():
        return path
    stem = path.name.removesuffix(".yaml").removesuffix(".yml")
    shipped = PRESETS_DIR / f"{stem}.yaml"
    if path.suffix in ("", ".yaml", ".yml") and shipped.is_file():
        return shipped
    raise ValueError(
        f"config {os.fspath(name)!r} is neither a file nor a shipped preset; "
        f"shipped presets: {', '.join(shipped_presets()) or '(none)'}"
    )


class _UniqueKeyLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` that refuses a key given twice (PyYAML keeps the last one silently)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: set[Any] = set()
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":  # '<<: *anchor' may be overridden
                continue
            key = self.construct_object(key_node, deep=deep)
            try:
                if key not in seen:
                    seen.add(key)
                    continue
            except TypeError:  # an unhashable key: SafeLoader reports it below
                continue
            raise yaml.constructor.ConstructorError(
                None, None, f"key {key!r} is given twice", key_node.start_mark
            )
        return super().construct_mapping(node, deep=deep)


def load_preset(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Read and validate a preset (a path or a shipped preset's name, see ``resolve_preset``);
    returns its keys (``EngineArgs`` field names) and values."""
    path = resolve_preset(path)
    try:
        with open(path, encoding="utf-8") as f:
            data = yaml.load(f, Loader=_UniqueKeyLoader)
    except OSError as e:
        raise ValueError(
            f"cannot read config file {os.fspath(path)!r}: {e.strerror}; "
            f"shipped presets: {', '.join(shipped_presets()) or '(none)'}"
        ) from None
    except yaml.YAMLError as e:
        raise ValueError(f"config file {os.fspath(path)!r} is not valid YAML: {e}") from None
    try:
        return validate_preset(data)
    except ValueError as e:
        raise ValueError(f"config file {os.fspath(path)!r}: {e}") from None


def validate_preset(preset: Any) -> dict[str, Any]:
    """Check keys and types against ``EngineArgs`` (and ``SpeculativeConfig`` for the nested
    mapping), then build the frozen configs that need no model folder so their validators run.
    Returns the preset with YAML lists turned into tuples where a field wants one."""
    if not isinstance(preset, Mapping):
        raise ValueError(
            f"a preset is a mapping of engine fields, got {_describe_value(preset)}; "
            "e.g. 'max_num_seqs: 64'"
        )
    checked = _check_fields(preset, EngineArgs, prefix="", known=EngineArgs.field_names())
    spec = checked.get(SPEC_KEY)
    if spec is not None:
        spec_fields = {f.name for f in dataclasses.fields(SpeculativeConfig)}
        checked[SPEC_KEY] = spec = _check_fields(
            spec, SpeculativeConfig, SPEC_KEY + ".", spec_fields
        )
        SpeculativeConfig.from_dict(spec)
    _validate_configs(checked)
    return checked


def _check_fields(values: Any, cls: type, prefix: str, known: set[str]) -> dict[str, Any]:
    if not isinstance(values, Mapping):
        raise ValueError(f"{prefix.rstrip('.')}: expected a mapping, got {_describe_value(values)}")
    unknown = sorted(str(k) for k in values if k not in known)
    if unknown:
        names = ", ".join(prefix + k for k in unknown)
        raise ValueError(f"unknown key(s) {names}; known keys: {', '.join(sorted(known))}")
    hints = get_type_hints(cls)
    return {k: _check_type(prefix + k, v, hints[k]) for k, v in values.items()}


@functools.cache
def _adapter(hint: Any) -> TypeAdapter[Any]:
    return TypeAdapter(hint)


def _check_type(key: str, value: Any, hint: Any) -> Any:
    """``value`` as ``hint`` wants it, else a ``ValueError``. pydantic validates it in strict
    mode as JSON, which is what YAML can say: a list fills a tuple and an int a float, and
    nothing is coerced (no '64' for 64, no true for 1, no 1.5 for an int)."""
    try:
        text = json.dumps(value, allow_nan=True)
    except (TypeError, ValueError):  # not JSON data, e.g. a YAML date
        text = None
    if text is not None:
        try:
            return _adapter(hint).validate_json(text, strict=True)
        except ValidationError:
            pass
    raise ValueError(f"{key}: expected {_describe_type(hint)}, got {_describe_value(value)}")


def _describe_type(hint: Any) -> str:
    origin = get_origin(hint)
    if origin in (Union, types.UnionType):
        return " or ".join(_describe_type(a) for a in get_args(hint))
    if hint is type(None):
        return "null"
    if origin is tuple:
        return f"a list of {_describe_type(get_args(hint)[0])}"
    if origin is dict:
        return "a mapping"
    if hint is Any:
        return "any value"
    return getattr(hint, "__name__", str(hint))


def _describe_value(value: Any) -> str:
    if value is None:
        return "null"
    return f"{type(value).__name__} {value!r}"


def _validate_configs(checked: dict[str, Any]) -> None:
    """Run the validators of the configs that need no model folder (``ValueError`` names the
    field). ``max_model_len`` and ``max_num_batched_tokens`` left unset are resolved from the
    checkpoint at load time; here they stand in with the scheduler's defaults."""
    from tandem.models.loader import resolve_dtype

    args = EngineArgs(**{"model": "", **checked})
    if args.dtype != "auto":
        resolve_dtype(args.dtype, None)
    if args.device not in ("auto", "cpu", "cuda") and not args.device.startswith("cuda:"):
        raise ValueError(f"device={args.device!r} is invalid: use auto, cpu, cuda or cuda:N")
    CacheConfig(
        block_size=args.block_size,
        kv_cache_memory_bytes=args.kv_cache_memory_bytes,
        gpu_memory_utilization=args.gpu_memory_utilization,
        enable_prefix_caching=args.enable_prefix_caching,
        num_blocks_override=args.num_kv_blocks,
    )
    SchedulerConfig(
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens
        or SchedulerConfig.max_num_batched_tokens,
        max_model_len=args.max_model_len or SchedulerConfig.max_model_len,
        max_waiting_requests=args.max_waiting_requests,
    )
    CUDAGraphConfig(args.enforce_eager, args.cuda_graph_batch_sizes)
    ParallelConfig(
        tensor_parallel_size=args.tensor_parallel_size,
        enable_attention_dp=args.enable_attention_dp,
        enable_lm_head_tp_in_adp=args.enable_lm_head_tp_in_adp,
        data_parallel_size=args.data_parallel_size,
        enable_expert_parallel=args.enable_expert_parallel,
        expert_parallel_size=args.expert_parallel_size,
        enable_eplb=args.enable_eplb,
        num_redundant_experts=args.num_redundant_experts,
        eplb_step_interval=args.eplb_step_interval,
        eplb_window_size=args.eplb_window_size,
    )
