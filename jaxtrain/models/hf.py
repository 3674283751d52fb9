"""Hugging Face interop for every family: a checkpoint out as the family's `*ForCausalLM` directory, such a
directory back in as params.

The family (jaxtrain.models.families, by config.json's `model_type`) maps the config both ways and names each
tensor. The stacked blocks' leading `layers` axis becomes one tensor per layer (`model.layers.{i}.*`), an
expert axis one per expert; HF linear weights are [out, in], jaxtrain kernels [in, out] with heads as their own
axes (e.g. `blocks.attn.wq` [L, d, H, hd] <-> `self_attn.q_proj.weight` [H*hd, d]). Both sides apply
rotate-half RoPE, so q/k need no permutation. Weights are read from one safetensors file or a sharded index,
and written as shards of at most `shard_bytes` with an index. Needs only numpy and safetensors. Commands:
`jaxtrain hf export|overrides` (jaxtrain.tools.hf; docs/huggingface.md).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import shutil
import tempfile
from pathlib import Path, PurePosixPath

import jax
import ml_dtypes
import numpy as np
from flax import nnx
from safetensors import SafetensorError, safe_open
from safetensors.numpy import save_file

from jaxtrain import files
from jaxtrain.errors import ConfigError, HFError, HFMismatch
from jaxtrain.models import families, lora, transformer
from jaxtrain.models.config import ModelConfig
from jaxtrain.models.families.base import HFConfig

CONFIG = "config.json"
WEIGHTS = "model.safetensors"
WEIGHTS_INDEX = "model.safetensors.index.json"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model")
# Written into every export, and only there: `--overwrite` replaces a directory that holds it, nothing else.
EXPORT_MARKER = "jaxtrain-export.json"
DTYPES = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16, "float16": np.float16}
SHARD_BYTES = 5 * 2**30  # transformers' default largest shard
# ModelConfig fields an HF config determines (each family sets those it has; the rest keep ModelConfig's
# defaults); the others (remat, dtypes, routing, init_std) are training choices.
FIELDS = ("family", "vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "head_dim", "d_ff",
          "tie_embeddings", "rope_theta", "norm_eps", "rope_scaling", "rope_factor", "rope_low_freq_factor",
          "rope_high_freq_factor", "rope_original_max_len", "rope_beta_fast", "rope_beta_slow",
          "rope_attention_factor", "qkv_bias", "qk_norm", "attn_scale", "attn_softcap", "sliding_window",
          "global_every", "rope_local_theta", "mlp_activation", "norm_offset", "post_norms", "embed_scale",
          "final_softcap", "n_experts", "moe_top_k", "moe_renormalize", "moe_score", "moe_groups", "moe_topk_groups",
          "moe_routed_scale", "moe_score_bias", "n_shared_experts", "first_dense_layers", "dense_d_ff",
          "kv_lora_rank", "q_lora_rank", "qk_nope_head_dim", "v_head_dim", "rope_interleave", "rope_mscale",
          "rope_mscale_all_dim", "mtp_layers")
_DEFAULTS = ModelConfig(dtype="float32", param_dtype="float32")


# ===== Layout conversion ===============================================================================


def _to_hf(x: np.ndarray, layout) -> np.ndarray:
    if layout is None:
        return x
    if layout == "vector":
        return x.reshape(-1)
    n_in = math.prod(x.shape[:layout])
    return np.ascontiguousarray(x.reshape(n_in, -1).T)


def _from_hf(w: np.ndarray, layout, shape: tuple[int, ...]) -> np.ndarray:
    if layout is None:
        return w
    return w.reshape(shape) if layout == "vector" else w.T.reshape(shape)


def _hf_shape(shape: tuple[int, ...], layout) -> tuple[int, ...]:
    if layout is None:
        return tuple(shape)
    if layout == "vector":
        return (math.prod(shape),)
    return (math.prod(shape[layout:]), math.prod(shape[:layout]))


def family_of(model_cfg: ModelConfig):
    family = families.get(model_cfg.family)
    if family is None:
        raise HFError(f"model.family: {model_cfg.family!r} is not a model family; choose one of "
                      f"{sorted(families.FAMILIES)}")
    return family


def layers_of(stack: str, model_cfg: ModelConfig) -> range:
    """The model's layers a stack of blocks holds: "dense_blocks" the first `first_dense_layers`, "blocks" the
    rest (all of them, without a dense stack), "mtp" the prediction modules after them."""
    if stack == "mtp":
        return range(model_cfg.n_layers, model_cfg.n_layers + model_cfg.mtp_layers)
    return range(model_cfg.first_dense_layers) if stack == "dense_blocks" else range(
        model_cfg.first_dense_layers, model_cfg.n_layers)


def _hf_names(path: tuple[str, ...], model_cfg: ModelConfig, table: dict) -> tuple[list[str], object, int]:
    """HF tensor names of one jaxtrain param (one per layer, and per expert, of a stacked param), its layout and
    how many leading axes the names enumerate."""
    if path not in table:
        raise HFError(f"{'.'.join(path)}: the {model_cfg.family} family has no Hugging Face name for this parameter")
    name, layout = table[path]
    layers = layers_of(path[0], model_cfg) if "{i}" in name else [None]
    experts = range(model_cfg.n_experts) if "{e}" in name else [None]
    names = [name.format(i=i, e=e) for i in layers for e in experts]
    return names, layout, ("{i}" in name) + ("{e}" in name)


def _flat(tree: dict, prefix: tuple[str, ...] = ()) -> dict[tuple[str, ...], object]:
    out = {}
    for k, v in tree.items():
        out.update(_flat(v, prefix + (str(k),)) if isinstance(v, dict) else {prefix + (str(k),): v})
    return out


def _nest(flat: dict[tuple[str, ...], object]) -> dict:
    out: dict = {}
    for path, v in flat.items():
        node = out
        for k in path[:-1]:
            node = node.setdefault(k, {})
        node[path[-1]] = v
    return out


def param_shapes(model_cfg: ModelConfig) -> dict[tuple[str, ...], tuple[int, ...]]:
    """{path: shape} of the model's params, traced from the model itself so a new parameter cannot be missed."""
    abstract = jax.eval_shape(lambda: nnx.to_pure_dict(nnx.state(transformer.build(model_cfg, 0))))
    return {path: tuple(x.shape) for path, x in _flat(abstract).items()}


# ===== Export ==========================================================================================


def hf_config(model_cfg: ModelConfig, *, dtype: str, max_position_embeddings: int = 2048,
              eos_token_id: int | None = None) -> dict:
    """The family's config.json for `model_cfg`. HFError names the first field the family cannot write (one it
    would read back otherwise), e.g. qk_norm on a Llama."""
    family = family_of(model_cfg)
    config = {**family.to_hf(model_cfg),
              "max_position_embeddings": max_position_embeddings,
              # Explicit ids: when absent, the HF config classes assume ids that are not our tokenizer's.
              "bos_token_id": None, "eos_token_id": eos_token_id, "pad_token_id": None,
              "attention_dropout": 0.0, "initializer_range": model_cfg.init_std,
              "torch_dtype": dtype,  # transformers 4.x
              "dtype": dtype}  # transformers 5.x
    back = {**{f: getattr(_DEFAULTS, f) for f in FIELDS}, **family.from_hf(HFConfig(config, "export")),
            "family": family.NAME}
    for field in FIELDS:
        if back[field] != getattr(model_cfg, field):
            raise HFError(f"model.{field}: {getattr(model_cfg, field)!r} cannot be written as a {family.NAME} "
                          f"checkpoint (it would read back as {back[field]!r}); choose another model.family")
    return config


def check_output(out_dir: Path, overwrite: bool) -> None:
    """HFError unless `out_dir` may receive an export: missing, empty, or (with `overwrite`) an earlier export,
    which only `export` marks (EXPORT_MARKER). Anything else is refused, naming what is in it: replacing
    deletes the directory, and a workdir or a model directory from elsewhere must never go that way."""
    if out_dir.exists() and not out_dir.is_dir():
        raise HFError(f"{out_dir}: exists and is not a directory")
    if not out_dir.is_dir() or not any(out_dir.iterdir()):
        return
    if not (out_dir / EXPORT_MARKER).is_file():
        names = sorted(p.name for p in out_dir.iterdir())
        held = [n for n in names if not n.startswith(".")] or names
        raise HFError(f"{out_dir}: not empty (it holds {', '.join(held[:4])}{', ...' if len(held) > 4 else ''}) and "
                      f"not written by jaxtrain hf export; choose another output directory")
    if not overwrite:
        raise HFError(f"{out_dir}: exists and is not empty; pass --overwrite (overwrite=True) to replace it")


def export(params: dict, model_cfg: ModelConfig, out_dir, *, dtype: str | None = None,
           tokenizer_dir=None, max_position_embeddings: int = 2048, overwrite: bool = False,
           shard_bytes: int = SHARD_BYTES) -> Path:
    """Writes `out_dir` as the family's Hugging Face directory: config.json, the weights (model.safetensors, or
    shards of at most `shard_bytes` with model.safetensors.index.json) and, when `tokenizer_dir` holds them,
    tokenizer.json / tokenizer.model (+ the EOS id from its manifest.json).

    `params`: the pure-dict params (jax or numpy arrays). `dtype`: float32, bfloat16 or float16; None keeps the
    params' own dtype. The directory appears complete or not at all: it is written beside `out_dir` and renamed
    into place. A non-empty `out_dir` is refused unless it is an earlier export and `overwrite` is set."""
    out_dir = Path(out_dir)
    check_output(out_dir, overwrite)
    if model_cfg.lora_rank:  # a LoRA run exports the model it computes: its adapters folded into the weights
        params, model_cfg = lora.merged(params, model_cfg), dataclasses.replace(model_cfg, lora_rank=0)
    if dtype is not None and dtype not in DTYPES:
        raise HFError(f"dtype: {dtype!r} is not one of {list(DTYPES)}")
    hf_config(model_cfg, dtype=dtype or "float32")  # refuses what the family cannot write, before any work
    table = family_of(model_cfg).weights(model_cfg)

    shapes = param_shapes(model_cfg)
    flat = _flat(params)
    if set(flat) != set(shapes):
        missing, extra = sorted(set(shapes) - set(flat)), sorted(set(flat) - set(shapes))
        raise HFError(f"params do not match the model config: missing {['.'.join(p) for p in missing]}, "
                      f"unexpected {['.'.join(p) for p in extra]}")
    tensors = {}
    for path, value in flat.items():
        x = np.asarray(jax.device_get(value))
        if x.shape != shapes[path]:
            raise HFError(f"{'.'.join(path)}: shape {x.shape}, the model config implies {shapes[path]}")
        if dtype is not None:
            x = x.astype(DTYPES[dtype])
        names, layout, lead = _hf_names(path, model_cfg, table)
        parts = x.reshape(-1, *x.shape[lead:]) if lead else x[None]
        for name, part in zip(names, parts):
            tensors[name] = _to_hf(part, layout)
    for name, source in getattr(family_of(model_cfg), "copies", lambda _: {})(model_cfg).items():
        tensors[name] = tensors[source]
    dtypes = {t.dtype.name for t in tensors.values()}
    if len(dtypes) != 1:  # a config.json can only name one
        raise HFError(f"params mix dtypes {sorted(dtypes)}; pass dtype= to export them as one")
    written_dtype = dtypes.pop()

    eos_id = None
    tok_files = []
    if tokenizer_dir is not None:
        tok_files = [Path(tokenizer_dir) / f for f in TOKENIZER_FILES if (Path(tokenizer_dir) / f).is_file()]
        manifest = Path(tokenizer_dir) / "manifest.json"  # jaxtrain.data.prepare's: the EOS its documents end with
        if manifest.is_file():
            eos_id = json.loads(manifest.read_text()).get("eos_id")

    def fill(tmp: Path) -> None:
        _save_weights(tensors, tmp, shard_bytes)
        config = hf_config(model_cfg, dtype=written_dtype, max_position_embeddings=max_position_embeddings,
                           eos_token_id=eos_id)
        (tmp / CONFIG).write_text(json.dumps(config, indent=2) + "\n")
        for f in tok_files:
            shutil.copyfile(f, tmp / f.name)
        if tok_files and tok_files[0].name == "tokenizer.json":
            _write_tokenizer_config(tmp, tok_files[0], eos_id)

    return _written_whole(out_dir, fill, "jaxtrain hf export")


def _written_whole(out_dir: Path, fill, written_by: str) -> Path:
    """`out_dir` made by `fill(tmp)` in a sibling temp dir (with the EXPORT_MARKER) and renamed into place: it
    appears complete or not at all, and an earlier export there is replaced whole."""
    files.make_dir(out_dir.parent, "--output")
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", suffix=".partial", dir=out_dir.parent))
    try:
        fill(tmp)
        (tmp / EXPORT_MARKER).write_text(json.dumps({"written_by": written_by}) + "\n")
        os.chmod(tmp, 0o755)  # mkdtemp makes it 0700
        _replace_dir(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir


# PEFT's adapter directory (peft.PeftModel.from_pretrained reads it onto the transformers model of the base).
ADAPTER_CONFIG, ADAPTER_WEIGHTS = "adapter_config.json", "adapter_model.safetensors"


def _adapter_tensors(model_cfg: ModelConfig):
    """(adapter param path, "lora_A" or "lora_B", PEFT tensor names, the stacked axes the names enumerate, whether
    it is an expert adapter) of each adapter `model_cfg` has: base_model.model.<module of the adapted weight's HF
    name>.lora_A/B.weight, or for the experts the module PEFT wraps their fused parameter in."""
    table = family_of(model_cfg).weights(model_cfg)
    for path in param_shapes(model_cfg):
        if not lora.is_adapter(path[-1]):
            continue
        suffix = next(x for x in lora.SUFFIXES if path[-1].endswith(x))
        kind = "lora_A" if suffix == lora.SUFFIXES[0] else "lora_B"
        weight_path = path[:-1] + (path[-1][: -len(suffix)],)
        experts = bool(model_cfg.n_experts) and weight_path[1:] in families.base.EXPERT_ADAPTERS
        if experts:
            module = families.base.EXPERT_ADAPTERS[weight_path[1:]]
            names, lead = [module.format(i=i) for i in layers_of(path[0], model_cfg)], 1
        else:
            names, _, lead = _hf_names(weight_path, model_cfg, table)
            names = [n.removesuffix(".weight") for n in names]
        yield path, kind, [f"base_model.model.{n}.{kind}.weight" for n in names], lead, experts


def _to_peft(x: np.ndarray, kind: str, experts: bool) -> np.ndarray:
    """One layer's adapter in PEFT's layout: lora_A [r, in], lora_B [out, r] (HF's [out, in] order); for E experts
    lora_A [E * r, in] (expert-major) and lora_B [out, r * E] (expert-minor), as PEFT's ParamWrapper reshapes them."""
    if experts:
        e, r = x.shape[0], x.shape[-1] if kind == "lora_A" else x.shape[1]
        if kind == "lora_A":
            return x.transpose(0, 2, 1).reshape(e * r, -1)
        return x.reshape(e, r, -1).transpose(2, 1, 0).reshape(-1, r * e)
    r = x.shape[-1] if kind == "lora_A" else x.shape[0]
    return (x.reshape(-1, r) if kind == "lora_A" else x.reshape(r, -1)).T


def _from_peft(w: np.ndarray, kind: str, experts: bool, one: tuple[int, ...]) -> np.ndarray:
    """`_to_peft`'s inverse, into one layer's shape `one`."""
    if experts:
        e, r = one[0], one[-1] if kind == "lora_A" else one[1]
        if kind == "lora_A":
            return w.reshape(e, r, -1).transpose(0, 2, 1).reshape(one)
        return w.reshape(-1, r, e).transpose(2, 1, 0).reshape(one)
    return w.T.reshape(one)


def export_adapters(params: dict, model_cfg: ModelConfig, out_dir, *, base_model: str = "",
                    overwrite: bool = False) -> Path:
    """Writes a LoRA run's adapters alone in PEFT's format: adapter_config.json and adapter_model.safetensors, each
    adapted weight W (the family's HF name, e.g. model.layers.0.self_attn.q_proj.weight) giving
    base_model.model.<W's module>.lora_A.weight [r, in] and lora_B.weight [out, r] (HF's [out, in] order), in f32;
    a mixture of experts' adapters as PEFT's target_parameters on transformers' fused experts (`_to_peft`).
    `base_model`: what the config names as the base (base_model_name_or_path)."""
    out_dir = Path(out_dir)
    check_output(out_dir, overwrite)
    adapters = _flat(lora.split(params)[0])
    if not adapters:
        raise HFError("params hold no LoRA adapters (model.lora_rank is 0); `hf export` writes the model itself")
    r, tensors = model_cfg.lora_rank, {}
    experts = False
    for path, kind, names, lead, expert in _adapter_tensors(model_cfg):
        x = np.asarray(jax.device_get(adapters[path]), np.float32)
        for name, part in zip(names, x.reshape(-1, *x.shape[lead:])):  # one layer's
            tensors[name] = np.ascontiguousarray(_to_peft(part, kind, expert))
        experts |= expert
    modules = sorted({name.split(".")[-3] for name in tensors if ".experts." not in name})  # q_proj, ...
    # lora_dropout: 0 (PEFT refuses dropout on experts; it is a training setting, and the adapters are exported).
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model or None,
              "r": r, "lora_alpha": model_cfg.lora_alpha, "lora_dropout": 0.0, "target_modules": modules,
              "target_parameters": families.base.EXPERT_PARAMETERS if experts else None,
              "bias": "none", "fan_in_fan_out": False, "use_rslora": False, "init_lora_weights": True,
              "inference_mode": True}

    def fill(tmp: Path) -> None:
        save_file(tensors, str(tmp / ADAPTER_WEIGHTS), metadata={"format": "pt"})
        (tmp / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2) + "\n")

    return _written_whole(out_dir, fill, "jaxtrain hf export --adapters")


def check_init_adapters(adapter_dir, model_cfg: ModelConfig) -> None:
    """`model.init_adapters` against `model_cfg`, its weights too (readable, finite, the run's shapes): adapters
    are small, and a damaged file must fail before the workdir exists, not after the compile."""
    try:
        import_adapters(adapter_dir, model_cfg)
    except HFError as e:
        raise ConfigError("model.init_adapters", str(e)) from None


# adapter_config.json fields that change the adapted function, with the value jaxtrain computes (PEFT's default):
# any other value is refused by name rather than trained with silently. rslora scales by alpha / sqrt(r), the
# patterns give modules their own r and alpha, DoRA adds a magnitude vector, fan_in_fan_out transposes the weight,
# layers_to_transform adapts some layers only, bias and modules_to_save train more than A and B.
_ADAPTER_FIXED = {"use_rslora": (False,), "alpha_pattern": (None, {}), "rank_pattern": (None, {}),
                  "use_dora": (False,), "fan_in_fan_out": (False,), "layers_to_transform": (None, []),
                  "layers_pattern": (None, [], ""), "bias": ("none",), "modules_to_save": (None, []),
                  "lora_bias": (False,), "trainable_token_indices": (None, {}, [])}


def _adapter_config(adapter_dir: Path, model_cfg: ModelConfig) -> dict:
    config_path, weights_path = adapter_dir / ADAPTER_CONFIG, adapter_dir / ADAPTER_WEIGHTS
    for path in (config_path, weights_path):
        if not path.is_file():
            raise HFError(f"{path}: not found; a PEFT adapter directory holds {ADAPTER_CONFIG} and {ADAPTER_WEIGHTS}")
    config = _read_json(config_path)
    for field, ours in (("peft_type", "LORA"), ("r", model_cfg.lora_rank), ("lora_alpha", model_cfg.lora_alpha)):
        if config.get(field) != ours:
            raise HFError(f"{config_path}: {field} is {config.get(field)!r}, the run has {ours!r} "
                          f"(model.lora_rank / model.lora_alpha)")
    for field, plain in _ADAPTER_FIXED.items():
        if field in config and not any(config[field] == v and type(config[field]) is type(v) for v in plain):
            raise HFError(f"{config_path}: {field} is {config[field]!r}; jaxtrain's adapters support only "
                          f"{plain[0]!r} (plain LoRA, scaled by lora_alpha / r)")
    return config


def import_adapters(adapter_dir, model_cfg: ModelConfig) -> dict:
    """The adapters of a PEFT LoRA directory (export_adapters' format, or PEFT's own) for `model_cfg`, as the
    params' adapter leaves (numpy f32, jaxtrain's layout): what continues training them. HFError names the field
    or tensor that does not fit: r and lora_alpha must equal model.lora_rank and lora_alpha, and each adapted
    module must be one `model.lora_targets` names."""
    adapter_dir = Path(adapter_dir)
    _adapter_config(adapter_dir, model_cfg)
    weights_path = adapter_dir / ADAPTER_WEIGHTS
    try:
        with safe_open(str(weights_path), framework="numpy") as f:
            tensors = {k: f.get_tensor(k) for k in f.keys()}
    except SafetensorError as e:
        raise HFError(f"{weights_path}: not a readable safetensors file ({e})") from None
    shapes = param_shapes(model_cfg)
    flat, used = {}, set()
    for path, kind, names, lead, expert in _adapter_tensors(model_cfg):
        one = shapes[path][lead:]
        want = _to_peft(np.zeros(one, np.float32), kind, expert).shape
        parts = []
        for name in names:
            if name not in tensors:
                raise HFError(f"{weights_path}: missing tensor {name}")
            w = np.asarray(tensors[name], np.float32)
            if w.shape != want:
                raise HFError(f"{weights_path}: tensor {name} has shape {list(w.shape)}, the run implies {list(want)}")
            if not _finite(w):
                raise HFError(f"{weights_path}: tensor {name} holds NaN or infinite values; the adapters are damaged")
            parts.append(np.ascontiguousarray(_from_peft(w, kind, expert, one)))
            used.add(name)
        flat[path] = np.stack(parts).reshape(shapes[path]) if lead else parts[0]
    if extra := sorted(set(tensors) - used):
        raise HFError(f"{weights_path}: adapters the run has no place for: {', '.join(extra[:3])}"
                      + (f" and {len(extra) - 3} more" if len(extra) > 3 else "")
                      + " (model.lora_targets names the adapted projections)")
    return _nest(flat)


def _save_weights(tensors: dict, out: Path, shard_bytes: int) -> None:
    """One model.safetensors, or (past `shard_bytes`) numbered shards and the index transformers reads."""
    shards, size = [{}], 0
    for name, t in tensors.items():
        if shards[-1] and size + t.nbytes > shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += t.nbytes
    # "format": "pt" is what transformers checks for in the header before it loads the file.
    if len(shards) == 1:
        save_file(tensors, out / WEIGHTS, metadata={"format": "pt"})
        return
    weight_map = {}
    for k, shard in enumerate(shards):
        name = f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, out / name, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, name))
    index = {"metadata": {"total_size": sum(t.nbytes for t in tensors.values())}, "weight_map": weight_map}
    (out / WEIGHTS_INDEX).write_text(json.dumps(index, indent=2) + "\n")


def _write_tokenizer_config(out: Path, tokenizer_json: Path, eos_id: int | None) -> None:
    # Names the EOS token (without this file transformers 5 loads the tokenizer with eos_token_id None) and a
    # class that takes tokenizer.json as it is, not the Llama tokenizer class that model_type "llama" implies.
    config = {"tokenizer_class": "PreTrainedTokenizerFast"}
    if eos_id is not None:
        added = json.loads(tokenizer_json.read_text()).get("added_tokens", [])
        if eos := next((t["content"] for t in added if t.get("id") == eos_id), None):
            config["eos_token"] = eos
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")


def _replace_dir(new: Path, target: Path) -> None:
    """Renames `new` onto `target`. An existing target is moved aside first (and back if the second rename
    fails), then deleted: `target` is the old or the new directory, never a mix and never missing for long."""
    if target.is_dir() and any(target.iterdir()):
        old = Path(tempfile.mkdtemp(prefix=f".{target.name}.", suffix=".old", dir=target.parent))
        os.rename(target, old / "dir")
        try:
            os.rename(new, target)
        except BaseException:
            os.rename(old / "dir", target)
            os.rmdir(old)
            raise
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.rename(new, target)  # an empty target dir is replaced by rename(2)


# ===== Import ==========================================================================================


def read_config(hf_dir) -> dict:
    """The ModelConfig fields (FIELDS, and the family's training defaults such as moe_routing) that an HF
    config.json implies; HFError for what the model cannot represent, naming the config field."""
    path = Path(hf_dir) / CONFIG
    if not path.is_file():
        raise HFError(f"{path}: not found: not a Hugging Face model directory")
    values = _read_json(path)
    model_type = values.get("model_type")
    family = families.for_model_type(model_type)
    if family is None:
        hint = "; its text model is 'gemma3_text'" if model_type == "gemma3" else ""
        raise HFError(f"{path}: model_type: {model_type!r} is not supported{hint}; supported: "
                      f"{families.model_types()}")
    fields = family.from_hf(HFConfig(values, path))
    if fields.get("mtp_layers") and not _holds_layer(Path(hf_dir), fields["n_layers"]):
        # transformers' DeepSeek-V3 writes num_nextn_predict_layers (its default 1) without the modules, which it
        # does not hold: there are none to read.
        fields["mtp_layers"] = 0
    return {**{f: getattr(_DEFAULTS, f) for f in FIELDS}, **fields, "family": family.NAME}


def _holds_layer(hf_dir: Path, layer: int) -> bool:
    """Whether the directory's weights hold a tensor of model.layers.<layer> (True when it has no weights to tell)."""
    prefix = f"model.layers.{layer}."
    if (hf_dir / WEIGHTS_INDEX).is_file() and not (hf_dir / WEIGHTS).is_file():
        weight_map = _read_json(hf_dir / WEIGHTS_INDEX).get("weight_map")
        return not isinstance(weight_map, dict) or any(str(k).startswith(prefix) for k in weight_map)
    if not (hf_dir / WEIGHTS).is_file():
        return True
    try:
        with safe_open(hf_dir / WEIGHTS, framework="np") as reader:  # the header only
            return any(k.startswith(prefix) for k in reader.keys())
    except SafetensorError:
        return True  # _read_tensors names the damaged file


def _read_json(path: Path) -> dict:
    try:
        value = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise HFError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(value, dict):
        raise HFError(f"{path}: not a JSON object")
    return value


def _finite(x: np.ndarray) -> bool:
    if x.dtype.kind not in "fV":  # integer tensors are always finite (V: ml_dtypes' bfloat16)
        return True
    return bool(np.isfinite(x.astype(np.float32, copy=False)).all())


def _read_tensors(hf_dir: Path) -> dict[str, np.ndarray]:
    single, index = hf_dir / WEIGHTS, hf_dir / WEIGHTS_INDEX
    if single.is_file():
        files = [single]
    elif index.is_file():
        weight_map = _read_json(index).get("weight_map")
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise HFError(f"{index}: no weight_map")
        for name in set(weight_map.values()):  # files of this directory only (symlinks in it, as the HF cache has, are)
            if PurePosixPath(name).is_absolute() or ".." in PurePosixPath(name).parts or "\\" in name:
                raise HFError(f"{index}: weight_map names {name!r}, outside the directory")
        files = [hf_dir / name for name in sorted(set(weight_map.values()))]
        for f in files:
            if not f.is_file():
                raise HFError(f"{f}: missing (listed in {index.name})")
    else:
        raise HFError(f"{hf_dir}: no {WEIGHTS} or {WEIGHTS_INDEX} (only safetensors checkpoints are supported)")
    tensors = {}
    for f in files:
        try:
            with safe_open(f, framework="np") as reader:
                for name in reader.keys():
                    if name in tensors:
                        raise HFError(f"{name}: in more than one file of {hf_dir}")
                    tensors[name] = reader.get_tensor(name)
                    if not _finite(tensors[name]):  # else the first step reports a non-finite loss instead
                        raise HFError(f"{name} in {f}: holds NaN or infinite values; the checkpoint is damaged")
        except SafetensorError as e:
            raise HFError(f"{f}: not a readable safetensors file ({e})") from None
    return tensors


def import_dir(hf_dir, *, dtype: str | None = None, mtp_layers: int | None = None) -> tuple[dict, dict]:
    """(model fields, params) of an HF directory of any family (model.safetensors or a sharded index).

    The params are numpy arrays in jaxtrain's pure-dict structure, float32 unless `dtype` is given (bf16 and
    f16 checkpoints widen to f32 exactly). `mtp_layers`: read only the first so many of the checkpoint's
    multi-token prediction modules (at most its own). HFError names the config field or tensor that does not fit."""
    hf_dir = Path(hf_dir)
    fields = read_config(hf_dir)
    if mtp_layers is not None:
        fields["mtp_layers"] = min(mtp_layers, fields["mtp_layers"])
    if dtype is not None and dtype not in DTYPES:
        raise HFError(f"dtype: {dtype!r} is not one of {list(DTYPES)}")
    target = DTYPES[dtype or "float32"]
    tensors = _read_tensors(hf_dir)
    # Older exports saved RoPE's frequency buffer; it is recomputed from rope_theta on both sides.
    tensors = {k: v for k, v in tensors.items() if not k.endswith(".rotary_emb.inv_freq")}
    # What the family's checkpoints hold beyond the model (DeepSeek's multi-token prediction layers).
    if skipped := getattr(families.get(fields["family"]), "skipped", None):
        tensors = {k: v for k, v in tensors.items() if not skipped(k, fields)}
    if fields["tie_embeddings"] and "lm_head.weight" in tensors:
        # Some exporters write the tied head anyway; harmless only if it really is the embedding.
        head = tensors.pop("lm_head.weight")
        if not np.array_equal(head, tensors.get("model.embed_tokens.weight")):
            raise HFError(f"{hf_dir}: lm_head.weight: present and unlike model.embed_tokens.weight, but the config "
                          f"has tie_word_embeddings true")

    model_cfg = ModelConfig(**fields, dtype="float32", param_dtype="float32")
    table = family_of(model_cfg).weights(model_cfg)
    flat = {}
    used = set()
    for path, shape in param_shapes(model_cfg).items():
        names, layout, lead = _hf_names(path, model_cfg, table)
        want = _hf_shape(shape[lead:], layout)
        parts = []
        for name in names:
            if name not in tensors:
                hint = "; leave the multi-token prediction modules out: model.mtp_layers=0" if path[0] == "mtp" else ""
                raise HFError(f"{hf_dir}: missing tensor {name}{hint}")
            w = tensors[name]
            if tuple(w.shape) != want:
                raise HFError(f"{hf_dir}: tensor {name} has shape {list(w.shape)}, config.json implies {list(want)}")
            if w.dtype not in (np.float32, np.float16, ml_dtypes.bfloat16):
                raise HFError(f"{hf_dir}: tensor {name} has dtype {w.dtype}; expected a float type")
            parts.append(np.ascontiguousarray(_from_hf(w, layout, shape[lead:]), target))
            used.add(name)
        flat[path] = np.stack(parts).reshape(shape) if lead else parts[0]
    if extra := sorted(set(tensors) - used):
        raise HFError(f"{hf_dir}: unexpected tensor(s) the model has no place for: {', '.join(extra[:5])}"
                      + (f" and {len(extra) - 5} more" if len(extra) > 5 else ""))
    return fields, _nest(flat)


def check_fields(fields: dict, model_cfg: ModelConfig, hf_dir) -> None:
    """HFMismatch on the first ModelConfig field (FIELDS order) that differs from the HF checkpoint's."""
    for field in FIELDS:
        ours, theirs = getattr(model_cfg, field), fields[field]
        if field == "mtp_layers" and ours < theirs:  # a run may leave prediction modules out, not add them
            continue
        if ours != theirs:
            raise HFMismatch(field, f"{ours!r} in the config, but the Hugging Face checkpoint {hf_dir} has "
                                    f"{theirs!r}; set --config.model.{field}={_flag_value(theirs)}")


def check_init_from(hf_dir, model_cfg: ModelConfig) -> None:
    """`model.init_from`'s config.json against `model_cfg` (its weights are read at init, after compiling)."""
    try:
        check_fields(read_config(hf_dir), model_cfg, hf_dir)
    except HFMismatch:
        raise
    except HFError as e:
        raise ConfigError("model.init_from", str(e)) from None


def load_params(hf_dir, model_cfg: ModelConfig) -> dict:
    """Params of an HF directory for `model_cfg` (numpy, in its param_dtype), after checking that every
    architecture field matches: HFMismatch names the first that does not, HFError anything unreadable."""
    fields = read_config(hf_dir)
    check_fields(fields, model_cfg, hf_dir)  # before reading gigabytes of weights
    _, params = import_dir(hf_dir, dtype=model_cfg.param_dtype, mtp_layers=model_cfg.mtp_layers)
    return params


def check_tokenizer(hf_dir, data_dir) -> None:
    """ConfigError('model.init_from') when `hf_dir` ships a tokenizer and the data in `data_dir` was made with
    another: the weights would read foreign ids. A checkpoint without one is taken as it is."""
    theirs = [Path(hf_dir) / f for f in TOKENIZER_FILES if (Path(hf_dir) / f).is_file()]
    if not theirs or any(_same_file(f, Path(data_dir) / f.name) for f in theirs):
        return
    raise ConfigError("model.init_from", f"{hf_dir} ships its own tokenizer, and the data in {data_dir} was "
                      f"tokenized with another; prepare the data with it (jaxtrain prepare "
                      f"--tokenizer {Path(hf_dir)} ...) and set data.dir")


def _same_file(a: Path, b: Path) -> bool:
    if not b.is_file():
        return False
    if a.suffix == ".json":  # the same tokenizer, whatever the JSON's formatting
        return _read_json(a) == _read_json(b)
    return a.read_bytes() == b.read_bytes()


# ===== Flags ===========================================================================================


def _flag_value(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return repr(value) if isinstance(value, float) else str(value)


def override_flags(hf_dir) -> list[str]:
    """`--config.model.<field>=<value>` for the family and the sizes, then every other field the directory sets
    away from its default (a config file that sets one the directory does not is caught by `check_fields`), then
    `--config.model.init_from=<hf_dir>`."""
    fields = read_config(hf_dir)
    always = FIELDS[:FIELDS.index("norm_eps") + 1]
    keys = [k for k in fields if k in always or fields[k] != getattr(_DEFAULTS, k)]
    return [f"--config.model.{k}={_flag_value(fields[k])}" for k in keys] + [
        f"--config.model.init_from={os.path.abspath(hf_dir)}"]
