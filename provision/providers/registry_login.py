"""The login a vendor's host needs to pull a private provider.image: the registry (from the image
reference, as docker reads it), provider.registry_user (else $GPUCTL_REGISTRY_USER), and the password
or token from $GPUCTL_REGISTRY_PASSWORD: the same variables `docker.ship: pull` and `image build
--push` read. The password goes into the vendor's create call (Vast's `image_login`,
RunPod's container registry auth) and nowhere else: not argv, not the state dir, not a message
(the API client redacts it: http.JsonApi.hide).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from provision.core.errors import ConfigError
from provision.core.provider_config import REGISTRY_PASSWORD_ENV, REGISTRY_USER_ENV, MarketProvider

DOCKER_HUB = "docker.io"


@dataclass(frozen=True)
class RegistryLogin:
    server: str
    user: str
    password: str = field(repr=False)

    def vast_image_login(self) -> str:
        """Vast's `image_login`: the arguments of the host's `docker login` (the vastai client's
        `--login '-u USER -p PASS SERVER'`), split on spaces by the host, hence none in the parts."""
        return f"-u {self.user} -p {self.password} {self.server}"


def registry_of(image: str) -> str:
    """The registry an image reference names, as docker reads it: a first component with a dot or a
    port, or `localhost`, is a registry host; anything else is on Docker Hub."""
    first, slash, _ = image.partition("/")
    if slash and ("." in first or ":" in first or first == "localhost"):
        return first
    return DOCKER_HUB


def registry_login(prov: MarketProvider) -> RegistryLogin | None:
    """The login for provider.image, or None for a public image (no registry_user, no $GPUCTL_REGISTRY_USER)."""
    user = prov.registry_user or os.environ.get(REGISTRY_USER_ENV, "").strip()
    if not user or not prov.image:
        return None
    password = os.environ.get(REGISTRY_PASSWORD_ENV, "")
    if not password:
        raise ConfigError(
            f"a registry user is set (provider.registry_user or ${REGISTRY_USER_ENV}) but ${REGISTRY_PASSWORD_ENV} is empty",
            f"export {REGISTRY_PASSWORD_ENV}=... (the registry's password or access token, e.g. a GitHub "
            "token with read:packages for ghcr.io)",
        )
    if any(c.isspace() for c in password) or len(password) > 4096:
        raise ConfigError(
            f"${REGISTRY_PASSWORD_ENV} has white space in it or is over 4096 characters",
            "give the registry's access token itself",
        )
    if any(c.isspace() for c in user):
        raise ConfigError(
            f"the registry user {user!r} has white space in it", f"set {REGISTRY_USER_ENV} to the user alone"
        )
    return RegistryLogin(server=registry_of(prov.image), user=user, password=password)
