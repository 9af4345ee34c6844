"""provider.hosts through an OpenSSH client config: what each entry resolves to (no network)."""

from __future__ import annotations

import getpass
from pathlib import Path

import pytest

from provision.core.errors import ConfigError
from provision.transport.ssh import aliases

CONFIG = """
Host bastion
  HostName 198.51.100.1
  User jumper
  Port 2200
  IdentityFile ~/.ssh/jump_key
  IdentitiesOnly yes
Host inner
  HostName 10.1.0.1
  ProxyJump bastion
Host gpu-*
  User ubuntu
  ConnectTimeout 7
  ServerAliveInterval 20
Host gpu-one
  HostName 10.2.0.5
  ProxyJump bastion,inner
Host gpu-direct
  HostName 203.0.113.9
  Port 2222
  IdentityFile /keys/direct
Host gpu-none
  HostName 203.0.113.10
  ProxyJump none
Host gpu-uri
  HostName 10.3.0.1
  ProxyJump ssh://ops@198.51.100.7:2022
Host proxied
  HostName 10.4.0.1
  ProxyCommand ssh -W %h:%p bastion
Host loop-a
  ProxyJump loop-b
Host loop-b
  ProxyJump loop-a
"""


@pytest.fixture
def config(tmp_path):
    path = tmp_path / "ssh_config"
    path.write_text(CONFIG)
    return aliases.load(str(path))[0]


def test_multi_hop_proxyjump_is_visited_in_openssh_order(config):
    found = aliases.resolve("gpu-one", config, "provider.hosts[0]")
    assert (found.user, found.address, found.port) == ("ubuntu", "10.2.0.5", 22)
    route = found.route
    assert route is not None and route.alias == "gpu-one"
    # bastion first; then inner, which is itself reached through bastion (its own ProxyJump first)
    assert [(h.user, h.address, h.port) for h in route.jumps] == [
        ("jumper", "198.51.100.1", 2200),
        ("jumper", "198.51.100.1", 2200),
        (getpass.getuser(), "10.1.0.1", 22),
    ]
    assert route.jumps[0].identity_files == [str(Path("~/.ssh/jump_key").expanduser())]
    assert route.jumps[0].identities_only and not route.jumps[2].identity_files
    assert (route.connect_timeout, route.keepalive_s) == (7.0, 20)


def test_entry_parts_win_and_plain_hosts_keep_root(config):
    found = aliases.resolve("alice@gpu-direct:2022", config, "f")
    assert (found.user, found.address, found.port) == ("alice", "203.0.113.9", 2022)
    assert found.route is not None and found.route.identity_files == ["/keys/direct"] and not found.route.jumps
    plain = aliases.resolve("127.0.0.1:2222", config, "f")
    assert (plain.user, plain.address, plain.port, plain.route) == ("root", "127.0.0.1", 2222, None)
    assert aliases.resolve("gpu-none", config, "f").route.jumps == []
    uri = aliases.resolve("gpu-uri", config, "f").route
    assert [(h.user, h.address, h.port) for h in uri.jumps] == [("ops", "198.51.100.7", 2022)]


def test_refusals_are_config_errors_naming_the_field(config):
    # a typo that only matches the wildcard block (`Host gpu-*`) resolves to nothing
    with pytest.raises(ConfigError, match=r"provider.hosts\[2\]: 'gpu-typo.invalid' is no Host alias in ~/.ssh/config"):
        aliases.resolve("gpu-typo.invalid", config, "provider.hosts[2]")
    with pytest.raises(ConfigError, match="ProxyCommand"):
        aliases.resolve("proxied", config, "provider.hosts[0]")
    with pytest.raises(ConfigError, match="hops deep"):
        aliases.resolve("loop-a", config, "provider.hosts[0]")


def test_a_hop_naming_itself_is_no_hop(tmp_path):
    path = tmp_path / "cfg"
    path.write_text("Host bastion\n  HostName 198.51.100.1\nHost *\n  ProxyJump bastion\n")
    config, _ = aliases.load(str(path))
    route = aliases.resolve("10.0.0.3", config, "f").route
    assert [h.address for h in route.jumps] == ["198.51.100.1"]
    assert aliases.resolve("bastion", config, "f").route.jumps == []
