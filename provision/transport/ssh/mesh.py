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

# Editing authorized_keys: write a copy, check it, rename it over the file. Never truncate the
# user's file first (`grep > tmp; cat tmp > file` empties it when the temp write fails on a full
# disk, and locks the user out of their own host). $1 the file ("~/" = $HOME/), $2 our public key
# line, $3 the line to have in its place ("": none). Every line holding our key's blob goes, the
# rest stays as it was; a symlinked file is edited where it points. Idempotent. One edit at a time
# (two clusters' setups or teardowns on one host would lose each other's line): a lock on the
# folder where flock exists; a change by anyone else between the copy and the rename shows in the
# count check, and the edit starts over. Every failure says why on stderr.
EDIT_KEY = r"""f="$1"; case "$f" in "~/"*) f="$HOME/${f#\~/}";; esac
[ -L "$f" ] && { f=$(readlink -f -- "$f") || exit 1; }
fail() { printf 'authorized_keys %s: %s\n' "$f" "$1" >&2; exit 1; }
blob=$(printf '%s\n' "$2" | awk '{print $2}'); [ -n "$blob" ] || fail "no key in the line to edit"
if [ ! -e "$f" ]; then
  [ -n "$3" ] || exit 0
  mkdir -p -- "$(dirname -- "$f")" && ( umask 077; : > "$f" ) || fail "cannot create it"
fi
if command -v flock >/dev/null && exec 9<"$(dirname -- "$f")"; then
  flock -w 60 9 || fail "another edit held its folder for 60 s"
fi
tmp=$(mktemp -- "$f.gpuctl.XXXXXX") || fail "cannot write a copy beside it"
trap 'rm -f -- "$tmp"' EXIT
for try in 1 2 3 4 5; do
  grep -vF -- "$blob" "$f" > "$tmp"; [ $? -le 1 ] || fail "reading it or writing the copy failed"  # 2 or a signal
  [ -z "$3" ] || printf '%s\n' "$3" >> "$tmp" || fail "writing the copy failed"
  keep=$(grep -cvF -- "$blob" "$f"); [ -z "$3" ] || keep=$((keep + 1))
  if [ "$(grep -c '' "$tmp")" = "$keep" ] && { [ -z "$3" ] || [ "$(tail -n 1 -- "$tmp")" = "$3" ]; }; then
    chmod go-rwx -- "$tmp" && mv -f -- "$tmp" "$f" && exit 0
    fail "cannot rename the copy over it"
  fi
  sleep "$try"  # the copy is short of a line: the file changed under us, or a write fell short
done
fail "the copy never held every line (the file kept changing, or the disk is full)"
"""
# On the first node: the address each node sees it connect from (for the key's from= option).
SOURCE_ADDRESS = 'printf "%s" "${SSH_CONNECTION%% *}"'


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
        pinned = keys.lookup(host_key_name(node.address, node.port))
        if not pinned:
            raise RemoteError(f"{node.address}:{node.port} has no pinned host key", "run `gpuctl up` again")
        name = host_key_name(inner_address(node), node.port)  # the key gpuctl pinned, under the name nodes use
        lines += [f"{name} {kind} {key.get_base64()}\n" for kind, key in pinned.items()]
    return "".join(lines)


def inner_address(node: state.NodeRecord) -> str:
    """Where the other nodes reach this one: its private address when the provider has one (AWS:
    traffic inside the VPC, which the cluster's security group admits), else its address."""
    return node.private_address or node.address


def node_ssh_config_text(cluster: state.ClusterRecord) -> str:
    folder = node_ssh_dir(cluster.nodes[0].workdir)
    blocks = []
    for node in cluster.nodes:
        name = node.host.split("@")[-1]  # pdsh passes user@host as -l user host
        blocks.append(
            host_block(
                [name],
                inner_address(node),
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
    """Let the first node reach every node (itself included) by its hostfile name.

    The cluster key goes in first as a plain line; the first node then asks every node which
    address it connects from, and the line is replaced by one with from="those addresses"
    (plus the nodes' own IPs), so the key opens nothing when used from anywhere else."""
    private, public = cluster_keypair(cluster.name)
    (key_dir(cluster.name) / "authorized_keys").write_text(authorized_keys + "\n")
    from provision.transport.ssh.group import run_on_all

    run_on_all(nodes, ["bash", "-c", EDIT_KEY, "gpuctl", authorized_keys, public, public], timeout=60)
    first, folder = nodes[0], node_ssh_dir(cluster.nodes[0].workdir)
    first.write_text(f"{folder}/id_ed25519", private, "600")
    first.write_text(f"{folder}/known_hosts", node_known_hosts(cluster), "600")
    first.write_text(f"{folder}/config", node_ssh_config_text(cluster), "600")
    seen = [_hop(cluster, first, folder, rec, SOURCE_ADDRESS) for rec in cluster.nodes]
    allowed = from_addresses(cluster, seen)
    if allowed:
        line = f'from="{",".join(allowed)}" {public}'
        run_on_all(nodes, ["bash", "-c", EDIT_KEY, "gpuctl", authorized_keys, public, line], timeout=60)
        for rec in cluster.nodes:  # the restricted key still lets the first node in
            _hop(cluster, first, folder, rec, "true")
    else:
        say(
            "warning: no node reported the address the first node connects from; the cluster key is not limited by from="
        )
    say(f"node-to-node SSH ready: {cluster.nodes[0].address} reaches {len(cluster.nodes)} nodes (pdsh)")


def _hop(cluster: state.ClusterRecord, first: Node, folder: str, rec: state.NodeRecord, command: str) -> str:
    """Run `command` on node `rec` from the first node, as pdsh will; its output."""
    name = rec.host.split("@")[-1]
    result = first.run(["ssh", "-F", f"{folder}/config", name, command], check=False, timeout=90)
    if result.rc != 0:
        raise RemoteError(
            f"node {cluster.nodes[0].address} cannot SSH to node {rec.host} "
            f"(port {rec.port}): {result.stderr.strip()[-200:] or f'exit {result.rc}'}",
            f"check that {rec.address}:{rec.port} is reachable from the first node "
            "and that provider.authorized_keys is the file its sshd reads",
        )
    return result.stdout.strip()


def from_addresses(cluster: state.ClusterRecord, seen: Sequence[str]) -> list[str]:
    """IP addresses for the cluster key's from= option: where the nodes saw the first node
    connect from, and the nodes' own IP addresses (host names cannot match: sshd's UseDNS is off)."""
    import ipaddress

    found: set[str] = set()
    for text in [*seen, *(n.address for n in cluster.nodes), *(n.private_address or "" for n in cluster.nodes)]:
        try:
            found.add(str(ipaddress.ip_address(text.strip())))
        except ValueError:
            continue
    return sorted(found) if any(seen) else []


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
            node.sh(EDIT_KEY, authorized, public, "", timeout=60)
            if i == 0:
                node.sh('rm -rf -- "$1"', node_ssh_dir(cluster.nodes[0].workdir), timeout=60)
        except RemoteError as exc:
            say(f"warning: could not remove the cluster key from {node.label}: {exc.message}")
    shutil.rmtree(folder, ignore_errors=True)
