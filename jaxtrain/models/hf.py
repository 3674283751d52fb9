"""Hugging Face Llama interop: a checkpoint out as a `LlamaForCausalLM` directory, such a directory back in as params.

LAYER_NAMES and TOP_NAMES map jaxtrain's parameters to HF's tensors. The stacked blocks' leading `layers`
axis becomes one tensor per layer (`model.layers.i.*`); HF linear weights are [out, in], jaxtrain kernels
[in, out] with heads as their own axes (e.g. `blocks.attn.wq` [L, d, H, hd] <-> `self_attn.q_proj.weight`
[H*hd, d]). Both sides apply rotate-half RoPE with frequencies theta^(-2j/hd), so q/k need no permutation.
Needs only numpy and safetensors. Commands: `jaxtrain hf export|overrides` (jaxtrain.tools.hf; docs/huggingface.md).
"""

from __future__ import annotations

import json
import math
import os
import shutil
import tempfile
from pathlib import Path

import jax
import ml_dtypes
import numpy as np
from flax import nnx
from safetensors import SafetensorError, safe_open
from safetensors.numpy import save_file

from jaxtrain import files
from jaxtrain.errors import ConfigError, HFError, HFMismatch
from jaxtrain.models import transformer
from jaxtrain.models.config import ModelConfig

CONFIG = "config.json"
WEIGHTS = "model.safetensors"
WEIGHTS_INDEX = "model.safetensors.index.json"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model")
# Written into every export, and only there: `--overwrite` replaces a directory that holds it, nothing else.
EXPORT_MARKER = "jaxtrain-export.json"
DTYPES = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16, "float16": np.float16}
# ModelConfig fields an HF config determines; the rest (remat, dtypes, init_std) are training choices.
FIELDS = ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "head_dim", "d_ff", "tie_embeddings",
          "rope_theta", "norm_eps")

# jaxtrain path under `blocks` -> (HF name under model.layers.i, leading axes that form the matmul's input).
# in_axes=None: a vector, copied as it is.
LAYER_NAMES = {
    ("attn_norm", "scale"): ("input_layernorm", None),
    ("attn", "wq"): ("self_attn.q_proj", 1),
    ("attn", "wk"): ("self_attn.k_proj", 1),
    ("attn", "wv"): ("self_attn.v_proj", 1),
    ("attn", "wo"): ("self_attn.o_proj", 2),
    ("mlp_norm", "scale"): ("post_attention_layernorm", None),
    ("mlp", "w_gate"): ("mlp.gate_proj", 1),
    ("mlp", "w_up"): ("mlp.up_proj", 1),
    ("mlp", "w_down"): ("mlp.down_proj", 1),
}
TOP_NAMES = {
    ("embed",): ("model.embed_tokens", None),  # already [V, d] in both
    ("final_norm", "scale"): ("model.norm", None),
    ("unembed",): ("lm_head", 1),
}


# ===== Layout conversion ===============================================================================


def _to_hf(x: np.ndarray, in_axes: int | None) -> np.ndarray:
    if in_axes is None:
        return x
    n_in = math.prod(x.shape[:in_axes])
    return np.ascontiguousarray(x.reshape(n_in, -1).T)


def _from_hf(w: np.ndarray, in_axes: int | None, shape: tuple[int, ...]) -> np.ndarray:
    return w if in_axes is None else w.T.reshape(shape)


def _hf_shape(shape: tuple[int, ...], in_axes: int | None) -> tuple[int, ...]:
    if in_axes is None:
        return tuple(shape)
    return (math.prod(shape[in_axes:]), math.prod(shape[:in_axes]))


def _hf_names(path: tuple[str, ...], n_layers: int) -> tuple[list[str], int | None]:
    """HF tensor names (one per layer for stacked blocks) and in_axes of one jaxtrain param."""
    if path[0] == "blocks" and path[1:] in LAYER_NAMES:
        name, in_axes = LAYER_NAMES[path[1:]]
        return [f"model.layers.{i}.{name}.weight" for i in range(n_layers)], in_axes
    if path in TOP_NAMES:
        name, in_axes = TOP_NAMES[path]
        return [f"{name}.weight"], in_axes
    raise HFError(f"{'.'.join(path)}: no Hugging Face Llama name for this parameter")


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
    c = model_cfg
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": c.vocab_size,
        "hidden_size": c.d_model,
        "intermediate_size": c.d_ff,
        "num_hidden_layers": c.n_layers,
        "num_attention_heads": c.n_heads,
        "num_key_value_heads": c.n_kv_heads,
        "head_dim": c.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": c.norm_eps,
        "max_position_embeddings": max_position_embeddings,
        "tie_word_embeddings": c.tie_embeddings,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        # rope_theta + rope_scaling for transformers 4.x, rope_parameters for 5.x (it reads either).
        "rope_theta": c.rope_theta,
        "rope_scaling": None,
        "rope_parameters": {"rope_type": "default", "rope_theta": c.rope_theta},
        # Explicit ids: when absent, LlamaConfig assumes bos=1, eos=2, which are not our tokenizer's.
        "bos_token_id": None,
        "eos_token_id": eos_token_id,
        "pad_token_id": None,
        "initializer_range": c.init_std,
        "torch_dtype": dtype,  # transformers 4.x
        "dtype": dtype,  # transformers 5.x
    }


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
                 tokenizer_dir=None, max_position_embeddings: int = 2048, overwrite: bool = False) -> Path:
    """Writes `out_dir` as a Hugging Face Llama directory: config.json, model.safetensors and, when
    `tokenizer_dir` holds them, tokenizer.json / tokenizer.model (+ the EOS id from its manifest.json).

    `params`: the pure-dict params (jax or numpy arrays). `dtype`: float32, bfloat16 or float16; None keeps the
    params' own dtype. The directory appears complete or not at all: it is written beside `out_dir` and renamed
    into place. A non-empty `out_dir` is refused unless it is an earlier export and `overwrite` is set."""
    out_dir = Path(out_dir)
    if model_cfg.n_experts:
        raise HFError(f"model.n_experts: {model_cfg.n_experts}, but a Llama checkpoint has no mixture of experts "
                      f"(a Mixtral export is not written yet)")
    check_output(out_dir, overwrite)
    if dtype is not None and dtype not in DTYPES:
        raise HFError(f"dtype: {dtype!r} is not one of {list(DTYPES)}")

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
        names, in_axes = _hf_names(path, model_cfg.n_layers)
        for i, name in enumerate(names):
            tensors[name] = _to_hf(x[i] if path[0] == "blocks" else x, in_axes)
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

    files.make_dir(out_dir.parent, "--output")
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", suffix=".partial", dir=out_dir.parent))
    try:
        # "format": "pt" is what transformers checks for in the header before it loads the file.
        save_file(tensors, tmp / WEIGHTS, metadata={"format": "pt"})
        config = hf_config(model_cfg, dtype=written_dtype, max_position_embeddings=max_position_embeddings,
                           eos_token_id=eos_id)
        (tmp / CONFIG).write_text(json.dumps(config, indent=2) + "\n")
        (tmp / EXPORT_MARKER).write_text(json.dumps({"written_by": "jaxtrain hf export"}) + "\n")
        for f in tok_files:
            shutil.copyfile(f, tmp / f.name)
        if tok_files and tok_files[0].name == "tokenizer.json":
            _write_tokenizer_config(tmp, tok_files[0], eos_id)
        os.chmod(tmp, 0o755)  # mkdtemp makes it 0700
        _replace_dir(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir


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
    """The ModelConfig fields (FIELDS) an HF Llama config.json implies; HFError for what the model cannot
    represent, naming the config field."""
    path = Path(hf_dir) / CONFIG
    if not path.is_file():
        raise HFError(f"{path}: not found: not a Hugging Face model directory")
    c = _read_json(path)

    def refuse(field, reason):
        raise HFError(f"{path}: {field}: {reason}")

    if c.get("model_type") != "llama":
        refuse("model_type", f"{c.get('model_type')!r}; only 'llama' is supported")
    if c.get("hidden_act", "silu") != "silu":
        refuse("hidden_act", f"{c['hidden_act']!r}; the model's MLP is SwiGLU (silu)")
    for field in ("attention_bias", "mlp_bias"):
        if c.get(field):
            refuse(field, "true; the model has no biases")
    if c.get("partial_rotary_factor", 1.0) != 1.0:
        refuse("partial_rotary_factor", f"{c['partial_rotary_factor']}; the model rotates the whole head")

    def number(field, default):
        value = c.get(field, default)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
            refuse(field, f"{value!r}; expected a positive number")
        return float(value)

    def size(field, default=None):
        value = c.get(field, default)
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            refuse(field, f"{value!r}; expected a positive integer")
        return value

    # transformers 4.x: rope_theta + rope_scaling; 5.x: rope_parameters. Only plain RoPE is representable.
    theta = number("rope_theta", 10000.0)
    for field in ("rope_scaling", "rope_parameters"):
        rope = c.get(field)
        if rope is None:
            continue
        plain = isinstance(rope, dict) and rope.get("rope_type", rope.get("type", "default")) == "default"
        if not plain or set(rope) - {"rope_type", "type", "rope_theta"}:
            refuse(field, f"{json.dumps(rope)}; only plain RoPE (rope_type 'default', no scaling) is supported")
        theta = rope.get("rope_theta", theta)
        if isinstance(theta, bool) or not isinstance(theta, (int, float)) or theta <= 0:
            refuse(f"{field}.rope_theta", f"{theta!r}; expected a positive number")

    n_heads = size("num_attention_heads")
    d_model = size("hidden_size")
    fields = {
        "vocab_size": size("vocab_size"),
        "d_model": d_model,
        "n_layers": size("num_hidden_layers"),
        "n_heads": n_heads,
        "n_kv_heads": size("num_key_value_heads", n_heads),
        # Older configs leave head_dim out: it is then hidden_size / heads.
        "head_dim": size("head_dim", d_model // n_heads if d_model % n_heads == 0 else None),
        "d_ff": size("intermediate_size"),
        "tie_embeddings": bool(c.get("tie_word_embeddings", False)),  # LlamaConfig's default
        "rope_theta": float(theta),
        "norm_eps": number("rms_norm_eps", 1e-6),  # LlamaConfig's default
    }
    if fields["n_heads"] % fields["n_kv_heads"]:
        refuse("num_key_value_heads", f"{fields['n_kv_heads']} does not divide num_attention_heads={n_heads}")
    if fields["head_dim"] % 2:
        refuse("head_dim", f"{fields['head_dim']} is odd; RoPE needs an even head_dim")
    return fields


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


def import_dir(hf_dir, *, dtype: str | None = None) -> tuple[dict, dict]:
    """(model fields, params) of an HF Llama directory (model.safetensors or a sharded index).

    The params are numpy arrays in jaxtrain's pure-dict structure, float32 unless `dtype` is given (bf16 and
    f16 checkpoints widen to f32 exactly). HFError names the config field or tensor that does not fit."""
    hf_dir = Path(hf_dir)
    fields = read_config(hf_dir)
    if dtype is not None and dtype not in DTYPES:
        raise HFError(f"dtype: {dtype!r} is not one of {list(DTYPES)}")
    target = DTYPES[dtype or "float32"]
    tensors = _read_tensors(hf_dir)
    # Older exports saved RoPE's frequency buffer; it is recomputed from rope_theta on both sides.
    tensors = {k: v for k, v in tensors.items() if not k.endswith(".rotary_emb.inv_freq")}
    if fields["tie_embeddings"] and "lm_head.weight" in tensors:
        # Some exporters write the tied head anyway; harmless only if it really is the embedding.
        head = tensors.pop("lm_head.weight")
        if not np.array_equal(head, tensors.get("model.embed_tokens.weight")):
            raise HFError(f"{hf_dir}: lm_head.weight: present and unlike model.embed_tokens.weight, but the config "
                          f"has tie_word_embeddings true")

    model_cfg = ModelConfig(**fields)
    flat = {}
    used = set()
    for path, shape in param_shapes(model_cfg).items():
        names, in_axes = _hf_names(path, model_cfg.n_layers)
        stacked = path[0] == "blocks"
        want = _hf_shape(shape[1:] if stacked else shape, in_axes)
        parts = []
        for name in names:
            if name not in tensors:
                raise HFError(f"{hf_dir}: missing tensor {name}")
            w = tensors[name]
            if tuple(w.shape) != want:
                raise HFError(f"{hf_dir}: tensor {name} has shape {list(w.shape)}, config.json implies {list(want)}")
            if w.dtype not in (np.float32, np.float16, ml_dtypes.bfloat16):
                raise HFError(f"{hf_dir}: tensor {name} has dtype {w.dtype}; expected a float type")
            parts.append(np.ascontiguousarray(_from_hf(w, in_axes, shape[1:] if stacked else shape), target))
            used.add(name)
        flat[path] = np.stack(parts) if stacked else parts[0]
    if extra := sorted(set(tensors) - used):
        raise HFError(f"{hf_dir}: unexpected tensor(s) the model has no place for: {', '.join(extra[:5])}"
                      + (f" and {len(extra) - 5} more" if len(extra) > 5 else ""))
    return fields, _nest(flat)


def check_fields(fields: dict, model_cfg: ModelConfig, hf_dir) -> None:
    """HFMismatch on the first ModelConfig field (FIELDS order) that differs from the HF checkpoint's."""
    if model_cfg.n_experts:
        raise HFMismatch("n_experts", f"{model_cfg.n_experts} in the config, but the Hugging Face Llama checkpoint "
                                      f"{hf_dir} is dense; set --config.model.n_experts=0")
    for field in FIELDS:
        ours, theirs = getattr(model_cfg, field), fields[field]
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
    """Params of an HF Llama directory for `model_cfg` (numpy, in its param_dtype), after checking that every
    architecture field matches: HFMismatch names the first that does not, HFError anything unreadable."""
    fields = read_config(hf_dir)
    check_fields(fields, model_cfg, hf_dir)  # before reading gigabytes of weights
    _, params = import_dir(hf_dir, dtype=model_cfg.param_dtype)
    return params


def check_tokenizer(hf_dir, data_dir) -> None:
    """ConfigError('model.init_from') when `hf_dir` ships a tokenizer and the data in `data_dir` was made with
    another: the weights would read foreign ids. A checkpoint without one is taken as it is."""
    theirs = [Path(hf_dir) / f for f in TOKENIZER_FILES if (Path(hf_dir) / f).is_file()]
    if not theirs or any(_same_file(f, Path(data_dir) / f.name) for f in theirs):
        return
    raise ConfigError("model.init_from", f"{hf_dir} ships its own tokenizer, and the data in {data_dir} was "
                      f"tokenized with another; prepare the data with it (jaxtrain prepare "
                      f"--tokenizer {theirs[0]} ...) and set data.dir")


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
    """`--config.model.<field>=<value>` for every FIELD, then `--config.model.init_from=<hf_dir>`."""
    fields = read_config(hf_dir)
    return [f"--config.model.{k}={_flag_value(fields[k])}" for k in FIELDS] + [
        f"--config.model.init_from={os.path.abspath(hf_dir)}"]
