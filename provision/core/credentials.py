"""Storage credentials for the node: resolved on the laptop, handed over through the run's env.

The laptop resolves them with boto3's standard chain (env vars, storage.profile or
AWS_PROFILE, SSO / assume-role, instance role) and the node gets plain AWS_* variables in
the bundle's 0600 secrets.env, which every rank reads itself (trainer/secrets_file.py; each node
its own copy). The node has no profile, so run.json carries no profile name
and no secret. Nothing here prints or raises with a key or token in it.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from urllib.parse import urlparse

from provision.core.config import StorageConfig
from provision.core.errors import ConfigError

# The storage credentials' names (secrets.env).
STORAGE_ENV_PREFIX = "AWS_"


@dataclass
class StorageCredentials:
    env: dict[str, str] = field(default_factory=dict)  # AWS_* for the node; secret values
    method: str | None = None  # botocore's name for where they came from: env, shared-credentials-file, sso, ...
    expires: bool = False  # temporary credentials (session token): uploads fail once they expire

    def __repr__(self) -> str:  # never show the values, e.g. in a traceback's locals
        return f"StorageCredentials(names={sorted(self.env)}, method={self.method!r}, expires={self.expires})"

    def expiry_warning(self) -> str | None:
        """What to tell the user before a run with temporary credentials: the node cannot refresh them."""
        if not self.expires:
            return None
        return (
            f"warning: the storage credentials ({self.method or 'session'}) are temporary; the node "
            "cannot refresh them, so uploads fail once they expire (use long-lived keys for long runs)"
        )


def storage_credentials(storage: StorageConfig, data: str | None = None) -> StorageCredentials:
    """The AWS_* env a node needs to reach storage.url or s3:// training data; else empty."""
    if urlparse(storage.url).scheme != "s3" and not (data or "").startswith("s3://"):
        return StorageCredentials()
    import boto3
    from botocore import exceptions as bx

    where = storage.url + (f" (endpoint {storage.endpoint_url})" if storage.endpoint_url else "")
    try:
        session = boto3.session.Session(profile_name=storage.profile)
        creds = session.get_credentials()
        frozen = creds.get_frozen_credentials() if creds is not None else None
    except bx.ProfileNotFound:
        raise ConfigError(
            f"storage.profile {storage.profile!r} is not in your AWS config",
            "fix storage.profile, or add the profile with `aws configure --profile NAME`",
        ) from None
    except bx.BotoCoreError as exc:  # SSO token expired, broken config file, role assumption refused
        raise ConfigError(
            f"cannot resolve AWS credentials for storage {where}: {type(exc).__name__}",
            "refresh them (e.g. `aws sso login`) and retry",
        ) from None
    if frozen is None or not frozen.access_key or not frozen.secret_key:
        profile = f" (profile {storage.profile})" if storage.profile else ""
        raise ConfigError(
            f"no AWS credentials found for storage {where}{profile}",
            "set storage.profile or AWS_PROFILE, or AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY",
        )
    env = {"AWS_ACCESS_KEY_ID": frozen.access_key, "AWS_SECRET_ACCESS_KEY": frozen.secret_key}
    if frozen.token:
        env["AWS_SESSION_TOKEN"] = frozen.token
    region = storage.region or session.region_name
    if region:
        env["AWS_DEFAULT_REGION"] = region
    return StorageCredentials(env=env, method=getattr(creds, "method", None), expires=bool(frozen.token))


def user_secrets(names: list[str], environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The values of gpuctl.yaml's `secrets:` names from this shell's environment (for `train`).

    They go to the node only in the run's 0600 secrets.env; a name that is not set is an error
    rather than an empty token the run would only trip over hours later."""
    env = os.environ if environ is None else environ
    missing = [name for name in names if not env.get(name)]
    if missing:
        raise ConfigError(
            f"secrets: {', '.join(missing)} {'is' if len(missing) == 1 else 'are'} not set in this shell",
            f"export {missing[0]}=... before `gpuctl train`, or remove it from secrets in gpuctl.yaml",
        )
    return {name: env[name] for name in names}
