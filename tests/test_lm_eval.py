"""lm-eval's model "jaxtrain" (jaxtrain.evals.lm_eval_model): its log-likelihoods, rolling log-likelihoods and greedy
generations equal a direct computation from the model's logits (log_softmax of one unpadded forward per input), the
same from the run's Hugging Face export, and lm-eval's own command line scores small local tasks (multiple choice,
generate_until, rolling perplexity) with the metrics that those references imply, with no network access."""

import functools
import json
import math
import os
import socket
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from lm_eval.api.instance import Instance

from jaxtrain import trainer
from jaxtrain.data import layout
from jaxtrain.evals import lm_eval_model
from jaxtrain.models import hf

REPO = Path(__file__).resolve().parent.parent
WINDOW = 32  # the tiny run's train.seq_len: the adapter's window
UNTIL, NEW_TOKENS = [".", "\n"], 16  # prompts keep their newest 16 tokens: one padded prompt length
TEXT = ("And God said, Let there be light: and there was light. And God saw the light, that it was good: and God "
        "divided the light from the darkness. And God called the light Day, and the darkness he called Night.")
PAIRS = [("And God said", " Let there be light"), ("In the beginning", " God created the heaven"),
         ("", "And the earth was without form"), ("And the LORD spake unto Moses", ","),
         ("Blessed are the meek", ": for they shall inherit the earth"), ("Jesus wept", "."),
         ("And it came to pass", " in those days"), ("The LORD is my shepherd", "; I shall not want"),
         (TEXT, " And the evening and the morning were the first day")]  # past the window: its newest tokens
PROMPTS = ["And God said", "In the beginning", "The LORD is my shepherd", "Blessed are", TEXT]


@pytest.fixture(scope="module")
def workdir(tiny_config):
    """A 2-step tiny run. init_std 0.3 spreads the logits: greedy choices have no near-ties to flip."""
    from jaxtrain import train

    config = tiny_config(**{"train.steps": 2, "model.init_std": 0.3})
    train.run(config, print_fn=lambda *a, **k: None)
    return config.workdir


@pytest.fixture(scope="module")
def model(workdir):
    config, model_cfg, graphdef, params = trainer.restore_params(workdir)
    return graphdef, params, layout.load_tokenizer(layout.default_dir(config.data)), model_cfg


@pytest.fixture(scope="module")
def lm(workdir):
    return lm_eval_model.JaxtrainLM(workdir=workdir, batch_size=4)


# --- The reference: one forward per input, nothing padded or batched ------------------------------------------

@functools.lru_cache
def _forward(graphdef):
    @jax.jit
    def forward(params, tokens):  # tokens [WINDOW]: causal, so what follows a prefix does not change its logits
        positions = jnp.arange(WINDOW, dtype=jnp.int32)[None]
        return nnx.merge(graphdef, params)(tokens[None], positions, jnp.ones((1, WINDOW), jnp.int32))[0]

    return forward


def log_softmax(model, ids):
    """float64 [len(ids), vocab]: the next-token log-probs after each prefix of `ids` (at most WINDOW)."""
    assert 1 <= len(ids) <= WINDOW
    buf = np.zeros(WINDOW, np.int32)
    buf[:len(ids)] = ids
    logits = np.asarray(_forward(model[0])(model[1], buf), np.float64)[:len(ids)]
    top = logits.max(-1, keepdims=True)
    return logits - top - np.log(np.exp(logits - top).sum(-1, keepdims=True))


def ref_tokens(model, context, continuation):
    """lm-eval's split: the continuation is what encoding the whole adds to encoding the context."""
    tok = model[2]
    if not context:
        return [tok.eos_id], tok.encode(continuation)
    ctx = tok.encode(context)
    return ctx, tok.encode(context + continuation)[len(ctx):]


def ref_loglikelihood(model, ctx, cont):
    seq = (ctx + cont)[-(WINDOW + 1):]
    lp = log_softmax(model, seq[:-1])
    rows = range(len(seq) - 1 - len(cont), len(seq) - 1)
    return sum(lp[i, seq[i + 1]] for i in rows), all(lp[i].argmax() == seq[i + 1] for i in rows)


def ref_rolling(model, text):
    """Every token scored once, in chunks of WINDOW, each conditioned on the WINDOW tokens before its last one."""
    toks = model[2].encode(text)
    ids = [model[2].eos_id] + toks  # ids[j + 1] is toks[j]
    total = 0.0
    for s in range(0, len(toks), WINDOW):
        e = min(s + WINDOW, len(toks))
        first = max(0, e - WINDOW)
        lp = log_softmax(model, ids[first:e])
        total += sum(lp[j - first, ids[j + 1]] for j in range(s, e))
    return total


def ref_generate(model, prompt, new_tokens=NEW_TOKENS, until=UNTIL):
    tok = model[2]
    ids = tok.encode(prompt)[-(WINDOW - new_tokens):]
    out = []
    for _ in range(new_tokens):
        nxt = int(log_softmax(model, ids + out)[-1].argmax())
        if nxt == tok.eos_id:
            break
        out.append(nxt)
    text = tok.decode(out)
    for term in until + [tok.decode([tok.eos_id])]:
        text = text.split(term)[0]
    return text


def requests(kind, args):
    return [Instance(kind, {}, a, i) for i, a in enumerate(args)]


# --- The adapter against the reference --------------------------------------------------------------------------

def test_loglikelihood_is_log_softmax_of_the_logits(lm, model):
    got = lm.loglikelihood(requests("loglikelihood", PAIRS), disable_tqdm=True)
    want = [ref_loglikelihood(model, *ref_tokens(model, c, x)) for c, x in PAIRS]
    np.testing.assert_allclose([g[0] for g in got], [w[0] for w in want], rtol=1e-5, atol=1e-4)
    assert [g[1] for g in got] == [bool(w[1]) for w in want]
    assert len(model[2].encode(TEXT)) > WINDOW + 1  # the last pair was cut to the window

    # A greedy continuation (ids, as TemplateLM hands them over) is greedy, and its log-prob the reference's.
    ctx = model[2].encode("And God said")
    cont = []
    for _ in range(5):
        cont.append(int(log_softmax(model, ctx + cont)[-1].argmax()))
    (log_prob, greedy), = lm._loglikelihood_tokens([(None, ctx, cont)], disable_tqdm=True)
    assert greedy and log_prob == pytest.approx(ref_loglikelihood(model, ctx, cont)[0], rel=1e-5)


def test_rolling_loglikelihood_scores_each_token_once_in_windows(lm, model):
    texts = [TEXT, "Jesus wept."]
    assert len(model[2].encode(TEXT)) > 2 * WINDOW  # three windows, the last one shorter
    got = lm.loglikelihood_rolling(requests("loglikelihood_rolling", [(t,) for t in texts]), disable_tqdm=True)
    np.testing.assert_allclose(got, [ref_rolling(model, t) for t in texts], rtol=1e-5)


def test_generate_until_is_greedy_decoding_cut_at_until(lm, model):
    settings = {"until": UNTIL, "max_gen_toks": NEW_TOKENS, "do_sample": False}
    got = lm.generate_until(requests("generate_until", [(p, settings) for p in PROMPTS]), disable_tqdm=True)
    assert got == [ref_generate(model, p) for p in PROMPTS]

    # Sampling is seeded: the same seed draws the same text.
    sampled = {"until": [], "max_gen_toks": NEW_TOKENS, "do_sample": True, "temperature": 1.0}
    draws = [lm_eval_model.JaxtrainLM.from_model(*model[:3], max_length=WINDOW, batch_size=4, seed=7).generate_until(
        requests("generate_until", [(p, sampled) for p in PROMPTS]), disable_tqdm=True) for _ in range(2)]
    assert draws[0] == draws[1] and all(isinstance(t, str) for t in draws[0])


def test_hugging_face_export_scores_as_the_workdir(lm, model, tmp_path, tiny_data_dir):
    graphdef, params, tok, model_cfg = model
    out = hf.export(params, model_cfg, tmp_path / "hf", tokenizer_dir=tiny_data_dir, max_position_embeddings=WINDOW)
    hf_lm = lm_eval_model.JaxtrainLM(hf=str(out), batch_size=4)
    assert (hf_lm.max_length, hf_lm.prefix_token_id) == (WINDOW, tok.eos_id)
    args = requests("loglikelihood", PAIRS[:-1])  # the short ones: one padded length, one compile
    np.testing.assert_allclose(hf_lm.loglikelihood(args, disable_tqdm=True), lm.loglikelihood(args, disable_tqdm=True),
                               rtol=1e-5, atol=1e-4)


def test_model_args_name_the_problem(workdir):
    with pytest.raises(ValueError, match="workdir=DIR"):
        lm_eval_model.JaxtrainLM()
    with pytest.raises(ValueError, match="step="):
        lm_eval_model.JaxtrainLM(hf=workdir, step=2)


# --- lm-eval's command line on local tasks ------------------------------------------------------------------------

MC_DOCS = [("In the beginning God created", ["the heaven", "a fish", "light"]),
           ("And God said, Let there be", ["light", "darkness", "water"]),
           ("The LORD is my", ["shepherd", "king", "light"]),
           ("Blessed are the", ["meek", "poor", "sea"]),
           ("And Jesus answered and said unto", ["them", "him", "Peter"]),
           ("For God so loved the", ["world", "man", "earth"])]


def write_tasks(model, root: Path) -> dict:
    """Three local tasks under `root` and the metrics the reference implies for them. Half the multiple-choice
    labels are the reference's pick and half are not; half the generation targets are its text."""
    mc, gen, expected = [], [], {}
    picks, norm_hits = [], []
    for i, (context, choices) in enumerate(MC_DOCS):
        lls = np.array([ref_loglikelihood(model, *ref_tokens(model, context, " " + c))[0] for c in choices])
        best = int(lls.argmax())
        label = best if i % 2 == 0 else (best + 1) % len(choices)
        mc.append({"context": context, "choices": choices, "label": label})
        picks.append(best == label)
        norm_hits.append(int((lls / np.array([len(c) for c in choices], float)).argmax()) == label)
    expected["jaxtrain_mc"] = {"acc,none": float(np.mean(picks)), "acc_norm,none": float(np.mean(norm_hits))}
    for i, prompt in enumerate(PROMPTS):
        text = ref_generate(model, prompt)
        gen.append({"prompt": prompt, "answer": text if i % 2 == 0 else text + " (not this)"})
    expected["jaxtrain_gen"] = {"exact_match,none": 3 / len(PROMPTS)}
    docs = [TEXT, "Jesus wept.", "The LORD is my shepherd; I shall not want."]
    ll = sum(ref_rolling(model, d) for d in docs)
    words, size = sum(len(d.split()) for d in docs), sum(len(d.encode()) for d in docs)
    expected["jaxtrain_ppl"] = {"word_perplexity,none": math.exp(-ll / words),
                                "bits_per_byte,none": -ll / size / math.log(2)}

    common = {"dataset_path": "json", "test_split": "test"}
    tasks = {
        "jaxtrain_mc": ({"output_type": "multiple_choice", "doc_to_text": "{{context}}", "doc_to_choice": "choices",
                         "doc_to_target": "label", "metric_list": [{"metric": "acc"}, {"metric": "acc_norm"}]}, mc),
        "jaxtrain_gen": ({"output_type": "generate_until", "doc_to_text": "{{prompt}}", "doc_to_target": "{{answer}}",
                          "generation_kwargs": {"until": UNTIL, "max_gen_toks": NEW_TOKENS, "do_sample": False},
                          "metric_list": [{"metric": "exact_match"}]}, gen),
        "jaxtrain_ppl": ({"output_type": "loglikelihood_rolling", "doc_to_text": "", "doc_to_target": "{{text}}",
                          "metric_list": [{"metric": "word_perplexity"}, {"metric": "bits_per_byte"}]},
                         [{"text": d} for d in docs]),
    }
    for name, (config, rows) in tasks.items():
        data = root / f"{name}.jsonl"
        data.write_text("".join(json.dumps(r) + "\n" for r in rows))
        kwargs = {"data_files": {"test": str(data)}, "cache_dir": str(root / "hf_datasets")}
        # JSON is YAML: lm-eval reads these as task files.
        (root / f"{name}.yaml").write_text(json.dumps({"task": name, **common, "dataset_kwargs": kwargs, **config}))
    return expected


TASKS = ["jaxtrain_mc", "jaxtrain_gen", "jaxtrain_ppl"]


def test_lm_eval_scores_local_tasks_offline(workdir, model, tmp_path, monkeypatch):
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    expected = write_tasks(model, tmp_path)
    for var in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.setenv(var, "1")

    def refuse(sock, address, *args):
        raise AssertionError(f"a network connection during an offline evaluation: {address}")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    # By name, as the command line does; only the local tasks indexed (lm-eval's own take seconds to index).
    out = simple_evaluate(model="jaxtrain", model_args=f"workdir={workdir}", batch_size=4, tasks=TASKS,
                          task_manager=TaskManager(include_path=str(tmp_path), include_defaults=False))
    for task, metrics in expected.items():
        for metric, value in metrics.items():
            assert out["results"][task][metric] == pytest.approx(value, rel=1e-5), (task, metric)


@pytest.mark.slow
def test_python_m_jaxtrain_evals_is_lm_evals_command_line(workdir, model, tmp_path):
    expected = write_tasks(model, tmp_path)
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run([sys.executable, "-m", "jaxtrain.evals", "--model", "jaxtrain", "--model_args",
                           f"workdir={workdir}", "--batch_size", "4", "--include_path", str(tmp_path), "--tasks",
                           ",".join(TASKS), "--output_path", str(tmp_path / "out")],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert all(task in proc.stdout for task in TASKS)  # lm-eval's results table
    files = sorted((tmp_path / "out").rglob("results_*.json"))
    assert len(files) == 1, files
    results = json.loads(files[0].read_text())["results"]
    for task, metrics in expected.items():
        for metric, value in metrics.items():
            assert results[task][metric] == pytest.approx(value, rel=1e-5), (task, metric)
