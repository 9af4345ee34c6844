"""Passwordless SSH between a cluster's nodes, for DeepSpeed's multi-node pdsh launcher.

DeepSpeed's runner on the first node runs `pdsh -w host1,host2 ...` with PDSH_RCMD_TYPE=ssh;
pdsh runs `ssh $PDSH_SSH_ARGS_APPEND -l<user> <host> "export ...; cd <run dir>; python -m
deepspeed.launcher.launch ..."`. gpuctl makes that work without touching the node's
~/.ssh/config or ~/.ssh/known_hosts:

* a keypair made for the cluster (<state>/keys/<cluster>/id_ed25519); its public key is
  added to every node's authorized_keys (marked `gpuctl-mesh-<cluster>`, removed by down);
* on the first node, <workdir>/ssh/{id_ed25519,config,known_hosts}: one Host block per
  hostfile name with HostName, Port, User, the key, and known_hosts entries copied from
  the keys gpuctl pinned (StrictHostKeyChecking yes): no trust-on-first-use between nodes;
* launch.sh exports PDSH_SSH_ARGS_APPEND="-F <workdir>/ssh/config" (render: spec.ssh_config);
  ports come from the config, so nodes may listen on different ports.

Providers call `setup(cluster, nodes, ...)` in `up` for 2+ nodes, once every node answers
and the record is complete, and `teardown(cluster, nodes, ...)` in `down`.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable, Sequence
from pathlib import Path

from provision.core import state
from provision.core.errors import RemoteError
from provision.transport.remote import Node
from provision.transport.ssh.client_config import host_block
from trainer.objstore.atomic import atomic_write

MARK = "gpuctl-mesh-"

# $1 authorized_keys path ("~/" = $HOME/), $2 the key line. Idempotent.
ADD_KEY = r'''f="$1"; case "$f" in "~/"*) f="$HOME/${f#\~/}";; esac
mkdir -p "$(dirname "$f")" && touch "$f" && chmod go-w "$f" || exit 1
grep -qxF -- "$2" "$f" || printf '%s\n' "$2" >> "$f"'''
# $1 authorized_keys path, $2 our key line: drop exactly that line, keep the rest as it was.
DROP_KEY = r'''f="$1"; case "$f" in "~/"*) f="$HOME/${f#\~/}";; esac
[ -f "$f" ] || exit 0
grep -vxF -- "$2" "$f" > "$f.gpuctl.tmp"; cat "$f.gpuctl.tmp" > "$f"; rm -f "$f.gpuctl.tmp"'''


def node_ssh_dir(workdir: str) -> str:
    return f"{workdir.rstrip('/')}/ssh"


def node_ssh_config(workdir: str) -> str:
    return f"{node_ssh_dir(workdir)}/config"


def key_dir(cluster: str) -> Path:
    return state.state_dir() / "keys" / cluster


def cluster_keypair(cluster: str) -> tuple[str, str]:
    """(private key in OpenSSH PEM, public key line), made once per cluster, kept 0600."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    folder = key_dir(cluster)
    private, public = folder / "id_ed25519", folder / "id_ed25519.pub"
    if not (private.is_file() and public.is_file()):
        key = Ed25519PrivateKey.generate()
        pem = key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.OpenSSH, serialization.NoEncryption()
        ).decode()
        pub = key.public_key().public_bytes(serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH).decode()
        folder.mkdir(parents=True, exist_ok=True)
        folder.chmod(0o700)
        atomic_write(private, pem, 0o600)
        atomic_write(public, f"{pub} {MARK}{cluster}\n", 0o644)
    return private.read_text(), public.read_text().strip()


def node_known_hosts(cluster: state.ClusterRecord) -> str:
    """known_hosts lines for every node, from the keys gpuctl pinned on first contact."""
    from provision.transport.ssh.hostkeys import host_key_name, load_known_hosts

    keys = load_known_hosts()
    lines = []
    for node in cluster.nodes:
        name = host_key_name(node.address, node.port)
        pinned = keys.lookup(name)
        if not pinned:
            raise RemoteError(f"{node.address}:{node.port} has no pinned host key", "run `gpuctl up` again")
        lines += [f"{name} {kind} {key.get_base64()}\n" for kind, key in pinned.items()]
    return "".join(lines)


def node_ssh_config_text(cluster: state.ClusterRecord) -> str:
    folder = node_ssh_dir(cluster.nodes[0].workdir)
    blocks = []
    for node in cluster.nodes:
        name = node.host.split("@")[-1]  # pdsh passes user@host as -l user host
        blocks.append(
            host_block(
                [name],
                node.address,
                node.port,
                node.user,
                f"{folder}/id_ed25519",
                f"{folder}/known_hosts",
                {"BatchMode": "yes", "ConnectTimeout": "30", "LogLevel": "ERROR", "ServerAliveInterval": "30"},
            )
        )
    return "# Written by gpuctl for DeepSpeed's pdsh launcher (node-to-node SSH).\n" + "\n".join(blocks)


def setup(
    cluster: state.ClusterRecord,
    nodes: Sequence[Node],
    authorized_keys: str = "~/.ssh/authorized_keys",
    say: Callable[[str], None] = print,
) -> None:
    """Let the first node reach every node (itself included) by its hostfile name."""
    private, public = cluster_keypair(cluster.name)
    (key_dir(cluster.name) / "authorized_keys").write_text(authorized_keys + "\n")
    for node in nodes:
        node.sh(ADD_KEY, authorized_keys, public, timeout=60)
    first, folder = nodes[0], node_ssh_dir(cluster.nodes[0].workdir)
    first.write_text(f"{folder}/id_ed25519", private, "600")
    first.write_text(f"{folder}/known_hosts", node_known_hosts(cluster), "600")
    first.write_text(f"{folder}/config", node_ssh_config_text(cluster), "600")
    for rec in cluster.nodes:
        name = rec.host.split("@")[-1]
        result = first.run(["ssh", "-F", f"{folder}/config", name, "true"], check=False, timeout=90)
        if result.rc != 0:
            raise RemoteError(
                f"node {cluster.nodes[0].address} cannot SSH to node {rec.host} "
                f"(port {rec.port}): {result.stderr.strip()[-200:] or f'exit {result.rc}'}",
                f"check that {rec.address}:{rec.port} is reachable from the first node "
                "and that provider.authorized_keys is the file its sshd reads",
            )
    say(f"node-to-node SSH ready: {cluster.nodes[0].address} reaches {len(cluster.nodes)} nodes (pdsh)")


def teardown(cluster: state.ClusterRecord, nodes: Sequence[Node], say: Callable[[str], None] = print) -> None:
    """Remove the cluster key from the nodes and the first node's ssh folder; forget the key."""
    folder = key_dir(cluster.name)
    marker = folder / "authorized_keys"
    if not marker.is_file():
        return
    authorized = marker.read_text().strip()
    public = (folder / "id_ed25519.pub").read_text().strip()
    for i, node in enumerate(nodes):
        try:
            node.sh(DROP_KEY, authorized, public, timeout=60)
            if i == 0:
                node.sh('rm -rf -- "$1"', node_ssh_dir(cluster.nodes[0].workdir), timeout=60)
        except RemoteError as exc:
            say(f"warning: could not remove the cluster key from {node.label}: {exc.message}")
    shutil.rmtree(folder, ignore_errors=True)
