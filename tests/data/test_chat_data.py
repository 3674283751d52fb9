"""Chat data end to end: `prepare --chat` shards (tokens + loss weights), whole-conversation packing, and the SFT
loss (the mean over assistant tokens) that the step computes from them."""

import collections
import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import chat_tokenizer_dir
from jaxtrain import objectives
from jaxtrain.data import layout, pipeline, prepare
from jaxtrain.errors import ConfigError, DataError
from jaxtrain.models import transformer
from jaxtrain.models.config import ModelConfig

WORDS = "red green blue cat dog sun moon tree fish bird".split()


def _conversations(n, seed=0):
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        words = " ".join(rng.choice(WORDS, 1 + i % 6))
        if i % 2:
            out.append({"prompt": f"say {words}", "completion": words})
        else:
            out.append({"messages": [{"role": "system", "content": "say"}, {"role": "user", "content": words},
                                     {"role": "assistant", "content": words}]})
    return out


@pytest.fixture(scope="module")
def chat_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("chat")
    hf = chat_tokenizer_dir(root / "hf", WORDS)
    data = root / "chats.jsonl"
    data.write_text("\n".join(json.dumps(c) for c in _conversations(60)) + "\n")
    out = root / "data"
    prepare.prepare_sources(str(out), [str(data)], field="*", tokenizer=str(hf), heldout_docs=6, chat=True,
                            max_len=64, workers=1, print_fn=lambda *a, **k: None)
    return out, hf


def test_shards_hold_tokens_and_weights_on_the_assistant_turns(chat_dir):
    out, _ = chat_dir
    manifest = layout.load_manifest(str(out))
    assert manifest["loss_weights"] and manifest["chat"]["conversations"] == 60
    assert manifest["chat"]["truncate"] == "left" and manifest["chat"]["max_len"] == 64
    tok = layout.load_tokenizer(str(out))
    stream = pipeline.PackedStream(str(out), "train", seed=None)
    record = stream.records.read([0])[0]
    n = int(stream.document_lengths()[0])
    ids = np.frombuffer(record, stream.dtype, n)
    weights = np.frombuffer(record, np.uint8, n, offset=n * stream.dtype.itemsize)
    text = tok.decode(ids)
    assert text.startswith("<|im_start|>system\nsay<|im_end|>\n<|im_start|>user\n")
    # the weighted tokens are the assistant's reply and its end-of-turn, nothing else
    answer = text.split("<|im_start|>assistant\n")[1]
    assert tok.decode(ids[weights == 1]) == answer
    assert answer.endswith("<|im_end|>\n")


def test_rows_pack_whole_conversations_and_pad(chat_dir):
    out, _ = chat_dir
    stream = pipeline.PackedStream(str(out), "train", seed=3)
    seq_len = 48
    assert stream.n_windows == 1  # (one window: the whole epoch)
    order, ends = stream.window(0, 0)
    lengths = np.diff(ends, prepend=0)
    seen = []
    for r in range(len(stream._packed_rows(0, 0, seq_len)) - 1):
        row = stream.row(r * seq_len, seq_len)
        segments = row["segment_ids"]
        used = int((segments > 0).sum())
        assert np.all(segments[used:] == 0) and np.all(row["loss_weights"][used:] == 0)
        for s in range(1, segments.max() + 1):  # each segment is one whole conversation, positions from 0
            where = np.flatnonzero(segments == s)
            assert np.array_equal(row["positions"][where], np.arange(len(where)))
            seen.append(len(where))
    assert seen == lengths.tolist()  # every conversation once, whole, in the epoch's order
    # the rows after the first epoch's continue into the next (a different order), as a resume would read them
    rows = len(stream._packed_rows(0, 0, seq_len)) - 1
    assert stream._locate_row(rows, seq_len) == (1, 0, 0)  # (epoch, window, row)


def test_rows_of_many_windows_hold_each_conversation_once_and_resume(chat_dir, tmp_path):
    """With 2-conversation blocks and 3-block windows (54 conversations: 9 windows), rows pack inside a window;
    over two epochs every conversation appears once per epoch, and a resume at any row gives the same rows."""
    out, _ = chat_dir
    small = tmp_path / "small"
    shutil.copytree(out, small)
    manifest = json.loads((small / "manifest.json").read_text())
    for row in manifest["splits"]["train"]:
        del row["blocks"]  # summed from the lengths at open, in blocks of 2
        row["block_records"] = 2
    (small / "manifest.json").write_text(json.dumps(manifest))
    stream = pipeline.PackedStream(str(small), "train", seed=1, window_blocks=3)
    assert stream.n_windows == 9
    seq_len = 64
    epoch_rows = [sum(len(stream._packed_rows(e, w, seq_len)) - 1 for w in range(9)) for e in (0, 1)]
    rows = [stream.row(r * seq_len, seq_len) for r in range(sum(epoch_rows) + 3)]
    records = stream.records.read(range(54))
    width = stream.dtype.itemsize
    everything = collections.Counter(r[:len(r) // (width + 1) * width] for r in records)  # tokens, then weights
    for epoch, start in ((0, 0), (1, epoch_rows[0])):
        seen = collections.Counter()
        for r in rows[start:start + epoch_rows[epoch]]:
            assert r["segment_ids"].max() <= 3 * 2  # a row packs within one window (3 blocks of 2)
            for s in range(1, r["segment_ids"].max() + 1):
                seen[r["tokens"][r["segment_ids"] == s].astype(stream.dtype).tobytes()] += 1
        assert seen == everything
    again = pipeline.PackedStream(str(small), "train", seed=1, window_blocks=3)
    for r in (sum(epoch_rows) + 2, epoch_rows[0], 5):
        np.testing.assert_array_equal(again.row(r * seq_len, seq_len)["tokens"], rows[r]["tokens"])


def test_truncation_and_drop_are_counted(chat_dir, tmp_path):
    _, hf = chat_dir
    data = tmp_path / "c.jsonl"
    long = " ".join(["red green blue"] * 30)  # far over 48 tokens; the others are at most 41
    data.write_text("\n".join(json.dumps(c) for c in [{"prompt": long, "completion": "cat dog"}] * 3 +
                              _conversations(10)) + "\n")
    counts = {}
    for truncate in ("left", "drop"):
        m = prepare.prepare_sources(str(tmp_path / truncate), [str(data)], field="*", tokenizer=str(hf),
                                    heldout_docs=1, chat=True, max_len=48, truncate=truncate, workers=1,
                                    print_fn=lambda *a, **k: None)
        counts[truncate] = m["chat"]
        assert m["chat"]["longest"] <= 48
    assert counts["left"]["truncated"] == 3 and counts["left"]["conversations"] == 13
    assert counts["drop"]["dropped_too_long"] == 3 and counts["drop"]["conversations"] == 10
    # a truncated conversation keeps its end: the reply is still weighted
    stream = pipeline.PackedStream(str(tmp_path / "left"), "train", seed=None)
    tok = layout.load_tokenizer(str(tmp_path / "left"))
    lengths = stream.document_lengths()
    cut = [k for k in range(len(lengths)) if lengths[k] == 48]
    assert len(cut) >= 2  # (one of the three may be the held-out conversation)
    for k in cut:
        n, record = 48, stream.records.read([k])[0]
        ids = np.frombuffer(record, stream.dtype, n)
        weights = np.frombuffer(record, np.uint8, n, offset=n * stream.dtype.itemsize)
        assert tok.decode(ids[weights == 1]) == "cat dog<|im_end|>\n"
        assert not tok.decode(ids).startswith("<|im_start|>user")


def test_a_seq_len_shorter_than_a_conversation_is_a_config_error(chat_dir):
    out, _ = chat_dir
    longest = layout.load_manifest(str(out))["chat"]["longest"]
    pipeline.check_conversations_fit(str(out), longest)
    with pytest.raises(ConfigError, match="train.seq_len"):
        pipeline.check_conversations_fit(str(out), longest - 1)


def test_template_failures_are_counted_with_their_reason_and_all_failing_is_the_error(chat_dir, tmp_path):
    """A template that fails on some records skips them with its message; on every record, its message is the
    error (not "no documents left ... lower --heldout_docs"). Records without the text field and no --chat say
    that --chat reads conversations."""
    _, hf = chat_dir
    data = tmp_path / "c.jsonl"
    data.write_text("\n".join(json.dumps(c) for c in _conversations(20)) + "\n")
    template = tmp_path / "t.jinja"
    # fails on conversations with a system turn (the even ones), as a template without a system role does
    template.write_text("{% for m in messages %}{% if m.role == 'system' %}{{ raise_exception('no system role') }}"
                        "{% endif %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
                        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    said = []
    m = prepare.prepare_sources(str(tmp_path / "some"), [str(data)], field="*", tokenizer=str(hf), heldout_docs=1,
                                chat=True, chat_template=str(template), workers=1,
                                print_fn=lambda *a, **k: said.append(" ".join(map(str, a))))
    assert m["chat"]["conversations"] == 10 and m["chat"]["skipped_template_error"] == 10
    assert not any(k.startswith("reason") for k in m["chat"])
    assert any("the chat template failed on 10 records, which are skipped: chat template line 1: no system role"
               in line for line in said), said
    assert any("skipped 10 (skipped_template_error 10)" in line for line in said), said
    # The same shard jobs as an Apache Beam pipeline count the same failures, with the same reasons.
    said.clear()
    beam = prepare.prepare_sources(str(tmp_path / "beam"), [str(data)], field="*", tokenizer=str(hf), heldout_docs=1,
                                   chat=True, chat_template=str(template), runner="DirectRunner",
                                   print_fn=lambda *a, **k: said.append(" ".join(map(str, a))))
    assert beam["chat"] == m["chat"]
    assert any("failed on 10 records, which are skipped: chat template line 1: no system role" in line
               for line in said), said

    template.write_text("{{ messages[0].content / 2 }}")
    with pytest.raises(DataError, match=r"the chat template failed on all 20 records: chat template line 1: "
                                        r"TypeError: unsupported operand"):
        prepare.prepare_sources(str(tmp_path / "all"), [str(data)], field="*", tokenizer=str(hf), heldout_docs=1,
                                chat=True, chat_template=str(template), workers=1, print_fn=lambda *a, **k: None)
    template.write_text("{% for m in messages %}")
    with pytest.raises(DataError, match="chat template line 1: Unexpected end of template"):
        prepare.prepare_sources(str(tmp_path / "syntax"), [str(data)], field="*", tokenizer=str(hf),
                                heldout_docs=1, chat=True, chat_template=str(template), workers=1)
    with pytest.raises(DataError, match=r"no record has the 'text' field \(--field\); conversations .* with --chat"):
        prepare.prepare_sources(str(tmp_path / "plain"), [str(data)], tokenizer=str(hf), heldout_docs=1, workers=1,
                                print_fn=lambda *a, **k: None)
    assert not any((tmp_path / d).exists() for d in ("all", "syntax", "plain"))


def test_chat_needs_a_tokenizer_directory(chat_dir, tmp_path):
    out, hf = chat_dir
    data = tmp_path / "c.jsonl"
    data.write_text(json.dumps(_conversations(1)[0]) + "\n")
    with pytest.raises(DataError, match="HF_MODEL_DIR"):
        prepare.prepare_sources(str(tmp_path / "o"), [str(data)], field="*", tokenizer=str(hf / "tokenizer.json"),
                                chat=True)
    assert not (tmp_path / "o").exists()


def test_resume_position_is_a_row_and_batches_carry_weights(chat_dir):
    out, _ = chat_dir
    it = pipeline.train_iterator(str(out), seq_len=48, global_batch=4, seed=1)
    assert pipeline.batch_keys(str(out)) == ("tokens", "segment_ids", "positions", "loss_weights")
    first = [next(it) for _ in range(3)]
    state = it.get_state()
    after = next(it)
    it.close()
    resumed = pipeline.train_iterator(str(out), seq_len=48, global_batch=2, seed=1)  # another batch size
    resumed.set_state(state)
    halves = [next(resumed), next(resumed)]
    resumed.close()
    for key in after:
        np.testing.assert_array_equal(np.concatenate([h[key] for h in halves]), after[key])
    assert all(b["loss_weights"].any() for b in first)
    other = pipeline.train_iterator(str(out), seq_len=40, global_batch=4, seed=1)
    with pytest.raises(DataError, match="train.seq_len"):
        other.set_state({**state, "next_token": state["next_token"] + 4})
    other.close()


def _tiny_model():
    cfg = ModelConfig(vocab_size=304, d_model=32, n_layers=1, n_heads=2, n_kv_heads=2, head_dim=16, d_ff=64,
                      dtype="float32", loss_chunk_tokens=16)
    from flax import nnx  # noqa: PLC0415

    model = transformer.Transformer(cfg, rngs=nnx.Rngs(0))
    graphdef, params = nnx.split(model)
    return graphdef, params, model


def test_sft_loss_is_the_mean_over_assistant_tokens(chat_dir):
    out, _ = chat_dir
    batch = {k: jnp.asarray(v) for k, v in
             pipeline.eval_batches(str(out), seq_len=48, global_batch=2, num_batches=1)[0].items()}
    graphdef, params, model = _tiny_model()
    ce_sum, count, _ = objectives.loss_terms(graphdef, params, batch)
    logits = np.asarray(model.forward(batch["tokens"], batch["positions"], batch["segment_ids"])[0], np.float64)
    tokens, seg, w = (np.asarray(batch[k]) for k in ("tokens", "segment_ids", "loss_weights"))
    logp = logits - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True)) - \
        logits.max(-1, keepdims=True)
    total, scored = 0.0, 0
    for b in range(tokens.shape[0]):
        for t in range(tokens.shape[1] - 1):
            # predicting token t+1 counts iff it is an assistant token of the same conversation
            if seg[b, t] and seg[b, t + 1] == seg[b, t] and w[b, t + 1]:
                total -= logp[b, t, tokens[b, t + 1]]
                scored += 1
    assert scored == int(count) and 0 < scored < int((seg > 0).sum())
    np.testing.assert_allclose(float(ce_sum), total, rtol=1e-5)


def test_prompt_positions_get_exactly_zero_gradient(chat_dir):
    """Through the fused head + loss the step uses: the gradient reaching the final hidden state (so the logits)
    of every position that predicts a prompt token is exactly zero, and nonzero at the assistant's."""
    from jaxtrain.models.cross_entropy import linear_cross_entropy  # noqa: PLC0415

    out, _ = chat_dir
    batch = {k: jnp.asarray(v) for k, v in
             pipeline.eval_batches(str(out), seq_len=48, global_batch=2, num_batches=1)[0].items()}
    targets, weights = objectives.next_token_targets(batch)
    x = jax.random.normal(jax.random.key(0), (*batch["tokens"].shape, 32))
    head = jax.random.normal(jax.random.key(1), (32, 304))
    grad = np.asarray(jax.grad(lambda x: linear_cross_entropy(x, head, targets, weights, 16, jnp.float32))(x))
    prompt = np.asarray(weights) == 0
    assert prompt.any() and (~prompt).any()
    assert np.all(grad[prompt] == 0.0)
    assert np.all(np.abs(grad[~prompt]).sum(-1) > 0)


def test_hf_inputs_give_the_same_conversations_as_jsonl(chat_dir, tmp_path, monkeypatch):
    """hf:json: rows are whole records too: both forms (messages, prompt and completion) read as from JSONL."""
    pytest.importorskip("datasets")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "cache"))
    _, hf = chat_dir
    data = tmp_path / "c.jsonl"
    data.write_text("\n".join(json.dumps(c) for c in _conversations(20)) + "\n")
    records = {}
    for name, spec in (("jsonl", str(data)), ("hf", f"hf:json:{data}")):
        out = tmp_path / name
        m = prepare.prepare_sources(str(out), [spec], field="*", tokenizer=str(hf), heldout_docs=2, chat=True,
                                    workers=1, print_fn=lambda *a, **k: None)
        assert m["chat"]["conversations"] == 20
        streams = [pipeline.PackedStream(str(out), split, None) for split in ("train", "heldout")]
        records[name] = sorted(r for s in streams for r in s.records.read(range(s.records.n_records)))
    assert records["hf"] == records["jsonl"]
