"""OpenSSH client config files gpuctl writes.

<state>/ssh_config holds one `Host gpuctl-<cluster>` block per SSH-reachable cluster (its
first node; `gpuctl-<cluster>-N` is node N), with the pinned host keys of gpuctl's own
known_hosts and StrictHostKeyChecking yes. `Include` it from ~/.ssh/config and
`ssh gpuctl-<cluster>` works with the key gpuctl pinned. It is rewritten from the state
records whenever a cluster comes up or goes down (`refresh`).
"""

from __future__ import annotations

from pathlib import Path

from provision.core import state
from provision.core.errors import ConfigError
from trainer.objstore.atomic import atomic_write


def laptop_config_path() -> Path:
    return state.state_dir() / "ssh_config"


def alias(cluster: str, index: int) -> str:
    return f"gpuctl-{cluster}-{index}"


def quote(value: str) -> str:
    """A value for an ssh_config line: double-quoted, `%` escaped (ssh expands %-tokens)."""
    if any(c in value for c in '"\n\r'):
        raise ConfigError(
            f"{value!r} cannot appear in an SSH config file (quote or newline)", "use a path without quotes or newlines"
        )
    return '"' + value.replace("%", "%%") + '"'


def host_block(
    names: list[str],
    address: str,
    port: int,
    user: str | None,
    identity_file: str | None,
    known_hosts: str,
    extra: dict[str, str] | None = None,
    keys: list[str] | None = None,
) -> str:
    """One Host block. `identity_file`: gpuctl's key, the only one offered; `keys`: IdentityFile
    lines from the user's ssh_config (the agent's keys are offered too, as there)."""
    lines = [f"Host {' '.join(names)}", f"  HostName {address}", f"  Port {port}"]
    if user:
        lines.append(f"  User {user}")
    if identity_file:
        lines += [f"  IdentityFile {quote(identity_file)}", "  IdentitiesOnly yes"]
    lines += [f"  IdentityFile {quote(k)}" for k in ([] if identity_file else keys or [])]
    lines += [f"  UserKnownHostsFile {quote(known_hosts)}", "  StrictHostKeyChecking yes", "  CheckHostIP no"]
    lines += [f"  {k} {v}" for k, v in (extra or {}).items()]
    return "\n".join(lines) + "\n"


def ssh_reachable(cluster: state.ClusterRecord) -> bool:
    return cluster.provider != "local" and all(n.address and n.address != "localhost" for n in cluster.nodes)


def render(clusters: list[state.ClusterRecord]) -> str:
    from provision.transport.ssh.hostkeys import known_hosts_path

    known = str(known_hosts_path())
    out = [
        "# Written by gpuctl from its state; rewritten by `gpuctl up` / `gpuctl down`.\n"
        "# Use it from ~/.ssh/config (near the top):  Include " + str(laptop_config_path()) + "\n"
    ]
    for cluster in clusters:
        if not ssh_reachable(cluster):
            continue
        for i, node in enumerate(cluster.nodes):
            names = ([f"gpuctl-{cluster.name}"] if i == 0 else []) + [alias(cluster.name, i)]
            out += route_blocks(names, node, cluster.identity_file, known, f"{alias(cluster.name, i)}-jump")
    return "\n".join(out)


def route_blocks(names: list[str], node: state.NodeRecord, identity: str | None, known: str, jump: str) -> list[str]:
    """The node's Host block and, when it sits behind ProxyJump hosts, one block per hop
    (`<jump>0`, `<jump>1` ...: the laptop's side first), each checked against the same pinned
    known_hosts: `ssh -F` reads this file again for the hops."""
    route = node.ssh
    blocks = []
    extra: dict[str, str] = {}
    for k, hop in enumerate(route.jumps if route else []):
        only = {"IdentitiesOnly": "yes"} if hop.identities_only and hop.identity_files else {}
        blocks.append(
            host_block([f"{jump}{k}"], hop.address, hop.port, hop.user, None, known, only, hop.identity_files)
        )
    if blocks:
        extra["ProxyJump"] = ",".join(f"{jump}{k}" for k in range(len(blocks)))
    if route and route.connect_timeout:
        extra["ConnectTimeout"] = str(max(1, round(route.connect_timeout)))
    if route and route.keepalive_s is not None:
        extra["ServerAliveInterval"] = str(route.keepalive_s)
    if route and route.identities_only and route.identity_files and not identity:
        extra["IdentitiesOnly"] = "yes"
    keys = route.identity_files if route else []
    return [host_block(names, node.address, node.port, node.user, identity, known, extra, keys), *blocks]


def refresh(exclude: str | None = None) -> Path:
    """Rewrite <state>/ssh_config from the recorded clusters (minus `exclude`)."""
    clusters = [c for c in state.list_clusters() if c.name != exclude]
    path = laptop_config_path()
    atomic_write(path, render(clusters), 0o600)
    return path


def include_hint(cluster: state.ClusterRecord) -> str:
    return (
        f"ssh: `gpuctl ssh` or, with `Include {laptop_config_path()}` at the top of ~/.ssh/config, "
        f"`ssh gpuctl-{cluster.name}`"
    )


def ssh_argv(cluster_name: str, index: int, command: list[str]) -> list[str]:
    """The OpenSSH command line for `gpuctl ssh`: one argument is a shell command line,
    several are an argv whose values arrive verbatim (quoted with shlex.join)."""
    import shlex
    import shutil

    cluster = state.load_cluster(cluster_name)
    if not ssh_reachable(cluster):
        raise ConfigError(
            f"cluster {cluster_name} runs on this machine ({cluster.provider}); there is no SSH", "run the command here"
        )
    if not 0 <= index < len(cluster.nodes):
        raise ConfigError(
            f"cluster {cluster_name} has {len(cluster.nodes)} node(s); no node {index}",
            f"pass --node 0..{len(cluster.nodes) - 1}",
        )
    client = shutil.which("ssh")
    if client is None:
        raise ConfigError("the OpenSSH client (ssh) is not installed here", "install openssh-client")
    argv = [client, "-F", str(refresh()), alias(cluster_name, index)]
    if len(command) == 1:
        argv.append(command[0])
    elif command:
        argv.append(shlex.join(command))
    return argv
