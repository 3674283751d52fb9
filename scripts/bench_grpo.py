"""GRPO on the CPU (configs/grpo_lora.py), end to end and offline: where a step's time goes.

    python scripts/bench_grpo.py [--root runs/sums] [--config configs/grpo_lora.py] [--config.train.steps=100]
    python scripts/bench_grpo.py --root runs/sums --warm_start_only     # the data and the SFT warm start only

The task: two-digit sums, "23+45=" -> "68", in a character tokenizer (the digits, "+", "=", EOS). `--root` gets
the prompts (every pair of addends in [10, 50), 100 held out), SFT documents "23+45=68", 4 per train prompt,
whose answer is right in 40% of them and a+b+1 in the rest, an SFT run of a 0.1M-parameter model on them, and its
Hugging Face export: a warm start that has the format and the arithmetic but prefers the wrong answer. Then a GRPO
run of the config from that export, in a fresh `ROOT/grpo_bench`. It prints the held-out reward (the run's evals,
sampled, and greedy) and, over the log records after the first (which holds the compiles), the medians of:
sampler tokens/s (completion tokens drawn per second of sampling), trainer tokens/s (the step's rows,
batch_size x seq_len, per second of step outside the rollout and rewards), the fraction of the step spent in
the rollout and rewards (`data_wait_frac`: sampling, scoring, the trainer's log-probs of the samples, the rows) and
in the sampling alone; and the decode's row-steps against lockstep's (summed). Ends with one JSON line.
tests/e2e/test_grpo_learns.py uses this task.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
LOW, HIGH = 10, 50  # the addends: every sum has two digits
RIGHT = 0.4  # the share of SFT documents with the right answer; the others say a+b+1
HELDOUT = 100


def tokenizer_dir(path: Path) -> Path:
    """A Hugging Face tokenizer directory, one token per character of the sums ("0"-"9", "+", "=") and <eos>."""
    import tokenizers
    from tokenizers import Regex, decoders, models, pre_tokenizers

    vocab = {"<eos>": 0, **{c: i + 1 for i, c in enumerate("0123456789+=")}}
    tok = tokenizers.Tokenizer(models.WordLevel(vocab, unk_token="<eos>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), "isolated")
    tok.decoder = decoders.Fuse()  # decode joins the characters without spaces
    path.mkdir(parents=True, exist_ok=True)
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps(
        {"eos_token": "<eos>", "bos_token": None, "tokenizer_class": "PreTrainedTokenizerFast"}))
    return path


def prepare_task(root: Path, seed: int = 0) -> dict[str, str]:
    """Writes and prepares the task under `root`: {"tokenizer", "prompts", "sft"} directories. The held-out
    prompts (drawn by `seed`) are in neither the SFT documents nor the GRPO train split."""
    import numpy as np

    from jaxtrain.data import prepare
    from jaxtrain.data import prompts as prompts_lib

    root.mkdir(parents=True, exist_ok=True)
    tok = tokenizer_dir(root / "tokenizer")
    (root / "sums.jsonl").write_text("".join(json.dumps({"prompt": f"{a}+{b}=", "answer": str(a + b)}) + "\n"
                                             for a in range(LOW, HIGH) for b in range(LOW, HIGH)))
    quiet = lambda *a, **k: None  # noqa: E731
    prompts_lib.prepare_prompts(str(root / "prompts"), [str(root / "sums.jsonl")], tokenizer=str(tok),
                                heldout=HELDOUT, seed=seed, print_fn=quiet)
    rng = np.random.default_rng(seed)
    docs = [f"{r['fields']['prompt']}{int(r['fields']['answer']) + (rng.random() >= RIGHT)}"
            for _ in range(4) for r in prompts_lib.load(str(root / "prompts"))]
    (root / "sft.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    prepare.prepare_sources(str(root / "sft"), [str(root / "sft.jsonl")], tokenizer=str(tok), heldout_docs=50,
                            workers=1, print_fn=quiet)
    return {"tokenizer": str(tok), "prompts": str(root / "prompts"), "sft": str(root / "sft")}


def sft_config(workdir, data_dir: str, steps: int, seed: int = 0):
    """The warm start: a 0.1M-parameter model trained on the SFT documents (whole documents, packed)."""
    from jaxtrain.config import base_config

    c = base_config()
    c.workdir = str(workdir)
    c.model.update(vocab_size=16, d_model=64, n_layers=2, n_heads=4, n_kv_heads=4, head_dim=16, d_ff=128)
    c.train.update(batch_size=16, seq_len=64, steps=steps, seed=seed)
    c.optim.update(lr=3e-3, warmup_steps=10)
    c.data.update(dir=data_dir)
    c.eval.update(every_steps=steps, batches=1)
    c.checkpoint.update(every_steps=steps)
    c.log.update(every_steps=max(1, steps // 10))
    c.sample.update(max_new_tokens=0)
    return c


def warm_start(root: Path, data_dir: str, steps: int, seed: int = 0, print_fn=print) -> tuple[str, str]:
    """(the SFT workdir, its Hugging Face export `root`/sft_hf): an SFT run, reused if it already finished."""
    from jaxtrain import train
    from jaxtrain.tools import hf as hf_cli

    cfg = sft_config(root / "sft_run", data_dir, steps, seed)
    train.run(cfg, print_fn=print_fn)
    if hf_cli.main(["export", "--workdir", cfg.workdir, "--output", str(root / "sft_hf"), "--overwrite"]):
        raise RuntimeError(f"exporting {cfg.workdir} failed")
    return cfg.workdir, str(root / "sft_hf")


def grpo_config(workdir, prompts_dir: str, init_from: str, config=None, **overrides):
    """configs/grpo_lora.py (or `config`) from the warm start's export on the prompts; `overrides`: dotted paths."""
    from jaxtrain import files

    c = config or files.run_python_file(REPO / "configs" / "grpo_lora.py", "get_config", field="--config")
    c = c.copy_and_resolve_references()
    c.workdir, c.data.dir, c.model.init_from = str(workdir), prompts_dir, init_from
    for path, value in overrides.items():
        group, key = path.split(".")
        c[group][key] = value
    return c


def greedy_reward(workdir, prompts_dir: str, max_new_tokens: int = 4) -> float:
    """The mean exact_match reward of the greedy answers to the held-out prompts, by the workdir's newest
    checkpoint (a LoRA run's adapters included), sampled by the rollout sampler at temperature 0."""
    import jax
    import numpy as np

    from jaxtrain import rewards
    from jaxtrain import trainer as trainer_lib
    from jaxtrain.data import layout
    from jaxtrain.data import prompts as prompts_lib
    from jaxtrain.models import rollout
    from jaxtrain.parallel import mesh as mesh_lib

    held = prompts_lib.load(prompts_dir, "heldout")
    tok = layout.load_tokenizer(prompts_dir)
    _, _, graphdef, params = trainer_lib.restore_params(str(workdir))  # on the first device
    mesh = mesh_lib.make_mesh({"data": 1}, devices=jax.devices()[:1])
    sampler = rollout.make_sampler(graphdef, mesh, "dp", max_prompt_tokens=max(len(r["prompt_ids"]) for r in held),
                                   max_new_tokens=max_new_tokens, temperature=0.0, stop_ids=[tok.eos_id])
    out = sampler(params, [r["prompt_ids"] for r in held], step=0)
    texts = [tok.decode([t for t in c if t != tok.eos_id]) for c in out.completions]
    return float(np.mean([rewards.exact_match(t, r["fields"]["answer"]) for t, r in zip(texts, held)]))


def records(workdir) -> list[dict]:
    return [json.loads(line) for line in (Path(workdir) / "metrics.jsonl").read_text().splitlines()]


def figures(workdir) -> dict:
    """The run's held-out rewards (its evals) and the step's figures: medians over the log records after the first."""
    lines = records(workdir)
    config = json.loads((Path(workdir) / "config.json").read_text())
    batch_size, seq_len = config["train"]["batch_size"], config["train"]["seq_len"]
    evals = [(r["step"], r["eval_reward"]) for r in lines if "eval_reward" in r]
    steps = [r for r in lines if "grpo/sampler_tokens_per_sec" in r][1:]
    if not steps:
        raise ValueError(f"{workdir}: fewer than 2 log records; run more steps than log.every_steps")
    median = lambda f: statistics.median(f(r) for r in steps)  # noqa: E731
    return {"eval_reward": evals,
            "sampler_tokens_per_sec": median(lambda r: r["grpo/sampler_tokens_per_sec"]),
            "trainer_tokens_per_sec": median(lambda r: r["tokens_per_sec"] / max(1 - r["data_wait_frac"], 1e-9)),
            "step_tokens_per_sec": median(lambda r: r["tokens_per_sec"]),
            "rollout_frac": median(lambda r: r["data_wait_frac"]),
            # The sampling alone: a step's completion tokens at the sampler's speed, over the step's time.
            "sampler_frac": median(lambda r: r["grpo/completion_tokens"] * batch_size / r["grpo/sampler_tokens_per_sec"]
                                   / (batch_size * seq_len / r["tokens_per_sec"])),
            "completion_tokens": median(lambda r: r["grpo/completion_tokens"]),
            # The decode's work, summed over the log records: rows run, and rows had each run until the last stopped.
            "decode_row_steps": sum(r.get("grpo/decode_row_steps", 0) for r in steps),
            "lockstep_row_steps": sum(r.get("grpo/lockstep_row_steps", 0) for r in steps),
            "log_records": len(steps)}


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.partition(":")[2].strip()
    except OSError:
        pass
    import platform

    return platform.processor() or platform.machine()


def main(argv):
    del argv
    from jaxtrain import compat

    compat.install()  # as `jaxtrain train`: on CPU the steps run on the calling thread, so timings are the step's
    import jax

    root = Path(_ROOT.value)
    t = time.perf_counter()
    task = prepare_task(root, _SEED.value)
    sft_workdir, sft_hf = warm_start(root, task["sft"], _SFT_STEPS.value, _SEED.value)
    print(f"warm start: {time.perf_counter() - t:.0f} s, greedy held-out reward "
          f"{greedy_reward(sft_workdir, task['prompts']):.3f}", file=sys.stderr)
    if _WARM_START_ONLY.value:
        print(f"--config.model.init_from={sft_hf} --config.data.dir={task['prompts']}")
        return
    workdir = root / "grpo_bench"
    shutil.rmtree(workdir, ignore_errors=True)  # a fresh run, not a resumed or finished one
    cfg = grpo_config(workdir, task["prompts"], sft_hf, _CONFIG.value)
    t = time.perf_counter()
    from jaxtrain import train

    train.run(cfg)
    wall = time.perf_counter() - t
    result = {"config": _CONFIG.value.workdir, "cpu": cpu_model(), "cpus": os.cpu_count(),
              "devices": jax.device_count(), "steps": cfg.train.steps, "wall_s": wall,
              "rows": f"{cfg.train.batch_size} x {cfg.train.seq_len}", **figures(workdir),
              "greedy_reward": [greedy_reward(sft_workdir, task["prompts"]), greedy_reward(workdir, task["prompts"])]}
    print(f"sampler {result['sampler_tokens_per_sec']:,.0f} tok/s | trainer {result['trainer_tokens_per_sec']:,.0f} "
          f"tok/s | rollout and rewards {100 * result['rollout_frac']:.0f}% of a step (sampling "
          f"{100 * result['sampler_frac']:.0f}%; decode row-steps {result['decode_row_steps']:,.0f} of lockstep's "
          f"{result['lockstep_row_steps']:,.0f}) | held-out reward (greedy) "
          f"{result['greedy_reward'][0]:.2f} -> {result['greedy_reward'][1]:.2f} | {result['cpu']}", file=sys.stderr)
    print(json.dumps(result))


if __name__ == "__main__":
    from absl import app, flags
    from ml_collections import config_flags

    _CONFIG = config_flags.DEFINE_config_file("config", str(REPO / "configs" / "grpo_lora.py"), "The GRPO config.")
    _ROOT = flags.DEFINE_string("root", "runs/sums", "Where the task's data and runs go.")
    _SFT_STEPS = flags.DEFINE_integer("sft_steps", 800, "Steps of the SFT warm start.")
    _SEED = flags.DEFINE_integer("seed", 0, "The held-out draw and the SFT documents' answers.")
    _WARM_START_ONLY = flags.DEFINE_bool("warm_start_only", False, "Stop after the warm start.")
    app.run(main)
