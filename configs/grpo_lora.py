"""GRPO with LoRA adapters on the CPU: a tiny model learns to answer two-digit sums ("23+45=" -> "68") from a
verifiable reward (exact_match) after a short SFT warm start that prefers a wrong answer, a+b+1
(docs/fine-tuning.md#grpo-reinforcement-learning-from-verifiable-rewards). Each step samples 8 prompts 8 times;
the held-out prompts' reward is evaluated at the start and every 50 steps. scripts/bench_grpo.py writes the sums
and the warm start, offline:

    python scripts/bench_grpo.py --root runs/sums --warm_start_only   # prompts, SFT data, SFT run, its HF export
    python -m jaxtrain.main --config configs/grpo_lora.py --config.model.init_from=runs/sums/sft_hf \\
        --config.data.dir=runs/sums/prompts
    python scripts/bench_grpo.py --root runs/sums                      # both, then the sampler/trainer figures

Other prompts: a JSONL of {"prompt": ..., "answer": ...} lines, then `jaxtrain prepare --prompts --input FILE
--tokenizer SFT_HF_DIR --heldout_prompts 100 --output DIR`, and a reward and completion length that fit them.
"""

from jaxtrain.config import base_config


def get_config():
    c = base_config()
    c.workdir = "runs/grpo_lora"
    # The architecture is model.init_from's. Rows: a prompt (6 tokens) and its completion (2 digits and EOS).
    c.train.update(objective="grpo", steps=150, batch_size=64, seq_len=16)
    c.model.update(lora_rank=8, lora_alpha=16.0)
    c.optim.update(lr=3e-3, warmup_steps=5)
    c.grpo.update(group_size=8, max_completion_tokens=4, rewards="jaxtrain.rewards:exact_match")
    c.eval.update(every_steps=50, at_start=True)
    c.checkpoint.update(every_steps=50)
    c.log.update(every_steps=10)
    c.sample.update(max_new_tokens=0)
    return c
