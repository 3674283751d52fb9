"""GRPO on Qwen3-8B with LoRA adapters, on GPUs: math prompts scored by math-verify and DeepSeek-R1's format,
8 completions per prompt, DAPO's clip-higher and token-level loss (docs/fine-tuning.md#grpo-reinforcement-
learning-from-verifiable-rewards). The rollouts sample on the training mesh with the trainer's own weights; the
planner's memory figure adds their K/V cache to the resident state:

    jaxtrain prepare --prompts --input math.jsonl --tokenizer QWEN3_8B_DIR --heldout_prompts 200 --output RL_DIR
    python -m jaxtrain.main --config configs/grpo_qwen3_8b.py --config.model.init_from=QWEN3_8B_DIR \\
        --config.data.dir=RL_DIR
    jaxtrain plan --config configs/grpo_qwen3_8b.py --devices 8 --backend gpu --device_kind H100 --compiler gpu
"""

from pathlib import Path

from jaxtrain import files


def get_config():
    c = files.run_python_file(Path(__file__).with_name("sft_lora.py"), "get_config", "qwen3_8b", field="--config")
    c.workdir = "runs/grpo_qwen3_8b"
    # 32 prompts x 8 completions a step, each row a prompt of at most 512 tokens and a completion of 1536.
    c.train.update(objective="grpo", batch_size=256, seq_len=2048, microbatches=8, steps=500)
    c.grpo.update(group_size=8, max_completion_tokens=1536, epsilon_high=0.28, loss_type="dapo",
                  rewards="jaxtrain.rewards:math_equal,jaxtrain.rewards:format_regex@0.2", eval_samples=4)
    c.optim.update(lr=1e-5, warmup_steps=10)
    c.eval.update(every_steps=50)
    return c
