"""train.data from s3://: local rank 0 downloads the object into the run dir's cache, then the
tokenize-once path takes it. Against moto's ThreadedMotoServer on loopback (no DeepSpeed launch)."""

from __future__ import annotations

import json
import uuid

import numpy as np
import pytest

pytest.importorskip("boto3")
pytest.importorskip("moto")
pytest.importorskip("transformers")

from provision.core.config import load_config
from provision.core.errors import ConfigError
from tests.helpers import free_port
from tests.s3server import HOST
from trainer.config import TrainerError
from trainer.dataset import PackedTokens, cache_path, prepare_token_file, resolve_data
from trainer.tokenizer import byte_tokenizer

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def endpoint():
    from moto.server import ThreadedMotoServer

    port = free_port()
    server = ThreadedMotoServer(ip_address=HOST, port=port, verbose=False)
    server.start()
    try:
        yield f"http://{HOST}:{port}"
    finally:
        server.stop()


@pytest.fixture
def bucket(endpoint, s3_env):
    import boto3

    client = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1")
    name = f"data-{uuid.uuid4().hex[:8]}"
    client.create_bucket(Bucket=name)
    return client, name


def storage(endpoint: str) -> dict:
    return {"url": "s3://ckpt/run", "endpoint_url": endpoint, "region": "us-east-1", "profile": None, "keep": 3}


def test_download_then_tokenize_once(bucket, endpoint, tmp_path):
    client, name = bucket
    body = "".join(json.dumps({"text": t}) + "\n" for t in ("ab", "cd"))
    client.put_object(Bucket=name, Key="corpus/d.jsonl", Body=body.encode())
    url, tok, lines = f"s3://{name}/corpus/d.jsonl", byte_tokenizer(), []

    token_file = prepare_token_file(url, tmp_path, storage(endpoint), tok, lines.append)
    assert any(line.startswith(f"data: downloading {url}") for line in lines), lines
    assert any("tokenizing d.jsonl" in line for line in lines), lines
    # what every other rank computes after the barrier, without touching S3
    assert cache_path(resolve_data(url, tmp_path), tok, tmp_path / "cache") == token_file
    packed = PackedTokens(token_file, len(tok), seq_len=2)
    inputs, targets = packed.batch(np.array([0, 1]))
    eos = tok.eos_token_id
    assert inputs.tolist() == [[ord("a"), ord("b")], [ord("c"), ord("d")]]
    assert targets.tolist() == [[ord("b"), eos], [ord("d"), eos]]

    lines.clear()  # a second launch (resume): no download, no tokenizing
    assert prepare_token_file(url, tmp_path, storage(endpoint), tok, lines.append) == token_file
    assert any("already downloaded" in line for line in lines) and not any("tokenizing" in line for line in lines)

    client.put_object(Bucket=name, Key="corpus/d.jsonl", Body=(body + json.dumps({"text": "ef"}) + "\n").encode())
    lines.clear()  # the object changed: fetched again, tokenized into a new token file
    new_file = prepare_token_file(url, tmp_path, storage(endpoint), tok, lines.append)
    assert new_file != token_file and PackedTokens(new_file, len(tok), seq_len=2).num_samples == 3
    assert not list((tmp_path / "cache" / "remote").rglob("*.tmp*"))


def test_txt_object_and_clear_errors(bucket, endpoint, tmp_path, monkeypatch):
    client, name = bucket
    client.put_object(Bucket=name, Key="a.txt", Body=b"ab\n\ncd\n")
    tok = byte_tokenizer()
    token_file = prepare_token_file(f"s3://{name}/a.txt", tmp_path, storage(endpoint), tok, lambda _m: None)
    assert PackedTokens(token_file, len(tok), seq_len=2).num_samples == 2

    with pytest.raises(TrainerError, match="no such object"):
        prepare_token_file(f"s3://{name}/missing.jsonl", tmp_path, storage(endpoint), tok, lambda _m: None)
    with pytest.raises(TrainerError, match=r"expected a \.txt, \.jsonl or \.parquet object"):
        resolve_data(f"s3://{name}/data.csv", tmp_path)
    with pytest.raises(TrainerError, match="expected s3://bucket/path"):
        resolve_data(f"s3://{name}", tmp_path)
    with pytest.raises(TrainerError, match="only s3://"):
        resolve_data("gs://b/d.jsonl", tmp_path)
    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    with pytest.raises(TrainerError, match="no S3 credentials on the node") as err:
        prepare_token_file(f"s3://{name}/b.txt", tmp_path, storage(endpoint), tok, lambda _m: None)
    assert "\n" not in str(err.value)


def test_gpuctl_yaml_checks_the_object_suffix(project):
    (project / "gpuctl.yaml").write_text("train: {data: 's3://bucket/corpus/d.csv'}\n")
    with pytest.raises(ConfigError, match=r"d\.csv is not a \.txt, \.jsonl or \.parquet object"):
        load_config(project / "gpuctl.yaml")
    (project / "gpuctl.yaml").write_text("train: {data: 's3://bucket/corpus/d.parquet'}\n")
    cfg = load_config(project / "gpuctl.yaml")
    assert cfg.data_path() is None  # nothing to ship: the node downloads it
