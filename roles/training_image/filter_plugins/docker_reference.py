"""Docker image references the way Docker reads them (distribution/reference's rules).

Owns: splitting `ftb_image` into registry, repository, tag and digest, so the role asks
the right registry for a tag's digest and logs in to the right one. Docker Hub short
names are the trap: in `pytorch/pytorch:2.4` the first part is a repository namespace,
not a registry host; `ubuntu` is `docker.io/library/ubuntu:latest`.
"""

from __future__ import annotations

import re

DOCKER_HUB = "docker.io"
DOCKER_HUB_API = "registry-1.docker.io"  # where docker.io's registry API answers
_DIGEST = re.compile(r"@(sha256:[0-9a-f]{64})$")


def docker_reference(ref: str) -> dict:
    """`ref` -> {registry, api_host, repository, tag, digest, name}.

    A first component is a registry host only when it holds a '.' or a ':' or is
    `localhost` (Docker's rule); otherwise the image is on Docker Hub, and a one-part
    name lives under `library/`. `name` is the reference without tag or digest, as
    written (Docker resolves it the same way on every host).
    """
    ref = str(ref).strip()
    digest = None
    match = _DIGEST.search(ref)
    if match:
        digest, ref = match.group(1), ref[:match.start()]
    tag = None
    last = ref.rsplit("/", 1)[-1]
    if ":" in last:
        ref, tag = ref.rsplit(":", 1)
    name = ref
    first, _, rest = ref.partition("/")
    if rest and ("." in first or ":" in first or first == "localhost"):
        registry, repository = first, rest
    else:
        registry, repository = DOCKER_HUB, ref
        if "/" not in repository:
            repository = "library/" + repository
    if registry in ("index.docker.io", "registry-1.docker.io"):
        registry = DOCKER_HUB
    return {
        "registry": registry,
        "api_host": DOCKER_HUB_API if registry == DOCKER_HUB else registry,
        "repository": repository,
        "tag": tag or ("latest" if digest is None else None),
        "digest": digest,
        "name": name,
    }


def bearer_challenge(header: str) -> dict:
    """A registry's `WWW-Authenticate: Bearer realm="...",service="...",scope="..."` ->
    {realm, service, scope}: where to ask for a token (Docker Hub asks even anonymous
    clients to)."""
    return dict(re.findall(r'(\w+)="([^"]*)"', str(header or "")))


class FilterModule:
    """Ansible filters: docker_reference, bearer_challenge."""

    def filters(self):
        return {"docker_reference": docker_reference, "bearer_challenge": bearer_challenge}
