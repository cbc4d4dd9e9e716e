"""The training_image role's reading of image references (its filter plugin): pure, no hosts."""

from __future__ import annotations

import importlib.util

import pytest

from tests.support.helpers import REPO

_spec = importlib.util.spec_from_file_location(
    "docker_reference", REPO / "roles" / "training_image" / "filter_plugins" / "docker_reference.py")
refs = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(refs)
DIGEST = "sha256:" + "a" * 64


@pytest.mark.parametrize("ref, registry, api_host, repository, tag, name", [
    # Docker Hub short names: the first part is a namespace, not a registry host
    ("pytorch/pytorch:2.4.0-cuda12.1-cudnn9-runtime", "docker.io", "registry-1.docker.io", "pytorch/pytorch",
     "2.4.0-cuda12.1-cudnn9-runtime", "pytorch/pytorch"),
    ("ubuntu", "docker.io", "registry-1.docker.io", "library/ubuntu", "latest", "ubuntu"),
    ("ubuntu:22.04", "docker.io", "registry-1.docker.io", "library/ubuntu", "22.04", "ubuntu"),
    ("docker.io/pytorch/pytorch:2.4", "docker.io", "registry-1.docker.io", "pytorch/pytorch", "2.4",
     "docker.io/pytorch/pytorch"),
    ("index.docker.io/library/ubuntu:22.04", "docker.io", "registry-1.docker.io", "library/ubuntu", "22.04",
     "index.docker.io/library/ubuntu"),
    # a '.', a ':' or localhost makes the first part a registry
    ("nvcr.io/nvidia/pytorch:24.01-py3", "nvcr.io", "nvcr.io", "nvidia/pytorch", "24.01-py3",
     "nvcr.io/nvidia/pytorch"),
    ("198.18.250.1:5000/ftbundle/train-cpu:abc", "198.18.250.1:5000", "198.18.250.1:5000", "ftbundle/train-cpu",
     "abc", "198.18.250.1:5000/ftbundle/train-cpu"),
    ("localhost/train", "localhost", "localhost", "train", "latest", "localhost/train"),
    # the registry's port is not a tag: the name keeps it whole
    ("registry:5000/train", "registry:5000", "registry:5000", "train", "latest", "registry:5000/train"),
])
def test_references_read_as_docker_reads_them(ref, registry, api_host, repository, tag, name):
    """``name`` is the reference without its tag, as written: spelled out per case (the old
    check parsed as ``assert (got == x) if cond else ref`` and passed for any untagged ref)."""
    got = refs.docker_reference(ref)
    assert (got["registry"], got["api_host"], got["repository"], got["tag"], got["name"]) == (
        registry, api_host, repository, tag, name)


def test_a_digest_is_split_off_and_the_name_kept_as_written():
    got = refs.docker_reference(f"pytorch/pytorch@{DIGEST}")
    assert got == {"registry": "docker.io", "api_host": "registry-1.docker.io", "repository": "pytorch/pytorch",
                   "tag": None, "digest": DIGEST, "name": "pytorch/pytorch"}
    assert refs.docker_reference(f"reg.example.com:443/ml/train:v1@{DIGEST}")["tag"] == "v1"


def test_bearer_challenge():
    header = ('Bearer realm="https://auth.docker.io/token",service="registry.docker.io",'
              'scope="repository:library/ubuntu:pull"')
    assert refs.bearer_challenge(header) == {"realm": "https://auth.docker.io/token", "service": "registry.docker.io",
                                             "scope": "repository:library/ubuntu:pull"}
    assert refs.bearer_challenge(None) == {}
