"""Tokenize once (issue 46 item 3): the kept tokenized dataset's key follows everything that
changes the data (dataset bytes, tokenizer files, template, cutoff_len, the model) and nothing
that does not (learning rate, output_dir, the adapter); a half-saved one is never used; the
ranks' config names the kept one, or a fresh ``.part-RUN`` that a later check promotes."""

from __future__ import annotations

import json

import yaml

from ftbundle import tokenized as T
from ftbundle.check import probe_spec
from ftbundle.facts import ClusterFacts, parse_facts
from ftbundle.plan import make_plan
from ftbundle.remote import probe_tokenized as PT
from tests.unit.test_check_unit import facts, layout_of, local_spec, run_probe, write_datasets

CONFIG = {"stage": "sft", "model_name_or_path": "/m", "dataset": "a", "dataset_dir": "/data", "template": "qwen",
          "cutoff_len": 512, "learning_rate": 1e-4, "output_dir": "/shared/out", "lora_rank": 8}


def save_tokenized(path, splits=("train",), complete=True):
    """What datasets' DatasetDict.save_to_disk leaves: dataset_dict.json first, each split's
    state.json and dataset_info.json last."""
    path.mkdir(parents=True)
    (path / "dataset_dict.json").write_text(json.dumps({"splits": list(splits)}))
    for s in splits:
        (path / s).mkdir()
        (path / s / "data-00000-of-00001.arrow").write_bytes(b"arrow")
        if complete:
            (path / s / "state.json").write_text("{}")
            (path / s / "dataset_info.json").write_text("{}")


def probe(tmp_path, config=None, data="[1]", tokenizer='{"v": 1}'):
    d, m = tmp_path / "data", tmp_path / "m"
    write_datasets(d, {"a": {"file_name": "a.json"}}, {"a.json": data})
    m.mkdir(exist_ok=True)
    (m / "tokenizer.json").write_text(tokenizer)
    (m / "config.json").write_text("{}")
    (m / "model.safetensors").write_bytes(b"weights: not the tokenizer's")
    asked = T.request(config or CONFIG, str(tmp_path / "shared"), str(m))
    return run_probe(local_spec(tmp_path, datasets={"dir": str(d), "names": ["a"]}, tokenized=asked))["tokenized"]


def test_the_key_follows_the_data_the_tokenizer_and_the_data_keys_only(tmp_path):
    first = probe(tmp_path)
    assert first == {"key": first["key"], "path": str(tmp_path / "shared/cache/tokenized" / first["key"]),
                     "ready": False}
    assert probe(tmp_path)["key"] == first["key"]
    assert probe(tmp_path, {**CONFIG, "learning_rate": 3e-4, "output_dir": "/o2", "lora_rank": 64,
                            "gradient_accumulation_steps": 8})["key"] == first["key"]
    for changed in ({**CONFIG, "template": "llama3"}, {**CONFIG, "cutoff_len": 1024},
                    {**CONFIG, "model_name_or_path": "/other"}, {**CONFIG, "some_future_key": 1}):
        assert probe(tmp_path, changed)["key"] != first["key"], changed
    assert probe(tmp_path, data="[2]")["key"] != first["key"]  # the dataset's bytes
    assert probe(tmp_path, tokenizer='{"v": 2}')["key"] != first["key"]  # the tokenizer's


def test_a_complete_part_is_promoted_and_a_half_saved_one_never_used(tmp_path):
    key = probe(tmp_path)["key"]
    root = tmp_path / "shared/cache/tokenized"
    save_tokenized(root / f"{key}.part-run-a", complete=False)  # (a run killed while it saved)
    assert probe(tmp_path)["ready"] is False and (root / f"{key}.part-run-a").is_dir()
    save_tokenized(root / f"{key}.part-run-b")
    found = probe(tmp_path)
    assert found["ready"] is True and found["path"] == str(root / key)
    assert not (root / f"{key}.part-run-b").exists() and (root / key / "train" / "state.json").is_file()
    assert PT.tokenized_complete(str(root / key)) and not PT.tokenized_complete(str(root / f"{key}.part-run-a"))


def test_a_dataset_the_check_did_not_hash_keeps_nothing(tmp_path):
    d = tmp_path / "data"
    write_datasets(d, {"hub": {"hf_hub_url": "org/ds"}}, {})
    asked = T.request(CONFIG, str(tmp_path / "shared"), None)
    out = run_probe(local_spec(tmp_path, datasets={"dir": str(d), "names": ["hub"]}, tokenized=asked))
    assert out["tokenized"] == {"error": "not every dataset is a local file the check hashed"}


def test_where_tokenize_once_does_not_apply():
    assert T.request({**CONFIG, "tokenized_path": "/mine"}, "/s", None) is None  # the user's own
    assert T.request({**CONFIG, "streaming": True}, "/s", None) is None
    # LlamaFactory's examples all say overwrite_cache: true (the datasets library's cache files): kept still
    assert T.request({**CONFIG, "overwrite_cache": True}, "/s", None)["basis"]["overwrite_cache"] is True
    assert T.path_for({"error": "x"}, "r1") is None and T.path_for(None, "r1") is None
    assert T.path_for({"path": "/s/k", "ready": True}, "r1") == ("/s/k", True)
    assert T.path_for({"path": "/s/k", "ready": False}, "r1") == ("/s/k.part-r1", False)


def test_rank_0_alone_is_asked_and_the_ranks_config_names_the_kept_dataset(tmp_path):
    layout = layout_of(tmp_path, 2, train={"llamafactory": {**CONFIG, "model_name_or_path": "/shared/m",
                                                            "dataset_dir": "/shared/data"}})
    spec = probe_spec(layout, 0, token="t", expect=[0, 1], port_peers=None)
    assert spec["tokenized"]["dir"] == "/shared/cache/tokenized" and spec["tokenized"]["model_dir"] == "/shared/m"
    assert "learning_rate" not in spec["tokenized"]["basis"] and spec["tokenized"]["basis"]["template"] == "qwen"
    assert "tokenized" not in probe_spec(layout, 1, token="t", expect=[0, 1], port_peers=None)
    off = layout_of(tmp_path, 2, tokenize_once=False, train=layout.job.train.llamafactory and
                    {"llamafactory": {**CONFIG, "dataset_dir": "/shared/data"}})
    assert "tokenized" not in probe_spec(off, 0, token="t", expect=[0, 1], port_peers=None)

    def planned(answer):
        hosts = [facts("node0", tokenized=answer), facts("node1", 1)]
        plan = make_plan(layout, ClusterFacts(hosts))
        return yaml.safe_load(plan.files["llamafactory.yaml"]), plan.notes

    config, notes = planned({"key": "k", "path": "/shared/cache/tokenized/k", "ready": True})
    assert config["tokenized_path"] == "/shared/cache/tokenized/k" and config["learning_rate"] == 1e-4
    assert "tokenized dataset: reused from /shared/cache/tokenized/k (same data, tokenizer and data keys)" in notes
    config, notes = planned({"key": "k", "path": "/shared/cache/tokenized/k", "ready": False})
    assert config["tokenized_path"] == f"/shared/cache/tokenized/k.part-{layout.run_id}"
    config, notes = planned(None)
    assert "tokenized_path" not in config
    assert parse_facts("h", 0, {"tokenized": {"key": "k"}}).tokenized == {"key": "k"}
