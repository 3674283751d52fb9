"""Preference data for DPO: `prepare --preference` stores each pair as its chosen and rejected conversations,
weighted on the response only; the pipeline shuffles and packs pairs whole (pair j of a row is segments 2j+1 and
2j+2); and a run refuses an objective that does not suit its data."""

import json
import os

import numpy as np
import pytest
from helpers import chat_tokenizer_dir

from jaxtrain import train
from jaxtrain.data import chat, encode, layout, pipeline, prepare
from jaxtrain.errors import ConfigError, DataError
from jaxtrain.tools import prepare as prepare_cli

WORDS = "red green blue cat dog sun moon tree fish bird".split()
QUIET = {"print_fn": lambda *a, **k: None}


def _pairs(n, seed=0):
    """Pairs in every accepted form: text, messages with a multi-turn prompt, and an implicit prompt."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        words = list(rng.choice(WORDS, 1 + i % 5))
        good, bad = " ".join(words), " ".join(words[::-1] + ["cat"])
        if i % 3 == 0:
            out.append({"prompt": good, "chosen": good, "rejected": bad})
        elif i % 3 == 1:
            prompt = [{"role": "user", "content": "say red"}, {"role": "assistant", "content": "red"},
                      {"role": "user", "content": good}]
            out.append({"prompt": prompt, "chosen": [{"role": "assistant", "content": good}],
                        "rejected": [{"role": "assistant", "content": bad}]})
        else:
            user = [{"role": "system", "content": "say"}, {"role": "user", "content": good}]
            out.append({"chosen": user + [{"role": "assistant", "content": good}],
                        "rejected": user + [{"role": "assistant", "content": bad}]})
    return out


def _record(stream, doc):
    raw = stream.records.read([doc])[0]
    n = len(raw) // (stream.dtype.itemsize + 1)
    return np.frombuffer(raw, stream.dtype, n), np.frombuffer(raw, np.uint8, n, offset=n * stream.dtype.itemsize)


@pytest.fixture(scope="module")
def pairs_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("pref")
    hf = chat_tokenizer_dir(root / "hf", WORDS)
    data = root / "pairs.jsonl"
    data.write_text("\n".join(json.dumps(p) for p in _pairs(60)) + "\n" + json.dumps({"prompt": "no pair"}) + "\n")
    out = root / "data"
    assert prepare_cli.main(["--preference", "--input", str(data), "--tokenizer", str(hf), "--heldout_docs", "6",
                             "--max_len", "128", "--workers", "1", "--output", str(out)]) == 0
    return out, hf, data


def test_pairs_are_stored_chosen_then_rejected_weighted_on_the_response(pairs_dir):
    out, hf, data = pairs_dir
    manifest = layout.load_manifest(str(out))
    assert manifest["pairs"] and manifest["loss_weights"]
    assert manifest["chat"]["pairs"] == 60 and manifest["chat"]["skipped_not_a_pair"] == 1
    tok = layout.load_tokenizer(str(out))
    template, variables = chat.load_template(str(hf)), chat.special_tokens(str(hf))
    stream = pipeline.PackedStream(str(out), "train", seed=None)
    units = len(stream.window(0, 0)[0])
    assert len(stream.document_lengths()) == 2 * units
    records = [json.loads(line) for line in data.read_text().splitlines()]
    heldout = pipeline.PackedStream(str(out), "heldout", seed=None)
    assert len(heldout.document_lengths()) == 2 * 6
    # The train split keeps the file order: find each stored pair among the records by its chosen text.
    by_text = {}
    for r in records[:-1]:
        prompt, chosen, rejected = chat.preference(r)
        by_text[chat.render(template, prompt + chosen, variables=variables)] = (prompt, chosen, rejected)
    for unit in range(units):
        (c_ids, c_w), (r_ids, r_w) = _record(stream, 2 * unit), _record(stream, 2 * unit + 1)
        prompt, chosen, rejected = by_text[tok.decode(c_ids)]
        for ids, w, response in ((c_ids, c_w, chosen), (r_ids, r_w, rejected)):
            full = chat.render(template, prompt + response, variables=variables)
            assert tok.decode(ids) == full
            # weighted: the response and its end of turn, never the prompt (nor an assistant turn inside it)
            assert tok.decode(ids[w == 1]) == response[0]["content"] + "<|im_end|>\n"
            assert not w[:len(chat.encode_prompt(tok, template, prompt, variables))].any()


def test_rows_pack_whole_pairs_in_a_seeded_order(pairs_dir):
    out, _, _ = pairs_dir
    stream = pipeline.PackedStream(str(out), "train", seed=3)
    again = pipeline.PackedStream(str(out), "train", seed=3)
    order, _ = stream.window(0, 0)
    seen = []
    for r in range(8):
        row = stream.row(r * 128, 128)
        np.testing.assert_array_equal(row["tokens"], again.row(r * 128, 128)["tokens"])
        seg = row["segment_ids"]
        assert seg.max() % 2 == 0  # whole pairs only
        for j in range(seg.max() // 2):
            chosen, rejected = row["tokens"][seg == 2 * j + 1], row["tokens"][seg == 2 * j + 2]
            unit = order[len(seen)]
            np.testing.assert_array_equal(chosen, _record(stream, 2 * unit)[0])
            np.testing.assert_array_equal(rejected, _record(stream, 2 * unit + 1)[0])
            seen.append(unit)
    assert sorted(seen) != seen  # shuffled (pairs as units)


def test_a_long_pair_is_truncated_to_fit_or_dropped(pairs_dir, tmp_path):
    _, hf, data = pairs_dir
    counts = {}
    for mode in ("left", "drop"):
        manifest = prepare.prepare_sources(str(tmp_path / mode), [str(data)], field="*", tokenizer=str(hf),
                                           heldout_docs=2, preference=True, max_len=48, truncate=mode, workers=1,
                                           **QUIET)
        counts[mode] = manifest["chat"]
        stream = pipeline.PackedStream(str(tmp_path / mode), "train", seed=None)
        assert stream.document_lengths().reshape(-1, 2).sum(1).max() <= 48
    assert counts["left"]["truncated"] > 0 and counts["left"]["pairs"] == 60
    assert counts["drop"]["dropped_too_long"] == counts["left"]["truncated"]
    assert counts["drop"]["pairs"] == 60 - counts["drop"]["dropped_too_long"]


def test_fair_split_keeps_the_shorter_side_whole_up_to_half():
    assert encode._fair_split([10, 100], 50) == [10, 40]
    assert encode._fair_split([100, 10], 50) == [40, 10]
    assert encode._fair_split([100, 90], 50) == [25, 25]


def test_preference_records_in_every_form():
    user = {"role": "user", "content": "hi"}
    assert chat.preference({"prompt": "hi", "chosen": "a", "rejected": "b"}) == (
        [user], [{"role": "assistant", "content": "a"}], [{"role": "assistant", "content": "b"}])
    implicit = chat.preference({"chosen": [user, {"role": "assistant", "content": "a"}],
                                "rejected": [user, {"role": "assistant", "content": "b"}]})
    assert implicit[0] == [user] and implicit[1][0]["content"] == "a"
    for bad in ({"prompt": "hi", "chosen": "a"}, {"prompt": "hi", "chosen": [], "rejected": "b"}, ["x"],
                {"chosen": {"role": "assistant"}, "rejected": {"role": "assistant"}}, {"chosen": 1, "rejected": 2},
                {"chosen": [user, 3], "rejected": [user, {"role": "assistant"}]}):
        with pytest.raises(DataError):
            chat.preference(bad)


def test_an_objective_that_does_not_suit_the_data_exits_before_the_workdir(pairs_dir, tiny_config, tiny_data_dir):
    out, _, _ = pairs_dir
    for objective, data_dir, said in (("lm", str(out), "holds preference pairs"),
                                      ("dpo", tiny_data_dir, "holds documents; set it to lm.*--preference")):
        cfg = tiny_config(**{"data.dir": data_dir, "train.seq_len": 128, "train.objective": objective,
                             "data.vocab_size": layout.load_tokenizer(data_dir).vocab_size})
        with pytest.raises(ConfigError, match=f"train.objective.*{said}"):
            train.run(cfg, **QUIET)
        assert not os.path.exists(cfg.workdir)
